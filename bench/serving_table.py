"""Markdown table and goals of one or more bench_serving.py runs (results.json), for docs/BENCHMARKS.md.

Run: .venv/bin/python bench/serving_table.py bench/out/serving_low_run5/results.json bench/out/serving_high_run5/results.json
Rows of several files are pooled; a file's repeats are numbered after the previous file's, so that paired ratios
pair only points that ran back to back. Columns as bench_serving.py's console table (medians over repeats,
min-max for throughput; x off = median ratio to the off lane at that concurrency).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import aggregate, goals  # noqa: E402


def pooled_rows(paths: list[str]) -> list[dict]:
    rows: list[dict] = []
    offset = 0
    for path in paths:
        record = json.loads(Path(path).read_text())
        repeats = [row["repeat"] for row in record["rows"]]
        rows += [{**row, "repeat": row["repeat"] + offset} for row in record["rows"]]
        offset += max(repeats) + 1 if repeats else 0
    return rows


def table(summary: list[dict]) -> list[str]:
    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value["median"] if isinstance(value, dict) else value, spec)

    baseline = {r["concurrency"]: r["throughput_tok_s"]["median"] for r in summary if r["lane"] == "off"}
    lines = ["| lane | C | tok/s median [min-max] | x off | TTFT p50 / p95 ms | ITL p50 / p95 ms | TPOT ms | AR | mean gamma |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        speed = r["throughput_tok_s"]
        ratio = speed["median"] / baseline[r["concurrency"]] if r["concurrency"] in baseline else None
        lines.append(
            f"| {r['lane']} | {r['concurrency']} | {speed['median']:.1f} [{speed['min']:.1f}-{speed['max']:.1f}] | {fmt(ratio, '.2f')} | "
            f"{fmt(r['ttft_p50_ms'], '.0f')} / {fmt(r['ttft_p95_ms'], '.0f')} | {fmt(r['itl_p50_ms'], '.0f')} / {fmt(r['itl_p95_ms'], '.0f')} | "
            f"{fmt(r['tpot_mean_ms'])} | {fmt(r['acceptance_rate'], '.2f')} | {fmt(r['mean_gamma'], '.2f')} |"
        )
    return lines


def lane_rank(lane: str) -> tuple[int, int]:
    """off, then fixed gammas in increasing order, then the rest (table, adaptive)."""
    if lane == "off":
        return (0, 0)
    if lane.startswith("fixed g="):
        return (1, int(lane.removeprefix("fixed g=")))
    return (2, 0)


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit("usage: serving_table.py RESULTS.json [RESULTS.json ...] (bench_serving.py's --out directories)")
    rows = pooled_rows(paths)
    summary = aggregate(rows)
    summary.sort(key=lambda r: (lane_rank(r["lane"]), r["concurrency"]))
    print("\n".join(table(summary)))
    print()
    for line in goals(rows, summary)[0]:
        print(f"- {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
