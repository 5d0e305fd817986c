"""Monte Carlo throughput: the lesson's pure-Python loop against specgate.simulate, in one process.

    .venv/bin/python bench/bench_montecarlo.py [--alpha 0.7] [--gamma 4] [--repeats 5] [--json]

Both simulate the same draft-verify process (same alpha, gamma). Runs alternate (python, numpy, python, ...)
so both see the same machine noise; the reported figure is the ratio of median iterations per second.
Both acceptance lengths are printed beside the closed form as a check that the two did the same work.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specgate import theory
from specgate.simulate import simulate

PYTHON_CHUNK = 100_000  # iterations between progress updates of the pure-Python loop


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


def time_python(iterations: int, alpha: float, gamma: int, advance) -> tuple[float, float]:
    """(seconds, mean tokens per iteration) of the pure-Python loop."""
    tokens, done = 0, 0
    start = time.perf_counter()
    while done < iterations:
        n = min(PYTHON_CHUNK, iterations - done)
        tokens += textbook_loop(n, alpha, gamma)
        done += n
        advance(n)
    return time.perf_counter() - start, tokens / iterations


def time_numpy(iterations: int, alpha: float, gamma: int, seed: int, advance) -> tuple[float, float]:
    """(seconds, mean tokens per iteration) of specgate.simulate."""
    reported = [0]

    def on_progress(done: int) -> None:
        advance(done - reported[0])
        reported[0] = done

    start = time.perf_counter()
    result = simulate(alpha, gamma, c=0.0, iterations=iterations, seed=seed, on_progress=on_progress)
    return time.perf_counter() - start, result.acceptance_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--python-iterations", type=int, default=2_000_000)
    parser.add_argument("--numpy-iterations", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    alpha, gamma = theory.check_alpha(args.alpha), theory.check_gamma(args.gamma)
    random.seed(args.seed)
    console = Console(stderr=args.json)

    python_s, numpy_s, python_al, numpy_al = [], [], [], []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        for repeat in range(args.repeats):
            task = progress.add_task(f"pure Python, run {repeat + 1}/{args.repeats}", total=args.python_iterations)
            seconds, al = time_python(args.python_iterations, alpha, gamma, lambda n: progress.advance(task, n))
            python_s.append(seconds), python_al.append(al)
            progress.remove_task(task)
            task = progress.add_task(f"specgate.simulate, run {repeat + 1}/{args.repeats}", total=args.numpy_iterations)
            seconds, al = time_numpy(args.numpy_iterations, alpha, gamma, args.seed + repeat, lambda n: progress.advance(task, n))
            numpy_s.append(seconds), numpy_al.append(al)
            progress.remove_task(task)

    python_rate = [args.python_iterations / s for s in python_s]
    numpy_rate = [args.numpy_iterations / s for s in numpy_s]
    report = {
        "alpha": alpha,
        "gamma": gamma,
        "repeats": args.repeats,
        "python_iterations_per_run": args.python_iterations,
        "numpy_iterations_per_run": args.numpy_iterations,
        "python_iterations_per_s_median": statistics.median(python_rate),
        "numpy_iterations_per_s_median": statistics.median(numpy_rate),
        "python_iterations_per_s_range": [min(python_rate), max(python_rate)],
        "numpy_iterations_per_s_range": [min(numpy_rate), max(numpy_rate)],
        "ratio_of_medians": statistics.median(numpy_rate) / statistics.median(python_rate),
        "python_acceptance_length": statistics.fmean(python_al),
        "numpy_acceptance_length": statistics.fmean(numpy_al),
        "closed_form_expected_tokens": theory.expected_tokens(alpha, gamma),
        "machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    table = Table(title=f"Monte Carlo throughput, alpha={alpha:g}, gamma={gamma}, {args.repeats} alternating runs each")
    for name in ("implementation", "iterations/run", "median", "min..max", "mean AL"):
        table.add_column(name, justify="left" if name == "implementation" else "right", no_wrap=True)
    for name, per_run, rates, al in (
        ("pure-Python loop", args.python_iterations, python_rate, report["python_acceptance_length"]),
        ("specgate.simulate", args.numpy_iterations, numpy_rate, report["numpy_acceptance_length"]),
    ):
        table.add_row(
            name, f"{per_run:,}", f"{statistics.median(rates) / 1e6:.2f} M it/s",
            f"{min(rates) / 1e6:.2f}..{max(rates) / 1e6:.2f}", f"{al:.4f}",
        )
    table.caption = (
        f"ratio of medians: {report['ratio_of_medians']:.1f}x (goal >= 30x); "
        f"closed form E[T] = {report['closed_form_expected_tokens']:.4f}"
    )
    console.print(table)


if __name__ == "__main__":
    main()
