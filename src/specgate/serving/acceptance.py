"""Live acceptance estimates for the adaptive policy: per draft position, conditional, exponentially weighted.

Position k's rate a_k = P(draft k accepted | drafts 1..k-1 accepted). Verification tests drafts in order and
stops at the first rejection, so a step with d drafts of which j were accepted tests positions 1..min(j+1, d):
1..j accepted, j+1 rejected (when j < d), the rest untested (for lookup drafts the scheduler scores the whole
proposal against the tokens actually produced, so positions beyond the verified drafts are tested too). Counts decay by `decay` at every observation, so the
estimate follows recent behaviour; an estimate blends the counts with `prior_weight` pseudo-tests of a prior
profile. A request's prior is the traffic's own estimate (all requests, slower decay), weighted as
REQUEST_PRIOR_WEIGHT (8) pseudo-tests against the request's ~5 own (a request's own few tests are mostly noise:
with 1 pseudo-test its estimates spread far wider than the rows' acceptance did), and whose prior is a flat
FLAT_PRIOR for position 1 and, for each later position, the estimate of the position before it (see profile): a new
request starts from what the server has been seeing, not from a constant guess.

Per position, not one alpha: lookup (n-gram) drafts are far from geometric. Gemma-3-270M, greedy, the bench
prompts, gamma 8: 33 of 39 first drafts accepted (0.85), then 27/33, 27/27, 24/27, 24/24, 24/24, 24/24, 24/24:
once a copied span starts it usually runs on, so one alpha (AR 0.71 here) undervalues long drafts.
"""

from __future__ import annotations

import numpy as np

FLAT_PRIOR = 0.5  # chance a draft is accepted before anything is known
MAX_POSITIONS = 64  # draft positions tracked (the policies' gamma limit)
REQUEST_DECAY = 0.8  # a request's counts: ~5 recent steps of evidence
TRAFFIC_DECAY = 0.98  # the traffic estimate: ~50 recent verified drafts
PRIOR_WEIGHT = 1.0  # pseudo-tests of the prior per position (the traffic's estimate against FLAT_PRIOR)
# a request's estimate against the traffic's: a request's own few tests mostly measure noise. Re-blending recorded
# steps with other weights (n-gram drafts, C=4) and scoring them on what was accepted: with 1 pseudo-test, the rows
# estimated lowest (a_1 0.61) were accepted at 0.85; over 33,891 tested positions the Brier score fell from 0.0638
# (weight 1) to 0.0595 (8), flat up to 32 (docs/BENCHMARKS.md, changelog)
REQUEST_PRIOR_WEIGHT = 8.0
STALE_DECAY = 0.9  # a step without drafts (draft model: no evidence) ages a request's counts towards the prior


class AcceptanceStats:
    """Exponentially weighted accepted / tested counts per draft position (position 1 = index 0)."""

    def __init__(self, decay: float = REQUEST_DECAY, positions: int = MAX_POSITIONS) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay={decay} is out of range (0, 1]: 1 keeps all evidence, smaller forgets faster")
        self.decay = decay
        self.accepted = np.zeros(positions)  # [K]
        self.tested = np.zeros(positions)  # [K]

    @property
    def observed(self) -> bool:
        return bool(self.tested[0] > 0)

    def observe(self, drafted: int, accepted: int) -> None:
        """One verified draft sequence: `accepted` of its `drafted` tokens were accepted (0 <= accepted <= drafted)."""
        if drafted <= 0:
            return
        self.observe_positions(0, min(accepted + 1, drafted), accepted)

    def observe_positions(self, counted: int, decided: int, accepted: int) -> None:
        """Positions counted+1..decided of one draft sequence were decided: those <= accepted were accepted, the
        one after them (if decided) rejected. The sequence's first call (counted 0) ages the earlier evidence, as
        one observe does; later calls add the positions decided since, so a sequence is counted position by
        position as its outcome becomes known (Scheduler._score_proposals), never twice."""
        decided = min(decided, self.tested.size)
        if decided <= counted:
            return
        if counted == 0:
            self.accepted *= self.decay
            self.tested *= self.decay
        self.accepted[counted : min(accepted, decided)] += 1.0  # empty when position counted + 1 was rejected
        self.tested[counted:decided] += 1.0

    def observe_first(self, accept_probability: float) -> None:
        """Evidence about position 1 only, as an expected accept (a shadow draft scored against the target)."""
        self.accepted *= self.decay
        self.tested *= self.decay
        self.accepted[0] += accept_probability
        self.tested[0] += 1.0

    def age(self, factor: float = STALE_DECAY) -> None:
        """Forget some evidence without new evidence (so an estimate of 0 drifts back and is tried again)."""
        self.accepted *= factor
        self.tested *= factor

    def first_rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """Position 1's rate, profile(prior, weight)[0] (the same operations, the same float) without the rest."""
        return float((self.accepted[0] + weight * prior) / (self.tested[0] + weight))

    def profile(self, prior: np.ndarray | float, weight: float = PRIOR_WEIGHT) -> np.ndarray:
        """Conditional rates per position [K]: (accepted + weight * prior) / (tested + weight). A profile prior
        [K] applies position by position; a single number is the prior of position 1 only, and each later
        position's prior is the estimate of the position before it (a chain): deep positions are tested only
        when the earlier ones were accepted, so they carry the least evidence, and "like the position before"
        is the right guess for i.i.d. acceptance (a draft model) and a cautious one for lookup drafts, whose
        later positions are accepted more often. A flat prior there priced long drafts at 0.5 per position until
        evidence came, and the adaptive policy drafted short while it learned."""
        if np.ndim(prior) > 0:
            return (self.accepted + weight * np.asarray(prior, dtype=float)) / (self.tested + weight)
        rates = np.empty_like(self.accepted)
        previous = float(prior)
        # past the deepest position ever tested the chain only repeats (0 + w r) / (0 + w): the loop stops there
        # (~8 positions, not 64: the scheduler asks for the traffic's profile once per request and step)
        tested = np.flatnonzero(self.tested)
        depth = int(tested[-1]) + 1 if tested.size else 0
        for k in range(depth):
            previous = rates[k] = (self.accepted[k] + weight * previous) / (self.tested[k] + weight)
        rates[depth:] = previous
        return rates
