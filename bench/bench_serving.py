"""Serving benchmark: closed-loop concurrency sweep of the continuous-batching scheduler, speculation off /
fixed gamma / adaptive, on one model (default Gemma-3-270M, runtime default dtype, n-gram drafts, greedy).

For each lane and each concurrency C, C clients each submit a request, wait for it to finish and submit the
next (closed loop), `--requests-per-client` times. All lanes share one loaded model, the same prompts and the
same scheduler settings; the adaptive lane calibrates its cost model once, up front. Per point:
- throughput: generated tokens / wall seconds of the point (first submit to last finish);
- TTFT p50 / p95 (arrival to first token), ITL p50 / p95 (time between token-emitting steps of a request:
  with speculation one step may emit several tokens), TPOT mean ((e2e - TTFT) / (tokens - 1));
- AR (accepted / drafted) and the mean gamma the policy chose.
Ratios against the `off` lane of the same concurrency are printed (same process, same machine state), and the
issue's goals: adaptive throughput / best other lane at each C (>= 0.95), adaptive ITL p50 at C=1 vs the best
fixed lane's.

Lanes: `off`, `fixed` (gamma --gamma) or `fixed=G`, `adaptive` (gamma_max --gamma-max, default --gamma).
Prompts: `repetitive` (input-grounded: lists, code, repeated sentences; high n-gram acceptance) or `prose`
(open-ended questions and story starts; lower acceptance).
--http: the same closed loop through the real server (specgate.serving.server.start_server on loopback) with
an async streaming client (httpx; SSE); TTFT and ITL are then measured by the client (ITL between text chunks).

Run (the full in-process sweep takes ~10 minutes on 2 cores in float32):
    .venv/bin/python bench/bench_serving.py --out bench/out/serving
Quick check of the script itself on any small model:
    .venv/bin/python bench/bench_serving.py --target PATH --concurrency 1,2 --requests-per-client 1 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
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

PROMPTS = {
    "repetitive": [
        "Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy: apple,",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
        "Speculative decoding drafts tokens with a small model and verifies them with the large one. Repeat: Speculative",
    ],
    "prose": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain to a ten-year-old why the sky is blue and sunsets are red.",
        "What are the main causes of inflation, and how do central banks respond?",
        "Describe your ideal weekend in the mountains, hour by hour.",
    ],
}


def resolve_dtype(name: str) -> torch.dtype:
    """--dtype auto|float32|bfloat16; auto = specgate.models.dtypes.default_dtype() (float32 where absent)."""
    try:
        from specgate.models.dtypes import resolve_dtype as resolve
    except ImportError:  # an older runtime without the helper
        return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    return resolve(name)


def parse_lane(lane: str, gamma: int) -> tuple[str, int]:
    """'off' / 'adaptive' / 'fixed' / 'fixed=G' -> (policy name, gamma)."""
    name, _, value = lane.partition("=")
    return name, int(value) if value else gamma


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
        **summarize(concurrency, wall_s, tokens, ttft, itl, tpot), "requests": len(finished),
        "acceptance_rate": sum(r.stats.accepted_tokens for r in finished) / drafted if drafted else None,
        "mean_gamma": statistics.fmean(gammas) if gammas else 0.0,
    }


def summarize(concurrency: int, wall_s: float, tokens: int, ttft: list[float], itl: list[float], tpot: list[float]) -> dict:
    return {
        "concurrency": concurrency, "tokens": tokens, "wall_s": wall_s, "throughput_tok_s": tokens / wall_s,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p95_ms": 1e3 * percentile(ttft, 95),
        "itl_p50_ms": 1e3 * percentile(itl, 50) if itl else None, "itl_p95_ms": 1e3 * percentile(itl, 95) if itl else None,
        "tpot_mean_ms": 1e3 * statistics.fmean(tpot) if tpot else None,
    }


def run_http_point(url: str, model_name: str, prompts: list[str], concurrency: int, per_client: int, max_tokens: int) -> dict:
    """The closed loop through the server: streaming /v1/completions, TTFT and ITL seen by the client."""
    import httpx

    records: list[tuple[float, list[float], int, float]] = []  # (start, text chunk times, tokens, end)

    async def one(client: httpx.AsyncClient, prompt: str, seed: int) -> None:
        body = {
            "model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
        }
        start, chunks, tokens = time.perf_counter(), [], 0
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
                if event.get("choices") and event["choices"][0].get("text"):
                    chunks.append(time.perf_counter())
        records.append((start, chunks, tokens, time.perf_counter()))

    async def loop() -> float:
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            async def client_loop(index: int) -> None:
                for i in range(per_client):
                    await one(client, prompts[(index + i) % len(prompts)], index * 1000 + i)

            start = time.perf_counter()
            await asyncio.gather(*(client_loop(c) for c in range(concurrency)))
            return time.perf_counter() - start

    wall_s = asyncio.run(loop())
    ttft = [chunks[0] - start for start, chunks, _, _ in records if chunks]
    itl = [b - a for _, chunks, _, _ in records for a, b in zip(chunks, chunks[1:])]
    tpot = [(end - chunks[0]) / (tokens - 1) for _, chunks, tokens, end in records if chunks and tokens > 1]
    return {**summarize(concurrency, wall_s, sum(r[2] for r in records), ttft, itl, tpot), "requests": len(records)}


def spec_counters(metrics) -> tuple[float, float]:
    """(draft tokens, accepted tokens) from the server's Prometheus counters (exact verification)."""
    labels = {"model_name": metrics.model_name, "lossless": "true"}
    drafted = metrics.registry.get_sample_value("specgate:spec_decode_num_draft_tokens_total", labels) or 0.0
    accepted = metrics.registry.get_sample_value("specgate:spec_decode_num_accepted_tokens_total", labels) or 0.0
    return drafted, accepted


def http_lane(target, draft, policy, concurrency: int, max_seq_len: int, prompts: list[str], per_client: int, max_tokens: int) -> dict:
    """Start the real server around a scheduler with this policy (the adaptive lane keeps its calibrated cost
    model), warm it up, measure one point, stop it."""
    from specgate.serving.api import create_app
    from specgate.serving.metrics import ServingMetrics
    from specgate.serving.server import Engine, ServerConfig, start_server

    metrics = ServingMetrics(target.name, concurrency)
    scheduler = Scheduler(target, draft, policy, num_slots=concurrency, max_seq_len=max_seq_len, max_waiting=concurrency, metrics=metrics)
    engine = Engine(scheduler, metrics, target.name, create_app(scheduler, model_name=target.name, metrics=metrics))
    handle = start_server(ServerConfig(target=target, draft=draft, port=0, max_num_seqs=concurrency), engine)
    try:
        run_http_point(handle.url, target.name, prompts, concurrency, 1, min(max_tokens, 8))  # warm-up
        drafted_before, accepted_before = spec_counters(metrics)
        row = run_http_point(handle.url, target.name, prompts, concurrency, per_client, max_tokens)
        drafted, accepted = (a - b for a, b in zip(spec_counters(metrics), (drafted_before, accepted_before)))
    finally:
        handle.stop()
    return {**row, "acceptance_rate": accepted / drafted if drafted else None, "mean_gamma": None}


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


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, from the rows: adaptive vs the best other lane per concurrency; ITL at C=1."""
    lines = []
    for concurrency in sorted({r["concurrency"] for r in rows}):
        point = {r["lane"]: r for r in rows if r["concurrency"] == concurrency}
        others = {lane: r for lane, r in point.items() if lane != "adaptive"}
        if "adaptive" not in point or not others:
            continue
        best_lane = max(others, key=lambda lane: others[lane]["throughput_tok_s"])
        ratio = point["adaptive"]["throughput_tok_s"] / others[best_lane]["throughput_tok_s"]
        lines.append(f"C={concurrency}: adaptive / best other ({best_lane}) = {ratio:.2f}x {'met' if ratio >= 0.95 else 'MISSED'} (goal >= 0.95)")
        fixed = {lane: r for lane, r in others.items() if lane.startswith("fixed")}
        if concurrency == 1 and fixed:
            best_fixed = max(fixed, key=lambda lane: fixed[lane]["throughput_tok_s"])
            mine, theirs = point["adaptive"]["itl_p50_ms"], fixed[best_fixed]["itl_p50_ms"]
            lines.append(f"C=1: ITL p50 adaptive {mine:.1f} ms vs best fixed ({best_fixed}) {theirs:.1f} ms; TPOT mean {point['adaptive']['tpot_mean_ms']:.1f} vs {fixed[best_fixed]['tpot_mean_ms']:.1f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--draft", default="ngram", help="ngram, or a draft model name / path")
    parser.add_argument("--dtype", default="auto", help="auto (the runtime's default), float32 or bfloat16")
    parser.add_argument("--gamma", type=int, default=4, help="gamma of the plain `fixed` lane")
    parser.add_argument("--gamma-max", type=int, default=None, help="adaptive lane's gamma_max (default --gamma)")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lanes", default="off,fixed,adaptive", help="comma list of off, fixed, fixed=G, adaptive")
    parser.add_argument("--prompts", default="repetitive", choices=sorted(PROMPTS))
    parser.add_argument("--http", action="store_true", help="through the real server and a streaming HTTP client")
    parser.add_argument("--out", type=Path, default=Path("bench/out/serving"))
    args = parser.parse_args()

    console = Console(width=170)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    dtype = resolve_dtype(args.dtype)
    gamma_max = args.gamma_max if args.gamma_max is not None else args.gamma
    target = load_model(args.target, dtype=dtype)
    draft = args.draft if args.draft in ("none", "ngram") else load_model(args.draft, dtype=dtype)
    texts = PROMPTS[args.prompts]
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in texts]
    max_seq_len = max(int(p.numel()) for p in prompts) + args.max_tokens + 1
    lanes = args.lanes.split(",")
    cost_model = None
    if "adaptive" in lanes:
        with console.status("calibrating the adaptive policy's cost model"):
            start = time.perf_counter()
            cost_model = calibrate_cost_model(target.model, None if isinstance(draft, str) else draft.model, gamma_max=gamma_max)
        console.print(f"cost model ({time.perf_counter() - start:.0f} s): {cost_model.to_dict()}")
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("sweep", total=len(lanes) * len(concurrencies))
        for lane in lanes:
            name, gamma = parse_lane(lane, gamma_max if lane == "adaptive" else args.gamma)
            label = f"fixed g={gamma}" if name == "fixed" else name
            for concurrency in concurrencies:
                policy = make_policy(name, gamma=gamma, cost_model=cost_model)
                if args.http:
                    row = http_lane(target, draft, policy, concurrency, max_seq_len, texts, args.requests_per_client, args.max_tokens)
                else:
                    scheduler = Scheduler(target, draft, policy, num_slots=concurrency, max_seq_len=max_seq_len, max_waiting=concurrency)
                    scheduler.start()
                    try:
                        run_point(scheduler, prompts, concurrency, 1, min(args.max_tokens, 8))  # warm-up
                        row = run_point(scheduler, prompts, concurrency, args.requests_per_client, args.max_tokens)
                    finally:
                        scheduler.stop()
                rows.append({"lane": label, **row})
                progress.advance(task)

    path = "HTTP (server + streaming client)" if args.http else "in process"
    table = Table(title=f"closed-loop serving sweep, {path}: {target.name} {str(dtype).removeprefix('torch.')}, draft {args.draft}, "
                  f"{args.prompts} prompts, {args.max_tokens} tokens/request")
    for column in ("lane", "C", "tok/s", "x off", "TTFT p50/p95 ms", "ITL p50/p95 ms", "TPOT ms", "AR", "mean gamma"):
        table.add_column(column)
    baseline = {r["concurrency"]: r["throughput_tok_s"] for r in rows if r["lane"] == "off"}

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    for r in rows:
        ratio = r["throughput_tok_s"] / baseline[r["concurrency"]] if r["concurrency"] in baseline else None
        table.add_row(
            r["lane"], str(r["concurrency"]), fmt(r["throughput_tok_s"]), fmt(ratio, ".2f"),
            f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p95_ms'])}", f"{fmt(r['itl_p50_ms'])} / {fmt(r['itl_p95_ms'])}",
            fmt(r["tpot_mean_ms"]), fmt(r["acceptance_rate"], ".2f"), fmt(r["mean_gamma"], ".2f"),
        )
    console.print(table)
    summary = goals(rows)
    for line in summary:
        console.print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "args": {k: str(v) for k, v in vars(args).items()}, "dtype": str(dtype), "path": path,
        "cost_model": cost_model.to_dict() if cost_model else None, "goals": summary, "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2))
    plot(rows, args.out / "serving_sweep.png")
    console.print(f"wrote {args.out / 'results.json'} and {args.out / 'serving_sweep.png'}")


if __name__ == "__main__":
    main()
