"""The gate's statistics: intervals for paired comparisons and the three-way decision against a margin.

Every comparison the gate makes is an `Interval` (estimate, low, high, confidence level, units behind it), and
every criterion is decided from one with `State`: PASS, FAIL, or UNDECIDED when the interval straddles the bound.
- `paired_ratio`: a ratio measured in paired rounds (configuration / baseline in the same block of interleaved
  windows); the geometric mean of the per-round ratios with a Student-t interval on their logs. Rounds are the
  independent units: requests inside one window share its machine state.
- `bootstrap_percentile_difference`: a latency percentile of two request samples, resampling whole requests
  within each round (stratified), so a slow round cannot be mistaken for slow requests.
- `ratio_of_sums`: a pooled rate over units (accepted / drafted tokens over a category's prompts), resampling whole
  units.
- `paired_proportion_difference`: Tango's score interval for a paired difference of proportions (exact match of
  the same items by two configurations); it stays honest with no discordant pair, where a Wald or bootstrap
  interval collapses to [0, 0].
- `mean_interval`: a Student-t interval of a mean (paired differences), the two one-sided tests (TOST) of an
  equivalence margin read off it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

LEVEL = 0.95  # the confidence of every reported interval (family-wise where the gate corrects for looks or configurations)
BOOTSTRAP_RESAMPLES = 2000


class State(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    UNDECIDED = "UNDECIDED"
    NA = "N/A"  # the criterion does not apply here (e.g. acceptance where a schedule does not speculate)


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    level: float  # two-sided confidence, e.g. 0.95
    n: int  # independent units behind it: rounds, requests, items or prompts

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def text(self, digits: int = 3, unit: str = "") -> str:
        return f"{fmt(self.estimate, digits)}{unit} [{fmt(self.low, digits)}, {fmt(self.high, digits)}]"

    def to_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "level": self.level, "n": self.n}


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "n/a" if x is None or math.isnan(x) else ("inf" if x > 0 else "-inf")
    return f"{x:.{digits}g}"


def split_level(level: float, tests: int) -> float:
    """Bonferroni: the per-test level that keeps `tests` tests at family-wise `level` (1 - (1 - level) / tests)."""
    if tests < 1:
        raise ValueError(f"tests={tests} must be >= 1")
    return 1.0 - (1.0 - level) / tests


def t_quantile(level: float, df: int) -> float:
    """The two-sided Student-t critical value: P(|T_df| <= t) = level."""
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2.0, df))


def z_quantile(level: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(0.5 + level / 2.0))


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval | None:
    """Student-t interval of the mean of `values` (None for no value; infinite for one)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return None
    mean = float(x.mean())
    if x.size == 1:
        return Interval(mean, -math.inf, math.inf, level, 1)
    half = t_quantile(level, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, level, int(x.size))


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float], level: float = LEVEL) -> Interval | None:
    """Geometric mean of numerators[k] / denominators[k] over paired rounds k, with a t interval on the logs.

    None when no round has both sides positive; an infinite interval from a single round (one round says
    nothing about the spread between rounds)."""
    logs = [math.log(a / b) for a, b in zip(numerators, denominators) if a > 0 and b > 0]
    inner = mean_interval(logs, level)
    if inner is None:
        return None
    return Interval(math.exp(inner.estimate), _exp(inner.low), _exp(inner.high), level, inner.n)


def _exp(x: float) -> float:
    return 0.0 if x == -math.inf else (math.inf if x == math.inf else math.exp(x))


def bootstrap_percentile_difference(
    a_groups: Sequence[Sequence[np.ndarray]], b_groups: Sequence[Sequence[np.ndarray]], q: float,
    level: float = LEVEL, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES,
) -> Interval | None:
    """The q-th percentile of a's pooled samples minus b's, with a percentile-bootstrap interval.

    a_groups[k] / b_groups[k]: the requests of round k, each request an array of samples (one TTFT, or its per-token
    ITLs). A resample draws, within every round, whole requests with replacement and pools their samples; the
    percentile is the inverted empirical CDF of the pooled samples (the same for the estimate). None when a side has
    no sample."""
    rng = np.random.default_rng(seed)
    a, b = _Pooled(a_groups), _Pooled(b_groups)
    if a.values.size == 0 or b.values.size == 0:
        return None
    estimate = a.percentile(q, np.ones((1, a.requests)))[0] - b.percentile(q, np.ones((1, b.requests)))[0]
    diffs = a.percentile(q, a.multiplicities(rng, resamples)) - b.percentile(q, b.multiplicities(rng, resamples))
    tail = (1.0 - level) / 2.0 * 100.0
    return Interval(float(estimate), float(np.percentile(diffs, tail)), float(np.percentile(diffs, 100.0 - tail)), level, a.requests + b.requests)


def ratio_of_sums(numerators: Sequence[float], denominators: Sequence[float], level: float = LEVEL, seed: int = 0,
                  resamples: int = BOOTSTRAP_RESAMPLES) -> Interval | None:
    """sum(numerators) / sum(denominators) over units (e.g. accepted / drafted tokens over prompts), with a
    percentile-bootstrap interval from resampling whole units. None when the denominators sum to 0; an infinite
    interval from one unit."""
    a, b = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if a.size == 0 or b.sum() <= 0:
        return None
    estimate = float(a.sum() / b.sum())
    if a.size == 1:
        return Interval(estimate, -math.inf, math.inf, level, 1)
    picks = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))
    sums = b[picks].sum(axis=1)
    ratios = a[picks].sum(axis=1)[sums > 0] / sums[sums > 0]
    tail = (1.0 - level) / 2.0 * 100.0
    return Interval(estimate, float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100.0 - tail)), level, int(a.size))


def percentile_of(groups: Sequence[Sequence[np.ndarray]], q: float) -> float | None:
    """The q-th percentile (inverted CDF, as bootstrap_percentile_difference) of every request's samples pooled."""
    pooled = _Pooled(groups)
    return float(pooled.percentile(q, np.ones((1, pooled.requests)))[0]) if pooled.values.size else None


class _Pooled:
    """Requests' samples, grouped by round, sorted once: a resample is a weight per request."""

    def __init__(self, groups: Sequence[Sequence[np.ndarray]]) -> None:
        requests = [np.asarray(r, dtype=float).ravel() for g in groups for r in g]
        self.rounds = [len(g) for g in groups]
        self.requests = len(requests)
        owner = np.concatenate([np.full(r.size, i) for i, r in enumerate(requests)]) if requests else np.zeros(0, dtype=int)
        values = np.concatenate(requests) if requests else np.zeros(0)
        order = np.argsort(values, kind="stable")
        self.values, self.owner = values[order], owner[order]

    def multiplicities(self, rng: np.random.Generator, resamples: int) -> np.ndarray:
        """[R, requests]: how often each request is drawn when each round's requests are resampled with replacement."""
        counts = np.zeros((resamples, self.requests))
        rows = np.arange(resamples)[:, None]
        start = 0
        for n in self.rounds:
            if n:
                np.add.at(counts, (rows, start + rng.integers(0, n, size=(resamples, n))), 1.0)
            start += n
        return counts

    def percentile(self, q: float, weights: np.ndarray) -> np.ndarray:
        """[R]: the q-th percentile (inverted CDF) of the samples weighted by their request's multiplicity."""
        w = weights[:, self.owner]  # [R, samples]
        cumulative = np.cumsum(w, axis=1)
        index = np.argmax(cumulative >= (q / 100.0) * cumulative[:, -1:], axis=1)
        return self.values[index]


def paired_proportion_difference(better: int, worse: int, n: int, level: float = LEVEL) -> Interval:
    """Tango's (1998) score interval of delta = (better - worse) / n for paired binary outcomes.

    better: items right under the configuration and wrong under the baseline; worse: the reverse; n: all items.
    delta0 is inside the interval when |Z(delta0)| <= z, Z = (better - worse - n delta0) / sqrt(n (2 q + delta0
    (1 - delta0))), q the maximum-likelihood probability of a `worse` pair under delta = delta0. With no
    discordant pair the interval is +-z^2 / (n + z^2): 80 concordant items bound a regression by 4.6 points."""
    if n < 1 or better < 0 or worse < 0 or better + worse > n:
        raise ValueError(f"better={better}, worse={worse}, n={n}: need 0 <= better + worse <= n and n >= 1")
    z = z_quantile(level)
    estimate = (better - worse) / n

    def score(delta0: float) -> float:
        q = _tango_q(better, worse, n, delta0)
        variance = n * (2.0 * q + delta0 * (1.0 - delta0))
        excess = better - worse - n * delta0
        return excess / math.sqrt(variance) if variance > 0 else math.copysign(math.inf, excess) if excess else 0.0

    edge = 1.0 - 1e-12  # score is decreasing in delta0 and 0 at the estimate: bisect score = +z below it, -z above
    low = _bisect(lambda d: score(d) - z, -edge, estimate) if score(-edge) > z else -1.0
    high = _bisect(lambda d: score(d) + z, estimate, edge) if score(edge) < -z else 1.0
    return Interval(estimate, low, high, level, n)


def _bisect(f: Callable[[float], float], lo: float, hi: float) -> float:
    """The root of a decreasing f on [lo, hi] (f(lo) >= 0 >= f(hi))."""
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13:
            break
    return (lo + hi) / 2.0


def _tango_q(better: int, worse: int, n: int, delta0: float) -> float:
    """Maximum-likelihood P(worse pair) q given P(better pair) = q + delta0: the root in [max(0, -d), (1 - d) / 2] of
    better q (1 - 2q - d) + worse (q + d)(1 - 2q - d) - 2 rest q (q + d) = 0 (the likelihood's derivative, cleared)."""
    d, rest = delta0, n - better - worse
    qa = -2.0 * n
    qb = better * (1.0 - d) + worse * (1.0 - 3.0 * d) - 2.0 * rest * d
    qc = worse * d * (1.0 - d)
    lower, upper = max(0.0, -d), (1.0 - d) / 2.0
    disc = math.sqrt(max(qb * qb - 4.0 * qa * qc, 0.0))
    valid = [r for r in ((-qb + disc) / (2.0 * qa), (-qb - disc) / (2.0 * qa)) if lower - 1e-12 <= r <= upper + 1e-12]
    return min(max(max(valid) if valid else lower, lower), upper)


# ------------------------------------------------------------------------------------------ decisions


def non_inferior(ratio: Interval | None, margin: float) -> State:
    """A ratio (configuration / baseline, higher is better) against 1 - margin: PASS when the interval lies at or
    above it, FAIL when it lies wholly below (a regression beyond the margin), UNDECIDED otherwise."""
    if ratio is None:
        return State.UNDECIDED
    if ratio.low >= 1.0 - margin:
        return State.PASS
    if ratio.high < 1.0 - margin:
        return State.FAIL
    return State.UNDECIDED


def above(interval: Interval | None, bound: float) -> State:
    """PASS when the whole interval is above `bound`, FAIL when it is wholly at or below, else UNDECIDED."""
    if interval is None:
        return State.UNDECIDED
    if interval.low > bound:
        return State.PASS
    if interval.high <= bound:
        return State.FAIL
    return State.UNDECIDED


def equivalent(difference: Interval | None, margin: float) -> State:
    """Two one-sided tests: PASS when the interval lies inside (-margin, margin), FAIL when it lies wholly outside
    it (a shift beyond the margin), UNDECIDED otherwise. The interval is the (1 - 2 alpha) one for tests at alpha."""
    if difference is None:
        return State.UNDECIDED
    if -margin < difference.low and difference.high < margin:
        return State.PASS
    if difference.low >= margin or difference.high <= -margin:
        return State.FAIL
    return State.UNDECIDED


def units_to_decide(interval: Interval | None, bound: float, log_scale: bool = False) -> int | None:
    """About how many units (rounds, items, prompts) in all would make `interval` clear `bound`, assuming its
    estimate and spread stay as they are (the half-width shrinks as 1/sqrt(n)); None when the estimate sits on
    the bound or nothing is known yet."""
    if interval is None or interval.n < 2 or not math.isfinite(interval.low) or not math.isfinite(interval.high):
        return None
    if log_scale:
        if min(interval.estimate, interval.low, bound) <= 0:
            return None
        centre, lo, hi, edge = math.log(interval.estimate), math.log(interval.low), math.log(interval.high), math.log(bound)
    else:
        centre, lo, hi, edge = interval.estimate, interval.low, interval.high, bound
    gap, half = abs(centre - edge), (hi - lo) / 2.0
    if gap <= 1e-12 or half <= 0:
        return None
    return max(interval.n + 1, math.ceil(interval.n * (half / gap) ** 2))
