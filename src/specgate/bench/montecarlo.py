"""Monte Carlo throughput (bench/bench_montecarlo.py): the lesson's pure-Python loop against specgate.simulate.

Both simulate the same draft-verify process (same alpha, gamma). Runs alternate (python, numpy, python, ...) so
both see the same machine noise; the figure is the ratio of median iterations per second. Both acceptance lengths
are reported beside the closed form as a check that the two did the same work.
"""

from __future__ import annotations

import platform
import random
import time
from typing import Any, Callable

from specgate import theory
from specgate.bench.timing import median
from specgate.simulate import simulate

PYTHON_CHUNK = 100_000  # iterations between progress updates of the pure-Python loop
Advance = Callable[[int], None]


def textbook_loop(iterations: int, alpha: float, gamma: int) -> int:
    """The lesson's loop, verbatim: returns tokens emitted over `iterations` iterations."""
    tokens = 0
    for _ in range(iterations):
        accepted = 0
        for _ in range(gamma):
            if random.random() < alpha:
                accepted += 1
            else:
                break
        tokens += accepted + 1
    return tokens


def time_python(iterations: int, alpha: float, gamma: int, advance: Advance = lambda n: None) -> tuple[float, float]:
    """(seconds, mean tokens per iteration) of the pure-Python loop."""
    tokens, done = 0, 0
    start = time.perf_counter()
    while done < iterations:
        n = min(PYTHON_CHUNK, iterations - done)
        tokens += textbook_loop(n, alpha, gamma)
        done += n
        advance(n)
    return time.perf_counter() - start, tokens / iterations


def time_numpy(iterations: int, alpha: float, gamma: int, seed: int, advance: Advance = lambda n: None) -> tuple[float, float]:
    """(seconds, mean tokens per iteration) of specgate.simulate."""
    reported = [0]

    def on_progress(done: int) -> None:
        advance(done - reported[0])
        reported[0] = done

    start = time.perf_counter()
    result = simulate(alpha, gamma, c=0.0, iterations=iterations, seed=seed, on_progress=on_progress)
    return time.perf_counter() - start, result.acceptance_length


def alternating_runs(alpha: float, gamma: int, python_iterations: int, numpy_iterations: int, repeats: int, seed: int,
                     lane: Callable[[str, int, int], Advance] = lambda name, repeat, total: (lambda n: None)) -> dict[str, list[tuple[float, float]]]:
    """`repeats` runs of each, alternating python, numpy, python, ...: name -> [(seconds, acceptance length)] per run.
    lane(name, repeat, total) is called before each run and returns its progress callback."""
    random.seed(seed)
    runs: dict[str, list[tuple[float, float]]] = {"python": [], "numpy": []}
    for repeat in range(repeats):
        runs["python"].append(time_python(python_iterations, alpha, gamma, lane("python", repeat, python_iterations)))
        runs["numpy"].append(time_numpy(numpy_iterations, alpha, gamma, seed + repeat, lane("numpy", repeat, numpy_iterations)))
    return runs


def montecarlo_report(runs: dict[str, list[tuple[float, float]]], alpha: float, gamma: int, python_iterations: int, numpy_iterations: int) -> dict[str, Any]:
    """The JSON record: median and range of iterations/s of each, the ratio of medians, the acceptance lengths."""
    python_rate = [python_iterations / s for s, _ in runs["python"]]
    numpy_rate = [numpy_iterations / s for s, _ in runs["numpy"]]
    return {
        "alpha": alpha,
        "gamma": gamma,
        "repeats": len(python_rate),
        "python_iterations_per_run": python_iterations,
        "numpy_iterations_per_run": numpy_iterations,
        "python_iterations_per_s_median": median(python_rate),
        "numpy_iterations_per_s_median": median(numpy_rate),
        "python_iterations_per_s_range": [min(python_rate), max(python_rate)],
        "numpy_iterations_per_s_range": [min(numpy_rate), max(numpy_rate)],
        "ratio_of_medians": median(numpy_rate) / median(python_rate),
        "python_acceptance_length": sum(al for _, al in runs["python"]) / len(runs["python"]),
        "numpy_acceptance_length": sum(al for _, al in runs["numpy"]) / len(runs["numpy"]),
        "closed_form_expected_tokens": theory.expected_tokens(alpha, gamma),
        "machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
    }


def montecarlo_table(report: dict[str, Any]) -> Any:
    """The rich table the script prints: per implementation iterations/run, median, range, mean AL; the ratio."""
    from rich.table import Table

    table = Table(title=f"Monte Carlo throughput, alpha={report['alpha']:g}, gamma={report['gamma']}, {report['repeats']} alternating runs each")
    for name in ("implementation", "iterations/run", "median", "min..max", "mean AL"):
        table.add_column(name, justify="left" if name == "implementation" else "right", no_wrap=True)
    for name, key in (("pure-Python loop", "python"), ("specgate.simulate", "numpy")):
        low, high = report[f"{key}_iterations_per_s_range"]
        table.add_row(name, f"{report[f'{key}_iterations_per_run']:,}", f"{report[f'{key}_iterations_per_s_median'] / 1e6:.2f} M it/s",
                      f"{low / 1e6:.2f}..{high / 1e6:.2f}", f"{report[f'{key}_acceptance_length']:.4f}")
    table.caption = (f"ratio of medians: {report['ratio_of_medians']:.1f}x (goal >= 30x); "
                     f"closed form E[T] = {report['closed_form_expected_tokens']:.4f}")
    return table
