"""Markdown tables of several bench_perf.py runs (repeats), with the median of each figure over the runs.

Run: .venv/bin/python bench/perf_summary.py bench/out/perf_run5/run_*.json
Prints, per dtype: per repeat the probe, floor, step and lanes, then the issue's ratios per repeat and their
median, then the theory section's measured / predicted ratios (decode phase and end to end) per lane.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def median(values: list[float]) -> float:
    return statistics.median(values)


def main(paths: list[str]) -> None:
    runs = [(Path(p).stem, json.loads(Path(p).read_text())) for p in paths]
    dtypes = [d for d in runs[0][1]["dtypes"]]
    for dtype in dtypes:
        rows = [(name, run["dtypes"][dtype]) for name, run in runs if dtype in run["dtypes"]]
        print(f"#### {dtype}\n")
        print("| repeat | read GB/s | floor ms | step ms | step / floor | verify(5) / step | own baseline tok/s | transformers greedy tok/s | "
              "own n-gram tok/s | transformers prompt lookup tok/s | own draft model tok/s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in rows:
            f, lanes = r["floor"], r["lanes"]
            speeds = [lanes.get(lane, {}).get("tokens_per_s", float("nan")) for lane in
                      ("own baseline", "transformers greedy", "own n-gram", "transformers prompt lookup", "own draft model")]
            print(f"| {name} | {f['read_gb_s']:.1f} | {f['floor_ms']:.1f} | {f['step_ms']:.1f} | {f['step_over_floor']:.2f}x | "
                  f"{f['verify_over_step']:.2f}x | " + " | ".join(f"{v:.1f}" for v in speeds) + " |")
        ratios = {
            "step / floor (median of the run's rounds)": [r["floor"]["step_over_floor"] for _, r in rows],
            "own baseline / transformers greedy": [r["ratios"]["own baseline / transformers greedy"] for _, r in rows],
            "own n-gram / transformers prompt lookup": [r["ratios"]["own n-gram / transformers prompt lookup"] for _, r in rows],
        }
        for lane in rows[0][1].get("theory", {}):
            for basis in ("decode_phase", "end_to_end"):
                for key in ("leviathan", "lengths", "lengths_and_verify_cost"):
                    ratios[f"{lane}: {basis.replace('_', ' ')} / predicted ({key.replace('_', ' ')})"] = [
                        r["theory"][lane][f"{basis}_over_predicted"][key] for _, r in rows]
        print("\n| ratio | " + " | ".join(name for name, _ in rows) + " | median |")
        print("|---|" + "---|" * (len(rows) + 1))
        for label, values in ratios.items():
            print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + f" | **{median(values):.2f}** |")
        for lane in rows[0][1].get("theory", {}):
            t = [r["theory"][lane] for _, r in rows]
            print(f"\n{lane}: alpha {median([x['alpha'] for x in t]):.3f}, AR {median([x['acceptance_rate'] for x in t]):.3f}, "
                  f"c {median([x['c'] for x in t]):.4f}, AL {median([x['acceptance_length'] for x in t]):.2f} "
                  f"(E[T] at gamma {t[0]['gamma']}: {median([x['expected_tokens_at_gamma'] for x in t]):.2f}), mean draft length "
                  f"{median([x['mean_draft_length'] for x in t]):.2f}, steps by draft length {t[0]['steps_by_draft_length']}; "
                  f"measured decode-phase speedup {median([x['measured']['decode_phase'] for x in t]):.2f}x, end to end "
                  f"{median([x['measured']['end_to_end'] for x in t]):.2f}x; predicted: Leviathan {median([x['predicted']['leviathan'] for x in t]):.2f}x, "
                  f"over the lengths {median([x['predicted']['lengths'] for x in t]):.2f}x, with V(t) "
                  f"{median([x['predicted']['lengths_and_verify_cost'] for x in t]):.2f}x; same tokens as the baseline: "
                  f"{all(x['same_tokens_as_baseline'] for x in t)}")
        v = [r["verification_cost"]["over_one_token"] for _, r in rows if "verification_cost" in r]
        if v:
            print("\nV(t), median over repeats: " + ", ".join(f"t={t + 1} {median([x[t] for x in v]):.2f}" for t in range(len(v[0]))))
        print()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: perf_summary.py RUN.json [RUN.json ...] (bench_perf.py --json-out files)")
    main(sys.argv[1:])
