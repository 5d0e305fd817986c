"""The Monte Carlo reproduces the closed forms, statistically, and a wrong formula is rejected.

Statistical design: each case is tested twice, a z-test of the mean against the closed form and a chi-square
goodness-of-fit of the histogram against the exact distribution of tokens per iteration. The family of
all those tests has significance FAMILY_ALPHA, Bonferroni-corrected per test. Seeds are fixed, so a run is
deterministic; the bounds say how surprising a failure would be for a correct simulator. Negative controls
(wrong formulas, a wrong alpha) must be rejected at the same thresholds.
"""

import json

import numpy as np
import pytest
from scipy import stats

from specgate import theory
from specgate.simulate import SimulationResult, simulate

FAMILY_ALPHA = 0.01
ITERATIONS = 400_000
CASES = {  # name: (conditional rates, chunk_iterations)
    "geometric a=0.7 g=4": ([0.7] * 4, 1 << 16),
    "geometric a=0.85 g=4": ([0.85] * 4, 1 << 16),
    "geometric a=0.3 g=2": ([0.3] * 2, 1 << 16),
    "geometric a=0.95 g=8": ([0.95] * 8, 1 << 16),
    "profile falling": ([0.9, 0.8, 0.6, 0.5], 1 << 16),
    "profile with a zero": ([1.0, 0.5, 0.0, 0.7], 1 << 16),
    "small uneven chunks": ([0.6, 0.7, 0.8], 777),
}
PER_TEST_ALPHA = FAMILY_ALPHA / (2 * len(CASES))  # two tests per case
Z_CRITICAL = stats.norm.ppf(1 - PER_TEST_ALPHA / 2)


def exact_pmf(rates):
    """P(tokens = 1 .. g+1) of one iteration: P(T = k+1) = m_k - m_{k+1}, m_k = prod_{i<=k} a_i."""
    marginal = np.concatenate([[1.0], np.cumprod(rates), [0.0]])  # [G+2]
    return marginal[:-1] - marginal[1:]


def z_score(result: SimulationResult, expected_mean: float) -> float:
    lo, hi = result.acceptance_length_ci95
    standard_error = (hi - lo) / (2 * 1.959963984540054)
    return (result.acceptance_length - expected_mean) / standard_error


def gof_p_value(histogram, pmf) -> float:
    """Chi-square goodness of fit over the bins the model gives positive probability (others must be empty)."""
    histogram, pmf = np.asarray(histogram), np.asarray(pmf)
    assert histogram[pmf == 0].sum() == 0
    keep = pmf > 0
    if keep.sum() < 2:  # a single possible outcome: the check above was the whole test
        return 1.0
    return float(stats.chisquare(histogram[keep], histogram.sum() * pmf[keep]).pvalue)


@pytest.fixture(scope="module")
def results():
    return {
        name: simulate(profile=rates, c=0.1, iterations=ITERATIONS, seed=i, chunk_iterations=chunk)
        for i, (name, (rates, chunk)) in enumerate(CASES.items())
    }


def test_lesson_case_closed_form_inside_its_ci():
    result = simulate(0.7, 4, c=0.1, iterations=1_000_000, seed=0)
    lo, hi = result.acceptance_length_ci95
    assert lo <= theory.expected_tokens(0.7, 4) <= hi
    assert lo <= result.acceptance_length <= hi
    assert result.speedup == pytest.approx(result.acceptance_length / 1.4)


@pytest.mark.parametrize("name", list(CASES))
def test_mean_matches_closed_form(results, name):
    rates, _ = CASES[name]
    result = results[name]
    expected = theory.expected_tokens_profile(rates)
    if rates[0] == rates[-1] and len(set(rates)) == 1:
        assert expected == pytest.approx(theory.expected_tokens(rates[0], len(rates)), rel=1e-12)
    assert abs(z_score(result, expected)) < Z_CRITICAL


@pytest.mark.parametrize("name", list(CASES))
def test_histogram_matches_exact_distribution(results, name):
    rates, _ = CASES[name]
    result = results[name]
    assert len(result.histogram) == len(rates) + 1
    assert sum(result.histogram) == result.iterations == ITERATIONS
    assert gof_p_value(result.histogram, exact_pmf(rates)) > PER_TEST_ALPHA


def test_negative_controls_wrong_formulas_are_rejected(results):
    result = results["geometric a=0.7 g=4"]
    a, g = 0.7, 4
    wrong_means = {
        "untruncated geometric 1/(1-a)": 1 / (1 - a),
        "off by one (1-a^g)/(1-a)": (1 - a**g) / (1 - a),
        "accepted drafts only, no bonus token": theory.expected_tokens(a, g) - 1,
        "alpha off by 0.01": theory.expected_tokens(a + 0.01, g),
    }
    for name, wrong in wrong_means.items():
        lo, hi = result.acceptance_length_ci95
        assert not lo <= wrong <= hi, name
        assert abs(z_score(result, wrong)) > Z_CRITICAL, name


def test_negative_control_wrong_distribution_is_rejected(results):
    histogram = results["profile falling"].histogram
    swapped = [0.8, 0.9, 0.6, 0.5]  # same positions, order swapped: same length, different pmf
    assert gof_p_value(histogram, exact_pmf(swapped)) < PER_TEST_ALPHA
    assert gof_p_value(histogram, exact_pmf([0.9, 0.8, 0.6, 0.52])) < PER_TEST_ALPHA


def test_negative_control_wrong_simulation_is_rejected():
    wrong = simulate(0.71, 4, c=0.1, iterations=ITERATIONS, seed=123)
    assert abs(z_score(wrong, theory.expected_tokens(0.7, 4))) > Z_CRITICAL
    assert gof_p_value(wrong.histogram, exact_pmf([0.7] * 4)) < PER_TEST_ALPHA


def test_degenerate_rates():
    assert simulate(0.0, 3, iterations=1000).histogram == (1000, 0, 0, 0)
    always = simulate(1.0, 3, c=0.25, iterations=1000)
    assert always.histogram == (0, 0, 0, 1000)
    assert always.acceptance_length == 4.0 and always.acceptance_length_ci95 == (4.0, 4.0)
    assert always.speedup == pytest.approx(4.0 / 1.75)


def test_seed_reproducible_and_seed_sensitive():
    first = simulate(0.6, 5, c=0.1, iterations=50_000, seed=7)
    again = simulate(0.6, 5, c=0.1, iterations=50_000, seed=7)
    other = simulate(0.6, 5, c=0.1, iterations=50_000, seed=8)
    assert first == again
    assert first.histogram != other.histogram


def test_progress_callback_reports_each_chunk():
    seen = []
    simulate(0.5, 2, iterations=2500, chunk_iterations=1000, on_progress=seen.append)
    assert seen == [1000, 2000, 2500]


def test_profile_and_gamma_agree():
    by_profile = simulate(profile=[0.5, 0.5], gamma=2, iterations=1000, seed=1)
    by_alpha = simulate(0.5, 2, iterations=1000, seed=1)
    assert by_profile == by_alpha


def test_to_dict_is_json():
    out = simulate(0.7, 4, c=0.1, iterations=1000, seed=0).to_dict()
    decoded = json.loads(json.dumps(out))
    assert set(decoded) >= {"acceptance_length", "acceptance_length_ci95", "speedup", "iterations", "histogram"}
    assert len(decoded["acceptance_length_ci95"]) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(alpha=1.5, gamma=4), "alpha=1.5 is outside [0, 1]"),
        (dict(alpha=0.5, gamma=0), "gamma=0 is outside [1, inf)"),
        (dict(alpha=0.5, gamma=2.0), "gamma=2.0 is not an integer"),
        (dict(alpha=0.5), "gamma=None"),
        (dict(gamma=4), "pass exactly one"),
        (dict(alpha=0.5, gamma=2, profile=[0.5, 0.5]), "pass exactly one"),
        (dict(profile=[0.5, 0.5], gamma=3), "gamma=3 does not match the profile's 2 positions"),
        (dict(profile=[0.5, 1.1]), "profile[1]=1.1 is outside [0, 1]"),
        (dict(profile=[]), "profile=[] is empty"),
        (dict(alpha=0.5, gamma=2, c=-0.5), "c=-0.5 is outside [0, inf)"),
        (dict(alpha=0.5, gamma=2, iterations=1), "iterations=1 is outside [2, inf)"),
        (dict(alpha=0.5, gamma=2, iterations=10.0), "iterations=10.0 is not an integer"),
        (dict(alpha=0.5, gamma=2, seed=-1), "seed=-1 is outside [0, inf)"),
        (dict(alpha=0.5, gamma=2, chunk_iterations=0), "chunk_iterations=0 is outside [1, inf)"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError) as info:
        simulate(**kwargs)
    assert message in str(info.value)
