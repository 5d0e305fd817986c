"""The decision, made once: per configuration, per load and for the gate, from the typed records of what was measured.

The lesson's rule, per load: where a configuration speculates, its acceptance must be above alpha_min for the
gamma and c measured at that load; at any load its throughput must not fall below the baseline's by more than the
margin. The verdict judges the target concurrency and the open-loop Poisson load, plus quality and exactness:

  acceptance_above_alpha_min     alpha > alpha_min(g, c) at the target concurrency (N/A where it does not speculate)
  throughput_at_target_concurrency  closed-loop ratio: lower bound of its interval >= 1 - margin
  throughput_under_poisson       open-loop ratio at the Poisson QPS, the same test
  greedy_exact_match             greedy texts identical to the baseline's (rate >= greedy_match_min)
  math_exact_match               paired non-inferiority within --quality-margin (quality.math_noninferiority)
  sampled_loglik_equivalence     the log-likelihood shift equivalent to 0 within --loglik-margin (quality.loglik_equivalence)
  lossless                       not labelled lossy; another engine's only inferred from the two tests above
  completed                      its server ran to the end
and, reported beside and binding only with --require: TTFT p95 no worse than the tolerance, ITL p95 improved,
memory headroom. Each criterion is PASS, FAIL or UNDECIDED (its interval straddles the bound) or N/A; the verdict
is NO-GO when a binding criterion FAILs, INCONCLUSIVE when one is UNDECIDED, GO when all PASS.
Per prompt category (analyse_categories, from the fixed-work greedy phase: the rounds mix categories) the same
rule on the decode speedup says where speculation pays and where it loses: reported beside the verdict, never binding.

One accounting (every target step, with drafts or without): over a window, T tokens were generated in
S = T - A target steps (A accepted drafts), D of them with drafts totalling G draft tokens. Then
  AL = 1 + A / D (tokens per step that drafted, vLLM's), g = G / D, alpha solves E[T](alpha, g) = AL;
  r = the decode time per step with speculation / without (TPOT x T / S over the baseline's TPOT);
  c = (r - 1) S / G (cost per draft token); alpha_min solves E[T](alpha, g) = 1 + g c;
  predicted S = (T / S) / r, so alpha > alpha_min exactly when the predicted (decode) speedup is > 1.
No clipping: a negative c reads "draft cost within noise of zero" (alpha_min is then 0).
The throughput ratio and the decode speedup are paired over rounds (stats.paired_ratio); alpha, c and alpha_min
get block-bootstrap intervals over the same rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from specgate import theory
from specgate.gate import quality, stats
from specgate.gate.options import TARGETS, GateOptions
from specgate.gate.records import ConfigRun
from specgate.gate.rounds import POISSON, Window
from specgate.gate.stats import Interval, State

CRITERIA = (
    "acceptance_above_alpha_min", "throughput_at_target_concurrency", "throughput_under_poisson", "ttft_p95_at_target_concurrency",
    "itl_p95_at_target_concurrency", "memory_headroom", "greedy_exact_match", "math_exact_match", "sampled_loglik_equivalence",
    "lossless", "completed",
)
SPECULATING_MIN_DRAFTS_PER_STEP = 0.5  # where a policy chooses per step, it speculates at a load when it drafts this much
BLOCK_BOOTSTRAP = 1000
VERDICTS = ("GO", "NO-GO", "INCONCLUSIVE")


@dataclass
class Criterion:
    name: str
    state: State
    reason: str
    binding: bool = True
    load: str | None = None  # the load it judges ("c4", "poisson"), None for quality and exactness
    estimate: float | None = None
    interval: Interval | None = None
    threshold: float | str | None = None
    needed: str | None = None  # what more data would decide it (UNDECIDED only)

    @property
    def passed(self) -> bool:
        return self.state == State.PASS

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "pass": self.passed, "binding": self.binding, "load": self.load,
                "estimate": self.estimate, "interval": self.interval.to_dict() if self.interval else None,
                "threshold": self.threshold, "reason": self.reason, "needed": self.needed}


def verdict_of(criteria: list[Criterion]) -> str:
    binding = [c for c in criteria if c.binding and c.state != State.NA]
    if any(c.state == State.FAIL for c in binding):
        return "NO-GO"
    if any(c.state == State.UNDECIDED for c in binding):
        return "INCONCLUSIVE"
    return "GO"


# ------------------------------------------------------------------------------------------ one load


@dataclass
class Acceptance:
    """The one accounting's figures at one load (module docstring), each with a block-bootstrap interval."""

    ar: Interval | None = None  # accepted / draft tokens
    al: Interval | None = None  # 1 + accepted / drafts
    tokens_per_step: Interval | None = None  # T / S over every step
    draft_len: float | None = None  # g = G / D
    drafts_per_step: float | None = None  # G / S: how much it speculates
    alpha: Interval | None = None
    c: Interval | None = None
    alpha_min: Interval | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.to_dict() if isinstance(v, Interval) else v) for k, v in self.__dict__.items()}


@dataclass
class LoadAnalysis:
    load: str
    concurrency: int | None
    qps: float | None
    rounds: int
    level: float
    baseline_tokens_per_s: float | None
    config_tokens_per_s: float | None
    throughput_ratio: Interval | None
    decode_speedup: Interval | None  # the predicted speedup of the one accounting: baseline TPOT / configuration TPOT
    speculating: bool
    speculating_reason: str
    acceptance: Acceptance
    latency_ms: dict[str, Interval | None]  # configuration - baseline: ttft_p50, ttft_p95, itl_p50, itl_p95, e2e_p50
    baseline_latency_ms: dict[str, float | None]
    best_gamma: int | None
    best_predicted_speedup: float | None
    recommended_gamma: int
    criteria: list[Criterion] = field(default_factory=list)  # acceptance (closed loads) and throughput at this load
    verdict: str = "INCONCLUSIVE"  # the lesson's rule at this load

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("acceptance", "criteria", "latency_ms")}
        for key in ("throughput_ratio", "decode_speedup"):
            out[key] = getattr(self, key).to_dict() if getattr(self, key) else None
        out["acceptance"] = self.acceptance.to_dict()
        out["latency_ms"] = {k: (v.to_dict() if v else None) for k, v in self.latency_ms.items()}
        out["criteria"] = [c.to_dict() for c in self.criteria]
        return out


def _pairs(baseline: list[Window], config: list[Window]) -> list[tuple[Window, Window]]:
    by_block = {w.block: w for w in baseline}
    return [(by_block[w.block], w) for w in config if w.block in by_block]


def expected_tokens(alpha: float, g: float) -> float:
    """Leviathan's E[T] = (1 - a^(g+1)) / (1 - a) at a real mean draft length g (1 + g at a = 1)."""
    return g + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (g + 1.0)) / (1.0 - alpha)


def alpha_from_al(al: float, g: float) -> float | None:
    """The alpha whose E[T] at draft length g is AL (None without drafts)."""
    from scipy.optimize import brentq

    if g <= 0 or not math.isfinite(al):
        return None
    if al <= 1.0:
        return 0.0
    if al >= g + 1.0:
        return 1.0
    return float(brentq(lambda a: expected_tokens(a, g) - al, 0.0, 1.0, xtol=1e-12))


def alpha_min_at(g: float, c: float) -> float | None:
    """The alpha at which E[T](alpha, g) = 1 + g c: 0 when c <= 0 (any acceptance pays), None when c >= 1."""
    if c <= 0:
        return 0.0
    if c >= 1.0 or g <= 0:
        return None
    from scipy.optimize import brentq

    return float(brentq(lambda a: expected_tokens(a, g) - (1.0 + g * c), 0.0, 1.0, xtol=1e-12))


def _counts(window: Window) -> tuple[float, float, float, float] | None:
    """(drafts D, draft tokens G, accepted A, generated T) over a window's counters; T from the client if not exported."""
    spec = window.spec
    if spec is None or spec.flavour is None or spec.flavour == "sglang":
        return None
    generated = spec.generation_tokens if spec.generation_tokens else window.tokens
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, float(generated)


def _accounting(pairs: list[tuple[Window, Window]], blocks: np.ndarray) -> dict[str, float | None]:
    """The one accounting over the rounds `blocks` (indices into pairs): AR, AL, T/S, g, G/S, alpha, c, alpha_min."""
    counts = [_counts(pairs[i][1]) for i in blocks]
    if any(c is None for c in counts):
        return {}
    D, G, A, T = (float(sum(c[k] for c in counts)) for k in range(4))  # type: ignore[index]
    base_tpot = _pooled_tpot([pairs[i][0] for i in blocks])
    spec_tpot = _pooled_tpot([pairs[i][1] for i in blocks])
    return accounting(D, G, A, T, spec_tpot / base_tpot if base_tpot and spec_tpot else None)


def accounting(drafts: float, draft_tokens: float, accepted: float, generated: float, tpot_ratio: float | None) -> dict[str, float | None]:
    """The one accounting (module docstring) of D drafts, G draft tokens, A accepted and T generated tokens:
    AR, AL, T/S, g, G/S and alpha; with tpot_ratio (configuration TPOT / baseline TPOT, same requests) also c and alpha_min."""
    D, G, A, T = drafts, draft_tokens, accepted, generated
    steps = T - A
    out: dict[str, float | None] = {"ar": A / G if G else None, "al": 1.0 + A / D if D else None,
                                    "tokens_per_step": T / steps if steps > 0 else None, "draft_len": G / D if D else None,
                                    "drafts_per_step": G / steps if steps > 0 else None}
    out["alpha"] = alpha_from_al(out["al"], out["draft_len"]) if out["al"] is not None and out["draft_len"] else None
    if tpot_ratio and out["tokens_per_step"] and G:
        r = tpot_ratio * out["tokens_per_step"]  # decode time per target step, over the baseline's
        out["c"] = (r - 1.0) * steps / G
        out["alpha_min"] = alpha_min_at(out["draft_len"] or 0.0, out["c"]) if out["draft_len"] else None
    return out


def _pooled_tpot(windows: list[Window]) -> float | None:
    tokens = sum(w.decode_tokens for w in windows)
    return sum(w.decode_s for w in windows) / tokens if tokens else None


def acceptance_at(pairs: list[tuple[Window, Window]], level: float, seed: int) -> Acceptance:
    """The one accounting's point estimates with percentile intervals from resampling whole rounds."""
    k = len(pairs)
    point = _accounting(pairs, np.arange(k))
    if not point:
        return Acceptance()
    rng = np.random.default_rng(seed)
    draws = [_accounting(pairs, rng.integers(0, k, size=k)) for _ in range(BLOCK_BOOTSTRAP)] if k >= 2 else []
    tail = (1.0 - level) / 2.0 * 100.0

    def interval(key: str) -> Interval | None:
        if point.get(key) is None:
            return None
        values = [d[key] for d in draws if d.get(key) is not None]
        if len(values) < len(draws) * 0.9 or not values:
            return Interval(float(point[key]), -math.inf, math.inf, level, k)  # type: ignore[arg-type]
        return Interval(float(point[key]), float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail)), level, k)  # type: ignore[arg-type]

    return Acceptance(ar=interval("ar"), al=interval("al"), tokens_per_step=interval("tokens_per_step"), draft_len=point.get("draft_len"),
                      drafts_per_step=point.get("drafts_per_step"), alpha=interval("alpha"), c=interval("c"), alpha_min=interval("alpha_min"))


def latency_differences(pairs: list[tuple[Window, Window]], level: float, seed: int) -> tuple[dict[str, Interval | None], dict[str, float | None]]:
    """Configuration - baseline, in ms, of TTFT / ITL / e2e percentiles, resampling whole requests within rounds."""
    out: dict[str, Interval | None] = {}
    base: dict[str, float | None] = {}
    for key, attr, q in (("ttft_p50", "ttft_s", 50), ("ttft_p95", "ttft_s", 95), ("itl_p50", "itl_s", 50), ("itl_p95", "itl_s", 95), ("e2e_p50", "e2e_s", 50)):
        def groups(side: int) -> list[list[np.ndarray]]:
            return [[np.atleast_1d(np.asarray(x, dtype=float)) * 1e3 for x in getattr(pair[side], attr)] for pair in pairs]

        a, b = groups(1), groups(0)
        out[key] = stats.bootstrap_percentile_difference(a, b, q, level, seed, resamples=500)
        base[key] = stats.percentile_of(b, q)
    return out, base


def speculates(run: ConfigRun, concurrency: int | None, acceptance: Acceptance) -> tuple[bool, str]:
    """Whether `run` speculates at this load: from its configuration where it fixes the draft length, else measured."""
    if run.policy in ("fixed", "engine") and run.spec not in ("server-cmd", "external", "none") and run.gamma > 0:
        return True, f"configured gamma {run.gamma}"
    if run.policy == "table" and run.gamma_table and concurrency is not None:
        gamma = _own_gamma(run, concurrency)
        return gamma > 0, f"its table gives gamma {gamma} at batch size {concurrency}"
    if run.policy == "off" or run.spec == "none":
        return False, "no speculation configured"
    rate = acceptance.drafts_per_step
    if rate is None:
        return False, "no drafts counted"
    return rate >= SPECULATING_MIN_DRAFTS_PER_STEP, f"it drafted {rate:.2g} tokens per step (speculating from {SPECULATING_MIN_DRAFTS_PER_STEP:g})"


def analyse_load(baseline: ConfigRun, run: ConfigRun, stage: str, load: str, options: GateOptions, level: float) -> LoadAnalysis:
    """One configuration against the baseline at one load of one stage: ratios, acceptance, latency, the rule."""
    pairs = _pairs(baseline.windows_at(stage, load), run.windows_at(stage, load))
    concurrency = int(load[1:]) if load.startswith("c") and load[1:].isdigit() else None
    qps = pairs[0][1].qps if pairs else None
    ratio = stats.paired_ratio([c.tokens_per_s for _, c in pairs], [b.tokens_per_s for b, _ in pairs], level)
    tpots = [(b.tpot_s, c.tpot_s) for b, c in pairs if b.tpot_s and c.tpot_s]
    decode = stats.paired_ratio([b for b, _ in tpots], [c for _, c in tpots], level)
    acceptance = acceptance_at(pairs, level, options.seed)
    speculating, why = speculates(run, concurrency, acceptance)
    latency, base_latency = latency_differences(pairs, level, options.seed) if pairs else ({}, {})
    best_g, best_s = _best_gamma(acceptance, run, options.gamma_max)
    analysis = LoadAnalysis(
        load=load, concurrency=concurrency, qps=qps, rounds=len(pairs), level=level,
        baseline_tokens_per_s=_mean([b.tokens_per_s for b, _ in pairs]), config_tokens_per_s=_mean([c.tokens_per_s for _, c in pairs]),
        throughput_ratio=ratio, decode_speedup=decode, speculating=speculating, speculating_reason=why, acceptance=acceptance,
        latency_ms=latency, baseline_latency_ms=base_latency, best_gamma=best_g, best_predicted_speedup=best_s, recommended_gamma=0,
    )
    analysis.criteria = [_throughput_criterion(analysis, options.margin, CRITERIA[2] if load == POISSON else CRITERIA[1])]
    if concurrency is not None:
        analysis.criteria.insert(0, _acceptance_criterion(analysis))
    analysis.verdict = verdict_of(analysis.criteria)
    pays = speculating and ratio is not None and ratio.estimate >= 1.0 and all(c.state != State.FAIL for c in analysis.criteria)
    analysis.recommended_gamma = _own_gamma(run, concurrency) if pays else 0  # measured settings only: no extrapolated gamma
    return analysis


def _own_gamma(run: ConfigRun, concurrency: int | None) -> int:
    """The draft length `run` used at this load (its table's entry, else its configured gamma)."""
    if run.policy == "table" and run.gamma_table and concurrency is not None:
        from specgate.serving.policy.simple import TablePolicy

        return TablePolicy.parse(run.gamma_table).gamma_for(concurrency)
    return run.gamma


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _best_gamma(acceptance: Acceptance, run: ConfigRun, gamma_max: int) -> tuple[int | None, float | None]:
    """argmax_g S(alpha, g, c) over g in 1..min(gamma_max, configured gamma); c below 0 counts as 0 here."""
    if acceptance.alpha is None or acceptance.c is None:
        return None, None
    cap = max(1, min(gamma_max, run.gamma or gamma_max))
    g, s = theory.best_gamma(min(max(acceptance.alpha.estimate, 0.0), 1.0), min(max(acceptance.c.estimate, 0.0), 1e6), cap)
    return int(g), float(s)


def _needed(interval: Interval | None, bound: float, pace_s: float | None, log_scale: bool = True) -> str | None:
    total = stats.units_to_decide(interval, bound, log_scale)
    if interval is None:
        return "no paired round measured: run more rounds"
    if total is None:
        return "its estimate sits on the bound: no amount of rounds is likely to decide it; widen --margin or accept INCONCLUSIVE"
    more = total - interval.n
    time = f" (about {more * pace_s:.0f} s more at this pace: raise --budget-s)" if pace_s else ""
    return f"about {total} paired rounds in all, {more} more{time}"


def _throughput_criterion(a: LoadAnalysis, margin: float, name: str) -> Criterion:
    r = a.throughput_ratio
    where = f"C={a.concurrency}" if a.concurrency is not None else f"Poisson {stats.fmt(a.qps)} QPS"
    state = stats.non_inferior(r, margin)
    if r is None:
        return Criterion(name, State.UNDECIDED, f"not measured at {where}", load=a.load, threshold=1 - margin, needed=_needed(None, 1 - margin, None))
    better = " (an improvement: the whole interval is above 1)" if r.low > 1.0 else ""
    why = {State.PASS: f"its lower bound {stats.fmt(r.low)} >= {stats.fmt(1 - margin)}: no regression beyond {margin:.0%}{better}",
           State.FAIL: f"its upper bound {stats.fmt(r.high)} < {stats.fmt(1 - margin)}: a regression beyond the {margin:.0%} margin",
           State.UNDECIDED: f"the interval straddles {stats.fmt(1 - margin)}: not yet decided"}[state]
    reason = f"throughput ratio {r.text()} at {where} over {r.n} paired rounds ({r.level:.1%} interval): {why}"
    return Criterion(name, state, reason, load=a.load, estimate=r.estimate, interval=r, threshold=1 - margin,
                     needed=_needed(r, 1 - margin, None) if state == State.UNDECIDED else None)


def _acceptance_criterion(a: LoadAnalysis) -> Criterion:
    name, where = CRITERIA[0], f"C={a.concurrency}"
    if not a.speculating:
        return Criterion(name, State.NA, f"n/a: not speculating at {where} ({a.speculating_reason}); only non-inferiority applies", load=a.load)
    acc, s = a.acceptance, a.decode_speedup
    state = stats.above(s, 1.0)
    parts = []
    if acc.alpha is not None:
        parts.append(f"alpha {acc.alpha.text()}")
    if acc.alpha_min is not None:
        parts.append(f"alpha_min {acc.alpha_min.text()}")
    if acc.c is not None:
        zero = ": draft cost within noise of zero" if acc.c.low <= 0.0 else ""  # no clipping: a negative c is noise around 0
        parts.append(f"c {acc.c.text()}{zero}")
    if acc.draft_len is not None:
        parts.append(f"g {acc.draft_len:.2f} drafts/step")
    facts = ", ".join(parts) or "acceptance counters not exported: judged on the decode speedup alone"
    if s is None:
        return Criterion(name, State.UNDECIDED, f"{facts}; decode times not measured at {where}", load=a.load, threshold=1.0)
    verdict = {State.PASS: "alpha > alpha_min", State.FAIL: "alpha <= alpha_min", State.UNDECIDED: "alpha vs alpha_min not yet decided"}[state]
    reason = f"at {where}: {facts}; predicted (decode) speedup {s.text()} vs 1 ({s.level:.1%}): {verdict}"
    return Criterion(name, state, reason, load=a.load, estimate=s.estimate, interval=s, threshold=1.0,
                     needed=_needed(s, 1.0, None) if state == State.UNDECIDED else None)


# ------------------------------------------------------------------------------------------ per category


class CategoryState(str, Enum):
    """The lesson's rule on one category's decode speedup (reported beside the verdict, never binding)."""

    PAYS = "pays"  # the interval's lower bound > 1
    LOSES = "loses"  # its upper bound < 1 - margin
    WITHIN_NOISE = "within noise"
    NA = "n/a"  # no prompt of the category has a greedy TPOT on both servers


@dataclass
class CategoryAnalysis:
    """One prompt category of the fixed-work greedy phase (every server on the same requests, at --max-num-seqs)."""

    category: str
    prompts: int  # the category's prompts in the plan
    paired: int  # those with a TPOT on both servers: the units of the interval
    level: float
    decode_speedup: Interval | None  # geometric mean over its prompts of baseline TPOT / configuration TPOT
    acceptance: Acceptance  # the one accounting over its one counter window: point estimates (unbounded, n = 1)
    state: CategoryState
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "prompts": self.prompts, "paired": self.paired, "level": self.level,
                "decode_speedup": self.decode_speedup.to_dict() if self.decode_speedup else None,
                "acceptance": self.acceptance.to_dict(), "state": self.state.value, "reason": self.reason}


def analyse_categories(baseline: ConfigRun, run: ConfigRun, categories: dict[str, str], options: GateOptions,
                       level: float) -> list[CategoryAnalysis]:
    """Per category (categories: prompt id -> category): the decode speedup paired by prompt (stats.paired_ratio on
    ConfigRun.greedy_tpot), AR / AL / alpha / c / alpha_min from the category's counter window (AR with a bootstrap
    interval over its prompts where the responses carry per-request counts), and the rule there.

    The paired rounds mix categories, so the greedy phase is where a category stands alone. Its prompts ran in one
    batch: the interval holds the prompt-to-prompt spread, not the drift between runs that the rounds' intervals hold."""
    names = list(dict.fromkeys([*categories.values(), *run.per_category, *baseline.per_category]))
    out = []
    for name in names:
        ids = [p for p, c in categories.items() if c == name]
        pairs = [(baseline.greedy_tpot[p], run.greedy_tpot[p]) for p in ids if baseline.greedy_tpot.get(p) and run.greedy_tpot.get(p)]
        speedup = stats.paired_ratio([b for b, _ in pairs], [c for _, c in pairs], level)
        counts = _category_counts(run.per_category.get(name), run.per_category_latency.get(name))
        figures = accounting(*counts, 1.0 / speedup.estimate if speedup else None) if counts else {}
        state, reason = _category_rule(speedup, options.margin)
        prompts = len(ids) or int((run.per_category_latency.get(name) or {}).get("requests") or 0)
        acceptance = _point_acceptance(figures, level)
        drafts = [run.greedy_drafts[p] for p in ids if p in run.greedy_drafts]
        if drafts:  # per-response counts (`timings`): intervals from resampling the category's prompts
            _per_prompt_acceptance(acceptance, drafts, level, options.seed)
        out.append(CategoryAnalysis(name, prompts, len(pairs), level, speedup, acceptance, state, reason))
    return out


def _per_prompt_acceptance(acceptance: Acceptance, drafts: list[tuple[int, int, int]], level: float, seed: int) -> None:
    """AR = accepted / drafted tokens pooled over the prompts, and where the responses count drafts (specgate) AL =
    1 + accepted / drafts and the alpha it implies at the pooled draft length, each with a bootstrap interval over
    prompts (alpha's from AL's bounds: alpha_from_al is increasing in AL)."""
    acceptance.ar = stats.ratio_of_sums([a for _, a, _ in drafts], [g for g, _, _ in drafts], level, seed=seed)
    if not all(d > 0 for _, _, d in drafts):
        return
    per_draft = stats.ratio_of_sums([a for _, a, _ in drafts], [d for _, _, d in drafts], level, seed=seed)
    if per_draft is None:
        return
    acceptance.al = Interval(1.0 + per_draft.estimate, 1.0 + per_draft.low, 1.0 + per_draft.high, level, per_draft.n)
    g = sum(x for x, _, _ in drafts) / sum(d for _, _, d in drafts)
    bound = lambda al: alpha_from_al(al, g) if math.isfinite(al) else (0.0 if al < 0 else 1.0)  # noqa: E731
    acceptance.alpha = Interval(bound(acceptance.al.estimate), bound(acceptance.al.low), bound(acceptance.al.high), level, per_draft.n)
    acceptance.draft_len = g


def _category_counts(window: dict[str, Any] | None, latency: dict[str, Any] | None) -> tuple[float, float, float, float] | None:
    """(D, G, A, T) of a category's counter window (prom.SpecWindow.to_dict); T from the client where not exported."""
    if not window or window.get("flavour") in (None, "sglang"):  # SGLang exports gauges, not counters to take deltas of
        return None
    generated = window.get("generation_tokens") or (latency or {}).get("output_tokens")
    if not generated:
        return None
    return (float(window.get("num_drafts") or 0.0), float(window.get("num_draft_tokens") or 0.0),
            float(window.get("num_accepted_tokens") or 0.0), float(generated))


def _point_acceptance(figures: dict[str, float | None], level: float) -> Acceptance:
    """The accounting's figures of a single window: one unit, so no spread is known (as acceptance_at for one round)."""
    def point(key: str) -> Interval | None:
        value = figures.get(key)
        return None if value is None else Interval(float(value), -math.inf, math.inf, level, 1)

    return Acceptance(ar=point("ar"), al=point("al"), tokens_per_step=point("tokens_per_step"), draft_len=figures.get("draft_len"),
                      drafts_per_step=figures.get("drafts_per_step"), alpha=point("alpha"), c=point("c"), alpha_min=point("alpha_min"))


def _category_rule(speedup: Interval | None, margin: float) -> tuple[CategoryState, str]:
    """pays: lower bound > 1; loses: upper bound < 1 - margin; else within noise; n/a without a paired TPOT."""
    if speedup is None:
        return CategoryState.NA, "n/a: no prompt of it has a greedy-phase TPOT on both servers"
    bound = 1.0 - margin
    where = f"decode speedup {speedup.text()} over {speedup.n} prompt(s) ({speedup.level:.1%} t interval on the per-prompt logs)"
    if speedup.low > 1.0:
        return CategoryState.PAYS, f"{where}: its lower bound {stats.fmt(speedup.low)} > 1"
    if speedup.high < bound:
        return CategoryState.LOSES, f"{where}: its upper bound {stats.fmt(speedup.high)} < {stats.fmt(bound)} (1 - margin {margin:g})"
    return CategoryState.WITHIN_NOISE, f"{where}: neither wholly above 1 nor wholly below {stats.fmt(bound)} (1 - margin {margin:g})"


def category_summary(analyses: list[CategoryAnalysis], engine: str) -> dict[str, Any]:
    """Which categories pay, lose or are undecided, and the report's sentence on what the losing ones mean on this
    engine: specgate can turn speculation off per request, the other engines speculate for every request."""
    named = {state: [a.category for a in analyses if a.state == state] for state in CategoryState}
    pays, loses, noise = named[CategoryState.PAYS], named[CategoryState.LOSES], named[CategoryState.WITHIN_NOISE]
    if loses and engine == "specgate":
        sentence = (f"specgate can leave speculation off per request: categories that lose ({', '.join(loses)}) would be served "
                    "without it (--policy adaptive chooses each request's draft length, 0 included)")
    elif loses:
        sentence = f"this engine ({engine}) speculates for every request: the categories that lose ({', '.join(loses)}) pay for the others"
    elif pays or noise:
        sentence = "no category loses beyond the margin" + (f"; speculation pays on {', '.join(pays)}" if pays else "")
    else:
        sentence = "per-category decode speedups not measured (no per-request TPOT of the greedy phase)"
    if loses and not pays:
        sentence += "; no category measurably pays"
    if noise:
        sentence += f"; within noise: {', '.join(noise)}"
    return {"engine": engine, "pays": pays, "loses": loses, "within_noise": noise, "not_measured": named[CategoryState.NA],
            "binding": False, "sentence": sentence}


# ------------------------------------------------------------------------------------------ one configuration


@dataclass
class ConfigDecision:
    name: str
    stage: str
    verdict: str
    criteria: list[Criterion]
    loads: list[LoadAnalysis]
    quality: dict[str, Any]
    level: float  # the confidence of its throughput and acceptance intervals (family-wise over looks)
    schedule: dict[str, Any] = field(default_factory=dict)
    categories: list[CategoryAnalysis] = field(default_factory=list)  # the greedy phase per category: reported, not binding
    category_summary: dict[str, Any] = field(default_factory=dict)

    def load(self, name: str) -> LoadAnalysis | None:
        return next((a for a in self.loads if a.load == name), None)

    def criterion(self, name: str) -> Criterion:
        return next(c for c in self.criteria if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "stage": self.stage, "verdict": self.verdict, "level": self.level,
                "criteria": [c.to_dict() for c in self.criteria], "loads": [a.to_dict() for a in self.loads],
                "quality": _jsonable_quality(self.quality), "schedule": self.schedule,
                "categories": [a.to_dict() for a in self.categories], "category_summary": self.category_summary}


def _jsonable_quality(q: dict[str, Any]) -> dict[str, Any]:
    def conv(x: Any) -> Any:
        if isinstance(x, Interval):
            return x.to_dict()
        if isinstance(x, State):
            return x.value
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, list):
            return [conv(v) for v in x]
        return x

    return conv(q)


def quality_of(baseline: ConfigRun, run: ConfigRun, plan: Any, options: GateOptions, configurations: int) -> dict[str, Any]:
    """Greedy exact match, math non-inferiority and the log-likelihood equivalence, at the family-wise level over
    `configurations` (Bonferroni)."""
    level = stats.split_level(stats.LEVEL, max(configurations, 1))
    out: dict[str, Any] = {"greedy": quality.greedy_exact_match(baseline.greedy, run.greedy, plan.categories), "level": level}
    out["math"] = (quality.math_noninferiority(plan.math_items, baseline.math_outputs, run.math_outputs, options.quality_margin, level)
                   if baseline.math_outputs and run.math_outputs else {})
    out["loglik"] = (quality.loglik_equivalence(baseline.scores, run.scores, options.loglik_margin, level)
                     if baseline.scores and run.scores else {"reason": "sampled continuations not scored (no target weights here, or a phase failed)"})
    return out


def decide_config(baseline: ConfigRun, run: ConfigRun, stage: str, loads: list[str], q: dict[str, Any], options: GateOptions,
                  level: float, categories: dict[str, str] | None = None) -> ConfigDecision:
    """Every criterion of the module docstring for one configuration in one stage, and its verdict; beside it, the
    greedy phase per category (categories: prompt id -> category; without it, acceptance per category only)."""
    analyses = [analyse_load(baseline, run, stage, load, options, level) for load in loads]
    target = f"c{options.judged_concurrency}"
    at_target = next((a for a in analyses if a.load == target), None)
    criteria = [_at(at_target, CRITERIA[0], target), _at(at_target, CRITERIA[1], target)]
    poisson = next((a for a in analyses if a.load == POISSON), None)
    criteria.append(_at(poisson, CRITERIA[2], POISSON) if poisson else Criterion(
        CRITERIA[2], State.NA, "measured for the recommendation, in its own paired rounds (not in screening)", binding=False, load=POISSON))
    criteria += _latency_targets(at_target, options)
    criteria.append(_memory_criterion(baseline, run, options))
    criteria += _quality_criteria(q, options)
    criteria.append(_lossless(run, criteria[-3], criteria[-1]))
    failure = run.failure or (f"baseline: {baseline.failure}" if baseline.failure else None)
    criteria.append(Criterion(CRITERIA[10], State.FAIL if failure else State.PASS, failure or "every phase and round ran"))
    required = {TARGETS[name] for name in options.require}
    for c in criteria:
        if c.name in TARGETS.values():
            c.binding = c.name in required
    decision = ConfigDecision(run.name, stage, verdict_of(criteria), criteria, analyses, q, level)
    decision.schedule = schedule_exports(decision, run, options.max_num_seqs, is_specgate_head(run.draft or "", options.target) and run.engine == "specgate")
    # the greedy phase ran once, not at each look: its level is family-wise over the categories alone
    named = set((categories or {}).values()) | set(run.per_category)
    decision.categories = analyse_categories(baseline, run, categories or {}, options, stats.split_level(stats.LEVEL, max(len(named), 1)))
    decision.category_summary = category_summary(decision.categories, run.engine)
    return decision


def _at(analysis: LoadAnalysis | None, name: str, load: str) -> Criterion:
    """The load analysis' own criterion `name`, or UNDECIDED when the load was not measured."""
    if analysis is not None:
        found = next((c for c in analysis.criteria if c.name == name), None)
        if found is not None:
            return found
    return Criterion(name, State.UNDECIDED, f"not measured at {load} (phase missing or failed)", load=load)


def _latency_targets(a: LoadAnalysis | None, options: GateOptions) -> list[Criterion]:
    """TTFT p95 within the tolerance of the baseline's; ITL p95 improved: from request-level bootstrap intervals."""
    out = []
    for name, key, rule in ((CRITERIA[3], "ttft_p95", "tolerance"), (CRITERIA[4], "itl_p95", "improvement")):
        diff = a.latency_ms.get(key) if a else None
        base = a.baseline_latency_ms.get(key) if a else None
        if diff is None or base is None:
            out.append(Criterion(name, State.UNDECIDED, "not measured at the target concurrency", load=a.load if a else None))
            continue
        if rule == "tolerance":
            bound = base * options.ttft_tolerance
            state = State.PASS if diff.high <= bound else State.FAIL if diff.low > bound else State.UNDECIDED
            reason = f"TTFT p95 {stats.fmt(base + diff.estimate)} ms vs baseline {stats.fmt(base)} ms: difference {diff.text(unit=' ms')}, allowed <= +{stats.fmt(bound)} ms ({options.ttft_tolerance:.0%})"
        else:
            bound = 0.0
            state = State.PASS if diff.high < 0 else State.FAIL if diff.low > 0 else State.UNDECIDED
            reason = f"ITL p95 {stats.fmt(base + diff.estimate)} ms vs baseline {stats.fmt(base)} ms: difference {diff.text(unit=' ms')}, an improvement needs it below 0"
        out.append(Criterion(name, state, reason, load=a.load if a else None, estimate=diff.estimate, interval=diff, threshold=bound))
    return out


def _memory_criterion(baseline: ConfigRun, run: ConfigRun, options: GateOptions) -> Criterion:
    """Peak RSS (and GPU memory) within the headroom, no more preemptions than the baseline."""
    memory, base_memory = run.memory or {}, baseline.memory or {}
    reasons, ok = [], True
    rss, total = memory.get("peak_rss_mib"), memory.get("mem_total_mib")
    limit = total * (1.0 - options.memory_headroom) if total else None
    if rss is not None and limit is not None:
        ok &= rss <= limit
        reasons.append(f"peak RSS {rss:.0f} MiB vs limit {limit:.0f} MiB ({options.memory_headroom:.0%} of {total:.0f} MiB kept free)")
    gpu_used, gpu_total = memory.get("gpu_memory_used_mib"), memory.get("gpu_memory_total_mib")
    if gpu_used is not None and gpu_total:
        ok &= gpu_used <= gpu_total * (1.0 - options.memory_headroom)
        reasons.append(f"GPU {gpu_used:.0f} of {gpu_total:.0f} MiB")
    pre, base_pre = memory.get("preemptions"), base_memory.get("preemptions")
    if pre is not None:
        ok &= pre <= (base_pre or 0.0)
        reasons.append(f"preemptions {pre:.0f} vs baseline {base_pre or 0:.0f}")
    if not reasons:
        return Criterion(CRITERIA[5], State.UNDECIDED, "no memory figure available (an external endpoint without preemption counters)")
    return Criterion(CRITERIA[5], State.PASS if ok else State.FAIL, "; ".join(reasons), estimate=rss, threshold=limit)


def _quality_criteria(q: dict[str, Any], options: GateOptions) -> list[Criterion]:
    """Greedy exact match, math non-inferiority and the log-likelihood equivalence (quality.py's tests)."""
    out = []
    greedy = q.get("greedy") or {}
    if greedy.get("rate") is None:
        out.append(Criterion(CRITERIA[6], State.UNDECIDED, "no paired greedy outputs", threshold=options.greedy_match_min))
    else:
        ok = greedy["rate"] >= options.greedy_match_min
        out.append(Criterion(CRITERIA[6], State.PASS if ok else State.FAIL, f"{greedy['matches']}/{greedy['pairs']} greedy outputs identical to the "
                             f"baseline's; {len(greedy['mismatches'])} mismatch(es) listed", estimate=greedy["rate"], threshold=options.greedy_match_min))
    out.append(_math_criterion(q.get("math") or {}, options))
    out.append(_loglik_criterion(q.get("loglik") or {}, options))
    return out


def _math_criterion(m: dict[str, Any], options: GateOptions) -> Criterion:
    if not m:
        return Criterion(CRITERIA[7], State.UNDECIDED, "math set not measured", threshold=-options.quality_margin)
    i = m["interval"]
    d = m["discordant"]
    reason = (f"exact match {m['speculative_em']:.3f} vs baseline {m['baseline_em']:.3f} over {m['items']} items "
              f"({d['speculative_right']} better, {d['baseline_right']} worse): delta {i.text()} ({i.level:.1%}, Tango), "
              f"margin -{options.quality_margin:g}; McNemar p={m['mcnemar_p']:.3g}")
    needed = None
    if m["state"] == State.UNDECIDED:
        needed = f"{m['items']} items rule out regressions >= {m['detectable'] * 100:.1f} points at best; --quality-margin {options.quality_margin:g} needs more items (--math-items)"
    return Criterion(CRITERIA[7], m["state"], reason, estimate=i.estimate, interval=i, threshold=-options.quality_margin, needed=needed)


def _loglik_criterion(ll: dict[str, Any], options: GateOptions) -> Criterion:
    i = ll.get("interval")
    if i is None:
        return Criterion(CRITERIA[8], State.UNDECIDED, ll.get("reason", "fewer than two sampled continuations scored"), threshold=options.loglik_margin)
    state = ll["state"]
    reason = (f"centered log-likelihood shift {i.text(unit=' nats/token')} over {ll['pairs']} paired continuations ({i.level:.1%} interval, "
              f"two one-sided tests); equivalent within +-{options.loglik_margin:g}" + {State.PASS: "", State.FAIL: ": NOT (a shift: lossy?)",
                                                                                     State.UNDECIDED: ": not decided"}[state])
    needed = None
    if state == State.UNDECIDED:
        room = options.loglik_margin - abs(i.estimate)
        more = (f"raise --sample-prompts to about {math.ceil(ll['pairs'] * (ll['detectable'] / room) ** 2)}" if room > ll["detectable"] / 10
                else "its estimate sits near the margin: more continuations would hardly decide it")
        needed = f"{ll['pairs']} continuations establish equivalence only within +-{ll['detectable']:.3f} nats/token: {more}"
    return Criterion(CRITERIA[8], state, reason, estimate=i.estimate, interval=i, threshold=options.loglik_margin, needed=needed)


def _lossless(run: ConfigRun, greedy: Criterion, loglik: Criterion) -> Criterion:
    """Labelled lossy: never lossless. specgate's verifier is proven exact; another engine's is only inferred, from
    identical greedy output and an equivalent sampled log-likelihood."""
    total = run.spec_total()
    if run.lossy or (total is not None and total.lossy):
        return Criterion(CRITERIA[9], State.FAIL, "lossy verification (labelled lossy by the server or the configuration): never GO as lossless")
    if run.engine == "specgate":
        return Criterion(CRITERIA[9], State.PASS, "exact verification (specgate's verifier, proven by check-lossless)")
    if greedy.passed and loglik.passed:
        return Criterion(CRITERIA[9], State.PASS, f"{run.engine}: inferred from identical greedy output and an equivalent log-likelihood")
    undecided = [n for n, c in (("greedy exact match", greedy), ("sampled log-likelihood", loglik)) if c.state == State.UNDECIDED]
    failed = [n for n, c in (("greedy exact match", greedy), ("sampled log-likelihood", loglik)) if c.state == State.FAIL]
    if failed:
        return Criterion(CRITERIA[9], State.FAIL, f"{run.engine} is not assumed lossless and its {' and '.join(failed)} test failed")
    return Criterion(CRITERIA[9], State.UNDECIDED, f"{run.engine} is not assumed lossless and its {' and '.join(undecided)} test is undecided")


# ------------------------------------------------------------------------------------------ schedules and the recommendation


HEAD_NOTE = ("specgate's EAGLE head (its own format: one layer on the target's final-norm state) is not a checkpoint vLLM, "
             "SGLang or TensorRT-LLM can load: there, use a head in their format (EAGLE-3) and measure it with "
             "`specgate gate --engine vllm --spec eagle3:PATH`")


def is_specgate_head(draft: str, target: str | None) -> bool:
    """True for a specgate EAGLE head: eagle / eagle:DIR, or `default` where the target's default is one."""
    from specgate.drafting.registry import DEFAULT_DRAFTS, EAGLE_PREFIX

    name = (target or "").rstrip("/").rsplit("/", 1)[-1]
    return draft == "eagle" or draft.startswith(EAGLE_PREFIX) or (draft == "default" and DEFAULT_DRAFTS.get(name, "").startswith(EAGLE_PREFIX))


def schedule_table(decision: ConfigDecision, max_num_seqs: int) -> list[list[int]]:
    """[[lo, hi, gamma], ...]: at each measured concurrency the draft length that ran there where it paid (its
    throughput ratio >= 1, no criterion failed there), 0 where it did not; off beyond the largest measured."""
    ranges, lo = [], 1
    for a in sorted((a for a in decision.loads if a.concurrency is not None), key=lambda a: a.concurrency or 0):
        ranges.append([lo, int(a.concurrency or lo), int(a.recommended_gamma)])
        lo = int(a.concurrency or lo) + 1
    if ranges and lo <= max_num_seqs:
        ranges.append([lo, max(max_num_seqs, lo), 0])  # beyond the measured range: off (not measured)
    return ranges


def schedule_exports(decision: ConfigDecision, run: ConfigRun, max_num_seqs: int, head: bool = False) -> dict[str, Any]:
    """The recommended per-concurrency gamma as vLLM / SGLang / TensorRT-LLM / specgate settings. head: the draft is a
    specgate EAGLE head, which only specgate runs: the other engines' settings are None / []."""
    ranges = schedule_table(decision, max_num_seqs)
    table = ",".join(f"{a}-{b}:{g}" for a, b, g in ranges)
    specgate = f"--policy table --gamma-table '{table}'" if any(g for _, _, g in ranges) else "--policy off"
    if head:
        return {"table": ranges, "specgate_table": table, "specgate": specgate, "vllm_speculative_config": None, "sglang_flags": [],
                "sglang_note": HEAD_NOTE, "tensorrt_llm": None}
    draft = run.draft or run.spec
    method = "ngram" if draft in ("ngram", "ngram-simple", "ngram-mod") else "draft_model"
    k_max = max((g for _, _, g in ranges), default=0)
    vllm: dict[str, Any] = {"method": method, "num_speculative_tokens": k_max, "num_speculative_tokens_per_batch_size": ranges}
    vllm.update({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {"model": draft})
    paying = [r for r in ranges if r[2] > 0]
    top = max(paying, key=lambda r: r[2]) if paying else None
    sglang = [] if top is None else [
        "--speculative-algorithm", "NGRAM" if method == "ngram" else "STANDALONE", "--speculative-num-steps", str(top[2]),
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(top[2] + 1), "--max-running-requests", str(max(r[1] for r in paying))]
    if top and method != "ngram":
        sglang[2:2] = ["--speculative-draft-model-path", draft]
    return {
        "table": ranges, "specgate_table": table, "specgate": specgate, "vllm_speculative_config": vllm, "sglang_flags": sglang,
        "sglang_note": ("SGLang has no batch-size table: these flags fit the paying range; cap --max-running-requests there or serve "
                        "the rest without speculation") if top else "speculation never paid: do not enable it",
        "tensorrt_llm": {"draft_len_schedule": {str(r[1]): r[2] for r in ranges}, "max_concurrency": max((r[1] for r in paying), default=0)},
    }


@dataclass
class Advice:
    """What to deploy, chosen on the screening's intervals: a configuration as it ran, its schedule, or no speculation."""

    kind: str  # "config", "schedule" (specgate --policy table) or "off"
    based_on: str | None
    reason: str
    gamma_table: str | None = None
    within_noise: list[str] = field(default_factory=list)  # the candidates whose target-concurrency interval overlaps the best's


def _ratio_at(decision: ConfigDecision, load: str) -> Interval | None:
    analysis = decision.load(load)
    return analysis.throughput_ratio if analysis else None


def choose(decisions: dict[str, ConfigDecision], runs: dict[str, ConfigRun], options: GateOptions) -> Advice:
    """The recommendation (docs/GATE.md, "The recommendation"): among the configurations that fail no binding criterion,
    the one that passes the rule at the target concurrency with the highest lower bound of its throughput ratio there
    (chosen on intervals: a lucky point estimate with a wide interval does not win); a specgate fixed draft length
    becomes its schedule where the measurements turn it off somewhere; else a paying configuration's schedule; else off."""
    target = f"c{options.judged_concurrency}"
    candidates = [n for n, d in decisions.items() if not runs[n].failure and not runs[n].lossy
                  and not any(c.binding and c.state == State.FAIL for c in d.criteria)]
    if candidates:
        def rank(name: str) -> tuple[bool, float]:  # the rule decided at the target first, then the surest throughput
            analysis = decisions[name].load(target)
            low = analysis.throughput_ratio.low if analysis and analysis.throughput_ratio else 0.0
            return (analysis is not None and analysis.verdict == "GO", low)

        pick = max(candidates, key=rank)
        top = _ratio_at(decisions[pick], target)
        within = [n for n in candidates if n != pick and top is not None and (_ratio_at(decisions[n], target) or top).high >= top.low]
        why = (f"{pick} fails no binding criterion, {'passes' if rank(pick)[0] else 'is not yet decided on'} the rule at {target}, and has "
               f"the highest lower bound of its throughput ratio there ({stats.fmt(rank(pick)[1])})"
               + (f"; within noise of it: {', '.join(within)}" if within else ""))
        table = _varying_schedule(decisions[pick], runs[pick], options)
        if table is not None and not any(g for _, _, g in schedule_table(decisions[pick], options.max_num_seqs)):
            return Advice("off", pick, why + "; but it paid at no measured concurrency: serve without speculation", None, within)
        if table is not None:
            return Advice("schedule", pick, why + "; its measured schedule turns speculation off where it did not pay", table, within)
        return Advice("config", pick, why, None, within)
    paying = [n for n, d in decisions.items() if runs[n].engine == "specgate" and runs[n].policy == "fixed" and not runs[n].lossy
              and not runs[n].failure and d.criterion(CRITERIA[6]).passed and any(a.recommended_gamma > 0 for a in d.loads)]
    if paying:
        best = max(paying, key=lambda n: max((a.throughput_ratio.estimate for a in decisions[n].loads if a.recommended_gamma > 0 and a.throughput_ratio), default=0.0))
        table = decisions[best].schedule["specgate_table"]
        loads = [a.load for a in decisions[best].loads if a.recommended_gamma > 0]
        return Advice("schedule", best, f"no configuration passed at {target}; {best} paid at {', '.join(loads)}: speculation there, off elsewhere", table)
    why = "no lossless configuration completed" if not any(not r.failure and not r.lossy for n, r in runs.items() if n in decisions) else (
        f"every configuration failed a binding criterion")
    return Advice("off", None, f"{why}: serve without speculation")


def _varying_schedule(decision: ConfigDecision, run: ConfigRun, options: GateOptions) -> str | None:
    """specgate --gamma-table text for a fixed-gamma specgate configuration whose recommended gamma is not its own
    gamma at every measured concurrency; None otherwise (what ran is what to deploy)."""
    if run.engine != "specgate" or run.policy != "fixed":
        return None
    measured = [a.recommended_gamma for a in decision.loads if a.concurrency is not None]
    if all(g == run.gamma for g in measured):
        return None
    return decision.schedule.get("specgate_table")


ROUND_CRITERIA = (CRITERIA[0], CRITERIA[1], CRITERIA[2], CRITERIA[3], CRITERIA[4])  # more paired rounds can decide these


def rounds_decided(d: ConfigDecision, options: GateOptions) -> bool:
    """Whether more rounds could still change the verdict: False while a binding criterion they decide is UNDECIDED."""
    return not any(c.binding and c.state == State.UNDECIDED for c in d.criteria if c.name in ROUND_CRITERIA)


# ------------------------------------------------------------------------------------------ the gate's verdict


@dataclass
class GateResult:
    """Everything the report renders: the verdict, what it speaks for, the recommendation and the records behind them."""

    verdict: str
    config: str | None  # the configuration the verdict speaks for (None: serve without speculation)
    advice: Advice
    criteria: list[Criterion]
    screening: dict[str, ConfigDecision]
    confirmation: ConfigDecision | None
    runs: dict[str, ConfigRun]
    stages: dict[str, dict[str, Any]]
    notes: list[str]
    perplexity: dict[str, Any] | None = None
    category_summary: dict[str, Any] | None = None  # of the configuration it speaks for (else the one the advice is based on)

    def decision(self, name: str) -> ConfigDecision | None:
        if self.confirmation is not None and self.confirmation.name == name:
            return self.confirmation
        return self.screening.get(name)


def conclude(advice: Advice | None, screening: dict[str, ConfigDecision], confirmation: ConfigDecision | None,
             runs: dict[str, ConfigRun], stages: dict[str, dict[str, Any]], notes: list[str], perplexity: dict | None) -> GateResult:
    """The headline: the confirmation's verdict; without one (--no-recommend), the chosen configuration's screening
    verdict; NO-GO when nothing is to be recommended. The category summary rides along: it never changes the verdict."""
    if confirmation is not None:
        return GateResult(confirmation.verdict, confirmation.name, advice or Advice("config", confirmation.name, "the endpoint as it runs"),
                          confirmation.criteria, screening, confirmation, runs, stages, notes, perplexity, confirmation.category_summary)
    based_on = screening.get(advice.based_on) if advice is not None and advice.based_on else None
    if advice is not None and advice.kind != "off" and based_on is not None:
        return GateResult(based_on.verdict, based_on.name, advice, based_on.criteria, screening, None, runs, stages, notes, perplexity,
                          based_on.category_summary)
    reason = advice.reason if advice else "no speculative configuration was measured"
    off = [Criterion("recommendation", State.FAIL, reason)]
    return GateResult("NO-GO", None, advice or Advice("off", None, reason), off, screening, None, runs, stages, notes, perplexity,
                      based_on.category_summary if based_on else None)
