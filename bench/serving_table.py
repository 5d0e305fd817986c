"""Markdown table and goals of one or more bench_serving.py runs (results.json), for docs/BENCHMARKS.md.

Run: .venv/bin/python bench/serving_table.py bench/out/serving_low_run5/results.json bench/out/serving_high_run5/results.json
Rows of several files are pooled; a file's repeats are numbered after the previous file's, so that paired ratios
pair only points that ran back to back. Columns as bench_serving.py's console table (medians over repeats,
min-max for throughput; x off = median ratio to the off lane at that concurrency).

Then the goal judged as bench_slices.py judges it (pooled_goals): each point's steady-state window (its tokens
over its seconds) stands for one slice and each repeat for one round, so adaptive / the best other lane is a
ratio of pooled throughputs with a 95% bootstrap interval over repeats (the lanes of one repeat resampled
together: they ran minutes apart), and the same against the best lane chosen without the repeat it is judged on
(held out). Three repeats of a ~3 s window cannot place a ratio within 0.95's neighbourhood on this host (one
burst moves a point 10-25%); the interval says how far the repeats pooled can.
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


def pooled_goals(rows: list[dict]) -> list[str]:
    """Per concurrency: adaptive / the best other lane over the pooled steady-state windows, with a bootstrap
    interval over repeats and the held-out figure (bench_slices.summarize on the points as slices). Only the
    repeats that ran every lane at that concurrency count; a concurrency without an adaptive lane is skipped."""
    from bench_slices import summarize  # bench_slices imports this module's sibling bench_serving: import late

    lines = []
    for concurrency in sorted({row["concurrency"] for row in rows}):
        point = [row for row in rows if row["concurrency"] == concurrency and row.get("window_s")]
        lanes = list(dict.fromkeys(row["lane"] for row in point))
        if "adaptive" not in lanes or len(lanes) < 2:
            continue
        repeats = sorted(r for r in {row["repeat"] for row in point} if all(any(x["lane"] == lane and x["repeat"] == r for x in point) for lane in lanes))
        if not repeats:
            continue
        pieces = [
            {"lane": row["lane"], "round": row["repeat"], "tokens": row["throughput_tok_s"] * row["window_s"], "wall_s": row["window_s"],
             "steps": row.get("window_steps", 0)}
            for row in point if row["repeat"] in repeats
        ]
        summary = summarize(pieces, lanes, repeats)
        low, high = summary["ci95"]
        text = (f"C={concurrency}: adaptive / best other ({summary['best_other']}) = {summary['ratio']:.3f} [{low:.2f}-{high:.2f}] "
                f"pooled over {len(repeats)} repeats")
        if "held_out" in summary:
            held = summary["held_out"]
            text += f"; held out {held['ratio']:.3f} [{held['ci95'][0]:.2f}-{held['ci95'][1]:.2f}]"
        lines.append(f"{text} {'met' if summary['met'] else 'MISSED'} (goal >= 0.95)")
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
    print()
    print("Pooled windows (tokens / seconds over the repeats), 95% bootstrap interval over repeats:")
    for line in pooled_goals(rows):
        print(f"- {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
