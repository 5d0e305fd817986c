"""The analytical model of speculative decoding (Leviathan et al., ICML 2023).

Symbols and units, used the same way in every function:

- ``alpha``: per-token acceptance probability of a draft token, a probability in [0, 1].
- ``gamma``: draft tokens proposed per iteration, an integer >= 1.
- ``c``: cost of one draft forward pass divided by one target forward pass, a ratio >= 0
  (a draft taking 8 ms next to a 40 ms target has c = 0.2).
- ``c_hat``: arithmetic operations per token of the draft divided by those of the target, >= 0.

One iteration drafts gamma tokens and verifies them in one target pass; it emits between 1 and gamma + 1
tokens. Speedups are walltime ratios against plain target decoding (1.0 = no change, below 1 = slower).
Real traffic is not geometric, so the position-dependent forms take a profile [a_1 .. a_g] of conditional
rates: a_k = P(draft k accepted | drafts 1..k-1 accepted).

Every function validates its input and raises ValueError naming the parameter, the value, the allowed
range and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import numpy as np

# --------------------------------------------------------------------------------------------- validation


def _check_real(name: str, value: object, allowed: str, fix: str) -> float:
    """Return `value` as a finite float, else raise ValueError naming it, the allowed range and the fix."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name}={value!r} is not a number in {allowed}; {fix}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name}={x} is not a finite number in {allowed}; {fix}")
    return x


def check_alpha(value: object, name: str = "alpha") -> float:
    """Return `value` as a float acceptance probability in [0, 1], or raise ValueError."""
    fix = "pass the per-token acceptance probability"
    x = _check_real(name, value, "[0, 1]", fix)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name}={x} is outside [0, 1]; {fix}")
    return x


def check_gamma(value: object, name: str = "gamma") -> int:
    """Return `value` as an int number of draft tokens >= 1, or raise ValueError (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(
            f"{name}={value!r} is not an integer in [1, inf); pass the number of draft tokens per iteration as an int"
        )
    g = int(value)
    if g < 1:
        raise ValueError(f"{name}={g} is outside [1, inf); pass at least 1 draft token per iteration")
    return g


def check_cost(value: object, name: str = "c") -> float:
    """Return `value` as a float cost ratio in [0, inf), or raise ValueError."""
    fix = "pass draft cost / target cost per forward pass (e.g. 8 ms / 40 ms = 0.2)"
    x = _check_real(name, value, "[0, inf)", fix)
    if x < 0.0:
        raise ValueError(f"{name}={x} is outside [0, inf); {fix}")
    return x


def check_profile(rates: object, name: str = "rates") -> list[float]:
    """Return a non-empty sequence of probabilities as a list of floats, or raise ValueError."""
    if isinstance(rates, (str, bytes)) or not isinstance(rates, (Sequence, np.ndarray)):
        raise ValueError(f"{name}={rates!r} is not a sequence; pass a list of per-position rates in [0, 1]")
    if len(rates) == 0:
        raise ValueError(f"{name}=[] is empty; pass one rate in [0, 1] per draft position")
    return [check_alpha(r, f"{name}[{i}]") for i, r in enumerate(rates)]


# --------------------------------------------------------------------------------------------- geometric


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted per iteration, E[T] = (1 - a^(g+1)) / (1 - a), in [1, gamma + 1].

    alpha in [0, 1] (alpha = 1 gives the limit gamma + 1), gamma >= 1 draft tokens. For alpha >= 0.5 it is
    computed with expm1/log1p, so alpha within 1e-12 of 1 stays accurate (the plain formula cancels there).
    """
    a, g = check_alpha(alpha), check_gamma(gamma)
    if a == 0.0:
        return 1.0
    if a == 1.0:
        return float(g + 1)
    if a < 0.5:  # 1 - a >= 0.5 and a^(g+1) <= 0.5^(g+1): the plain formula has no cancellation here
        return (1.0 - a ** (g + 1)) / (1.0 - a)
    one_minus_a = 1.0 - a  # exact for a in [0.5, 1] (Sterbenz lemma)
    return -math.expm1((g + 1) * math.log1p(-one_minus_a)) / one_minus_a


def iteration_cost(gamma: int, c: float) -> float:
    """Walltime of one iteration in target forward passes: g c + 1 (g draft passes, one verify pass)."""
    return check_gamma(gamma) * check_cost(c) + 1.0


def speedup(alpha: float, gamma: int, c: float) -> float:
    """Walltime speedup over plain decoding, S = E[T] / (g c + 1); S < 1 means speculation slows down."""
    return expected_tokens(alpha, gamma) / iteration_cost(gamma, c)


def speedup_over_lengths(alpha: float, steps_by_draft_length: Sequence[int], c: float,
                         verify_cost: Sequence[float] | None = None) -> float:
    """Leviathan's model applied to the draft lengths that ran, and optionally to the hardware's verification cost.

    steps_by_draft_length[k]: how many iterations drafted k tokens (k = 0: a plain target step, 1 token). A lookup
    drafter proposes fewer than gamma tokens when its match runs out, which E[T](a, gamma) ignores. Each
    iteration with k drafts emits E[T](a, k) tokens on average (1 for k = 0) and costs k c + V(k + 1) target
    passes, V(t) being the cost of a t-token target pass in 1-token passes: Leviathan's model takes V = 1 (a
    target with spare parallel compute); verify_cost[t - 1] = V(t), measured, prices it on the machine at hand
    (on a CPU verification grows with t). S = sum_k n_k E[T](a, k) / sum_k n_k (k c + V(k + 1)). With every
    iteration at gamma and V = 1 it equals speedup(alpha, gamma, c).
    """
    a, cost = check_alpha(alpha), check_cost(c)
    counts = list(steps_by_draft_length)
    if not counts or any(isinstance(n, bool) or not isinstance(n, Integral) or n < 0 for n in counts) or sum(counts) == 0:
        raise ValueError(f"steps_by_draft_length={counts!r} must be non-negative integer counts per draft length with at least one step")
    if verify_cost is not None:
        if len(verify_cost) < len(counts):
            raise ValueError(f"verify_cost has {len(verify_cost)} entries: give V(t) for t = 1..{len(counts)} (the longest pass)")
        cost_of = [check_cost(v, f"verify_cost[{i}]") for i, v in enumerate(verify_cost)]
    else:
        cost_of = [1.0] * len(counts)
    tokens = sum(n * (expected_tokens(a, k) if k else 1.0) for k, n in enumerate(counts))
    passes = sum(n * (k * cost + cost_of[k]) for k, n in enumerate(counts))
    return tokens / passes


def c_break(alpha: float, gamma: int) -> float:
    """The draft cost ratio at which speculation breaks even (S = 1): c_break = (E[T] - 1) / g, in [0, 1]."""
    return (expected_tokens(alpha, gamma) - 1.0) / check_gamma(gamma)


def alpha_min(gamma: int, c: float) -> float | None:
    """The acceptance probability in [0, 1) at which S = 1, found with Brent's method.

    S grows with alpha from 1 / (g c + 1) at alpha = 0 to (g + 1) / (g c + 1) at alpha = 1, so:
    c = 0 gives 0.0 (any acceptance helps); c >= 1 gives None (a draft as slow as the target never pays,
    no alpha < 1 reaches S = 1).
    """
    g, cost = check_gamma(gamma), check_cost(c)
    if cost == 0.0:
        return 0.0
    if cost >= 1.0:
        return None
    from scipy.optimize import brentq  # lazy: scipy.optimize costs ~0.5 s of every CLI start

    target = iteration_cost(g, cost)
    root = brentq(lambda a: expected_tokens(a, g) - target, 0.0, 1.0, xtol=1e-14, rtol=4 * np.finfo(float).eps)
    return float(root)


def best_gamma(alpha: float, c: float, gamma_max: int = 16) -> tuple[int, float]:
    """The number of drafts in 1..gamma_max that maximises speedup: (gamma*, S*); ties go to the smaller gamma.

    S* < 1 means no gamma helps at this (alpha, c): turn speculation off.
    """
    a, cost, g_max = check_alpha(alpha), check_cost(c), check_gamma(gamma_max, "gamma_max")
    speedups = [speedup(a, g, cost) for g in range(1, g_max + 1)]
    best = int(np.argmax(speedups))
    return best + 1, speedups[best]


def best_speedup_grid(alphas: Sequence[float], cs: Sequence[float], gamma_max: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised best_gamma over a grid: returns (gamma* [A, C] int, S* [A, C] float) for plots and maps.

    alphas in [0, 1] and cs in [0, inf), each a 1-D sequence; gamma searched over 1..gamma_max.
    """
    a = np.asarray(check_profile(list(alphas), "alphas"))[:, None, None]  # [A, 1, 1]
    c = np.asarray([check_cost(x, f"cs[{i}]") for i, x in enumerate(cs)])[None, :, None]  # [1, C, 1]
    g_max = check_gamma(gamma_max, "gamma_max")
    gammas = np.arange(1, g_max + 1)[None, None, :]  # [1, 1, G]
    powers = a ** np.arange(0, g_max + 1)  # [A, 1, G+1]: a^k
    tokens = np.cumsum(powers, axis=-1)[..., 1:]  # [A, 1, G]: E[T] = sum_{k<=g} a^k (exact, no cancellation)
    speedups = tokens / (gammas * c + 1.0)  # [A, C, G]
    best = speedups.argmax(axis=-1)  # [A, C]
    return best + 1, np.take_along_axis(speedups, best[..., None], axis=-1)[..., 0]


def compute_overhead(alpha: float, gamma: int, c_hat: float) -> float:
    """Arithmetic operations relative to plain decoding (Leviathan Thm 3.11), >= 1 in practice.

    (1 - a)(g c_hat + g + 1) / (1 - a^(g+1)) = (g c_hat + g + 1) / E[T]: every iteration runs g draft passes
    and verifies g + 1 target positions, and emits E[T] tokens. c_hat >= 0 is the draft/target op ratio.
    """
    g, ops = check_gamma(gamma), check_cost(c_hat, "c_hat")
    return (g * ops + g + 1.0) / expected_tokens(alpha, g)


def speedup_lower_bound(alpha: float, c: float) -> float | None:
    """Leviathan Cor. 3.9: if alpha > c, some gamma (gamma = 1 suffices) gives S >= (1 + a) / (1 + c).

    Returns None when alpha <= c, where the corollary promises nothing.
    """
    a, cost = check_alpha(alpha), check_cost(c)
    if a <= cost:
        return None
    return (1.0 + a) / (1.0 + cost)


def c_from_times(draft_ms: float, target_ms: float) -> float:
    """The cost ratio c = draft_ms / target_ms from one draft and one target forward pass, in milliseconds."""
    draft_fix, target_fix = "pass the draft's time per forward pass in ms", "pass the target's time per forward pass in ms"
    draft = _check_real("draft_ms", draft_ms, "[0, inf)", draft_fix)
    target = _check_real("target_ms", target_ms, "(0, inf)", target_fix)
    if draft < 0.0:
        raise ValueError(f"draft_ms={draft} is outside [0, inf); {draft_fix}")
    if target <= 0.0:
        raise ValueError(f"target_ms={target} is outside (0, inf); {target_fix}")
    return draft / target


# ---------------------------------------------------------------------------------- position-dependent


def expected_tokens_profile(conditional_rates: Sequence[float]) -> float:
    """Expected tokens per iteration from conditional rates [a_1 .. a_g]: 1 + sum_k prod_{i<=k} a_i.

    Each a_k in [0, 1]; gamma = len(conditional_rates). A constant profile [a] * g equals expected_tokens(a, g).
    """
    rates = check_profile(conditional_rates, "conditional_rates")
    return 1.0 + math.fsum(np.cumprod(rates))


def speedup_profile(conditional_rates: Sequence[float], c: float) -> float:
    """Walltime speedup from a conditional profile: E[T] / (g c + 1) with g = len(conditional_rates)."""
    return expected_tokens_profile(conditional_rates) / iteration_cost(len(conditional_rates), c)


def marginal_to_conditional(marginal_rates: Sequence[float]) -> list[float]:
    """Convert marginal per-position rates m_k = P(draft k accepted) to conditional rates a_k = m_k / m_{k-1}.

    vLLM exports accepted_tokens_per_pos / num_drafts, which is m_k (marginal: a draft at position k is only
    accepted if all before it were). m must be non-increasing (up to 1e-9 of float noise). Where m_{k-1} = 0
    no draft reached position k and its conditional rate is unknown; it is returned as 0.0, which leaves E[T]
    unchanged.
    """
    marginal = check_profile(marginal_rates, "marginal_rates")
    conditional, previous = [], 1.0
    for k, m in enumerate(marginal):
        if m > previous + 1e-9:
            raise ValueError(
                f"marginal_rates[{k}]={m} exceeds marginal_rates[{k - 1}]={previous}; marginal rates must be "
                "non-increasing (a draft is only accepted after all earlier ones); pass accepted_per_pos / drafts"
            )
        conditional.append(0.0 if previous == 0.0 else min(m / previous, 1.0))
        previous = m
    return conditional


def conditional_to_marginal(conditional_rates: Sequence[float]) -> list[float]:
    """Convert conditional rates [a_1 .. a_g] to marginal rates m_k = prod_{i<=k} a_i (non-increasing)."""
    return [float(m) for m in np.cumprod(check_profile(conditional_rates, "conditional_rates"))]
