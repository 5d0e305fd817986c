"""The GO / NO-GO decision, as the lesson states it, and the recommended per-concurrency gamma schedule.

GO only if every binding criterion passes (each one PASS / FAIL with its value, threshold and reason):
1. acceptance: the measured alpha > alpha_min(gamma, c_measured), the acceptance at which
   S(alpha_min, gamma, c) = 1 (specgate.theory.alpha_min);
2. throughput at the target concurrency >= the baseline's (closed loop, output tokens/s);
3. greedy exact match >= greedy_match_min (1.0: a lossless configuration reproduces the baseline);
4. math exact match: the paired difference's 95% CI contains 0 (or the delta is >= 0);
5. sampled log-likelihood: the two-sample test does not flag a shift (p >= its significance);
6. lossless: not labelled lossy; for an engine other than specgate, whose verifier is not ours, only when the
   exact-match and log-likelihood tests both pass ("unknown" otherwise);
7. completed: the configuration's server ran every phase (did not die mid-run).
Targets, reported with PASS / FAIL beside them and binding only when asked (`Thresholds.require`, the CLI's
`--require ttft,itl,memory`): TTFT p95 <= baseline x (1 + ttft_tolerance); ITL p95 < baseline (an improvement);
memory headroom (peak RSS <= (1 - memory_headroom) x RAM, GPU likewise, no more preemptions than the baseline).
Speculation is a latency optimisation whose cost shows up as lost throughput: the lesson's rule judges the
acceptance against the measured cost and the throughput under load; latency and memory goals depend on the
deployment, so they bind only where the user says they do.

Measured c (effective draft cost ratio, verify overhead included), from the closed-loop step times at
concurrency n: t_step = sum over requests of (e2e - TTFT) / decode steps after the first token, where a
speculative request's steps = its tokens - accepted drafts; c(n) = (t_step_spec / t_step_base - 1) / g, with g
the mean draft length (draft tokens / drafts; a lookup drafter may propose fewer than gamma).
The schedule picks, per measured concurrency n, argmax_g S(alpha, g, c(n)) over g in 1..min(gamma_max, gamma)
(0 where no g gives S > 1 or where the measured throughput ratio is < 1): it assumes the verify cost grows
linearly in g and does not extrapolate beyond the measured gamma.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from specgate import theory

CRITERIA = (
    "acceptance_above_alpha_min", "throughput_at_target_concurrency", "ttft_p95_at_target_concurrency",
    "itl_p95_at_target_concurrency", "memory_headroom", "greedy_exact_match", "math_exact_match_delta",
    "sampled_loglik_shift", "lossless", "completed",
)
TARGETS = {"ttft": "ttft_p95_at_target_concurrency", "itl": "itl_p95_at_target_concurrency", "memory": "memory_headroom"}


@dataclass
class Thresholds:
    target_concurrency: int = 4
    ttft_tolerance: float = 0.10  # spec TTFT p95 may be up to 10% worse
    memory_headroom: float = 0.20  # keep 20% of RAM / GPU memory free
    greedy_match_min: float = 1.0
    gamma_max: int = 8
    require: tuple[str, ...] = ()  # targets made binding: any of TARGETS' keys

    def validate(self) -> None:
        unknown = [name for name in self.require if name not in TARGETS]
        if unknown:
            raise ValueError(f"--require {','.join(unknown)} is not a target: use any of {', '.join(TARGETS)} (comma-separated)")
        if self.target_concurrency < 1:
            raise ValueError(f"--target-concurrency {self.target_concurrency} must be >= 1")
        if not 0.0 <= self.ttft_tolerance <= 10.0:
            raise ValueError(f"--ttft-tolerance {self.ttft_tolerance} is out of range [0, 10] (a fraction: 0.1 = 10% worse allowed)")
        if not 0.0 <= self.memory_headroom < 1.0:
            raise ValueError(f"--memory-headroom {self.memory_headroom} is out of range [0, 1) (fraction of memory kept free)")
        if not 0.0 <= self.greedy_match_min <= 1.0:
            raise ValueError(f"--greedy-match-min {self.greedy_match_min} is out of range [0, 1]")


@dataclass
class Criterion:
    name: str
    value: Any
    threshold: Any
    passed: bool
    reason: str
    binding: bool = True  # a target (TTFT, ITL, memory) is reported but binds only when required

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "threshold": self.threshold, "pass": self.passed, "reason": self.reason,
                "binding": self.binding}


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def alpha_from_acceptance_length(acceptance_length: float, gamma: int) -> float:
    """Invert Leviathan's E[T]: the i.i.d. alpha whose expected tokens per step with gamma drafts is AL."""
    from scipy.optimize import brentq

    if acceptance_length <= 1.0:
        return 0.0
    if acceptance_length >= gamma + 1:
        return 1.0
    return float(brentq(lambda a: theory.expected_tokens(a, gamma) - acceptance_length, 0.0, 1.0, xtol=1e-12))


def step_time_s(level: dict[str, Any], speculative: bool) -> float | None:
    """Decode seconds per step of one request at one concurrency level (module docstring)."""
    decode_s, tokens, requests = level.get("decode_s_sum"), level.get("output_tokens") or 0, level.get("ok") or 0
    accepted = (level.get("spec") or {}).get("num_accepted_tokens") or 0.0 if speculative else 0.0
    steps = tokens - accepted - requests
    if not decode_s or steps <= 0:
        return None
    return decode_s / steps


def measured_c(base_level: dict, spec_level: dict, gamma: int) -> float | None:
    """c(n) = (t_step_spec / t_step_base - 1) / gamma, clipped at 0 (None when a time is missing)."""
    t_base, t_spec = step_time_s(base_level, False), step_time_s(spec_level, True)
    if t_base is None or t_spec is None or gamma < 1:
        return None
    return max(t_spec / t_base - 1.0, 0.0) / gamma


def _level(config: dict, concurrency: int) -> dict | None:
    return next((lv for lv in config.get("sweep", []) if lv.get("concurrency") == concurrency), None)


def analyse(baseline: dict, spec: dict, gamma_max: int = 8) -> dict[str, Any]:
    """Per concurrency: measured c, alpha, predicted and measured speedup, best gamma; the paying range; alpha_min."""
    gamma = int(spec.get("gamma") or 0)
    rows = []
    for level in spec.get("sweep", []):
        n = level["concurrency"]
        base = _level(baseline, n)
        if base is None or gamma < 1:
            continue
        window = level.get("spec") or {}
        length = window.get("acceptance_length")
        g_eff = max(int(round(window.get("mean_draft_len") or gamma)), 1)  # the engine's measured draft length
        alpha = alpha_from_acceptance_length(length, g_eff) if length else None
        c = measured_c(base, level, g_eff)
        predicted = theory.speedup(alpha, g_eff, c) if alpha is not None and c is not None else None
        b_tps, s_tps = base.get("output_tokens_per_s"), level.get("output_tokens_per_s")
        measured = s_tps / b_tps if b_tps and s_tps else None
        best_g, best_s = theory.best_gamma(alpha, c, min(gamma_max, gamma)) if alpha is not None and c is not None else (None, None)
        rows.append({
            "concurrency": n, "alpha": alpha, "c": c, "gamma": g_eff, "predicted_speedup": predicted, "measured_speedup": measured,
            "best_gamma": best_g, "best_predicted_speedup": best_s,
            "recommended_gamma": (best_g if best_s is not None and best_s > 1.0 and (measured is None or measured >= 1.0) else 0),
        })
    paying = [r["concurrency"] for r in rows if r["measured_speedup"] is not None and r["measured_speedup"] >= 1.0]
    first = rows[0] if rows else {}
    c1, g1 = first.get("c"), first.get("gamma") or gamma or 1
    a_min = theory.alpha_min(g1, c1) if c1 is not None else None
    return {
        "per_concurrency": rows, "paying_concurrency": paying, "paying_range": _contiguous_from_start(rows),
        "alpha_min": a_min, "alpha_min_gamma": g1, "alpha_min_c": c1,
    }


def _contiguous_from_start(rows: list[dict]) -> list[int] | None:
    """[lo, hi]: the measured concurrencies from the lowest up to the last one where speculation still pays."""
    paying = []
    for row in rows:
        if row["measured_speedup"] is None or row["measured_speedup"] < 1.0:
            break
        paying.append(row["concurrency"])
    return [paying[0], paying[-1]] if paying else None


HEAD_NOTE = ("specgate's EAGLE head (its own format: one layer on the target's final-norm state) is not a checkpoint vLLM, "
             "SGLang or TensorRT-LLM can load: there, use a head in their format (EAGLE-3) and measure it with "
             "`specgate gate --engine vllm --spec eagle3:PATH`")


def is_specgate_head(draft: str, target: str | None) -> bool:
    """True for a specgate EAGLE head: eagle / eagle:DIR, or `default` where the target's default is one."""
    from specgate.drafting.registry import DEFAULT_DRAFTS, EAGLE_PREFIX

    name = (target or "").rstrip("/").rsplit("/", 1)[-1]
    return draft == "eagle" or draft.startswith(EAGLE_PREFIX) or (draft == "default" and DEFAULT_DRAFTS.get(name, "").startswith(EAGLE_PREFIX))


def schedule_exports(analysis: dict, draft: str, max_num_seqs: int, head: bool = False) -> dict[str, Any]:
    """The recommended per-concurrency gamma as vLLM / SGLang / TensorRT-LLM / specgate settings. head: the draft is
    a specgate EAGLE head (is_specgate_head), which only specgate runs: the other engines' settings are None / []."""
    rows = analysis["per_concurrency"]
    ranges, lo = [], 1
    for row in rows:
        ranges.append([lo, row["concurrency"], int(row["recommended_gamma"])])
        lo = row["concurrency"] + 1
    if rows and lo <= max_num_seqs:
        ranges.append([lo, max(max_num_seqs, lo), 0])  # beyond the measured range: off (not measured)
    k_max = max((r[2] for r in ranges), default=0)
    method = "ngram" if draft == "ngram" else "draft_model"
    vllm: dict[str, Any] = {"method": method, "num_speculative_tokens": k_max, "num_speculative_tokens_per_batch_size": ranges}
    if method == "ngram":
        vllm.update({"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    else:
        vllm["model"] = draft
    paying = [r for r in ranges if r[2] > 0]
    top = max(paying, key=lambda r: r[2]) if paying else None
    sglang = (
        ["--speculative-algorithm", "NGRAM" if method == "ngram" else "STANDALONE", "--speculative-num-steps", str(top[2]),
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(top[2] + 1),
         "--max-running-requests", str(max(r[1] for r in paying))]
        if top else []
    )
    if top and method != "ngram":
        sglang[2:2] = ["--speculative-draft-model-path", draft]
    trt = {"draft_len_schedule": {str(r[1]): r[2] for r in ranges}, "max_concurrency": max((r[1] for r in paying), default=0)}
    table = ",".join(f"{a}-{b}:{g}" for a, b, g in ranges)
    if head:
        return {"table": ranges, "vllm_speculative_config": None, "sglang_flags": [], "sglang_note": HEAD_NOTE, "tensorrt_llm": None,
                "specgate": f"--policy table --gamma-table '{table}'" if table else "--policy off"}
    return {
        "table": ranges, "vllm_speculative_config": vllm,
        "sglang_flags": sglang, "sglang_note": "SGLang has no batch-size table: these flags fit the paying range; cap "
        "--max-running-requests there or serve the rest without speculation" if top else "speculation never paid: do not enable it",
        "tensorrt_llm": trt, "specgate": f"--policy table --gamma-table '{table}'" if table else "--policy off",
    }


def decide(baseline: dict, spec: dict, quality: dict, thresholds: Thresholds, analysis: dict | None = None) -> tuple[str, list[Criterion]]:
    """Every criterion of the module docstring for one speculative configuration -> ("GO" | "NO-GO", criteria)."""
    analysis = analysis or analyse(baseline, spec, thresholds.gamma_max)
    n = thresholds.target_concurrency
    out = [_acceptance_criterion(analysis, n)]  # 1. acceptance vs alpha_min at the measured c
    out += _speed_criteria(_level(baseline, n), _level(spec, n), n, thresholds)  # 2-4. throughput, TTFT p95, ITL p95
    out.append(_memory_criterion(baseline, spec, thresholds))  # 5. memory headroom and preemptions
    out += _quality_criteria(quality, thresholds)  # 6-8. greedy match, math, sampled log-likelihood
    # 9-10. lossless and completed
    out.append(_lossless(spec, out[5], out[7]))
    failure = spec.get("failure") or (f"baseline: {baseline['failure']}" if baseline.get("failure") else None)
    out.append(Criterion(CRITERIA[9], failure is None, True, failure is None, failure or "every phase ran"))
    required = {TARGETS[name] for name in thresholds.require}
    for c in out:
        c.binding = c.name not in TARGETS.values() or c.name in required
    verdict = "GO" if all(c.passed for c in out if c.binding) else "NO-GO"
    return verdict, out


def _acceptance_criterion(analysis: dict, n: int) -> Criterion:
    """Criterion 1: the measured alpha (at concurrency n, else the first measured) above alpha_min."""
    rows = {r["concurrency"]: r for r in analysis["per_concurrency"]}
    alpha = (rows.get(n) or (analysis["per_concurrency"][0] if analysis["per_concurrency"] else {})).get("alpha")
    a_min = analysis.get("alpha_min")
    if alpha is None or analysis.get("alpha_min_c") is None:
        return Criterion(CRITERIA[0], alpha, a_min, False, "alpha or c not measured (no drafts verified, or a phase failed)")
    if a_min is None:
        return Criterion(CRITERIA[0], alpha, None, False, f"c={_fmt(analysis['alpha_min_c'])} >= 1: the draft step costs as much as a target step, no alpha pays")
    ok = alpha > a_min
    return Criterion(CRITERIA[0], alpha, a_min, ok,
                     f"alpha {_fmt(alpha)} {'>' if ok else '<='} alpha_min {_fmt(a_min)} (gamma {analysis['alpha_min_gamma']}, c {_fmt(analysis['alpha_min_c'])})")


def _speed_criteria(base_lv: dict | None, spec_lv: dict | None, n: int, thresholds: Thresholds) -> list[Criterion]:
    """Criteria 2-4 at the target concurrency n: throughput at least the baseline's, TTFT p95 within the tolerance,
    ITL p95 strictly below the baseline's."""

    def compare(name: str, key: str, better: str, tolerance: float = 0.0, strict: bool = False) -> Criterion:
        if base_lv is None or spec_lv is None or base_lv.get(key) is None or spec_lv.get(key) is None:
            return Criterion(name, None, None, False, f"not measured at concurrency {n} (phase missing or failed)")
        b, s = base_lv[key], spec_lv[key]
        if better == "higher":
            ok, threshold = s >= b, b
            reason = f"{_fmt(s)} vs baseline {_fmt(b)} ({_fmt(s / b if b else None)}x) at concurrency {n}"
        else:
            threshold = b * (1.0 + tolerance)
            ok = s < threshold if strict else s <= threshold
            rel = "<" if strict else "<="
            reason = f"{_fmt(s)} s vs baseline {_fmt(b)} s at concurrency {n}: need {rel} {_fmt(threshold)} s"
        return Criterion(name, s, threshold, bool(ok), reason)

    return [
        compare(CRITERIA[1], "output_tokens_per_s", "higher"),
        compare(CRITERIA[2], "ttft_p95_s", "lower", thresholds.ttft_tolerance),
        compare(CRITERIA[3], "itl_p95_s", "lower", strict=True),
    ]


def _memory_criterion(baseline: dict, spec: dict, thresholds: Thresholds) -> Criterion:
    """Criterion 5: peak RSS (and GPU memory) within the headroom, no more preemptions than the baseline."""
    memory, base_memory = spec.get("memory") or {}, baseline.get("memory") or {}
    reasons, ok = [], True
    rss, total = memory.get("peak_rss_mib"), memory.get("mem_total_mib")
    limit = total * (1.0 - thresholds.memory_headroom) if total else None
    if rss is not None and limit is not None:
        ok &= rss <= limit
        reasons.append(f"peak RSS {rss:.0f} MiB vs limit {limit:.0f} MiB ({thresholds.memory_headroom:.0%} of {total:.0f} MiB kept free)")
    gpu_used, gpu_total = memory.get("gpu_memory_used_mib"), memory.get("gpu_memory_total_mib")
    if gpu_used is not None and gpu_total:
        ok &= gpu_used <= gpu_total * (1.0 - thresholds.memory_headroom)
        reasons.append(f"GPU {gpu_used:.0f} of {gpu_total:.0f} MiB")
    pre, base_pre = memory.get("preemptions"), base_memory.get("preemptions")
    if pre is not None:
        ok &= pre <= (base_pre or 0.0)
        reasons.append(f"preemptions {pre:.0f} vs baseline {base_pre or 0:.0f}")
    if not reasons:
        reasons.append("no memory figure available (external endpoint without preemption counters): not measurable")
    return Criterion(CRITERIA[4], rss, limit, bool(ok), "; ".join(reasons))


def _quality_criteria(quality: dict, thresholds: Thresholds) -> list[Criterion]:
    """Criteria 6-8: greedy outputs identical to the baseline's, math accuracy within noise, no shift of the sampled
    continuations' log-likelihood."""
    out = []
    greedy = quality.get("greedy") or {}
    rate = greedy.get("rate")
    if rate is None:
        out.append(Criterion(CRITERIA[5], None, thresholds.greedy_match_min, False, "no paired greedy outputs"))
    else:
        out.append(Criterion(CRITERIA[5], rate, thresholds.greedy_match_min, rate >= thresholds.greedy_match_min,
                             f"{greedy['matches']}/{greedy['pairs']} greedy outputs identical to the baseline; {len(greedy['mismatches'])} mismatch(es) listed"))
    math_q = quality.get("math") or {}
    if not math_q:
        out.append(Criterion(CRITERIA[6], None, "95% CI of the delta contains 0", False, "math set not measured"))
    else:
        lo, hi = math_q["delta_ci95"]
        out.append(Criterion(CRITERIA[6], math_q["delta"], "95% CI of the delta contains 0 (or delta >= 0)", bool(math_q["within_noise"]),
                             f"exact match {math_q['speculative_em']:.3f} vs baseline {math_q['baseline_em']:.3f}, delta 95% CI [{lo:.3f}, {hi:.3f}], McNemar p={math_q['mcnemar_p']:.3g}"))
    loglik = quality.get("loglik") or {}
    if not loglik or loglik.get("p_value") is None:
        out.append(Criterion(CRITERIA[7], None, LOGLIK_THRESHOLD_TEXT, False, loglik.get("reason", "sampled continuations not scored")))
    else:
        out.append(Criterion(CRITERIA[7], loglik["p_value"], loglik["significance"], not loglik["flagged"],
                             f"Wilcoxon signed-rank over {loglik['pairs']} prompts: mean log-prob/token {loglik['speculative_mean']:.3f} vs baseline "
                             f"{loglik['baseline_mean']:.3f}, p={loglik['p_value']:.3g}" + (" (a shift: lossy?)" if loglik["flagged"] else "")))
    return out


def _lossless(spec: dict, greedy: Criterion, loglik: Criterion) -> Criterion:
    """Labelled lossy: never lossless. specgate's verifier is proven exact; another engine's is only inferred, from
    identical greedy output and an unshifted sampled log-likelihood, and is "unknown" otherwise."""
    if spec.get("lossy") or (spec.get("spec_total") or {}).get("lossy"):
        return Criterion(CRITERIA[8], False, True, False, "lossy verification (labelled lossy by the server or the configuration): never GO as lossless")
    if (spec.get("engine") or "specgate") == "specgate":
        return Criterion(CRITERIA[8], True, True, True, "exact verification (specgate's verifier, proven by check-lossless)")
    if greedy.passed and loglik.passed:
        return Criterion(CRITERIA[8], True, True, True, f"{spec['engine']}: inferred from identical greedy output and an unshifted log-likelihood")
    failed = " and ".join(n for n, c in (("greedy exact match", greedy), ("sampled log-likelihood", loglik)) if not c.passed)
    return Criterion(CRITERIA[8], "unknown", True, False, f"{spec['engine']} is not assumed lossless and its {failed} test did not pass")


LOGLIK_THRESHOLD_TEXT = "p >= 0.01"


def criteria_dicts(criteria: list[Criterion]) -> list[dict[str, Any]]:
    return [c.to_dict() for c in criteria]


def thresholds_dict(thresholds: Thresholds) -> dict[str, Any]:
    return asdict(thresholds)
