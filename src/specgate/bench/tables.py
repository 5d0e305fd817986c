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


# --- one bench_perf.py report -------------------------------------------------------------------------------------


def perf_header_lines(report: dict) -> list[str]:
    """The machine and the bandwidth probe."""
    m = report["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_capability']}), {m['threads']} threads, "
             f"native bf16: {m['native_bf16']}, default_dtype: {m['default_dtype']}, load {m['load_average_start']} -> {report['load_average_end']}"]
    if "bandwidth" in report:
        b = report["bandwidth"]
        lines.append(f"bandwidth probe ({b['megabytes']} MB): read {b['read_gb_s']:.1f} GB/s (torch sum {b['torch_sum_read_gb_s']:.1f}, "
                     f"AVX2 sum {b.get('native_read_gb_s', float('nan')):.1f}, with prefetch {b.get('native_prefetch_read_gb_s', float('nan')):.1f}), "
                     f"copy {b['copy_gb_s']:.1f} GB/s\n")
    return lines


def perf_floor_lines(rows: list[tuple[str, dict]]) -> list[str]:
    """Per dtype the floor's medians over rounds, then its per-round ratios and the products alone."""
    floors = [(d, r["floor"]) for d, r in rows if r.get("floor") and "floor_ms" in r["floor"]]
    if not any("floor" in r for _, r in rows):
        return []
    lines = ["Medians over rounds (each round: probe, then the steps, back to back):",
             "| dtype | MB read per step | read GB/s | floor ms | step ms | step / floor | achieved GB/s | verify / step | "
             "torch-path step ms | torch path / C path | torch-path verify / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, f in floors:
        lines.append(f"| {d} | {f['bytes_per_step']['total'] / 1e6:.0f} | {f['read_gb_s']:.1f} | {f['floor_ms']:.1f} | {f['step_ms']:.1f} | "
                     f"{f['step_over_floor']:.2f}x | {f['achieved_gb_s']:.1f} | {f['verify_over_step']:.2f}x | "
                     f"{f['torch_path_step_ms']:.1f} | {f['torch_path_over_c_path']:.2f}x | {f['torch_path_verify_over_step']:.2f}x |")
    for d, f in floors:
        lines.append(f"{d}: step / floor per round: " + ", ".join(f"{row['step_over_floor']:.2f}x" for row in f["rounds"]) +
                     "; verify / step per round: " + ", ".join(f"{row['verify_over_step']:.2f}x" for row in f["rounds"]))
        if f.get("products_ms") is not None:
            lines.append(f"{d}: the step's products alone, one by one: {f['products_ms']:.1f} ms of the {f['step_ms']:.1f} ms step "
                         f"(the rest, {f['step_ms'] - f['products_ms']:.1f} ms: norms, RoPE, attention, embedding, dispatch)")
    return lines + [""]


def perf_theory_lines(d: str, r: dict) -> list[str]:
    """One dtype's verification cost V(t) and each theory lane: measured against predicted."""
    lines = []
    if "verification_cost" in r:
        v = r["verification_cost"]
        lines.append(f"{d}: verification cost V(t) at position {v['position']}: " +
                     ", ".join(f"t={t} {ms:.1f} ms ({ratio:.2f}x)" for t, ms, ratio in zip(v["tokens"], v["ms"], v["over_one_token"])))
    for lane, t in r.get("theory", {}).items():
        p, m = t["predicted"], t["measured"]
        lines += [f"{d}: theory, {lane} (gamma {t['gamma']}): alpha {t['alpha']:.3f} (AR {t['acceptance_rate']:.3f}), c {t['c']:.4f}, "
                  f"AL {t['acceptance_length']:.2f} vs E[T] {t['expected_tokens_at_gamma']:.2f}, mean draft length {t['mean_draft_length']:.2f}, "
                  f"steps by draft length {t['steps_by_draft_length']}",
                  f"{d}:   measured speedup: decode phase {m['decode_phase']:.2f}x, end to end {m['end_to_end']:.2f}x; predicted: "
                  f"Leviathan {p['leviathan']:.2f}x, over the lengths that ran {p['lengths']:.2f}x, and with V(t) {p['lengths_and_verify_cost']:.2f}x",
                  f"{d}:   decode phase / predicted: " + ", ".join(f"{k} {v:.2f}" for k, v in t["decode_phase_over_predicted"].items()) +
                  "; end to end / predicted: " + ", ".join(f"{k} {v:.2f}" for k, v in t["end_to_end_over_predicted"].items())]
    return lines


def perf_lane_lines(rows: list[tuple[str, dict]]) -> list[str]:
    """Tokens/s per dtype and lane, then per dtype the ratios, same-token checks and the theory."""
    laned = [(d, r) for d, r in rows if "lanes" in r]
    if not laned:
        return []
    names = list(laned[0][1]["lanes"])
    lines = ["| dtype | " + " | ".join(f"{n} tok/s" for n in names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {d} | " + " | ".join(f"{r['lanes'][n]['tokens_per_s']:.1f}" for n in names) + " |" for d, r in laned]
    lines.append("")
    for d, r in laned:
        lines += [f"{d}: " + "; ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items()),
                  f"{d}: by CPU seconds: " + "; ".join(f"{k} {v:.2f}x" for k, v in r["cpu_time_ratios"].items()),
                  f"{d}: same tokens as own baseline: " + ", ".join(f"{n} {r['lanes'][n]['same_tokens_as_own_baseline']}" for n in names)]
        lines += perf_theory_lines(d, r)
    return lines + [""]


def perf_product_lines(report: dict) -> list[str]:
    """The head and layer products: median ms per row count and formulation."""
    lines = []
    for section in ("head", "layers"):
        if report.get(section):
            names = [name for name in ("f_linear_ms", "onednn_ms", "native_ms", "native_bf16_ms") if name in report[section][0]]
            lines += [f"{section}:\n| rows | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
            lines += [f"| {row['rows']} | " + " | ".join(f"{row[name]:.1f}" for name in names) + " |" for row in report[section]]
            lines.append("")
    return lines


def perf_report(report: dict) -> list[str]:
    """Markdown of one bench_perf.py report: machine, probe, floor, lanes and theory, products, make demo's RSS."""
    rows = list(report["dtypes"].items())
    lines = perf_header_lines(report) + perf_floor_lines(rows) + perf_lane_lines(rows) + perf_product_lines(report)
    return lines + [f"demo peak RSS {row['peak_rss_mib']:.0f} MiB (exit {row['exit_status']}, {row.get('wall')}): {row['command']}"
                    for row in report.get("demo_rss", [])]
