"""The adaptive speculation policy: each step, the vector of per-request gammas (0 included) that maximises expected
goodput = sum_i E[T_i](gamma_i) / predicted step time, E[T](gamma) = 1 + sum_{k<=gamma} prod_{j<=k} a_j, from a
cost model calibrated on the running machine (specgate.serving.policy.cost_model) and each request's live
acceptance profile.

Joint choice. The batched target pass is padded to its widest row, W = max gamma_i + 1 tokens per row (its
price depends on the batch and on W), and the draft model's k-th sequential pass runs over the rows with
gamma_i >= k. So the policy searches, for every width W in 1..gamma_max and every k, the plan "the k requests
with the most expected extra tokens at min(cap_i, W) drafts get that many, the others 0", plus "everyone 0", and
keeps the best (ties go to fewer drafts). With free lookup drafts a request drafts whenever the width is paid for
anyway; with a draft model, a request whose drafts are rarely accepted is dropped when its rows in the draft passes
cost more than its expected extra tokens are worth. A plan is priced at its padded rectangle (batch x W tokens).

Robustness. The optimum is flat and the predictions carry noise (per-request acceptance estimates, step-time
jitter), so the width must not flip from step to step on estimate noise: the width that ran last (the incumbent)
runs again while its best plan stays within `margin` of the best predicted goodput; otherwise the best plan runs
and becomes the incumbent. This is hysteresis without a direction: the rule "the narrowest plan within the
margin" also stops the flapping but, by construction, runs narrower than the optimum whenever a narrower plan is
within the margin, which costs throughput where the optimum is the widest plan (concurrency 1). The cost model is
corrected by every target step the scheduler runs (CostModel.observe), because the calibration's timing
conditions are not the serving ones (a busy machine at start, another thread, contention that slows wide verify
passes most), so a model that flatters a width is corrected by running it; a model that over-prices a width would
never run it, so one decision in probe_every probes the other width with the best optimistic goodput
(AdaptivePolicy._probe). The acceptance side is checked the same way: each step's committed tokens against the
plan's expected ones give one live factor on every plan's expected accepted drafts (AdaptivePolicy.token_factor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from specgate.serving.policy.base import Acceptance, SpeculationPolicy, check_gamma
from specgate.serving.policy.constants import (
    DEFAULT_GAMMA_MAX,
    DEFAULT_MARGIN,
    DEFAULT_PRIOR_ALPHA,
    DEFAULT_PROBE_BONUS,
    DEFAULT_PROBE_EVERY,
    DEFAULT_PROBE_MARGIN,
    TOKEN_DECAY,
    TOKEN_FACTOR_RANGE,
    TOKEN_PRIOR,
)
from specgate.serving.policy.cost_model import CostModel


class Plan(NamedTuple):
    """One candidate plan of a step: its expected goodput (tokens per ms), gammas [B], width (max gamma) and drafts
    (sum of gammas)."""

    goodput: float
    gammas: np.ndarray
    width: int
    drafts: int


class AdaptivePolicy(SpeculationPolicy):
    """Maximise expected goodput (emitted tokens per ms) over per-request gammas in 0..gamma_max each step.

    See the module docstring for the search. prior_alpha: the flat acceptance used for a request with no
    estimate (the scheduler passes per-position profiles that already blend in the traffic's estimate).
    margin: the hysteresis. The width that ran last step (the incumbent) runs again while its best plan's
    predicted goodput is within `margin` (a fraction) of the best plan's; otherwise the best plan runs (exact ties
    to the narrower) and its width becomes the incumbent. Why: the predictions carry errors larger than the
    differences the argmax would act on (per-request acceptance estimates from a few steps, step-time jitter on
    a shared VM), and near the optimum the goodput curve is flat (several widths within a few percent), so a plain
    argmax would flip the width from step to step. Holding the incumbent costs at most `margin` by the model's own
    account, and has no bias towards narrow or wide plans. probe_every, probe_margin, probe_bonus: see _probe.
    """

    name = "adaptive"

    def __init__(
        self,
        cost_model: CostModel,
        gamma_max: int = DEFAULT_GAMMA_MAX,
        prior_alpha: float = DEFAULT_PRIOR_ALPHA,
        margin: float = DEFAULT_MARGIN,
        probe_every: int = DEFAULT_PROBE_EVERY,
        probe_margin: float = DEFAULT_PROBE_MARGIN,
        probe_bonus: float = DEFAULT_PROBE_BONUS,
    ) -> None:
        self.cost_model = cost_model
        self.gamma_max = check_gamma(gamma_max, "gamma_max")
        _check_settings(prior_alpha, margin, probe_every, probe_margin, probe_bonus)
        self.prior_alpha = prior_alpha
        self.margin = margin
        self.probe_every, self.probe_margin, self.probe_bonus = probe_every, probe_margin, probe_bonus
        self.incumbent: int | None = None  # width (max gamma) of the plan that ran last; None before the first
        self.plans_made = 0
        self.probes = 0  # probe decisions made (AdaptivePolicy._probe)
        self.last_prediction: tuple | None = None  # the last plan's expected tokens, predicted ms, goodput per plan
        self._last_plan: tuple[int, int, float] | None = None  # (batch, width, raw expected accepted drafts)
        self._last_plans: tuple | None = None  # ([(width, drafts)], target ms by width [G+1]) of the last decision
        self.token_counts = [0.0, 0.0, 0.0]  # decayed sums over the plans run: steps, realized, raw predicted accepted drafts
        self._draft_ms: dict[int, np.ndarray] = {}  # batch -> one draft pass over r rows, by r [B+1]
        self._target_ms: dict[int, np.ndarray] = {}  # batch -> predicted target step by width [G+1]
        self._costs_at = cost_model.observations

    @property
    def max_gamma(self) -> int:
        return self.gamma_max

    def rates(self, acceptance: Sequence[Acceptance]) -> np.ndarray:
        """Conditional acceptance per request and draft position, clipped to [0, 1]: [B, gamma_max]."""
        rows = np.empty((len(acceptance), self.gamma_max))
        for i, estimate in enumerate(acceptance):
            if estimate is None or np.ndim(estimate) == 0:
                rows[i] = self.prior_alpha if estimate is None else float(estimate)
            else:
                profile = np.asarray(estimate, dtype=float)[: self.gamma_max]
                rows[i, : profile.size] = profile
                rows[i, profile.size :] = profile[-1] if profile.size else self.prior_alpha
        return np.clip(rows, 0.0, 1.0)

    def costs(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The prices of one batch size's plans: target_ms[w], a target step of width w (padded to w + 1 tokens per
        row, CostModel.target_step_ms), [G+1]; draft_ms[r], one draft pass over r rows, [B+1]. target_ms is
        recomputed when the live correction moves (and replaced, never mutated); draft_ms once."""
        if batch not in self._draft_ms:
            self._draft_ms[batch] = np.array([0.0] + [self.cost_model.draft_step_ms(b) for b in range(1, batch + 1)])  # [B+1]
        if self._costs_at != self.cost_model.observations:  # the live correction moved: price again
            self._target_ms, self._costs_at = {}, self.cost_model.observations
        if batch not in self._target_ms:
            self._target_ms[batch] = np.array([self.cost_model.target_step_ms(batch, w + 1) for w in range(self.gamma_max + 1)])  # [G+1]
        return self._target_ms[batch], self._draft_ms[batch]

    def candidates(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[tuple[float, np.ndarray]]:
        """The best plan of every width (k requests drafting, see the module docstring), "everyone 0" first:
        [(expected goodput in tokens per ms, gammas [B]), ...] in increasing width."""
        return [(p.goodput, p.gammas) for p in self._candidates(acceptance, caps)]

    def _candidates(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None) -> list[Plan]:
        """candidates(), each plan with its width and drafts."""
        batch = len(acceptance)
        limit = np.full(batch, self.gamma_max) if caps is None else np.clip(np.asarray(caps, dtype=int), 0, self.gamma_max)  # [B]
        target_ms, draft_ms = self.costs(batch)
        plans = [Plan(batch / float(target_ms[0]), np.zeros(batch, dtype=int), 0, 0)]
        top = min(self.gamma_max, int(limit.max()))
        if top == 0:
            return plans
        gain = np.zeros((batch, top + 1))  # [B, W+1]: expected accepted drafts with g drafts
        gain[:, 1:] = np.cumsum(np.cumprod(self.rates(acceptance)[:, :top], axis=1), axis=1)
        # every width at once: one set of numpy calls per step, not one per width (the policy runs every step);
        # plain fancy indexing, not take_along_axis: at batch 1 this runs in ~0.1 ms of a ~15-40 ms step
        widths = np.arange(1, top + 1)  # [W]
        plan_rows = np.arange(top)[:, None]  # [W, 1]
        gammas = np.minimum(limit[None], widths[:, None])  # [W, B]
        value = gain[np.arange(batch)[None], gammas]  # [W, B] expected extra tokens
        order = np.argsort(-value, axis=1, kind="stable")  # [W, B] most valuable first
        ranked = gammas[plan_rows, order]  # [W, B]
        # prefix k (rows order[:k] draft): the widest row, the drafts, the price, the expected tokens
        widest = np.maximum.accumulate(ranked, axis=1)  # [W, B] the plan's width
        drafts = np.cumsum(ranked, axis=1)  # [W, B]
        cost_ms = target_ms[widest]  # [W, B]
        if draft_ms.any():  # a draft model: the s-th draft pass runs over the rows drafting >= s (lookups: free)
            drafting = np.cumsum(ranked[:, :, None] >= widths[None, None], axis=1)  # [W, B, S]
            cost_ms = cost_ms + draft_ms[drafting].sum(axis=2)  # (draft_ms[0] = 0: passes past a row's gamma)
        tokens = batch + self.token_factor() * np.cumsum(value[plan_rows, order], axis=1)  # [W, B]
        goodput = tokens / cost_ms  # [W, B]
        if draft_ms.any():
            best = np.argmax(goodput, axis=1)  # [W] the best prefix per width (first of ties)
        else:  # free drafts: every row drafts what the width allows (its price depends on the width only)
            best = np.full(top, batch - 1)
        chosen = np.zeros_like(gammas)
        chosen[plan_rows, order] = np.where(np.arange(batch)[None] <= best[:, None], ranked, 0)
        at = (np.arange(top), best)
        plans.extend(Plan(*p) for p in zip(goodput[at].tolist(), chosen, widest[at].tolist(), drafts[at].tolist()))
        return plans

    def plan(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> tuple[list[int], float]:
        """The chosen gamma per request and its expected goodput (tokens per ms): the incumbent width's plan while
        it is within `margin` of the best, else the best (exact ties to fewer drafts), except on a probe decision;
        see the class docstring."""
        if not acceptance:
            return [], 0.0
        batch = len(acceptance)
        plans = self._candidates(acceptance, caps)
        goodput, gammas = self._hold_or_switch(plans)
        self.incumbent = int(gammas.max())
        self.plans_made += 1
        if self.probe_every and self.plans_made % self.probe_every == 0:
            probe = self._probe(plans, max(p.goodput for p in plans), batch)
            if probe is not None:  # this step only: the incumbent stays
                goodput, gammas = probe
        self._record_prediction(batch, plans, goodput, gammas)
        return gammas.tolist(), float(goodput)

    def _hold_or_switch(self, plans: list[Plan]) -> tuple[float, np.ndarray]:
        """The incumbent width's best plan while its goodput is within margin of the best plan's; else the best."""
        best = max(plans, key=lambda p: (p.goodput, -p.width, -p.drafts))
        held = [p for p in plans if p.width == self.incumbent]
        kept = max(held, key=lambda p: p.goodput) if held else None
        if kept is not None and kept.goodput >= best.goodput - best.goodput * self.margin * (1 + 1e-9):
            return kept.goodput, kept.gammas
        return best.goodput, best.gammas

    def _record_prediction(self, batch: int, plans: list[Plan], goodput: float, gammas: np.ndarray) -> None:
        """Keep the chosen plan's predicted tokens and ms (last_prediction, for the scheduler's trace; _last_plan,
        for the token factor when the step is observed) and every plan's width and drafts (plans_priced)."""
        target_ms, draft_ms = self.costs(batch)
        width = int(gammas.max())
        predicted_ms = float(target_ms[width])
        if width and draft_ms.any():
            predicted_ms += float(draft_ms[(gammas[None] >= np.arange(1, width + 1)[:, None]).sum(axis=1)].sum())
        expected = goodput * predicted_ms  # rows + token_factor * the estimates' accepted drafts
        self.last_prediction = (expected, predicted_ms, [float(f"{p.goodput:.5g}") for p in plans])
        # priced only if asked (plans_priced: benchmarks' traces), at this decision's prices (costs() replaces, never
        # mutates, its arrays when the live correction moves)
        self._last_plans = ([(p.width, p.drafts) for p in plans], target_ms)
        self._last_plan = (batch, width, (expected - batch) / self.token_factor())

    def plans_priced(self) -> list[list[float]] | None:
        """The last decision's plans, each [width, drafts, target ms] (for offline counterfactuals of a trace);
        None before any."""
        if self._last_plans is None:
            return None
        plans, target_ms = self._last_plans
        return [[width, drafts, round(float(target_ms[width]), 2)] for width, drafts in plans]

    def _probe(self, plans: list[Plan], best_goodput: float, batch: int) -> tuple[float, np.ndarray] | None:
        """The plan of another width than the incumbent with the best optimistic goodput, if that is within
        probe_margin of the best predicted goodput; else None.

        Why: the live cost correction learns a shape only from the steps that run it, and the policy runs only the
        shapes it prices best, so a width the model over-prices (a calibration that priced a shape well above what
        serving then measures) would never be run again and never be corrected, however good it is. Optimism in
        the face of uncertainty (UCB): a width's goodput is scaled by exp(probe_bonus / sqrt(n + 1)), n the recent
        visits of its (batch, tokens) shape (DEFAULT_PROBE_BONUS); one decision in probe_every runs the best width
        by that score. A probe costs at most what the plan's predicted goodput lacks (< 1 - (1 - probe_margin) /
        exp(probe_bonus)), one step in probe_every, and less as the shapes near the optimum are learnt. n is the
        shape's recent visits (CostModel.visits), which age while other shapes run, so a shape priced out by a
        burst of interference gets its optimism back and is retried."""
        self.probes += 1
        scored = []
        for plan in plans:
            if plan.width != self.incumbent:
                bonus = self.probe_bonus / np.sqrt(self.cost_model.visits(batch, plan.width + 1) + 1.0)
                scored.append((plan.goodput * float(np.exp(bonus)), plan.goodput, plan.gammas))
        if not scored:
            return None
        optimistic, goodput, gammas = max(scored, key=lambda p: p[0])
        if optimistic >= best_goodput * (1 - self.probe_margin):
            return goodput, gammas
        return None

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        return self.plan(acceptance, caps)[0]

    def token_factor(self) -> float:
        """Realized / predicted accepted drafts of the plans that ran (1 before any): the live check on the
        acceptance estimates, as CostModel.observe is on the prices. A request's estimate comes from its few latest
        proposals, and the scheduler's lookup evidence resolves a proposal at its first rejection but, when it is
        right, only once it is fully covered, so recent evidence leans to rejections and the plans run emit a few
        percent more than predicted. One factor for all widths, as the live cost correction has one per batch: a
        factor per width would correct only the widths run, so the incumbent alone would be priced by it. The
        ratio of decayed sums (TOKEN_DECAY), shrunk to 1 by TOKEN_PRIOR pseudo-steps, within TOKEN_FACTOR_RANGE;
        it scales every plan's expected accepted drafts."""
        steps, realized, predicted = self.token_counts
        if predicted <= 0.0:
            return 1.0
        ratio = (steps * realized / predicted + TOKEN_PRIOR) / (steps + TOKEN_PRIOR)
        return min(max(float(ratio), TOKEN_FACTOR_RANGE[0]), TOKEN_FACTOR_RANGE[1])  # (np.clip on a scalar: ~6 us)

    def observe_step(self, batch: int, width_tokens: int, target_ms: float, emitted: int | None = None) -> None:
        self.cost_model.observe(batch, width_tokens, target_ms)
        plan, self._last_plan = self._last_plan, None
        if emitted is None or plan is None or plan[:2] != (batch, width_tokens - 1) or width_tokens <= 1:
            return  # no prediction for this step (another caller, rows dropped), or nothing drafted
        for i, value in enumerate((1.0, float(emitted - batch), plan[2])):
            self.token_counts[i] = TOKEN_DECAY * self.token_counts[i] + value

    def describe(self) -> dict:
        return {
            "policy": self.name, "gamma_max": self.gamma_max, "prior_alpha": self.prior_alpha, "margin": self.margin,
            "probe_every": self.probe_every, "probe_margin": self.probe_margin, "probe_bonus": self.probe_bonus, "probes": self.probes,
            "token_factor": round(self.token_factor(), 3),
            "cost_model": self.cost_model.to_dict(),
        }


def _check_settings(prior_alpha: float, margin: float, probe_every: int, probe_margin: float, probe_bonus: float) -> None:
    """A ValueError naming the first AdaptivePolicy setting out of its range, and the range."""
    if not 0.0 <= prior_alpha <= 1.0:
        raise ValueError(f"prior_alpha={prior_alpha} is out of range [0, 1]")
    if not 0.0 <= margin < 0.5:
        raise ValueError(f"margin={margin} is out of range [0, 0.5): the fraction of the best goodput treated as a tie (0 = strict argmax)")
    if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 0:
        raise ValueError(f"probe_every={probe_every!r} must be an integer >= 0 (decisions between probes of another width; 0 = never)")
    if not 0.0 <= probe_margin < 1.0:
        raise ValueError(f"probe_margin={probe_margin} is out of range [0, 1): how much worse than the best a probed width may be predicted")
    if not 0.0 <= probe_bonus <= 2.0:
        raise ValueError(f"probe_bonus={probe_bonus} is out of range [0, 2]: the log optimism given an unvisited shape when probing")
