"""Monte Carlo throughput: the lesson's pure-Python loop against specgate.simulate, in one process.

    .venv/bin/python bench/bench_montecarlo.py [--alpha 0.7] [--gamma 4] [--repeats 5] [--json]

Both simulate the same draft-verify process (same alpha, gamma). Runs alternate (python, numpy, python, ...)
so both see the same machine noise; the reported figure is the ratio of median iterations per second.
Both acceptance lengths are printed beside the closed form as a check that the two did the same work.
The method: specgate.bench.montecarlo.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specgate import theory
from specgate.bench.montecarlo import alternating_runs, montecarlo_report, montecarlo_table

NAMES = {"python": "pure Python", "numpy": "specgate.simulate"}


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
    console = Console(stderr=args.json)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:

        def lane(name: str, repeat: int, total: int):
            for task in progress.task_ids:
                progress.remove_task(task)
            task = progress.add_task(f"{NAMES[name]}, run {repeat + 1}/{args.repeats}", total=total)
            return lambda n: progress.advance(task, n)

        runs = alternating_runs(alpha, gamma, args.python_iterations, args.numpy_iterations, args.repeats, args.seed, lane)
    report = montecarlo_report(runs, alpha, gamma, args.python_iterations, args.numpy_iterations)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    console.print(montecarlo_table(report))


if __name__ == "__main__":
    main()
