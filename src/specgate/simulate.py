"""A vectorised Monte Carlo of the draft-verify loop, the empirical check on specgate.theory.

Each simulated iteration drafts gamma tokens; draft k is accepted with its conditional rate a_k if all
drafts before it were accepted, and the iteration emits (accepted drafts + 1) tokens (the target's bonus or
correction token). A geometric alpha is the constant profile [alpha] * gamma.

The loop runs over draft positions, never over iterations: a chunk of iterations draws a [gamma, N] block of
32-bit uniforms, keeps a [N] mask of rows whose drafts are all accepted so far, and counts the survivors
after each position. Survivor counts give the histogram of tokens per iteration exactly, and the histogram
gives the mean and its confidence interval. Chunks bound memory; the result depends only on the seed, the
inputs and chunk_iterations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from numbers import Integral

import numpy as np

from specgate import theory

Z_95 = 1.959963984540054  # standard normal quantile 0.975, for the two-sided 95% interval
_UNIFORM_BITS = 32  # acceptance thresholds are quantised to 2^-32 (bias < 2.4e-10 per rate)
DEFAULT_CHUNK_ITERATIONS = 1 << 16  # [gamma, 65536] uint32 = 256 KiB per position: stays in cache


@dataclass(frozen=True)
class SimulationResult:
    """What one Monte Carlo run measured.

    acceptance_length: mean tokens emitted per iteration, in [1, gamma + 1].
    acceptance_length_ci95: (lo, hi) two-sided 95% normal-approximation interval of that mean (tokens are
        bounded, so the CLT interval is accurate from a few hundred iterations).
    speedup: modelled walltime speedup acceptance_length / (gamma c + 1).
    iterations: simulated draft-verify iterations.
    histogram: counts of iterations that emitted 1, 2, ..., gamma + 1 tokens (sums to iterations).
    """

    acceptance_length: float
    acceptance_length_ci95: tuple[float, float]
    speedup: float
    iterations: int
    histogram: tuple[int, ...]
    gamma: int
    c: float
    conditional_rates: tuple[float, ...]
    seed: int | None

    def to_dict(self) -> dict:
        """A JSON-ready dict (tuples become lists)."""
        out = asdict(self)
        out["acceptance_length_ci95"] = list(self.acceptance_length_ci95)
        out["histogram"] = list(self.histogram)
        out["conditional_rates"] = list(self.conditional_rates)
        return out


def _check_count(name: str, value: object, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name}={value!r} is not an integer in [{minimum}, inf); {fix}")
    if int(value) < minimum:
        raise ValueError(f"{name}={int(value)} is outside [{minimum}, inf); {fix}")
    return int(value)


def _resolve_rates(alpha: float | None, gamma: int | None, profile: Sequence[float] | None) -> list[float]:
    """The conditional rates [a_1 .. a_g] of either a geometric alpha with gamma, or a profile."""
    if (alpha is None) == (profile is None):
        raise ValueError(
            "alpha and profile: pass exactly one (alpha=<probability> with gamma, or profile=[a_1, .., a_g])"
        )
    if profile is not None:
        rates = theory.check_profile(profile, "profile")
        if gamma is not None and theory.check_gamma(gamma) != len(rates):
            raise ValueError(
                f"gamma={gamma} does not match the profile's {len(rates)} positions; omit gamma or pass gamma={len(rates)}"
            )
        return rates
    if gamma is None:
        raise ValueError("gamma=None is outside [1, inf); pass the number of draft tokens per iteration with alpha")
    return [theory.check_alpha(alpha)] * theory.check_gamma(gamma)


def _survivors(rng: np.random.Generator, thresholds: list[int], n: int) -> np.ndarray:
    """Simulate n iterations; entry k of the result counts iterations whose first k+1 drafts were accepted."""
    g = len(thresholds)
    uniforms = rng.bit_generator.random_raw((g * n + 1) // 2).view(np.uint32)[: g * n].reshape(g, n)  # [G, N]
    survivors = np.zeros(g, dtype=np.int64)  # [G]
    alive = np.ones(n, dtype=bool)  # [N]: every draft so far accepted
    accepted = np.empty(n, dtype=bool)  # [N]
    for k, threshold in enumerate(thresholds):
        if threshold < (1 << _UNIFORM_BITS):  # rate 1 accepts every row: nothing to compare
            np.less(uniforms[k], np.uint32(threshold), out=accepted)
            np.logical_and(alive, accepted, out=alive)
        survivors[k] = np.count_nonzero(alive)
        if survivors[k] == 0:  # later positions have no survivors either
            break
    return survivors


def simulate(
    alpha: float | None = None,
    gamma: int | None = None,
    c: float = 0.0,
    iterations: int = 100_000,
    seed: int | None = 0,
    *,
    profile: Sequence[float] | None = None,
    chunk_iterations: int = DEFAULT_CHUNK_ITERATIONS,
    on_progress: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Monte Carlo of `iterations` draft-verify iterations.

    Pass either alpha in [0, 1] with gamma >= 1 (geometric acceptance), or profile = conditional rates
    [a_1 .. a_g] in [0, 1] (gamma then defaults to len(profile)). c >= 0 is the draft/target cost ratio used
    for the modelled speedup. iterations >= 2; seed an int >= 0 (None draws fresh entropy). Memory is bounded
    by chunk_iterations x gamma x 4 bytes; on_progress(n) is called with the iterations done after each chunk.
    """
    rates = _resolve_rates(alpha, gamma, profile)
    g = len(rates)
    cost = theory.check_cost(c)
    n_total = _check_count("iterations", iterations, 2, "pass at least 2 iterations (100000 gives AL to ~0.01)")
    chunk = _check_count("chunk_iterations", chunk_iterations, 1, "pass a positive chunk size")
    if seed is not None:
        _check_count("seed", seed, 0, "pass a non-negative int, or None for fresh entropy")

    # P(u < floor(a 2^32)) = floor(a 2^32) / 2^32 for a 32-bit uniform u: a Bernoulli(a) up to 2^-32.
    thresholds = [int(math.floor(a * (1 << _UNIFORM_BITS))) for a in rates]
    rng = np.random.default_rng(seed)
    survivors = np.zeros(g, dtype=np.int64)  # [G]
    done = 0
    while done < n_total:
        n = min(chunk, n_total - done)
        survivors += _survivors(rng, thresholds, n)
        done += n
        if on_progress is not None:
            on_progress(done)

    # tokens = 1 + accepted drafts: histogram[j] counts iterations emitting j + 1 tokens.
    reached = np.concatenate([[n_total], survivors, [0]])  # [G+2]: iterations with >= j accepted drafts
    histogram = reached[:-1] - reached[1:]  # [G+1]
    tokens = np.arange(1, g + 2, dtype=np.float64)  # [G+1]
    mean = float(np.dot(histogram, tokens)) / n_total
    variance = float(np.dot(histogram, (tokens - mean) ** 2)) / (n_total - 1)
    half_width = Z_95 * math.sqrt(variance / n_total)
    return SimulationResult(
        acceptance_length=mean,
        acceptance_length_ci95=(mean - half_width, mean + half_width),
        speedup=mean / theory.iteration_cost(g, cost),
        iterations=n_total,
        histogram=tuple(int(h) for h in histogram),
        gamma=g,
        c=cost,
        conditional_rates=tuple(rates),
        seed=seed,
    )
