"""The gate's outputs, rendered from the decision (decision.GateResult); nothing here decides.

report.json: `verdict` (GO / NO-GO / INCONCLUSIVE), `config` (what it speaks for), `recommendation`, `criteria` (the
headline's, each with its state, load, estimate, interval, threshold, reason and what would decide it), `configs`
(every decided configuration: screening decisions, and `recommended`'s confirmation), `stages` (blocks, looks,
confidence level, budget), `measurements` (every run's records: fixed-work outputs and paired-round windows),
`perplexity`, `notes`, `definitions`, `options`, `traffic` (the measured workload, as the runner describes it: source,
prompts, skipped, token lengths, categories; null when not recorded). Every configuration carries `categories` (the
greedy phase per category) and `category_summary`; the recommendation carries the summary it speaks for. report.md and a self-contained report.html say the same for people,
with plots (the throughput ratio with its interval per load for every configuration first); requests.jsonl holds one
row per request.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specgate.gate import prom, quality
from specgate.gate.decision import ConfigDecision, GateResult
from specgate.gate.options import GateOptions
from specgate.jsonutil import jsonable

DEFINITIONS = {
    "round": "one server's steady-state window at one load (ramp-up and drain excluded); a block gives every compared server one round per load, in alternating order",
    "throughput ratio": "configuration / baseline output tokens per second over paired rounds: the geometric mean of the per-block ratios with a Student-t interval on their logs",
    "margin": "a ratio whose interval's lower bound is >= 1 - margin shows no regression; upper bound < 1 - margin: a regression; else undecided",
    "TTFT": "time to first token: from sending the request to the first streamed chunk with text (client clock)",
    "ITL": "inter-token latency, per token: a chunk arriving d s after the previous one with k tokens counts k samples of d/k",
    "TPOT": "time per output token after the first: (e2e - TTFT) / (completion tokens - 1)",
    "AR": "acceptance rate = accepted draft tokens / draft tokens verified (counter deltas over the windows)",
    "AL": "mean acceptance length = 1 + accepted / drafts: tokens per verify step that drafted (vLLM's)",
    "tokens per step": "generated tokens / target steps, every step counted (with drafts or without): the one accounting",
    "alpha": "Leviathan's per-token acceptance: the alpha whose E[T] at the mean draft length g equals AL",
    "c": "cost per draft token: (decode time per target step with speculation / without - 1) x steps / draft tokens",
    "alpha_min": "the alpha at which E[T](alpha, g) = 1 + g c: speculation pays above it (0 when c <= 0)",
    "predicted speedup": "(tokens per step) / (step time ratio) = baseline TPOT / configuration TPOT: above 1 exactly when alpha > alpha_min",
    "measured speedup": "the closed-loop throughput ratio at the same concurrency (prefill and HTTP included)",
    "per-category decode speedup": "from the fixed-work greedy phase (same requests on every server, one batch per category): the geometric mean over the category's prompts of baseline TPOT / configuration TPOT, a t interval on the logs; pays: lower bound > 1, loses: upper bound < 1 - margin; reported, not binding",
    "INCONCLUSIVE": "a binding criterion's interval still straddles its bound when the budget is spent; the report says how much more would decide it",
}


def acceptance_summary(run: Any) -> dict[str, Any] | None:
    """{ar, al, per_position, source} over every phase and round: counter deltas, else the responses' timings; with both,
    `fixed_work_check` sets the counters' AR over the fixed-work phases beside the responses' (the same requests)."""
    total = run.spec_total()
    if total is not None and total.flavour and (total.num_draft_tokens or total.acceptance_rate is not None):
        rates, gamma = list(total.per_position_rate or []), int(run.gamma or 0)
        if gamma and not any(rates[gamma:]):  # llama.cpp exports zeros past the draft length
            rates = rates[:gamma]
        rates += [0.0] * (gamma - len(rates)) if total.num_drafts else []  # a never-accepted position exports no sample
        warning = None
        if gamma and run.policy != "adaptive" and (total.mean_draft_len or 0.0) > gamma + 1e-9:
            warning = (f"drafted {total.mean_draft_len:.1f} tokens per draft, more than the configured draft length {gamma}: the engine's "
                       "draft-length option does not govern this method; alpha and c use the measured mean")
        phases = prom.merge_windows(run.phase_windows) if run.phase_windows else None  # the requests the timings cover
        check = {"counters_ar": phases.acceptance_rate if phases else None,
                 "timings_ar": run.timings["accepted_tokens"] / run.timings["draft_tokens"] if run.timings and run.timings.get("draft_tokens") else None}
        return {"ar": total.acceptance_rate, "al": total.acceptance_length, "per_position": rates, "source": "counters",
                "flavour": total.flavour, "timings": run.timings, "fixed_work_check": check, "warning": warning}
    if run.timings and run.timings.get("draft_tokens"):
        return {"ar": run.timings["accepted_tokens"] / run.timings["draft_tokens"], "al": None, "per_position": [], "source": "timings",
                "flavour": None, "timings": run.timings, "warning": None}
    return None


def build_report(options: GateOptions, plan: Any, result: GateResult, *, tokenizer: Any = None, wall_s: float,
                 traffic: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report dict (report.json), from the decision's records; `traffic` (else `plan.traffic`) describes the workload."""
    baseline = result.runs.get("baseline")
    configs: dict[str, Any] = {}
    for d in [*result.screening.values(), *([result.confirmation] if result.confirmation else [])]:
        run = result.runs[d.name]
        if tokenizer is not None and baseline is not None:
            quality.add_token_positions(d.quality["greedy"], baseline.greedy, run.greedy, tokenizer)
        configs[d.name] = {**d.to_dict(), "engine": run.engine, "command": run.command, "policy": run.policy, "acceptance": acceptance_summary(run)}
        warning = (configs[d.name]["acceptance"] or {}).get("warning")
        if warning and f"{d.name}: {warning}" not in result.notes:
            result.notes.append(f"{d.name}: {warning}")
        if configs[d.name]["acceptance"] is None and not run.failure and run.spec != "none":
            result.notes.append(f"{d.name}: the engine reported neither spec-decode counters nor per-response timings: acceptance not measured")
    return {
        "verdict": result.verdict, "engine": (baseline.engine if baseline else None), "config": result.config,
        "recommendation": _recommendation(result), "criteria": [c.to_dict() for c in result.criteria], "configs": configs,
        "stages": result.stages, "measurements": {name: run.to_dict() for name, run in result.runs.items()},
        "perplexity": result.perplexity, "notes": result.notes, "definitions": DEFINITIONS,
        "traffic": traffic if traffic is not None else getattr(plan, "traffic", None),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}, "wall_s": wall_s,
    }


def _recommendation(result: GateResult) -> dict[str, Any]:
    advice = result.advice
    baseline = result.runs.get("baseline")
    if advice.kind == "off" or result.config is None:
        return {"kind": "off", "config": "off", "based_on": advice.based_on, "reason": advice.reason, "verdict": result.verdict,
                "command": baseline.command if baseline else None, "engine": baseline.engine if baseline else None, "measured": bool(baseline and baseline.windows),
                "throughput_ratio": {}, "within_noise": advice.within_noise, "gamma_table": None, "category_summary": result.category_summary}
    decided = result.decision(result.config)
    run = result.runs[result.config]
    return {
        "kind": advice.kind, "config": result.config, "based_on": advice.based_on, "reason": advice.reason, "verdict": result.verdict,
        "command": run.command, "engine": run.engine, "measured": bool(run.windows) and not run.failure,
        "throughput_ratio": {a.load: (a.throughput_ratio.to_dict() if a.throughput_ratio else None) for a in (decided.loads if decided else [])},
        "within_noise": advice.within_noise, "gamma_table": advice.gamma_table, "category_summary": result.category_summary,
    }


# ------------------------------------------------------------------------------------------ text


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


def _iv(d: dict[str, Any] | None, digits: int = 3) -> str:
    """An interval dict as 'estimate [low, high]' (an unbounded side, null in JSON, shows as -inf / inf)."""
    if not d:
        return "n/a"
    low = "-inf" if d.get("low") is None else _f(d["low"], digits)
    high = "inf" if d.get("high") is None else _f(d["high"], digits)
    return f"{_f(d['estimate'], digits)} [{low}, {high}]"


def _state(c: dict[str, Any]) -> str:
    return c["state"] + ("" if c.get("binding", True) else " (target)")


def recommendation_lines(report: dict[str, Any]) -> list[str]:
    """The headline: what to deploy, the command to paste, and the verdict of its own measured rounds."""
    r = report["recommendation"]
    if r["kind"] == "off":
        return [f"**Recommendation: serve without speculation** ({r['reason']}).", *(["", "```", r["command"], "```"] if r.get("command") else [])]
    ratios = ", ".join(f"{load}: {_iv(v)}" for load, v in r["throughput_ratio"].items()) or "n/a"
    origin = "as it ran" if r["kind"] == "config" else f"{r['kind']}, from `{r['based_on']}`"
    lines = [f"**Recommendation: `{r['config']}`** on {r['engine']} ({origin}), measured again in its own paired rounds: "
             f"**{r['verdict']}**; throughput vs the baseline {ratios}.", "", f"Why: {r['reason']}."]
    return lines + (["", "```", r["command"], "```"] if r.get("command") else [])


def criteria_rows(criteria: list[dict[str, Any]]) -> list[list[str]]:
    return [[c["name"], c.get("load") or "", _iv(c.get("interval")) if c.get("interval") else _f(c.get("estimate")), _f(c.get("threshold")),
             _state(c), c["reason"] + (f" To decide: {c['needed']}." if c.get("needed") else "")] for c in criteria]


def load_rows(config: dict[str, Any]) -> list[list[str]]:
    rows = []
    for a in config["loads"]:
        acc = a["acceptance"]
        rows.append([a["load"], "yes" if a["speculating"] else "no", str(a["rounds"]), _iv(a["throughput_ratio"]), _iv(a["decode_speedup"]),
                     _iv(acc.get("alpha")), _iv(acc.get("alpha_min")), _iv(acc.get("c")), _f(acc.get("draft_len")), str(a["recommended_gamma"]), a["verdict"]])
    return rows


def category_config(report: dict[str, Any]) -> str | None:
    """The configuration whose categories the report shows: the one the verdict speaks for, else the advice's basis."""
    name = report["config"] or report["recommendation"].get("based_on")
    return name if name in report["configs"] else None


def _point(d: dict[str, Any] | None) -> str:
    """An interval measured over one unit (unbounded) as its estimate alone, else 'estimate [low, high]'."""
    if d and (d.get("low") is None or d.get("high") is None or not math.isfinite(d["low"]) or not math.isfinite(d["high"])):
        return _f(d.get("estimate"))
    return _iv(d)


def category_rows(config: dict[str, Any]) -> list[list[str]]:
    return [[a["category"], str(a["prompts"]), _point(a["acceptance"].get("ar")), _point(a["acceptance"].get("al")),
             _point(a["acceptance"].get("alpha")), _iv(a["decode_speedup"]), a["state"], a["reason"]] for a in config.get("categories") or []]


def category_lines(report: dict[str, Any]) -> list[str]:
    """The greedy phase per category of the configuration the verdict speaks for, and the summary sentence."""
    name = category_config(report)
    config = report["configs"].get(name) if name else None
    if not config or not config.get("categories"):
        return []
    return [f"## Per category (`{name}`)", "", _category_intro(report, config), "", *_table(CATEGORY_HEADER, category_rows(config)),
            "", f"**{_category_sentence(config)}**"]


def _category_intro(report: dict[str, Any], config: dict[str, Any]) -> str:
    return (f"From the fixed-work greedy phase: every server ran the same requests, one batch per category at concurrency "
            f"{report['options'].get('max_num_seqs')} (--max-num-seqs); intervals at {config['categories'][0]['level']:.2%} "
            "(95% family-wise over the categories). Reported, not binding: the verdict judges the mix.")


def _category_sentence(config: dict[str, Any]) -> str:
    sentence = (config.get("category_summary") or {}).get("sentence") or "n/a"
    return sentence[:1].upper() + sentence[1:] + "."


def traffic_lines(report: dict[str, Any]) -> list[str]:
    """What was measured, so a reader can tell whether it is like their traffic: source, counts, lengths, category mix."""
    t = report.get("traffic")
    if not t:
        return []
    skipped = ", ".join(f"{reason}: {n}" for reason, n in (t.get("skipped") or {}).items()) or "none"
    lines = ["## Traffic", "", f"- Source: {t.get('source') or 'n/a'}; {_f(t.get('prompts'))} prompts measured; skipped: {skipped}."]
    for key, label in (("prompt_tokens", "Prompt tokens"), ("output_tokens", "Output tokens")):
        q = (t.get("quantiles") or {}).get(key) or {}
        lines.append(f"- {label}: " + ", ".join(f"{k} {_f(q.get(k))}" for k in ("p10", "p50", "p90", "max")) + ".")
    mix = t.get("categories") or {}
    total = sum(mix.values())
    lines.append("- Categories: " + (", ".join(f"{k} {n} ({n / total:.0%})" for k, n in mix.items()) if total else "n/a") + ".")
    return lines


CATEGORY_HEADER = ["category", "prompts", "AR", "AL", "alpha", "decode speedup [interval]", "state", "reason"]
LOAD_HEADER = ["load", "speculating", "rounds", "throughput ratio", "predicted S (decode)", "alpha", "alpha_min", "c", "g", "schedule gamma", "rule"]
CRITERIA_HEADER = ["criterion", "load", "estimate [interval]", "threshold", "result", "why"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# specgate gate: **{report['verdict']}**" + (f" for `{report['config']}`" if report["config"] else ""), ""]
    lines += recommendation_lines(report) + [""]
    lines += [f"- {note}" for note in report["notes"]] + ([""] if report["notes"] else [])
    lines += ["## Criteria", ""] + _table(CRITERIA_HEADER, criteria_rows(report["criteria"]))
    for name, stage in report["stages"].items():
        lines += ["", f"Stage `{name}`: {stage['blocks']} blocks of paired rounds over loads {', '.join(stage['loads'])} in {stage['wall_s']:.0f} s; "
                  f"intervals at {stage['level']:.2%} ({stage['looks']} planned look(s), 95% family-wise)."]
    for section in (category_lines(report), traffic_lines(report)):
        lines += ([""] + section) if section else []
    for name, c in report["configs"].items():
        lines += ["", f"## `{name}` ({c.get('engine') or 'unknown'}, {c['stage']}): {c['verdict']}", ""]
        if c.get("command"):
            lines += ["```", c["command"], "```", ""]
        acc = c.get("acceptance") or {}
        lines += [f"Acceptance over every phase ({acc.get('source') or 'not reported by the engine'}): AR {_f(acc.get('ar'))}, AL {_f(acc.get('al'))}, "
                  f"per position {_f(acc.get('per_position') or None)}.", ""]
        lines += _table(LOAD_HEADER, load_rows(c))
        failing = [x for x in c["criteria"] if x["state"] in ("FAIL", "UNDECIDED") and x["binding"]]
        lines += ["", "Binding criteria not passed: " + ("; ".join(f"{x['name']} {x['state']}" for x in failing) or "none") + "."]
        lines += ["", "Schedule:", "", "```", _schedule_text(c["schedule"]), "```"]
        for m in c["quality"]["greedy"]["mismatches"]:
            at = f"token {m['first_diff_token']}" if m.get("first_diff_token") is not None else f"char {m['first_diff_char']}"
            lines.append(f"- greedy mismatch `{m['prompt_id']}` ({m.get('category')}) from {at}, after {m.get('context', '')!r}: "
                         f"baseline {m['baseline']!r} vs speculative {m['speculative']!r}")
    lines += ["", "## Latency at each load (configuration - baseline, ms, request-level bootstrap)", ""]
    rows = [[name, a["load"], *(_iv(a["latency_ms"].get(k)) for k in ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "e2e_p50"))]
            for name, c in report["configs"].items() for a in c["loads"]]
    lines += _table(["config", "load", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "e2e p50"], rows)
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


def _schedule_text(s: dict[str, Any]) -> str:
    if not s:
        return "(no schedule)"
    if s.get("vllm_speculative_config") is None:  # a specgate EAGLE head: only specgate runs it
        return "\n".join([f"specgate serve {s['specgate']}", f"# {s['sglang_note']}"])
    return "\n".join([
        f"vLLM --speculative-config '{json.dumps(s['vllm_speculative_config'])}'",
        f"SGLang: {' '.join(s['sglang_flags']) or '(no speculation)'}  # {s['sglang_note']}",
        f"TensorRT-LLM: {json.dumps(s['tensorrt_llm'])}",
        f"specgate serve {s['specgate']}",
    ])


# ------------------------------------------------------------------------------------------ plots


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else float("nan")


def _ratio_plot(report: dict[str, Any], ax: Any, key: str, title: str) -> None:
    """Each configuration's `key` interval per load, as a point with its interval; 1 and 1 - margin marked."""
    loads = sorted({a["load"] for c in report["configs"].values() for a in c["loads"]}, key=_load_order)
    configs = list(report["configs"].items())
    width = 0.7 / max(len(configs), 1)
    for i, (name, c) in enumerate(configs):
        by_load = {a["load"]: a.get(key) for a in c["loads"]}
        xs, ys, lo, hi = [], [], [], []
        for j, load in enumerate(loads):
            iv = by_load.get(load)
            if iv and iv.get("low") is not None and iv.get("high") is not None:
                xs.append(j - 0.35 + width * (i + 0.5))
                ys.append(iv["estimate"])
                lo.append(iv["estimate"] - iv["low"])
                hi.append(iv["high"] - iv["estimate"])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, color=f"C{i}", label=f"{name} ({c['stage']})")
    ax.axhline(1.0, color="grey", lw=1)
    margin = report["options"]["margin"]
    if key == "throughput_ratio":
        ax.axhline(1.0 - margin, color="C3", lw=1, ls="--", label=f"1 - margin ({margin:g})")
    ax.set_xticks(range(len(loads)), loads)
    ax.set(xlabel="load (closed-loop concurrency cN, open-loop poisson)", title=title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _load_order(load: str) -> tuple[int, int]:
    return (1, 0) if not load[1:].isdigit() else (0, int(load[1:]))


def make_plots(report: dict[str, Any]) -> dict[str, str]:
    """name -> base64 PNG: the throughput ratio per load with intervals, predicted vs measured, absolute throughput, acceptance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    _ratio_plot(report, ax1, "throughput_ratio", "Throughput ratio over the baseline (interval per load)")
    ax1.set_ylabel("configuration / baseline")
    _ratio_plot(report, ax2, "decode_speedup", "Predicted (decode) speedup: above 1 iff alpha > alpha_min")
    plots["throughput_ratio"] = _png(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for i, (name, run) in enumerate(report["measurements"].items()):
        by_load: dict[str, list[float]] = {}
        for w in run.get("windows") or []:
            by_load.setdefault(w["load"], []).append(w["tokens_per_s"])
        loads = sorted((x for x in by_load if x != "poisson"), key=_load_order)
        ax1.plot([int(x[1:]) for x in loads], [sum(by_load[x]) / len(by_load[x]) for x in loads], "o-", color=f"C{i}", label=name)
    ax1.set(xlabel="concurrency (closed loop)", ylabel="output tokens/s (mean of rounds)", title="Throughput")
    ax1.set_xscale("log", base=2)
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    _acceptance_plot(report, ax2)
    plots["throughput_acceptance"] = _png(fig)
    if report.get("traffic"):
        plots["traffic"] = _traffic_plot(report["traffic"])
    return plots


def _traffic_plot(traffic: dict[str, Any]) -> str:
    """The measured workload: prompt-length and output-length histograms and the category mix."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
    for ax, key, title in ((axes[0], "prompt_tokens", "Prompt length"), (axes[1], "output_tokens", "Output length")):
        values = [v for v in traffic.get(key) or [] if isinstance(v, (int, float))]
        if values:
            ax.hist(values, bins=min(30, max(5, len(set(values)))), color="C0")
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel="tokens", ylabel="prompts", title=f"{title} ({len(values)} prompts)")
        ax.grid(alpha=0.3)
    mix = traffic.get("categories") or {}
    axes[2].bar(list(mix), list(mix.values()), color="C1")
    axes[2].set(ylabel="prompts", title="Category mix")
    axes[2].tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"Traffic measured: {traffic.get('source') or 'n/a'}", fontsize=10)
    return _png(fig)


def _acceptance_plot(report: dict[str, Any], ax: Any) -> None:
    for i, (name, c) in enumerate(report["configs"].items()):
        rates = (c.get("acceptance") or {}).get("per_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, "o-", color=f"C{i}", label=name)
    ax.set(xlabel="draft position", ylabel="accepted / drafts (marginal)", title="Acceptance per position", ylim=(0, 1))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


# ------------------------------------------------------------------------------------------ html and files


def render_html(report: dict[str, Any], plots: dict[str, str]) -> str:
    """A self-contained page: no external resources, plots as data: URIs."""
    e = html.escape
    verdict = report["verdict"]
    colour = {"GO": "#1a7f37", "NO-GO": "#b42318"}.get(verdict, "#9a6700")
    rows = "".join(f"<tr class='{e(c['state'].lower())}'>" + "".join(f"<td>{e(x)}</td>" for x in row) + "</tr>"
                   for c, row in zip(report["criteria"], criteria_rows(report["criteria"])))
    rec = report["recommendation"]
    recommendation = (f"<div id='recommendation'><h2>Recommendation: {e(str(rec['config']))} ({e(rec['verdict'])})</h2><p>{e(rec['reason'])}</p>"
                      + (f"<pre>{e(rec['command'])}</pre>" if rec.get("command") else "") + "</div>")
    configs = "".join(
        f"<h3>{e(name)} ({e(c['stage'])}): {e(c['verdict'])}</h3><table class='loads'><tr>{''.join(f'<th>{e(h)}</th>' for h in LOAD_HEADER)}</tr>"
        + "".join("<tr>" + "".join(f"<td>{e(x)}</td>" for x in row) + "</tr>" for row in load_rows(c)) + "</table>"
        f"<pre>{e(_schedule_text(c['schedule']))}</pre>" for name, c in report["configs"].items())
    mismatches = "".join(
        f"<li><code>{e(name)}</code> / <code>{e(m['prompt_id'])}</code> from "
        f"{e('token ' + str(m['first_diff_token']) if m.get('first_diff_token') is not None else 'char ' + str(m['first_diff_char']))}:"
        f"<br>baseline: <code>{e(m['baseline'])}</code><br>speculative: <code>{e(m['speculative'])}</code></li>"
        for name, c in report["configs"].items() for m in c["quality"]["greedy"]["mismatches"])
    images = "".join(f"<figure><img class='plot' id='plot-{e(name)}' alt='{e(name)}' src='data:image/png;base64,{data}'></figure>" for name, data in plots.items())
    notes = "".join(f"<li>{e(n)}</li>" for n in report["notes"])
    definitions = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in report["definitions"].items())
    categories, traffic = _category_html(report), _traffic_html(report)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>specgate gate: {e(verdict)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1200px; }}
#verdict {{ font-size: 2.4em; font-weight: bold; color: {colour}; }}
table {{ border-collapse: collapse; font-size: 0.85em; }} td, th {{ border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; }}
tr.pass td:nth-child(5) {{ color: #1a7f37; font-weight: bold; }} tr.fail td:nth-child(5) {{ color: #b42318; font-weight: bold; }}
tr.undecided td:nth-child(5) {{ color: #9a6700; font-weight: bold; }}
#categories tr.pays td:nth-child(6) {{ color: #1a7f37; font-weight: bold; }} #categories tr.loses td:nth-child(6) {{ color: #b42318; font-weight: bold; }}
img.plot {{ max-width: 100%; }} pre {{ background: #f6f8fa; padding: 8px; overflow-x: auto; }}
</style></head><body>
<h1>specgate gate</h1>
<p id="verdict">{e(verdict)}</p>
<p>Configuration: <code>{e(str(report['config']))}</code>; wall time {report['wall_s']:.1f} s.</p>
<ul>{notes}</ul>
{recommendation}
<h2>Criteria of <code>{e(str(report['config']))}</code></h2>
<table id="criteria"><tr>{''.join(f'<th>{e(h)}</th>' for h in CRITERIA_HEADER)}</tr>{rows}</table>
{categories}
{traffic}
<h2>Plots</h2>{images}
<h2>Configurations</h2>{configs}
<h2>Greedy mismatches</h2><ul id="mismatches">{mismatches or '<li>none</li>'}</ul>
<h2>Definitions</h2><dl>{definitions}</dl>
</body></html>
"""


def _category_html(report: dict[str, Any]) -> str:
    """The per-category table of report.md's section, as HTML ('' when there is none)."""
    e = html.escape
    name = category_config(report)
    config = report["configs"][name] if name else {}
    if not config.get("categories"):
        return ""
    rows = "".join(f"<tr class='{e(a['state'].replace(' ', '-'))}'>" + "".join(f"<td>{e(x)}</td>" for x in row) + "</tr>"
                   for a, row in zip(config["categories"], category_rows(config)))
    return (f"<h2>Per category ({e(name)})</h2><p>{e(_category_intro(report, config))}</p><table id='categories'><tr>"
            f"{''.join(f'<th>{e(h)}</th>' for h in CATEGORY_HEADER)}</tr>{rows}</table><p><b>{e(_category_sentence(config))}</b></p>")


def _traffic_html(report: dict[str, Any]) -> str:
    """report.md's Traffic section as HTML ('' without `traffic`)."""
    lines = traffic_lines(report)
    items = "".join(f"<li>{html.escape(line[2:])}</li>" for line in lines if line.startswith("- "))
    return f"<h2>Traffic</h2><ul id='traffic'>{items}</ul>" if lines else ""


def write_outputs(out: Path, report: dict[str, Any], records: list[dict]) -> dict[str, Any]:
    """Write report.json, report.md, report.html and requests.jsonl into `out`; returns the report as written
    (JSON values: an unbounded interval side is null), with `files`."""
    paths = {"json": out / "report.json", "markdown": out / "report.md", "html": out / "report.html", "requests": out / "requests.jsonl"}
    report["files"] = {k: str(v) for k, v in paths.items()}
    report = jsonable(report)
    plots = make_plots(report)
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    paths["markdown"].write_text(render_markdown(report))
    paths["html"].write_text(render_html(report, plots))
    with open(paths["requests"], "w") as f:
        for record in records:
            f.write(json.dumps(jsonable(record)) + "\n")
    return report
