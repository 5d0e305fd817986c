"""Serving benchmark: closed-loop concurrency sweep of the continuous-batching scheduler, speculation off /
fixed gamma / adaptive, on one model (default Gemma-3-270M, fp32, n-gram drafts, greedy).

For each lane and each concurrency C, C client threads each submit a request, wait for it to finish and submit
the next (closed loop), `--requests-per-client` times. All lanes share one loaded model, the same prompts and
the same scheduler settings; the adaptive lane calibrates its cost model once, up front. Per point:
- throughput: generated tokens / wall seconds of the point (first submit to last finish);
- TTFT p50 / p95 (arrival to first token), ITL p50 / p95 (time between token-emitting steps of a request:
  with speculation one step may emit several tokens), TPOT mean ((e2e - TTFT) / (tokens - 1));
- AR (accepted / drafted) and the mean gamma the policy chose.
Ratios against the `off` lane of the same concurrency are printed (same process, same machine state).

Run (the full sweep takes tens of minutes on 2 cores):
    .venv/bin/python bench/bench_serving.py --out bench/out/serving
Quick check of the script itself on any small model:
    .venv/bin/python bench/bench_serving.py --target PATH --concurrency 1,2 --requests-per-client 1 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from specgate.models import load_model
from specgate.sampling import SamplingParams
from specgate.serving import Request, Scheduler, calibrate_cost_model, make_policy

PROMPTS = [
    "Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy: apple,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Speculative decoding drafts tokens with a small model and verifies them with the large one. Repeat: Speculative",
]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_point(scheduler: Scheduler, prompts: list[torch.Tensor], concurrency: int, per_client: int, max_tokens: int) -> dict:
    """One closed-loop measurement: `concurrency` clients, `per_client` requests each."""
    finished: list[Request] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for i in range(per_client):
            done = threading.Event()
            prompt = prompts[(index + i) % len(prompts)]
            request = Request(prompt, SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True, seed=index * 1000 + i)
            request.sink = lambda event, done=done: done.set() if event[0] == "done" else None
            scheduler.submit(request)
            done.wait()
            with lock:
                finished.append(request)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in finished)
    ttft = [r.stats.ttft_s for r in finished if r.stats.ttft_s is not None]
    itl = [x for r in finished for x in r.stats.itl_s]
    tpot = [(r.stats.e2e_s - r.stats.ttft_s) / (len(r.tokens) - 1) for r in finished if len(r.tokens) > 1]
    drafted = sum(r.stats.drafted_tokens for r in finished)
    gammas = [g for r in finished for g in r.stats.gammas]
    return {
        "concurrency": concurrency, "requests": len(finished), "tokens": tokens, "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s, "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p95_ms": 1e3 * percentile(ttft, 95),
        "itl_p50_ms": 1e3 * percentile(itl, 50) if itl else None, "itl_p95_ms": 1e3 * percentile(itl, 95) if itl else None,
        "tpot_mean_ms": 1e3 * statistics.fmean(tpot) if tpot else None,
        "acceptance_rate": sum(r.stats.accepted_tokens for r in finished) / drafted if drafted else None,
        "mean_gamma": statistics.fmean(gammas) if gammas else 0.0,
    }


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for lane in sorted({r["lane"] for r in rows}):
        lane_rows = [r for r in rows if r["lane"] == lane]
        xs = [r["concurrency"] for r in lane_rows]
        axes[0].plot(xs, [r["throughput_tok_s"] for r in lane_rows], marker="o", label=lane)
        axes[1].plot(xs, [r["ttft_p50_ms"] for r in lane_rows], marker="o", label=lane)
        axes[2].plot(xs, [r["itl_p50_ms"] for r in lane_rows], marker="o", label=lane)
    for ax, title in zip(axes, ("throughput (tokens/s)", "TTFT p50 (ms)", "ITL p50 (ms, per step)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--draft", default="ngram", help="ngram, or a draft model name / path")
    parser.add_argument("--gamma", type=int, default=4, help="fixed lane's gamma; adaptive lane's gamma_max")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lanes", default="off,fixed,adaptive")
    parser.add_argument("--out", type=Path, default=Path("bench/out/serving"))
    args = parser.parse_args()

    console = Console()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    target = load_model(args.target)
    draft = args.draft if args.draft in ("none", "ngram") else load_model(args.draft)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS]
    max_seq_len = max(int(p.numel()) for p in prompts) + args.max_tokens + 1
    lanes = args.lanes.split(",")
    cost_model = None
    if "adaptive" in lanes:
        with console.status("calibrating the adaptive policy's cost model"):
            cost_model = calibrate_cost_model(target.model, None if isinstance(draft, str) else draft.model, gamma_max=args.gamma)
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("sweep", total=len(lanes) * len(concurrencies))
        for lane in lanes:
            for concurrency in concurrencies:
                policy = make_policy(lane, gamma=args.gamma, cost_model=cost_model)
                scheduler = Scheduler(target, draft, policy, num_slots=concurrency, max_seq_len=max_seq_len, max_waiting=concurrency)
                scheduler.start()
                try:
                    run_point(scheduler, prompts, concurrency, 1, min(args.max_tokens, 8))  # warm-up
                    row = run_point(scheduler, prompts, concurrency, args.requests_per_client, args.max_tokens)
                finally:
                    scheduler.stop()
                rows.append({"lane": lane if lane != "fixed" else f"fixed g={args.gamma}", **row})
                progress.advance(task)

    table = Table(title=f"closed-loop serving sweep: {target.name}, draft {args.draft}, {args.max_tokens} tokens/request")
    for column in ("lane", "C", "tok/s", "x off", "TTFT p50/p95 ms", "ITL p50/p95 ms", "AR", "mean gamma"):
        table.add_column(column)
    baseline = {r["concurrency"]: r["throughput_tok_s"] for r in rows if r["lane"] == "off"}

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    for r in rows:
        ratio = r["throughput_tok_s"] / baseline[r["concurrency"]] if r["concurrency"] in baseline else None
        table.add_row(
            r["lane"], str(r["concurrency"]), fmt(r["throughput_tok_s"]), fmt(ratio, ".2f"),
            f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p95_ms'])}", f"{fmt(r['itl_p50_ms'])} / {fmt(r['itl_p95_ms'])}",
            fmt(r["acceptance_rate"], ".2f"), fmt(r["mean_gamma"], ".2f"),
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    plot(rows, args.out / "serving_sweep.png")
    console.print(f"wrote {args.out / 'results.json'} and {args.out / 'serving_sweep.png'}")


if __name__ == "__main__":
    main()
