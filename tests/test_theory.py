"""specgate.theory reproduces the lesson's numbers and Leviathan et al.'s, and holds its properties."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate import theory

ALPHAS = st.floats(0.0, 1.0, allow_nan=False)
GAMMAS = st.integers(1, 32)
COSTS = st.floats(0.0, 10.0, allow_nan=False)


def naive_expected_tokens(alpha, gamma):
    """Reference: sum_{k=0..g} a^k, term by term (positive terms, no cancellation)."""
    return math.fsum(alpha**k for k in range(gamma + 1))


# ----------------------------------------------------------------------------- the lesson's and paper's numbers


@pytest.mark.parametrize(
    ("alpha", "gamma", "c", "expected_speedup"),
    [(0.7, 4, 0.10, 1.981), (0.7, 4, 0.20, 1.541), (0.5, 4, 0.20, 1.076), (0.85, 4, 0.15, 2.318)],
)
def test_lesson_speedups(alpha, gamma, c, expected_speedup):
    assert theory.speedup(alpha, gamma, c) == pytest.approx(expected_speedup, abs=5e-4)


def test_lesson_expected_tokens_and_c_break():
    assert theory.expected_tokens(0.7, 4) == pytest.approx(2.773, abs=5e-4)
    assert theory.iteration_cost(4, 0.1) == pytest.approx(1.4)
    assert theory.c_break(0.7, 4) == pytest.approx(0.443, abs=5e-4)
    # at c = c_break the speedup is exactly 1
    assert theory.speedup(0.7, 4, theory.c_break(0.7, 4)) == pytest.approx(1.0, abs=1e-12)


def test_exercise_draft_8ms_target_40ms():
    c = theory.c_from_times(8.0, 40.0)
    assert c == pytest.approx(0.2)
    assert theory.speedup(0.75, 4, c) == pytest.approx(1.695, abs=5e-4)
    assert theory.speedup(0.75, 4, c) > 1  # the exercise's answer: it helps


@pytest.mark.parametrize(("alpha", "gamma", "speed", "compute"), [(0.8, 5, 3.69, 1.63), (0.9, 10, 6.86, 1.60)])
def test_leviathan_table_1(alpha, gamma, speed, compute):
    assert theory.speedup(alpha, gamma, 0.0) == pytest.approx(speed, abs=5e-3)
    assert theory.compute_overhead(alpha, gamma, 0.0) == pytest.approx(compute, abs=5e-3)


def test_alpha_min_lesson():
    assert theory.alpha_min(4, 0.2) == pytest.approx(0.455, abs=5e-4)


def test_alpha_min_edges():
    assert theory.alpha_min(4, 0.0) == 0.0  # a free draft helps at any acceptance
    assert theory.alpha_min(4, 1.0) is None  # a draft as slow as the target never pays
    assert theory.alpha_min(4, 3.0) is None
    assert theory.alpha_min(1, 0.3) == pytest.approx(0.3, abs=1e-12)  # gamma = 1: S = (1 + a) / (1 + c)


def test_compute_overhead_formula():
    a, g, c_hat = 0.6, 3, 0.05
    paper = (1 - a) * (g * c_hat + g + 1) / (1 - a ** (g + 1))
    assert theory.compute_overhead(a, g, c_hat) == pytest.approx(paper, rel=1e-12)


def test_speedup_lower_bound():
    assert theory.speedup_lower_bound(0.7, 0.1) == pytest.approx(1.7 / 1.1)
    assert theory.speedup_lower_bound(0.3, 0.3) is None  # needs alpha > c
    assert theory.speedup_lower_bound(0.2, 0.5) is None


# ------------------------------------------------------------------------------------------ numerics


def test_expected_tokens_limits():
    assert theory.expected_tokens(1.0, 4) == 5.0
    assert theory.expected_tokens(0.0, 4) == 1.0
    assert theory.expected_tokens(0.5, 1) == 1.5


@pytest.mark.parametrize("gap", [1e-4, 1e-8, 1e-12, 1e-15])
def test_expected_tokens_stable_near_one(gap):
    alpha, gamma = 1.0 - gap, 7
    assert theory.expected_tokens(alpha, gamma) == pytest.approx(naive_expected_tokens(alpha, gamma), rel=1e-13)


def test_best_gamma_matches_brute_force_and_grid():
    alphas, costs = [0.0, 0.3, 0.6, 0.75, 0.9, 0.99], [0.0, 0.05, 0.2, 0.5, 1.5]
    grid_gamma, grid_speedup = theory.best_speedup_grid(alphas, costs, gamma_max=12)
    for i, a in enumerate(alphas):
        for j, c in enumerate(costs):
            speedups = [theory.speedup(a, g, c) for g in range(1, 13)]
            g_star, s_star = theory.best_gamma(a, c, gamma_max=12)
            assert s_star == max(speedups)
            assert g_star == speedups.index(max(speedups)) + 1
            assert grid_gamma[i, j] == g_star
            assert grid_speedup[i, j] == pytest.approx(s_star, rel=1e-12)
    assert theory.best_gamma(0.7, 0.1) == (4, pytest.approx(1.981, abs=5e-4))


# ------------------------------------------------------------------------------------------ properties


@settings(max_examples=200, deadline=None)
@given(alpha=ALPHAS, gamma=GAMMAS, c1=COSTS, c2=COSTS)
def test_speedup_decreases_in_c(alpha, gamma, c1, c2):
    lo, hi = sorted((c1, c2))
    assert theory.speedup(alpha, gamma, lo) >= theory.speedup(alpha, gamma, hi)
    if hi - lo > 1e-9:  # strictly, once the difference survives float rounding
        assert theory.speedup(alpha, gamma, lo) > theory.speedup(alpha, gamma, hi)


@settings(max_examples=200, deadline=None)
@given(alpha=ALPHAS, gamma=GAMMAS)
def test_expected_tokens_bounds(alpha, gamma):
    tokens = theory.expected_tokens(alpha, gamma)
    assert 1.0 <= tokens <= gamma + 1
    assert tokens == pytest.approx(naive_expected_tokens(alpha, gamma), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(gamma=st.integers(1, 16), c=st.floats(1e-6, 0.999, allow_nan=False))
def test_alpha_min_round_trips_through_speedup(gamma, c):
    a_min = theory.alpha_min(gamma, c)
    assert a_min is not None and 0.0 < a_min < 1.0
    assert theory.speedup(a_min, gamma, c) == pytest.approx(1.0, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(alpha=ALPHAS, c=COSTS)
def test_lower_bound_is_reached_by_best_gamma(alpha, c):
    bound = theory.speedup_lower_bound(alpha, c)
    if bound is not None:
        assert theory.best_gamma(alpha, c)[1] >= bound * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(alpha=ALPHAS, gamma=GAMMAS, c=COSTS)
def test_constant_profile_equals_geometric(alpha, gamma, c):
    rates = [alpha] * gamma
    assert theory.expected_tokens_profile(rates) == pytest.approx(theory.expected_tokens(alpha, gamma), rel=1e-12)
    assert theory.speedup_profile(rates, c) == pytest.approx(theory.speedup(alpha, gamma, c), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=12))
def test_marginal_conditional_round_trip(rates):
    marginal = theory.conditional_to_marginal(rates)
    assert all(b <= a for a, b in zip(marginal, marginal[1:]))
    back = theory.marginal_to_conditional(marginal)
    assert theory.expected_tokens_profile(back) == pytest.approx(theory.expected_tokens_profile(rates), rel=1e-12)
    reached = [1.0] + marginal[:-1]  # P(a draft reaches position k)
    for a, b, p_reach in zip(rates, back, reached):
        if p_reach > 1e-200:  # a rate after a (near-)zero marginal is unknowable, and returned as 0
            assert b == pytest.approx(a, rel=1e-9, abs=1e-12)


# ----------------------------------------------------------------------------- position-dependent examples


def test_profile_example():
    rates = [0.9, 0.8, 0.5]
    assert theory.expected_tokens_profile(rates) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    assert theory.speedup_profile(rates, 0.1) == pytest.approx(2.98 / 1.3)


def test_marginal_to_conditional_vllm_counts():
    # vLLM counters over a window: 1000 drafts, accepted_per_pos = [800, 560, 280]
    marginal = [800 / 1000, 560 / 1000, 280 / 1000]
    assert theory.marginal_to_conditional(marginal) == pytest.approx([0.8, 0.7, 0.5])
    assert theory.marginal_to_conditional([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]


def test_marginal_must_not_increase():
    with pytest.raises(ValueError, match=r"marginal_rates\[1\]=0\.6 exceeds marginal_rates\[0\]=0\.5"):
        theory.marginal_to_conditional([0.5, 0.6])


# ---------------------------------------------------------------------------------------------- bad input


BAD_ALPHA = [(1.5, "outside [0, 1]"), (-0.1, "outside [0, 1]"), (math.nan, "nan"), (math.inf, "inf"), ("0.5", "not a number"), (True, "not a number")]
BAD_GAMMA = [(0, "outside [1, inf)"), (-3, "outside [1, inf)"), (2.5, "not an integer"), (4.0, "not an integer"), (True, "not an integer"), (None, "not an integer")]
BAD_COST = [(-0.1, "outside [0, inf)"), (math.nan, "nan"), (math.inf, "inf"), (None, "not a number")]


@pytest.mark.parametrize(("value", "why"), BAD_ALPHA)
@pytest.mark.parametrize(
    "call",
    [
        lambda a: theory.expected_tokens(a, 4),
        lambda a: theory.speedup(a, 4, 0.1),
        lambda a: theory.c_break(a, 4),
        lambda a: theory.best_gamma(a, 0.1),
        lambda a: theory.compute_overhead(a, 4, 0.1),
        lambda a: theory.speedup_lower_bound(a, 0.1),
    ],
)
def test_bad_alpha(call, value, why):
    with pytest.raises(ValueError) as info:
        call(value)
    message = str(info.value)
    assert message.startswith(f"alpha={value!r}" if isinstance(value, (str, bool)) else "alpha=")
    assert why in message and "[0, 1]" in message


@pytest.mark.parametrize(("value", "why"), BAD_GAMMA)
@pytest.mark.parametrize(
    "call",
    [
        lambda g: theory.expected_tokens(0.5, g),
        lambda g: theory.iteration_cost(g, 0.1),
        lambda g: theory.speedup(0.5, g, 0.1),
        lambda g: theory.c_break(0.5, g),
        lambda g: theory.alpha_min(g, 0.1),
        lambda g: theory.compute_overhead(0.5, g, 0.1),
    ],
)
def test_bad_gamma(call, value, why):
    with pytest.raises(ValueError, match=r"^gamma=") as info:
        call(value)
    assert why in str(info.value) and "[1, inf)" in str(info.value)


@pytest.mark.parametrize(("value", "why"), BAD_COST)
@pytest.mark.parametrize(
    "call",
    [
        lambda c: theory.iteration_cost(4, c),
        lambda c: theory.speedup(0.5, 4, c),
        lambda c: theory.alpha_min(4, c),
        lambda c: theory.best_gamma(0.5, c),
        lambda c: theory.speedup_lower_bound(0.5, c),
        lambda c: theory.speedup_profile([0.5], c),
    ],
)
def test_bad_cost(call, value, why):
    with pytest.raises(ValueError, match=r"^c=") as info:
        call(value)
    assert why in str(info.value) and "[0, inf)" in str(info.value)


def test_bad_other_parameters():
    cases = [
        (lambda: theory.best_gamma(0.5, 0.1, gamma_max=0), "gamma_max=0 is outside [1, inf)"),
        (lambda: theory.compute_overhead(0.5, 4, -1.0), "c_hat=-1.0 is outside [0, inf)"),
        (lambda: theory.c_from_times(-1.0, 40.0), "draft_ms=-1.0 is outside [0, inf)"),
        (lambda: theory.c_from_times(8.0, 0.0), "target_ms=0.0 is outside (0, inf)"),
        (lambda: theory.c_from_times(8.0, math.nan), "target_ms=nan is not a finite number in (0, inf)"),
        (lambda: theory.expected_tokens_profile([]), "conditional_rates=[] is empty"),
        (lambda: theory.expected_tokens_profile([0.5, 1.2]), "conditional_rates[1]=1.2 is outside [0, 1]"),
        (lambda: theory.expected_tokens_profile(0.5), "conditional_rates=0.5 is not a sequence"),
        (lambda: theory.marginal_to_conditional([0.5, -0.1]), "marginal_rates[1]=-0.1 is outside [0, 1]"),
        (lambda: theory.best_speedup_grid([0.5], [-0.2]), "cs[0]=-0.2 is outside [0, inf)"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert message in str(info.value)


def test_numpy_scalars_accepted():
    assert theory.speedup(np.float64(0.7), np.int64(4), np.float32(0.1)) == pytest.approx(1.981, abs=5e-4)


# --- the model applied to the draft lengths that ran, and to a measured verification cost --------------------


def test_speedup_over_lengths_reduces_to_leviathan_at_fixed_gamma():
    from specgate.theory import speedup_over_lengths

    for alpha, gamma, c in ((0.8, 5, 0.0), (0.6, 3, 0.2), (1.0, 4, 0.05)):
        counts = [0] * gamma + [7]
        assert speedup_over_lengths(alpha, counts, c) == pytest.approx(theory.speedup(alpha, gamma, c), rel=1e-12)
        assert speedup_over_lengths(alpha, counts, c, verify_cost=[1.0] * (gamma + 1)) == pytest.approx(theory.speedup(alpha, gamma, c), rel=1e-12)


def test_speedup_over_lengths_by_hand_and_against_simulated_steps():
    """One plain step + one 2-draft step, alpha 0.5, c 0.1, V = (1, 1.1, 1.2): tokens 1 + 1.75, passes 1 + 1.4.
    Then mixed lengths against a Monte Carlo of i.i.d. acceptance (200,000 steps in these proportions; 4
    standard errors)."""
    from specgate.theory import speedup_over_lengths

    assert speedup_over_lengths(0.5, [1, 0, 1], 0.1, verify_cost=[1.0, 1.1, 1.2]) == pytest.approx(2.75 / 2.4, rel=1e-12)
    rng = np.random.default_rng(0)
    counts, alpha, c, verify = [300, 0, 500, 0, 1200], 0.7, 0.05, [1.0, 1.05, 1.1, 1.2, 1.3]
    lengths = np.repeat(np.arange(len(counts)), [100 * n for n in counts])  # [S] draft length of each step
    accepted_run = np.argmin(np.concatenate([rng.random((lengths.size, 4)) < alpha, np.zeros((lengths.size, 1), bool)], axis=1), axis=1)
    tokens = np.minimum(accepted_run, lengths) + 1  # [S] accepted drafts before the first rejection, plus one
    passes = lengths * c + np.asarray(verify)[lengths]
    simulated = tokens.mean() / passes.mean()
    stderr = tokens.std() / np.sqrt(tokens.size) / passes.mean()
    assert abs(speedup_over_lengths(alpha, counts, c, verify_cost=verify) - simulated) < 4 * stderr


def test_speedup_over_lengths_rejects_bad_input():
    from specgate.theory import speedup_over_lengths

    with pytest.raises(ValueError, match="steps_by_draft_length"):
        speedup_over_lengths(0.5, [], 0.1)
    with pytest.raises(ValueError, match="steps_by_draft_length"):
        speedup_over_lengths(0.5, [1, -1], 0.1)
    with pytest.raises(ValueError, match=r"verify_cost has 2 entries: give V\(t\) for t = 1..3"):
        speedup_over_lengths(0.5, [1, 0, 1], 0.1, verify_cost=[1.0, 1.1])
    with pytest.raises(ValueError, match="alpha"):
        speedup_over_lengths(1.5, [1], 0.1)
