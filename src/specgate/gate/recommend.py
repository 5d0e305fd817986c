"""What to deploy, derived from the measured configurations, and then measured itself.

The rule (docs/GATE.md, "The recommendation"):
1. Candidates: speculative configurations that completed and are lossless.
2. If some candidate passes every binding criterion known before scoring (all but the sampled log-likelihood,
   which needs the target loaded after the servers stop), the best is the one with the highest throughput at
   the target concurrency. On specgate, whose `--policy table` takes a per-batch-size schedule, a fixed-gamma
   best becomes its schedule (speculation where the analysis says it pays, 0 elsewhere) when the schedule is
   not the fixed gamma everywhere; an adaptive best, or any other engine's best, is recommended as it is
   (llama.cpp has no batch-size schedule: its best single configuration).
3. Else, on specgate, a candidate that paid at some measured concurrency (throughput ratio >= 1) with identical
   greedy output is recommended as its schedule: on at the loads where it paid, off elsewhere.
4. Else: no speculation (the baseline), verdict NO-GO.
The gate launches the recommendation (2-3) as the configuration `recommended` with the same phases, and its
verdict comes from those measurements, not from the ones it was derived from. Should that run measure worse than
the configuration it came from, that configuration, as it ran, is the advice (report._recommendation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from specgate.gate import decision, launch, quality

RECOMMENDED = "recommended"
PENDING_BEFORE_SCORING = ("sampled_loglik_shift", "lossless")  # need the target's scores of sampled outputs


@dataclass
class Advice:
    kind: str  # "config" (a measured configuration as it was), "schedule" (specgate --policy table), "off"
    based_on: str | None  # the configuration it was derived from (None: off)
    reason: str
    profile: launch.LaunchProfile | None = None  # what the gate launches as `recommended` (None: off)


def throughput(result: dict[str, Any], concurrency: int) -> float | None:
    level = next((lv for lv in result.get("sweep") or [] if lv.get("concurrency") == concurrency), None)
    return (level or {}).get("output_tokens_per_s")


def config_quality(plan: Any, baseline: dict, spec: dict, seed: int, loglik: dict | None = None) -> dict[str, Any]:
    """Greedy exact match and paired math for one configuration (and its log-likelihood test when scored)."""
    q: dict[str, Any] = {
        "greedy": quality.greedy_exact_match(baseline.get("greedy") or {}, spec.get("greedy") or {}, plan.categories),
        "math": quality.paired_math(plan.math_items, baseline.get("math_outputs") or {}, spec.get("math_outputs") or {}, seed)
        if baseline.get("math_outputs") and spec.get("math_outputs") else {},
    }
    q["loglik"] = loglik if loglik is not None else {"reason": "sampled continuations not scored (no target weights here, or a phase failed)"}
    return q


def _passes_before_scoring(options: Any, plan: Any, baseline: dict, spec: dict) -> tuple[bool, dict]:
    analysis = decision.analyse(baseline, spec, options.thresholds.gamma_max)
    _, criteria = decision.decide(baseline, spec, config_quality(plan, baseline, spec, options.seed), options.thresholds, analysis)
    return all(c.passed for c in criteria if c.binding and c.name not in PENDING_BEFORE_SCORING), analysis


def _schedule_profile(options: Any, profile: launch.LaunchProfile, analysis: dict) -> launch.LaunchProfile | None:
    """specgate --policy table with the analysis' schedule; None when it is the fixed gamma at every measured load."""
    table = decision.schedule_exports(analysis, profile.draft or "ngram", options.max_num_seqs)["table"]
    measured_max = max(options.concurrency)
    if all(g == profile.gamma for lo, _, g in table if lo <= measured_max):  # beyond the measured loads the table is off: not evidence
        return None
    text = ",".join(f"{lo}-{hi}:{g}" for lo, hi, g in table)
    argv = launch.specgate_command(options.launch_options(), profile.draft, "table", 0, gamma_table=text)
    return launch.LaunchProfile(RECOMMENDED, "specgate", argv, f"table:{profile.draft}", max(g for _, _, g in table), "table", draft=profile.draft)


def recommend(options: Any, plan: Any, results: dict[str, dict], profiles: list[launch.LaunchProfile]) -> Advice:
    """The module docstring's rule over what was measured; `profile` is None when nothing is to be launched."""
    baseline = results.get("baseline")
    by_name = {p.name: p for p in profiles}
    n = options.thresholds.target_concurrency
    if not baseline or baseline.get("failure"):
        return Advice("off", None, "the baseline was not measured: nothing can be recommended")
    candidates = [name for name, r in results.items() if name != "baseline" and not r.get("failure") and not r.get("lossy")]
    checked = {name: _passes_before_scoring(options, plan, baseline, results[name]) for name in candidates}
    passing = [name for name in candidates if checked[name][0]]
    if passing:
        best = max(passing, key=lambda name: throughput(results[name], n) or 0.0)
        profile = by_name.get(best)
        reason = f"{best} passed every binding criterion measured before scoring with the best throughput at concurrency {n}"
        if profile is None:  # external: the endpoint as it runs
            return Advice("config", best, reason + " (a running endpoint: its measurements are the recommendation's)")
        if profile.engine == "specgate" and profile.policy == "fixed":
            table = _schedule_profile(options, profile, checked[best][1])
            if table is not None:
                return Advice("schedule", best, reason + "; its measured schedule turns speculation off where it did not pay", table)
        return Advice("config", best, reason, replace(profile, name=RECOMMENDED))
    paying = []
    for name in candidates:
        rows = checked[name][1]["per_concurrency"]
        greedy = quality.greedy_exact_match(baseline.get("greedy") or {}, results[name].get("greedy") or {})
        if any((r["measured_speedup"] or 0.0) >= 1.0 for r in rows) and greedy["rate"] == 1.0:
            paying.append(name)
    specgate_paying = [name for name in paying if name in by_name and by_name[name].engine == "specgate" and by_name[name].policy == "fixed"]
    if specgate_paying:
        best = max(specgate_paying, key=lambda name: checked[name][1]["per_concurrency"][0]["measured_speedup"] or 0.0)
        table = _schedule_profile(options, by_name[best], checked[best][1])
        if table is not None:
            return Advice("schedule", best, f"no configuration passed at concurrency {n}; {best} paid at "
                          f"{checked[best][1]['paying_concurrency']}: speculation there, off elsewhere", table)
    why = "no lossless configuration completed" if not candidates else (
        f"no configuration passed the binding criteria at concurrency {n}" + ("" if paying else " or paid at any measured concurrency"))
    return Advice("off", None, f"{why}: serve without speculation")
