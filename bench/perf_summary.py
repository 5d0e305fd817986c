"""Markdown tables of several bench_perf.py runs (repeats), with the median of each figure over the runs.

Run: .venv/bin/python bench/perf_summary.py out/perf/run_a.json out/perf/run_b.json out/perf/run_c.json
Prints, per dtype: per repeat the probe, floor, step and lanes, then the issue's ratios per repeat and their
median, then the theory section's measured / predicted ratios per lane (specgate.bench.tables.perf_summary).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specgate.bench.tables import perf_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN.json", help="bench_perf.py --json-out files, one per repeat")
    args = parser.parse_args()
    print("\n".join(perf_summary([(path.stem, json.loads(path.read_text())) for path in args.runs])))


if __name__ == "__main__":
    main()
