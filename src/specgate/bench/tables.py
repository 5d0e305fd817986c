"""Markdown tables and plots of benchmark results: the lockstep sweep (per lane, per step shape, the verdict per
concurrency, a two-panel plot) and several bench_perf.py runs summarised with their medians."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

LOCKSTEP_TITLES = ("throughput (tokens/s), each lane its own server, stepped in lockstep",
                   "adaptive / best other lane (95% bootstrap CI over blocks)")


def ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def held_out_text(summary: dict) -> str:
    if "held_out" not in summary:
        return ""
    h = summary["held_out"]
    picks = ", ".join(f"{lane} {n}" for lane, n in h["picks"].items())
    return (f"; against the best other chosen on the other rounds ({picks} rounds): {h['ratio']:.3f}x "
            f"[{h['ci95'][0]:.3f}-{h['ci95'][1]:.3f}] {'met' if h['met'] else 'MISSED'}")


def verdict_line(concurrency: int, summary: dict) -> str:
    """One line per concurrency: throughput per lane, adaptive / best other with its interval and the held-out
    figure, ITL adaptive / that lane, and every twin's control."""
    speeds = ", ".join(f"{lane} {v['throughput_tok_s']:.1f}" for lane, v in summary["lanes"].items())
    text = f"C={concurrency}: {speeds} tok/s"
    if "ratio" in summary:
        low, high = summary["ci95"]
        text += (f"; adaptive / best other ({summary['best_other']}) = {summary['ratio']:.3f}x [95% CI {low:.3f}-{high:.3f}] "
                 f"{'met' if summary['met'] else 'MISSED'} (goal >= 0.95){held_out_text(summary)}")
    if "itl_vs_best" in summary:
        itl = summary["itl_vs_best"]
        text += (f"; ITL adaptive / {summary['best_other']}: per chunk p50 {itl['chunk_p50']:.3f} [{itl['chunk_p50_ci95'][0]:.3f}-"
                 f"{itl['chunk_p50_ci95'][1]:.3f}], per token mean {itl['token_mean']:.3f} [{itl['token_mean_ci95'][0]:.3f}-{itl['token_mean_ci95'][1]:.3f}]")
    for twin, control in summary.get("twins", {}).items():
        text += f"; control {twin} / {control['against']} = {control['ratio']:.3f} [{control['ci95'][0]:.3f}-{control['ci95'][1]:.3f}]"
    return text


def lane_table(record: dict) -> list[str]:
    """Markdown: one row per (C, lane): throughput, x off, TTFT, ITL in both conventions, mean width, steps; then
    the verdict per C (verdict_line)."""
    rows = ["| C | lane | tok/s | x off | TTFT p50 / p95 ms | ITL per chunk p50 / p95 ms | ITL per token p50 / p95 / mean ms | mean width | steps |",
            "|---|---|---|---|---|---|---|---|---|"]
    for point in record["points"]:
        lanes = point["summary"]["lanes"]
        off = lanes.get("off", {}).get("throughput_tok_s")
        for lane, v in lanes.items():
            x_off = f"{v['throughput_tok_s'] / off:.2f}" if off else "-"
            rows.append(
                f"| {point['concurrency']} | {lane} | {v['throughput_tok_s']:.1f} | {x_off} | {ms(v.get('ttft_p50_ms'))} / {ms(v.get('ttft_p95_ms'))} | "
                f"{ms(v['itl_p50_ms'])} / {ms(v['itl_p95_ms'])} | {ms(v['itl_token_p50_ms'], 1)} / {ms(v['itl_token_p95_ms'], 1)} / "
                f"{ms(v['itl_token_mean_ms'], 1)} | {ms(v['mean_width'], 2)} | {v['steps']} |")
    return rows + [""] + ["- " + verdict_line(point["concurrency"], point["summary"]) for point in record["points"]]


def shape_table(record: dict) -> list[str]:
    """Markdown: per (C, lane, shape) of the full-batch decode steps: count, median step ms (the lane's clock, the
    whole scheduler step), the adaptive lane's mean predicted ms over the mean measured, and tokens per ms."""
    rows = ["| C | lane | batch x width | steps | step ms (median) | predicted / measured (mean) | tokens per step | tokens / ms |",
            "|---|---|---|---|---|---|---|---|"]
    for point in record["points"]:
        for lane, shapes in point.get("shapes", {}).items():
            for shape, steps in sorted(shapes.items(), key=lambda kv: [int(x) for x in kv[0].split("x")]):
                if int(shape.split("x")[0]) != point["concurrency"]:
                    continue
                predicted = [(p, step_ms) for step_ms, p, _ in steps if p is not None]
                ratio = f"{sum(p for p, _ in predicted) / sum(m for _, m in predicted):.3f}" if predicted else "-"
                rows.append(f"| {point['concurrency']} | {lane} | {shape} | {len(steps)} | {statistics.median(m for m, _, _ in steps):.1f} | "
                            f"{ratio} | {statistics.fmean(n for _, _, n in steps):.2f} | {sum(n for _, _, n in steps) / sum(m for m, _, _ in steps):.4f} |")
    return rows


def plot_sweep(record: dict, out: Path, titles: tuple[str, str] = LOCKSTEP_TITLES) -> None:
    """Left: pooled throughput per lane against concurrency. Right: adaptive / the best other lane per concurrency,
    with its 95% bootstrap interval and the 0.95 goal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = record["points"]
    xs = [p["concurrency"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for lane in points[0]["summary"]["lanes"]:
        left.plot(xs, [p["summary"]["lanes"][lane]["throughput_tok_s"] for p in points], marker="o", label=lane,
                  linewidth=2.5 if lane == "adaptive" else 1.2)
    judged = [p for p in points if "ratio" in p["summary"]]
    if judged:
        ratio = np.array([p["summary"]["ratio"] for p in judged])
        ci = np.array([p["summary"]["ci95"] for p in judged]).T
        right.errorbar([p["concurrency"] for p in judged], ratio, yerr=[ratio - ci[0], ci[1] - ratio], marker="o", capsize=4, color="black")
        for p in judged:
            right.annotate(p["summary"]["best_other"], (p["concurrency"], p["summary"]["ratio"]), textcoords="offset points", xytext=(6, 6), fontsize=8)
        right.axhline(0.95, color="red", linestyle="--", label="goal 0.95")
        right.axhline(1.0, color="gray", linewidth=0.8)
        right.legend()
    for ax, title in zip((left, right), titles):
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


PERF_LANES = ("own baseline", "transformers greedy", "own n-gram", "transformers prompt lookup", "own draft model")


def perf_repeat_rows(rows: list[tuple[str, dict]]) -> list[str]:
    """Per bench_perf.py run (a repeat) of one dtype: probe, floor, step and every lane's tokens/s."""
    lines = ["| repeat | read GB/s | floor ms | step ms | step / floor | verify(5) / step | own baseline tok/s | transformers greedy tok/s | "
             "own n-gram tok/s | transformers prompt lookup tok/s | own draft model tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        f = r["floor"]
        speeds = [r["lanes"].get(lane, {}).get("tokens_per_s", float("nan")) for lane in PERF_LANES]
        lines.append(f"| {name} | {f['read_gb_s']:.1f} | {f['floor_ms']:.1f} | {f['step_ms']:.1f} | {f['step_over_floor']:.2f}x | "
                     f"{f['verify_over_step']:.2f}x | " + " | ".join(f"{v:.1f}" for v in speeds) + " |")
    return lines


def perf_ratio_rows(rows: list[tuple[str, dict]]) -> list[str]:
    """The issue's ratios and the theory's measured / predicted per repeat, with their median."""
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
    lines = ["| ratio | " + " | ".join(name for name, _ in rows) + " | median |", "|---|" + "---|" * (len(rows) + 1)]
    for label, values in ratios.items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + f" | **{statistics.median(values):.2f}** |")
    return lines


def perf_theory_line(lane: str, t: list[dict]) -> str:
    """One theory lane's medians over repeats: alpha, AR, c, AL, draft lengths, measured and predicted speedups."""
    med = lambda key: statistics.median([key(x) for x in t])  # noqa: E731
    return (f"{lane}: alpha {med(lambda x: x['alpha']):.3f}, AR {med(lambda x: x['acceptance_rate']):.3f}, c {med(lambda x: x['c']):.4f}, "
            f"AL {med(lambda x: x['acceptance_length']):.2f} (E[T] at gamma {t[0]['gamma']}: {med(lambda x: x['expected_tokens_at_gamma']):.2f}), "
            f"mean draft length {med(lambda x: x['mean_draft_length']):.2f}, steps by draft length {t[0]['steps_by_draft_length']}; "
            f"measured decode-phase speedup {med(lambda x: x['measured']['decode_phase']):.2f}x, end to end {med(lambda x: x['measured']['end_to_end']):.2f}x; "
            f"predicted: Leviathan {med(lambda x: x['predicted']['leviathan']):.2f}x, over the lengths {med(lambda x: x['predicted']['lengths']):.2f}x, "
            f"with V(t) {med(lambda x: x['predicted']['lengths_and_verify_cost']):.2f}x; same tokens as the baseline: "
            f"{all(x['same_tokens_as_baseline'] for x in t)}")


def perf_summary(runs: list[tuple[str, dict]]) -> list[str]:
    """Markdown of several bench_perf.py reports (name, report), per dtype: the repeats, the ratios with their
    medians, each theory lane's medians and the verification cost V(t) (median over repeats)."""
    lines: list[str] = []
    for dtype in runs[0][1]["dtypes"]:
        rows = [(name, run["dtypes"][dtype]) for name, run in runs if dtype in run["dtypes"]]
        lines += [f"#### {dtype}", "", *perf_repeat_rows(rows), "", *perf_ratio_rows(rows)]
        for lane in rows[0][1].get("theory", {}):
            lines += ["", perf_theory_line(lane, [r["theory"][lane] for _, r in rows])]
        v = [r["verification_cost"]["over_one_token"] for _, r in rows if "verification_cost" in r]
        if v:
            lines += ["", "V(t), median over repeats: " + ", ".join(f"t={t + 1} {statistics.median([x[t] for x in v]):.2f}" for t in range(len(v[0])))]
        lines.append("")
    return lines
