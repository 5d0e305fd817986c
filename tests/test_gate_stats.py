"""The gate's statistics against hand-computed cases, their coverage by simulation, and negative controls."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specgate.gate import stats
from specgate.gate.stats import Interval, State

T_975_3 = 3.182446305284263  # Student t, 3 degrees of freedom, 97.5th percentile (tables)
Z_975 = 1.959963984540054


def test_paired_ratio_is_the_geometric_mean_with_a_t_interval_on_the_logs():
    spec, base = [110.0, 120.0, 100.0, 115.0], [100.0, 100.0, 100.0, 100.0]
    logs = [math.log(1.1), math.log(1.2), 0.0, math.log(1.15)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    r = stats.paired_ratio(spec, base)
    assert r.estimate == pytest.approx(math.exp(mean))
    assert r.low == pytest.approx(math.exp(mean - T_975_3 * sd / 2)) and r.high == pytest.approx(math.exp(mean + T_975_3 * sd / 2))
    assert r.n == 4 and r.level == 0.95
    one = stats.paired_ratio([2.0], [1.0])
    assert one.estimate == 2.0 and one.low == 0.0 and one.high == math.inf  # one round: no spread known
    assert stats.paired_ratio([], []) is None and stats.paired_ratio([0.0], [1.0]) is None


def test_tango_interval_with_no_discordant_pair_is_z2_over_n_plus_z2_and_not_zero_width():
    for n in (8, 40, 80, 120):
        i = stats.paired_proportion_difference(0, 0, n)
        assert i.estimate == 0.0
        assert i.high == pytest.approx(Z_975 ** 2 / (n + Z_975 ** 2), abs=1e-9) and i.low == pytest.approx(-i.high, abs=1e-9)
    assert stats.paired_proportion_difference(0, 0, 80).high == pytest.approx(0.0458, abs=1e-4)  # 80 agreeing items: 4.6 points


def test_tango_interval_endpoints_have_score_z_and_swapping_sides_mirrors_it():
    a = stats.paired_proportion_difference(5, 2, 50)
    b = stats.paired_proportion_difference(2, 5, 50)
    assert a.estimate == pytest.approx(0.06) and a.low < 0.06 < a.high
    assert (b.low, b.high) == pytest.approx((-a.high, -a.low), abs=1e-9)
    for delta0 in (a.low, a.high):  # each endpoint is where the score statistic equals +-z
        q = stats._tango_q(5, 2, 50, delta0)
        score = (5 - 2 - 50 * delta0) / math.sqrt(50 * (2 * q + delta0 * (1 - delta0)))
        assert abs(score) == pytest.approx(Z_975, abs=1e-6)
    with pytest.raises(ValueError, match="need 0 <= better"):
        stats.paired_proportion_difference(30, 30, 50)


@pytest.mark.parametrize("p_better, p_worse", [(0.05, 0.10), (0.0, 0.02)])
def test_tango_interval_covers_the_true_difference_at_about_its_level(p_better, p_worse):
    """Simulation: 3000 paired samples of 60 items; the interval must cover delta = p_better - p_worse at about 95%.
    Negative control: where discordant pairs are rare, the Wald interval collapses to [0, 0] whenever none occurs
    (30% of samples at P(worse) = 0.02) and misses the regression it should bound."""
    rng = np.random.default_rng(7)
    n = 60
    cells = rng.multinomial(n, [p_better, p_worse, 1 - p_better - p_worse], size=3000)
    covered = wald = 0
    for better, worse, _ in cells:
        i = stats.paired_proportion_difference(int(better), int(worse), n)
        covered += i.low <= p_better - p_worse <= i.high
        d = (better - worse) / n
        se = math.sqrt(max((better + worse) / n - d * d, 0.0) / n)
        wald += d - Z_975 * se <= p_better - p_worse <= d + Z_975 * se
    assert covered / 3000 >= 0.93  # discrete data: conservative where discordance is rare, near 95% elsewhere
    if p_better == 0.0:
        assert wald / 3000 < 0.75
    else:
        assert covered / 3000 <= 0.975


def test_mean_interval_and_the_equivalence_test():
    values = [0.1, -0.2, 0.05, 0.0]
    i = stats.mean_interval(values)
    sd = float(np.std(values, ddof=1))
    assert i.estimate == pytest.approx(-0.0125) and i.high - i.estimate == pytest.approx(T_975_3 * sd / 2)
    assert stats.equivalent(Interval(0.0, -0.1, 0.1, 0.9, 10), 0.2) == State.PASS
    assert stats.equivalent(Interval(0.5, 0.3, 0.7, 0.9, 10), 0.2) == State.FAIL  # wholly beyond the margin
    assert stats.equivalent(Interval(0.0, -0.1, 0.1, 0.9, 10), 0.05) == State.UNDECIDED  # the sample cannot establish 0.05
    assert stats.equivalent(None, 0.2) == State.UNDECIDED


def test_three_way_states_against_a_margin():
    assert stats.non_inferior(Interval(1.0, 0.98, 1.02, 0.95, 6), 0.03) == State.PASS
    assert stats.non_inferior(Interval(0.9, 0.88, 0.96, 0.95, 6), 0.03) == State.FAIL
    assert stats.non_inferior(Interval(1.0, 0.95, 1.05, 0.95, 6), 0.03) == State.UNDECIDED
    assert stats.non_inferior(None, 0.03) == State.UNDECIDED
    assert stats.above(Interval(1.2, 1.1, 1.3, 0.95, 6), 1.0) == State.PASS
    assert stats.above(Interval(0.9, 0.8, 0.99, 0.95, 6), 1.0) == State.FAIL
    assert stats.above(Interval(1.0, 0.9, 1.1, 0.95, 6), 1.0) == State.UNDECIDED


def test_bootstrap_percentile_difference_resamples_whole_requests_within_rounds():
    rng = np.random.default_rng(0)
    a = [[rng.normal(12.0, 1.0, size=20) for _ in range(6)] for _ in range(4)]  # 4 rounds x 6 requests x 20 ITL samples
    b = [[rng.normal(10.0, 1.0, size=20) for _ in range(6)] for _ in range(4)]
    d = stats.bootstrap_percentile_difference(a, b, 50, seed=1)
    pooled = lambda g: np.sort(np.concatenate([r for round_ in g for r in round_]))  # noqa: E731
    assert d.estimate == pytest.approx(pooled(a)[239] - pooled(b)[239])  # the 240th of 480 samples: the inverted CDF at 0.5
    assert d.low < d.estimate < d.high and 1.5 < d.low and d.high < 2.5 and d.n == 48
    same = stats.bootstrap_percentile_difference(a, a, 95, seed=1)
    assert same.estimate == 0.0 and same.low < 0.0 < same.high
    one_slow_request = [[np.array([1.0] * 19 + [100.0])] + [np.ones(20)] * 5]  # its samples move together when resampled
    spread = stats.bootstrap_percentile_difference(one_slow_request, [[np.ones(20)] * 6], 99, seed=1)
    assert spread.low == 0.0 and spread.high == 99.0
    assert stats.bootstrap_percentile_difference([[]], b, 50) is None


def test_units_to_decide_scales_the_half_width_as_one_over_root_n():
    i = Interval(1.05, 1.0, 1.10, 0.95, 4)  # half-width 0.05, the estimate 0.08 above 0.97
    assert stats.units_to_decide(i, 0.97) == 5  # already decided in effect: at least one more unit
    assert stats.units_to_decide(Interval(1.0, 0.9, 1.1, 0.95, 4), 0.97) == math.ceil(4 * (0.1 / 0.03) ** 2)
    assert stats.units_to_decide(Interval(0.97, 0.9, 1.04, 0.95, 4), 0.97) is None  # the estimate sits on the bound
    assert stats.split_level(0.95, 4) == pytest.approx(0.9875)


def test_looks_are_planned_from_the_blocks_the_budget_holds():
    """The first look after --rounds blocks whatever the budget; then every 2 blocks (whole ABBA pairs) while the
    budget holds them, counting the blocks already measured; the fewer the looks, the wider each look's level."""
    from specgate.gate.runner import planned_looks

    assert planned_looks(4, 210.0, 35.0, done=1, spent_s=20.0) == [4, 6]  # 1 + 190 // 35 = 6 blocks
    assert planned_looks(4, 100.0, 35.0, done=1, spent_s=20.0) == [4]  # the budget holds fewer than --rounds
    assert planned_looks(4, 400.0, 35.0, done=1, spent_s=20.0) == [4, 6, 8, 10, 11]
    assert planned_looks(2, 60.0, 10.0) == [2, 4, 6]


def test_ratio_of_sums_resamples_whole_units():
    """The pooled rate is sum / sum (not a mean of ratios); its interval covers the pooled rate, narrows with more
    units, and is unbounded from one unit."""
    accepted, drafted = [5, 1, 9, 3], [10, 10, 12, 6]
    one = stats.ratio_of_sums(accepted, drafted, seed=0)
    assert one.estimate == pytest.approx(18 / 38) and one.low < one.estimate < one.high and one.n == 4
    many = stats.ratio_of_sums(accepted * 8, drafted * 8, seed=0)
    assert many.high - many.low < one.high - one.low
    assert stats.ratio_of_sums([3], [4]).low == -math.inf and stats.ratio_of_sums([0], [0]) is None
