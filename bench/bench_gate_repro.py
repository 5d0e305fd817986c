"""Does the gate's verdict reproduce? Runs `specgate gate ARGS` --runs times in a row and prints each run's verdict
and the recommendation's throughput-ratio intervals, then whether they agree (the method: specgate.bench.repro).

    PYTHONPATH=src python bench/bench_gate_repro.py --runs 3 -- --quick
    PYTHONPATH=src python bench/bench_gate_repro.py --runs 3 -- --engine llama.cpp --quick
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from specgate.bench import repro

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/out/gate-repro", help="each run's report goes to OUT/run-N; the summary to OUT/summary.json")
    parser.add_argument("--label", default="quick")
    parser.add_argument("gate_args", nargs=argparse.REMAINDER, help="the gate's arguments, after --")
    args = parser.parse_args()
    gate_args = [a for a in args.gate_args if a != "--"]
    out = Path(args.out)
    rows = []
    for i in range(1, args.runs + 1):
        rows.append(repro.run_once(gate_args, out / f"run-{i}"))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"command": "specgate gate " + " ".join(gate_args), "runs": rows, **repro.agreement(rows)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(repro.table(args.label, rows)))
    print(f"same verdict: {summary['same_verdict']}; target intervals overlap: {summary['intervals_overlap']}")


if __name__ == "__main__":
    main()
