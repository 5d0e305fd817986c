"""The gate's outputs: report.json (every raw number), report.md, a self-contained report.html (plots embedded
as base64 PNG) and requests.jsonl (one row per request).

report.json: `verdict` ("GO" | "NO-GO", for `config`, the best speculative configuration), `criteria` (a list of
{name, value, threshold, pass, reason}), `configs` (each speculative configuration's own verdict, criteria,
analysis and recommended schedule), `measurements` (per configuration: sweep, poisson, per-category and
total spec-decode windows, memory, outputs), `quality`, `perplexity`, `notes`, `definitions`, `thresholds`.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any

from specgate.gate import decision, quality
from specgate.jsonutil import jsonable

DEFINITIONS = {
    "TTFT": "time to first token: from sending the request to the first streamed chunk with text (client clock)",
    "ITL": "inter-token latency, per token: a chunk arriving d s after the previous one with k tokens counts k samples of d/k",
    "chunk gap": "raw time between streamed chunks (one speculative step can stream several tokens at once)",
    "TPOT": "time per output token after the first: (e2e - TTFT) / (completion tokens - 1), one value per request",
    "e2e": "end-to-end request latency: from sending the request to the end of the stream",
    "AR": "acceptance rate = accepted draft tokens / draft tokens verified (counter deltas over the window)",
    "AL": "mean acceptance length = 1 + accepted / drafts: tokens emitted per verify step with drafts",
    "alpha": "Leviathan's per-token acceptance probability: the i.i.d. alpha whose E[T] at the mean draft length equals AL",
    "c": "effective draft cost ratio: (decode step time with speculation / without - 1) / gamma at the same concurrency",
    "alpha_min": "the alpha at which S(alpha, gamma, c) = 1 (specgate.theory.alpha_min); below it speculation slows decoding",
    "predicted speedup": "S = E[T](alpha, gamma) / (gamma c + 1) (Leviathan et al.)",
    "measured speedup": "closed-loop output tokens/s with speculation / without, at the same concurrency",
    "per-position rate": "accepted drafts at position i / drafts (marginal, as vLLM's counters)",
}


def _speculative(results: dict[str, dict]) -> list[str]:
    return [name for name, r in results.items() if name != "baseline"]


def acceptance(result: dict[str, Any]) -> dict[str, Any] | None:
    """{ar, al, per_position, source} over every phase: counter deltas, else the responses' summed timings."""
    total = result.get("spec_total") or {}
    if total.get("flavour") and (total.get("num_draft_tokens") or total.get("acceptance_rate") is not None):
        rates, gamma = list(total.get("per_position_rate") or []), int(result.get("gamma") or 0)
        if gamma and not any(rates[gamma:]):  # llama.cpp exports zeros past the draft length
            rates = rates[:gamma]
        rates += [0.0] * (gamma - len(rates)) if total.get("num_drafts") else []  # a never-accepted position exports no sample
        out = {"ar": total.get("acceptance_rate"), "al": total.get("acceptance_length"), "per_position": rates,
               "source": "counters", "flavour": total.get("flavour"), "timings": result.get("timings_total"), "warning": None}
        if gamma and (total.get("mean_draft_len") or 0.0) > gamma + 1e-9:
            out["warning"] = (f"drafted {total['mean_draft_len']:.1f} tokens per draft, more than the configured draft length {gamma}: the "
                              "engine's draft-length option does not govern this method; alpha and c use the measured mean")
        return out
    timed = result.get("timings_total")
    if timed and timed.get("draft_tokens"):
        return {"ar": timed["accepted_tokens"] / timed["draft_tokens"], "al": None, "per_position": [], "source": "timings",
                "flavour": None, "timings": timed, "warning": None}
    return None


def build_report(options: Any, plan: Any, results: dict[str, dict], scored: dict, notes: list[str], *, wall_s: float,
                 advice: Any = None) -> dict[str, Any]:
    """Decide every speculative configuration against the baseline and assemble the report dict."""
    from specgate.gate.recommend import RECOMMENDED, config_quality

    baseline = results.get("baseline") or {"name": "baseline", "failure": "the baseline server did not run"}
    configs: dict[str, Any] = {}
    quality_all: dict[str, Any] = {}
    for name in _speculative(results):
        spec = results[name]
        base_ll, spec_ll = scored["loglik"].get("baseline"), scored["loglik"].get(name)
        q = config_quality(plan, baseline, spec, options.seed, quality.loglik_two_sample(base_ll, spec_ll).to_dict() if base_ll and spec_ll else None)
        if scored.get("tokenizer") is not None:
            quality.add_token_positions(q["greedy"], baseline.get("greedy") or {}, spec.get("greedy") or {}, scored["tokenizer"])
        analysis = decision.analyse(baseline, spec, options.thresholds.gamma_max)
        verdict, criteria = decision.decide(baseline, spec, q, options.thresholds, analysis)
        configs[name] = {
            "verdict": verdict, "engine": spec.get("engine"), "command": spec.get("command"), "acceptance": acceptance(spec),
            "criteria": decision.criteria_dicts(criteria), "analysis": analysis,
            "schedule": decision.schedule_exports(analysis, spec.get("draft") or name, options.max_num_seqs,
                                                  spec.get("engine") == "specgate" and decision.is_specgate_head(spec.get("draft") or "", options.target)),
        }
        if (configs[name]["acceptance"] or {}).get("warning"):
            notes.append(f"{name}: {configs[name]['acceptance']['warning']}")
        if configs[name]["acceptance"] is None and not spec.get("failure"):
            notes.append(f"{name}: the engine reported neither spec-decode counters nor per-response timings: acceptance not measured")
        quality_all[name] = q
    recommendation = _recommendation(advice, configs, results, baseline, options.thresholds.target_concurrency, RECOMMENDED)
    headline = recommendation["config"] if recommendation["config"] in configs else _headline(configs, results, options.thresholds.target_concurrency)
    top = configs.get(headline) if headline else None
    criteria = top["criteria"] if top else [{"name": "completed", "value": False, "threshold": True, "pass": False, "binding": True,
                                            "reason": "no speculative configuration was measured"}]
    for result in results.values():
        for key in ("greedy", "math_outputs", "samples"):
            result.setdefault(key, {})
    return {
        "verdict": recommendation["verdict"], "engine": baseline.get("engine") or recommendation["engine"], "config": headline, "recommendation": recommendation, "criteria": criteria,
        "configs": configs, "quality": quality_all, "perplexity": scored.get("perplexity"), "notes": notes,
        "measurements": results, "thresholds": decision.thresholds_dict(options.thresholds),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items() if k != "thresholds"},
        "definitions": DEFINITIONS, "wall_s": wall_s, "scoring_s": scored.get("scoring_s"),
    }


def _recommendation(advice: Any, configs: dict, results: dict, baseline: dict, concurrency: int, recommended: str) -> dict[str, Any]:
    """report.json's `recommendation`: what to deploy, its command, and its verdict from its own measurements."""
    def ratios(name: str) -> dict[str, float | None]:
        rows = (configs.get(name) or {}).get("analysis", {}).get("per_concurrency", [])
        return {str(r["concurrency"]): r["measured_speedup"] for r in rows}

    if advice is None or advice.kind == "off":
        return {"config": "off", "engine": baseline.get("engine"), "command": baseline.get("command"), "measured": bool(baseline.get("sweep")),
                "verdict": "NO-GO", "throughput_ratio": {str(lv["concurrency"]): 1.0 for lv in baseline.get("sweep") or []},
                "kind": "off", "based_on": None, "reason": advice.reason if advice else "no recommendation was derived"}
    name = recommended if recommended in configs else advice.based_on  # external: the endpoint's own measurements
    measured = name in configs and not results[name].get("failure")
    verdict = configs[name]["verdict"] if measured else "NO-GO"
    reason = advice.reason if measured else f"{advice.reason}; but the recommendation's own run failed: {(results.get(name) or {}).get('failure')}"
    kind = advice.kind
    source = advice.based_on
    if advice.kind == "schedule" and measured and name != source and _measured_better(source, name, configs, results, concurrency):
        from specgate.gate.recommend import throughput

        ours, theirs = throughput(results[name], concurrency), throughput(results[source], concurrency)
        reason = (f"{advice.reason}; but its schedule, measured as `{name}`, ran {_f(ours)} tok/s against {_f(theirs)} for "
                  f"`{source}` at concurrency {concurrency}: `{source}` is recommended as it ran")
        name, kind, verdict = source, "config", configs[source]["verdict"]
    return {"config": name, "engine": results.get(name, {}).get("engine"), "command": results.get(name, {}).get("command"),
            "measured": measured, "verdict": verdict, "throughput_ratio": ratios(name), "kind": kind, "based_on": source,
            "reason": reason}


def _measured_better(source: str | None, name: str, configs: dict, results: dict, concurrency: int) -> bool:
    """Whether the configuration a schedule was derived from measured better than the schedule's own run: GO where
    the schedule is not, or as GO (or as NO-GO) with more output tokens/s at the target concurrency. A schedule
    fills in gammas the analysis predicts from one measured gamma; when its run is slower, what ran is the advice.
    Only for a schedule: a configuration recommended as it ran is launched again, and taking the better of its two
    runs would pick noise."""
    from specgate.gate.recommend import throughput

    if source not in configs or results[source].get("failure"):
        return False
    ours, theirs = throughput(results[name], concurrency), throughput(results[source], concurrency)
    go, source_go = configs[name]["verdict"] == "GO", configs[source]["verdict"] == "GO"
    if go != source_go:
        return source_go
    return ours is not None and theirs is not None and theirs > ours


def _headline(configs: dict[str, Any], results: dict[str, dict], concurrency: int) -> str | None:
    """The configuration the verdict speaks for: a GO one if any (best throughput), else the one closest to GO."""
    def throughput(name: str) -> float:
        level = next((lv for lv in results[name].get("sweep", []) if lv.get("concurrency") == concurrency), {})
        return level.get("output_tokens_per_s") or 0.0

    def key(name: str) -> tuple:
        c = configs[name]
        lossless = not results[name].get("lossy")
        return (c["verdict"] == "GO", lossless, sum(x["pass"] for x in c["criteria"]), throughput(name))

    return max(configs, key=key) if configs else None


# ------------------------------------------------------------------------------------------ plots


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None and math.isfinite(x) else float("nan")


def _concurrency_axis(ax: Any, levels: list[int]) -> None:
    if levels:  # nothing measured (every server failed to start): a linear, empty axis
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()


def make_plots(report: dict[str, Any]) -> dict[str, str]:
    """name -> base64 PNG: throughput and ITL vs concurrency, acceptance per category / position, predicted vs measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["measurements"]
    colour = {name: f"C{i}" for i, name in enumerate(results)}  # one colour per configuration in every plot
    levels = sorted({lv["concurrency"] for r in results.values() for lv in r.get("sweep") or []})
    plots = {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in results.items():
        sweep = r.get("sweep") or []
        xs = [lv["concurrency"] for lv in sweep]
        ax1.plot(xs, [_num(lv.get("output_tokens_per_s")) for lv in sweep], "o-", color=colour[name], label=name)
        ax2.plot(xs, [_num(lv.get("itl_p95_s")) * 1e3 for lv in sweep], "o-", color=colour[name], label=f"{name} p95")
        ax2.plot(xs, [_num(lv.get("itl_p50_s")) * 1e3 for lv in sweep], "x--", color=colour[name], alpha=0.6, label=f"{name} p50")
    ax1.set(xlabel="concurrency (closed loop)", ylabel="output tokens/s", title="Throughput vs concurrency")
    ax2.set(xlabel="concurrency (closed loop)", ylabel="ITL per token (ms)", title="ITL vs concurrency")
    for ax in (ax1, ax2):
        _concurrency_axis(ax, levels)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    plots["throughput_itl"] = _png(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    spec_names = [n for n in results if n != "baseline"]
    categories = sorted({c for n in spec_names for c in (results[n].get("per_category") or {})})
    width = 0.8 / max(len(spec_names), 1)
    for i, name in enumerate(spec_names):
        per_cat = results[name].get("per_category") or {}
        values = [_num((per_cat.get(c) or {}).get("acceptance_rate")) for c in categories]
        ax1.bar([j + i * width for j in range(len(categories))], values, width, color=colour[name], label=name)
        rates = ((results[name].get("spec_total") or {}).get("per_position_rate")) or []
        ax2.plot(range(1, len(rates) + 1), rates, "o-", color=colour[name], label=name)
        if rates:
            ax2.set_xticks(range(1, len(rates) + 1))
    ax1.set_xticks([j + width * (len(spec_names) - 1) / 2 for j in range(len(categories))], categories)
    ax1.set(ylabel="acceptance rate (AR)", title="Acceptance per category (concurrency 1)", ylim=(0, 1))
    ax2.set(xlabel="draft position", ylabel="accepted / drafts (marginal)", title="Acceptance per position", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    plots["acceptance"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, c in report["configs"].items():
        rows = c["analysis"]["per_concurrency"]
        xs = [r["concurrency"] for r in rows]
        ax.plot(xs, [_num(r["predicted_speedup"]) for r in rows], "s--", color=colour.get(name), label=f"{name} predicted")
        ax.plot(xs, [_num(r["measured_speedup"]) for r in rows], "o-", color=colour.get(name), label=f"{name} measured")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set(xlabel="concurrency", ylabel="speedup over baseline", title="Predicted (theory) vs measured speedup")
    _concurrency_axis(ax, levels)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    plots["speedup"] = _png(fig)
    return plots


# ------------------------------------------------------------------------------------------ text outputs


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        return "n/a" if not math.isfinite(x) else f"{x:.{digits}g}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_f(v, digits) for v in x) + "]"
    return str(x)


def _sweep_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, r in report["measurements"].items():
        for lv in r.get("sweep") or []:
            spec = lv.get("spec") or {}
            rows.append([name, str(lv["concurrency"]), _f(lv.get("output_tokens_per_s")), _f(lv.get("requests_per_s")),
                         _f(_ms(lv.get("ttft_p50_s"))), _f(_ms(lv.get("ttft_p95_s"))), _f(_ms(lv.get("itl_p50_s"))),
                         _f(_ms(lv.get("itl_p95_s"))), _f(_ms(lv.get("tpot_p50_s"))), _f(spec.get("acceptance_rate")),
                         _f(spec.get("acceptance_length")), f"{lv.get('ok')}/{lv.get('requests')}"])
    return rows


SWEEP_HEADER = ["config", "conc.", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "TPOT p50 ms", "AR", "AL", "ok"]


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _schedule_text(config: dict[str, Any]) -> str:
    s = config["schedule"]
    if s["vllm_speculative_config"] is None:  # a specgate EAGLE head: only specgate runs it
        return "\n".join([f"specgate serve {s['specgate']}", f"# {s['sglang_note']}"])
    return "\n".join([
        f"vLLM --speculative-config '{json.dumps(s['vllm_speculative_config'])}'",
        f"SGLang: {' '.join(s['sglang_flags']) or '(no speculation)'}  # {s['sglang_note']}",
        f"TensorRT-LLM: {json.dumps(s['tensorrt_llm'])}",
        f"specgate serve {s['specgate']}",
    ])


def _result(c: dict[str, Any]) -> str:
    return ("PASS" if c["pass"] else "FAIL") + ("" if c.get("binding", True) else " (target)")


def recommendation_lines(report: dict[str, Any]) -> list[str]:
    """The headline: what to deploy, the command to paste, and the verdict of its own measured run."""
    r = report["recommendation"]
    if r["kind"] == "off":
        return [f"**Recommendation: serve without speculation** ({r['reason']}).",
                *([f"", "```", r["command"], "```"] if r.get("command") else [])]
    ratios = ", ".join(f"C={c}: {_f(v)}x" for c, v in r["throughput_ratio"].items())
    origin = "as it ran" if r["config"] == r["based_on"] else f"{r['kind']}, from `{r['based_on']}`"
    lines = [f"**Recommendation: `{r['config']}`** on {r['engine']} ({origin}), measured as its own "
             f"configuration: **{r['verdict']}**; throughput vs the baseline {ratios or 'n/a'}.", "", f"Why: {r['reason']}."]
    if r.get("command"):
        lines += ["", "```", r["command"], "```"]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# specgate gate: **{report['verdict']}**" + (f" for `{report['config']}`" if report["config"] else ""), ""]
    lines += recommendation_lines(report) + [""]
    lines += [f"- {note}" for note in report["notes"]] + ([""] if report["notes"] else [])
    lines += ["## Criteria", "", "| criterion | value | threshold | result | reason |", "|---|---|---|---|---|"]
    for c in report["criteria"]:
        lines.append(f"| {c['name']} | {_f(c['value'])} | {_f(c['threshold'])} | {_result(c)} | {c['reason']} |")
    for name, c in report["configs"].items():
        acc = c.get("acceptance") or {}
        lines += ["", f"## Configuration `{name}` ({c.get('engine') or 'unknown'}): {c['verdict']}", ""]
        if c.get("command"):
            lines += ["```", c["command"], "```", ""]
        lines.append(f"Acceptance ({acc.get('source') or 'not reported by the engine'}): AR {_f(acc.get('ar'))}, AL {_f(acc.get('al'))}, "
                     f"per position {_f(acc.get('per_position') or None)}.")
        if name != report["config"]:
            failed = [x["name"] for x in c["criteria"] if not x["pass"]]
            lines.append(f"Failed criteria: {', '.join(failed) or 'none'}.")
        a = c["analysis"]
        lines += ["", f"alpha_min {_f(a['alpha_min'])} (gamma {a['alpha_min_gamma']}, c {_f(a['alpha_min_c'])}); "
                  f"speculation pays at concurrency {a['paying_concurrency'] or 'none'} (range {a['paying_range'] or 'none'}).", "",
                  "| concurrency | alpha | c | predicted S | measured S | best gamma | recommended gamma |", "|---|---|---|---|---|---|---|"]
        for r in a["per_concurrency"]:
            lines.append(f"| {r['concurrency']} | {_f(r['alpha'])} | {_f(r['c'])} | {_f(r['predicted_speedup'])} | {_f(r['measured_speedup'])} | {_f(r['best_gamma'])} | {r['recommended_gamma']} |")
        lines += ["", "Recommended schedule:", "", "```", _schedule_text(c), "```"]
        q = report["quality"][name]
        for m in q["greedy"]["mismatches"]:
            at = f"token {m['first_diff_token']}" if m.get("first_diff_token") is not None else f"char {m['first_diff_char']}"
            lines.append(f"- greedy mismatch `{m['prompt_id']}` ({m.get('category')}) from {at}, after {m.get('context', '')!r}: "
                         f"baseline {m['baseline']!r} vs speculative {m['speculative']!r}")
    lines += ["", "## Load sweep (closed loop)", "", "| " + " | ".join(SWEEP_HEADER) + " |", "|" + "---|" * len(SWEEP_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in _sweep_rows(report)]
    lines += ["", "## Per category (closed loop, concurrency 1)", "", "| config | category | AR | AL | out tok/s | TTFT p50 ms | TPOT p50 ms |",
              "|---|---|---|---|---|---|---|"]
    for name, r in report["measurements"].items():
        for category, latency in (r.get("per_category_latency") or {}).items():
            window = (r.get("per_category") or {}).get(category) or {}
            lines.append(f"| {name} | {category} | {_f(window.get('acceptance_rate'))} | {_f(window.get('acceptance_length'))} | "
                         f"{_f(latency.get('output_tokens_per_s'))} | {_f(_ms(latency.get('ttft_p50_s')))} | {_f(_ms(latency.get('tpot_p50_s')))} |")
    lines += ["", "## Open loop (Poisson arrivals)", ""]
    for name, r in report["measurements"].items():
        p = r.get("poisson") or {}
        lines.append(f"- {name}: {_f(p.get('qps'))} QPS offered, {_f(p.get('output_tokens_per_s'))} output tok/s, "
                     f"{_f(p.get('requests_per_s'))} req/s, TTFT p95 {_f(_ms(p.get('ttft_p95_s')))} ms, ITL p95 {_f(_ms(p.get('itl_p95_s')))} ms")
    lines += ["", "## Memory", ""]
    for name, r in report["measurements"].items():
        m = r.get("memory") or {}
        lines.append(f"- {name}: peak RSS {_f(m.get('peak_rss_mib'))} MiB of {_f(m.get('mem_total_mib'))} MiB; GPU {_f(m.get('gpu_memory_used_mib'))} MiB; "
                     f"KV slots {_f(m.get('kv_slots_total'))}; preemptions {_f(m.get('preemptions'))}" + (f"; FAILED: {r['failure']}" if r.get("failure") else ""))
    if report.get("perplexity"):
        p = report["perplexity"]
        lines += ["", f"Target perplexity of the text: {p['perplexity']:.3f} (95% CI {_f(p['ci95'])}, {p['tokens']} tokens)."]
    lines += ["", "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in report["definitions"].items()]
    lines += ["", f"Gate wall time: {report['wall_s']:.1f} s."]
    return "\n".join(lines) + "\n"


def render_html(report: dict[str, Any], plots: dict[str, str]) -> str:
    """A self-contained page: no external resources, plots as data: URIs."""
    e = html.escape
    verdict = report["verdict"]
    colour = "#1a7f37" if verdict == "GO" else "#b42318"
    rows = "".join(
        f"<tr class='{'pass' if c['pass'] else 'fail'}'><td>{e(c['name'])}</td><td>{e(_f(c['value']))}</td><td>{e(_f(c['threshold']))}</td>"
        f"<td>{_result(c)}</td><td>{e(c['reason'])}</td></tr>" for c in report["criteria"]
    )
    rec = report["recommendation"]
    recommendation = (f"<div id='recommendation'><h2>Recommendation: {e(rec['config'])} ({e(rec['verdict'])})</h2><p>{e(rec['reason'])}</p>"
                      + (f"<pre>{e(rec['command'])}</pre>" if rec.get("command") else "") + "</div>")
    mismatches = "".join(
        f"<li><code>{e(name)}</code> / <code>{e(m['prompt_id'])}</code> from "
        f"{e('token ' + str(m['first_diff_token']) if m.get('first_diff_token') is not None else 'char ' + str(m['first_diff_char']))}:"
        f"<br>baseline: <code>{e(m['baseline'])}</code><br>speculative: <code>{e(m['speculative'])}</code></li>"
        for name, q in report["quality"].items() for m in q["greedy"]["mismatches"]
    )
    sweep = "".join("<tr>" + "".join(f"<td>{e(x)}</td>" for x in row) + "</tr>" for row in _sweep_rows(report))
    images = "".join(
        f"<figure><img class='plot' id='plot-{e(name)}' alt='{e(name)}' src='data:image/png;base64,{data}'></figure>" for name, data in plots.items()
    )
    notes = "".join(f"<li>{e(n)}</li>" for n in report["notes"])
    schedules = "".join(f"<h3>{e(name)}: {e(c['verdict'])}</h3><pre>{e(_schedule_text(c))}</pre>" for name, c in report["configs"].items())
    configs = "".join(
        f"<tr><td>{e(name)}</td><td>{e(str(c.get('engine')))}</td><td>{e(c['verdict'])}</td><td>{e(_f((c.get('acceptance') or {}).get('ar')))}</td>"
        f"<td>{e(', '.join(x['name'] for x in c['criteria'] if not x['pass']) or 'none')}</td>"
        f"<td>{e(report['measurements'][name].get('failure') or '')}</td></tr>" for name, c in report["configs"].items()
    )
    definitions = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in report["definitions"].items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>specgate gate: {e(verdict)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1200px; }}
#verdict {{ font-size: 2.4em; font-weight: bold; color: {colour}; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ border: 1px solid #ccc; padding: 3px 6px; }}
tr.pass td:nth-child(4) {{ color: #1a7f37; font-weight: bold; }} tr.fail td:nth-child(4) {{ color: #b42318; font-weight: bold; }}
img.plot {{ max-width: 100%; }} pre {{ background: #f6f8fa; padding: 8px; overflow-x: auto; }}
</style></head><body>
<h1>specgate gate</h1>
<p id="verdict">{e(verdict)}</p>
<p>Configuration: <code>{e(str(report['config']))}</code>; target concurrency {report['thresholds']['target_concurrency']}; wall time {report['wall_s']:.1f} s.</p>
<ul>{notes}</ul>
{recommendation}
<h2>Configurations</h2>
<table id="configs"><tr><th>configuration</th><th>engine</th><th>verdict</th><th>AR</th><th>failed criteria</th><th>failure</th></tr>{configs}</table>
<h2>Greedy mismatches</h2><ul id="mismatches">{mismatches or '<li>none</li>'}</ul>
<h2>Criteria of <code>{e(str(report['config']))}</code></h2>
<table id="criteria"><tr><th>criterion</th><th>value</th><th>threshold</th><th>result</th><th>reason</th></tr>{rows}</table>
<h2>Plots</h2>{images}
<h2>Load sweep</h2>
<table><tr>{''.join(f'<th>{e(h)}</th>' for h in SWEEP_HEADER)}</tr>{sweep}</table>
<h2>Recommended schedules</h2>{schedules}
<h2>Definitions</h2><dl>{definitions}</dl>
</body></html>
"""


def write_outputs(out: Path, report: dict[str, Any], records: list[dict]) -> dict[str, str]:
    """Write report.json, report.md, report.html and requests.jsonl into `out`; returns their paths."""
    plots = make_plots(report)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "html": out / "report.html", "requests": out / "requests.jsonl"}
    report["files"] = {k: str(v) for k, v in paths.items()}
    paths["json"].write_text(json.dumps(jsonable(report), indent=1) + "\n")
    paths["markdown"].write_text(render_markdown(report))
    paths["html"].write_text(render_html(report, plots))
    with open(paths["requests"], "w") as f:
        for record in records:
            f.write(json.dumps(jsonable(record)) + "\n")
    return report["files"]
