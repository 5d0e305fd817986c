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
burst moves a point 10-25%); the interval says how far the repeats pooled can. `--lanes "fixed g=2,fixed g=4,fixed
g=8,adaptive"` judges among those lanes only, so that files run with different lanes pool.

Twin controls: a run with a tagged twin lane (bench_serving.py --lanes ...,fixed=4,fixed=4#b: a second scheduler of
the same setting) prints the twin / its setting judged the same way, the judge's own noise on this host. In the
goal a twin pools with its setting (more of one setting's windows), it is not one more candidate.
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


def base_lane(lane: str) -> str:
    """'fixed g=4 #b' -> 'fixed g=4': a tagged lane is a second scheduler of the same setting (bench_serving.py's
    lane 'fixed=4#b'), run as a control of the judge."""
    return lane.partition(" #")[0]


def window_pieces(point: list[dict], repeats: list[int], rename=base_lane) -> list[dict]:
    """Each point's steady-state window as one slice (bench_slices.summarize's input), its lane renamed."""
    return [
        {"lane": rename(row["lane"]), "round": row["repeat"], "tokens": row["throughput_tok_s"] * row["window_s"], "wall_s": row["window_s"],
         "steps": row.get("window_steps", 0)}
        for row in point if row["repeat"] in repeats
    ]


def complete_repeats(point: list[dict], lanes: list[str]) -> list[int]:
    return sorted(r for r in {row["repeat"] for row in point} if all(any(x["lane"] == lane and x["repeat"] == r for x in point) for lane in lanes))


def pooled_goals(rows: list[dict], lanes: list[str] | None = None) -> list[str]:
    """Per concurrency: adaptive / the best other lane over the pooled steady-state windows, with a bootstrap
    interval over repeats and the held-out figure (bench_slices.summarize on the points as slices). Only the
    repeats that ran every lane at that concurrency count (`lanes`: judge among these only, so that files with
    different lane sets pool); a concurrency without an adaptive lane is skipped. A tagged twin ('fixed g=4 #b')
    counts as more of its setting (its windows pool with the untagged lane's), not as one more candidate: two
    noisy readings of one setting would raise the best-of maximum the judge divides by."""
    from bench_slices import summarize  # bench_slices imports this module's sibling bench_serving: import late

    lines = []
    for concurrency in sorted({row["concurrency"] for row in rows}):
        point = [row for row in rows if row["concurrency"] == concurrency and row.get("window_s") and (lanes is None or base_lane(row["lane"]) in lanes)]
        present = list(dict.fromkeys(row["lane"] for row in point))
        judged = list(dict.fromkeys(base_lane(lane) for lane in present))
        if "adaptive" not in judged or len(judged) < 2:
            continue
        repeats = complete_repeats(point, judged)
        if not repeats:
            continue
        summary = summarize(window_pieces(point, repeats), judged, repeats)
        low, high = summary["ci95"]
        text = (f"C={concurrency}: adaptive / best other ({summary['best_other']}) = {summary['ratio']:.3f} [{low:.2f}-{high:.2f}] "
                f"pooled over {len(repeats)} repeats")
        if "held_out" in summary:
            held = summary["held_out"]
            text += f"; held out {held['ratio']:.3f} [{held['ci95'][0]:.2f}-{held['ci95'][1]:.2f}]"
        lines.append(f"{text} {'met' if summary['met'] else 'MISSED'} (goal >= 0.95)")
    return lines


def twin_controls(rows: list[dict]) -> list[str]:
    """The judge's own noise: a tagged twin of a fixed setting against that setting, as the goal is judged (pooled
    windows, bootstrap over the repeats that ran both). Two schedulers of one policy differ only by noise and by
    the lanes they ran after, so this ratio's distance from 1 is what the host alone can do to adaptive / best."""
    from bench_slices import summarize

    lines = []
    for concurrency in sorted({row["concurrency"] for row in rows}):
        point = [row for row in rows if row["concurrency"] == concurrency and row.get("window_s")]
        for twin in sorted({row["lane"] for row in point if " #" in row["lane"]}):
            pair = [row for row in point if row["lane"] in (twin, base_lane(twin))]
            repeats = complete_repeats(pair, [twin, base_lane(twin)])
            if base_lane(twin) == twin or len(repeats) < 2:
                continue
            summary = summarize(window_pieces(pair, repeats, rename=lambda lane: "adaptive" if lane == twin else lane), ["adaptive", base_lane(twin)], repeats)
            low, high = summary["ci95"]
            lines.append(f"C={concurrency}: {twin} / {base_lane(twin)} = {summary['ratio']:.3f} [{low:.2f}-{high:.2f}] over {len(repeats)} repeats "
                         f"(paired median {summary['paired_median']:.3f}, range {min(summary['paired_ratios']):.2f}-{max(summary['paired_ratios']):.2f})")
    return lines


def forward_lines(rows: list[dict]) -> list[str]:
    """Per concurrency and lane: the width its full-batch steps ran most (over the repeats), and the median target
    forward at that width per repeat (bench_serving's by_width_at_max_batch), with their mean: whether one lane's
    forwards of a shape run slower than another's (the order A/B of run 35)."""
    lines = []
    for concurrency in sorted({row["concurrency"] for row in rows}):
        point = [row for row in rows if row["concurrency"] == concurrency and (row.get("steps") or {}).get("by_width_at_max_batch")]
        for lane in sorted({row["lane"] for row in point}, key=lane_rank):
            mine = sorted((row for row in point if row["lane"] == lane), key=lambda row: row["repeat"])
            counts: dict[str, int] = {}
            for row in mine:
                for width, cell in row["steps"]["by_width_at_max_batch"].items():
                    counts[width] = counts.get(width, 0) + cell["count"]
            width = max(counts, key=lambda w: (counts[w], -int(w)))
            forwards = [row["steps"]["by_width_at_max_batch"][width]["forward_ms_p50"] for row in mine if width in row["steps"]["by_width_at_max_batch"]]
            lines.append(f"C={concurrency} {lane}: width {width} ({counts[width]} of {sum(counts.values())} full-batch steps), forward p50 per repeat "
                         f"{', '.join(f'{f:.1f}' for f in forwards)} ms, mean {sum(forwards) / len(forwards):.1f}")
    return lines


def lane_rank(lane: str) -> tuple[int, int, str]:
    """off, then fixed gammas in increasing order (a twin after its setting), then the rest (table, adaptive)."""
    base, _, tag = lane.partition(" #")
    if base == "off":
        return (0, 0, tag)
    if base.startswith("fixed g="):
        return (1, int(base.removeprefix("fixed g=")), tag)
    return (2, 0, tag)


def judge_rows(rows: list[dict], lane: str) -> list[dict]:
    """Judge another adaptive variant ('adaptive prior=1', bench_serving.py's lane adaptive:prior=1) as the goal
    judges adaptive: its rows are labelled 'adaptive', and the default adaptive lane's 'adaptive (default)', a
    candidate like any other unless --lanes leaves it out."""
    if not any(row["lane"] == lane for row in rows):
        raise SystemExit(f"--judge {lane!r}: no such lane in the results (lanes: {sorted({row['lane'] for row in rows})})")
    rename = {lane: "adaptive", "adaptive": "adaptive (default)"}
    return [{**row, "lane": rename.get(row["lane"], row["lane"])} for row in rows]


def main(argv: list[str]) -> None:
    lanes, judge = None, None
    while argv[:1] in (["--lanes"], ["--judge"]) and len(argv) > 1:
        if argv[0] == "--lanes":
            lanes = argv[1].split(",")
        else:
            judge = argv[1]
        argv = argv[2:]
    paths = argv
    if not paths:
        raise SystemExit('usage: serving_table.py [--lanes "fixed g=2,fixed g=4,adaptive"] [--judge "adaptive prior=1"] RESULTS.json [RESULTS.json ...] '
                         "(bench_serving.py's --out directories)")
    rows = pooled_rows(paths)
    if judge:
        rows = judge_rows(rows, judge)
        print(f"(judging {judge} as adaptive)")
    summary = aggregate(rows)
    summary.sort(key=lambda r: (lane_rank(r["lane"]), r["concurrency"]))
    print("\n".join(table(summary)))
    print()
    for line in goals(rows, summary)[0]:
        print(f"- {line}")
    print()
    print("Pooled windows (tokens / seconds over the repeats), 95% bootstrap interval over repeats:")
    if lanes:
        print(f"(judged among {', '.join(lanes)} only)")
    for line in pooled_goals(rows, lanes):
        print(f"- {line}")
    for title, lines in (("Target forwards at each lane's most-run full-batch width (medians per repeat):", forward_lines(rows)),
                         ("Twin controls (one setting on two schedulers, judged the same way):", twin_controls(rows))):
        if lines:
            print(f"\n{title}")
            print("\n".join(f"- {line}" for line in lines))


if __name__ == "__main__":
    main(sys.argv[1:])
