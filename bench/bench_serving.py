"""Serving benchmark: closed-loop concurrency sweep of the continuous-batching scheduler, speculation off /
fixed gamma / adaptive, on one model (default Gemma-3-270M, runtime default dtype, n-gram drafts, greedy).

For each lane and each concurrency C, C clients each submit a request, wait for it to finish and submit the
next (closed loop). Method (built to beat this shared 2-core VM's 20-30% run-to-run noise):
- one process, one loaded model; one scheduler per (lane, C), kept across repeats (the adaptive lane keeps
  learning its traffic, as a running server does) and warmed up once when created, with one full-length request
  per client (every lane alike: kernels, caches and, for the adaptive lane, its acceptance and cost estimates
  reach the state a running server is in, so the repeats measure that state, not the first minute);
- lanes interleaved: for each repeat, for each C, every lane runs one point, in an order rotated per repeat, so
  lanes compared at one C ran minutes apart at most and none always goes first; a rotation keeps each lane after
  the same one (adaptive, listed last, follows fixed gamma 8 in most repeats), `--order balanced` has each lane
  follow every other equally often (a Williams design, as bench_slices.py's);
- `--repeats` repeats of the whole sweep (identical workloads); medians over repeats, with the spread (min-max),
  and paired ratios (adaptive / lane in the same repeat) that cancel slow drifts of the machine;
- throughput is steady-state: tokens committed between the first finished request of a point (the synchronised
  first prefill wave is over) and the moment the first client finishes its last request (concurrency starts to
  fall), over that window's seconds; every client sends ceil(--requests-per-point / C) requests (at least 2);
  the whole-point figure (first submit to last finish) is kept in the JSON too.
Per point also: TTFT p50 / p95 (arrival to first token), ITL p50 / p95 (time between token-emitting steps of a
request: with speculation one step may emit several tokens), TPOT mean ((e2e - TTFT) / (tokens - 1)), AR
(accepted / drafted), the mean gamma the policy chose, and per-step timings (the scheduler's trace): measured
target forward vs the adaptive cost model's prediction, and the step's time outside the forwards.
The issue's goals: adaptive median throughput / best other lane's median at each C (>= 0.95), adaptive ITL p50
at C=1 vs the best fixed-gamma lane's.

Lanes: `off`, `fixed` (gamma --gamma) or `fixed=G`, `adaptive` (gamma_max --gamma-max, default --gamma).
A lane with a `#tag` (`fixed=4#b`) is a second scheduler of the same setting, labelled `fixed g=4 #b`: a twin
that measures the judge's own noise (serving_table.twin_controls) and, run after a different lane, the order's.
Prompts: `repetitive` (input-grounded: lists, code, repeated sentences; high n-gram acceptance) or `prose`
(open-ended questions and story starts; lower acceptance).
--http: the same closed loop through the real server (specgate.serving.server.start_server on loopback) with
an async streaming client (httpx; SSE); TTFT and ITL are then measured by the client (ITL between text chunks);
one server per point, whole-point throughput.

Run (float32 on 2 cores: ~15 min per 3 concurrencies x 5 lanes x 3 repeats):
    .venv/bin/python bench/bench_serving.py --lanes off,fixed=2,fixed=4,fixed=8,adaptive --gamma-max 8 --concurrency 1,2,4
Quick check of the script itself on any small model:
    .venv/bin/python bench/bench_serving.py --target PATH --concurrency 1,2 --repeats 1 --requests-per-point 2 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import statistics
import sys
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
from specgate.serving.policy import AdaptivePolicy

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
    """'off' / 'adaptive' / 'fixed' / 'fixed=G', each with optional ':key=value' options and a '#tag' -> (policy
    name, gamma)."""
    name, _, value = lane.partition("#")[0].partition(":")[0].partition("=")
    if name not in ("off", "fixed", "adaptive"):
        raise ValueError(f"lane {lane!r}: the policy must be off, fixed, fixed=G or adaptive (with optional :key=value options and a #tag)")
    lane_options(lane)
    return name, int(value) if value else gamma


# an adaptive lane's options: name -> (AdaptivePolicy keyword or None for the scheduler's prior weight, type, check, what it is)
LANE_OPTIONS = {
    "prior": (None, float, lambda v: v > 0, "W > 0: pseudo-tests of the traffic's acceptance in a request's estimate"),
    "margin": ("margin", float, lambda v: 0 <= v < 0.5, "0 <= M < 0.5: the hysteresis"),
    "probe": ("probe_every", int, lambda v: v >= 0, "N >= 0: decisions between probes (0 = never)"),
    "objective": ("objective", str, lambda v: v in ("goodput", "throughput"), "goodput or throughput"),
}


def lane_options(lane: str) -> dict[str, float | int | str]:
    """'adaptive:prior=1:margin=0' -> {'prior': 1.0, 'margin': 0.0}: an adaptive variant, in the order given.
    prior: the lane's schedulers weigh the traffic's acceptance profile by W pseudo-tests in each request's
    estimate (Scheduler request_prior_weight); margin, probe, objective: AdaptivePolicy's margin, probe_every and
    objective. An A/B on the machine: --lanes fixed=4,adaptive,adaptive:prior=1."""
    text = lane.partition("#")[0].partition(":")[2]
    options: dict[str, float | int | str] = {}
    for option in text.split(":") if text else []:
        key, _, raw = option.partition("=")
        if key not in LANE_OPTIONS:
            raise ValueError(f"lane {lane!r}: the option {key!r} is unknown: use {', '.join(f'{k}=' for k in LANE_OPTIONS)} (adaptive lanes only)")
        _, kind, check, meaning = LANE_OPTIONS[key]
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or not check(value):
            raise ValueError(f"lane {lane!r}: the option must be :{key}=" + meaning)
        options[key] = value
    if options and not lane.startswith("adaptive"):
        raise ValueError(f"lane {lane!r}: options are for adaptive lanes only")
    return options


def lane_prior_weight(lane: str) -> float | None:
    """'adaptive:prior=1' -> 1.0 (lane_options' prior; None: the scheduler's default)."""
    return lane_options(lane).get("prior")


def lane_policy(lane: str, gamma: int, cost_model):
    """The lane's policy: make_policy by name, or the adaptive policy with the lane's options (on this cost model)."""
    name = parse_lane(lane, gamma)[0]
    keywords = {LANE_OPTIONS[k][0]: v for k, v in lane_options(lane).items() if LANE_OPTIONS[k][0] is not None}
    if keywords:
        return AdaptivePolicy(cost_model, gamma_max=gamma, **keywords)
    return make_policy(name, gamma=gamma, cost_model=cost_model)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_point(scheduler: Scheduler, prompts: list[torch.Tensor], concurrency: int, per_client: int, max_tokens: int) -> dict:
    """One closed-loop measurement: `concurrency` clients, `per_client` requests each (see the module docstring)."""
    finished: list[tuple[int, Request]] = []  # (client, request)
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
                finished.append((index, request))

    scheduler.trace = []
    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    requests = [r for _, r in finished]
    tokens = sum(len(r.tokens) for r in requests)
    ttft = [r.stats.ttft_s for r in requests if r.stats.ttft_s is not None]
    itl = [x for r in requests for x in r.stats.itl_s]
    tpot = [(r.stats.e2e_s - r.stats.ttft_s) / (len(r.tokens) - 1) for r in requests if len(r.tokens) > 1]
    drafted = sum(r.stats.drafted_tokens for r in requests)
    gammas = [g for r in requests for g in r.stats.gammas]
    # steady-state window: after the first finish, until the first client is done (see the module docstring)
    window_start = min(r.stats.finish_s for r in requests)
    window_end = min(max(r.stats.finish_s for c, r in finished if c == index) for index in range(concurrency))
    steps = [t for t in scheduler.trace if window_start < t["end_s"] <= window_end]
    steady = sum(t["emitted"] for t in steps) / (window_end - window_start) if window_end > window_start and steps else None
    return {
        **summarize(concurrency, wall_s, tokens, ttft, itl, tpot), "requests": len(requests),
        "throughput_whole_tok_s": tokens / wall_s, "throughput_tok_s": steady if steady is not None else tokens / wall_s,
        "window_s": window_end - window_start, "window_steps": len(steps),
        "acceptance_rate": sum(r.stats.accepted_tokens for r in requests) / drafted if drafted else None,
        "mean_gamma": statistics.fmean(gammas) if gammas else 0.0,
        "steps": step_timings(scheduler),
    }


def step_timings(scheduler: Scheduler) -> dict:
    """Per-step timings from the scheduler's trace: medians of the target forward, the draft passes and the rest
    of the step (lookups, verification, commit); with the adaptive cost model, the median of the measured step but
    its draft passes (what the policy prices) over the model's prediction (1.0 = the model prices this load right)."""
    trace = scheduler.trace or []
    if not trace:
        return {}
    out = {
        "count": len(trace), "mean_batch": statistics.fmean(t["batch"] for t in trace),
        "mean_width": statistics.fmean(t["width"] for t in trace),
        "forward_ms_p50": statistics.median(t["forward_ms"] for t in trace),
        "draft_ms_p50": statistics.median(t["draft_ms"] for t in trace),
        "other_ms_p50": statistics.median(t["step_ms"] - t["forward_ms"] - t["draft_ms"] for t in trace),
        "width_changes": sum(a["width"] != b["width"] for a, b in zip(trace, trace[1:])) / max(len(trace) - 1, 1),
        # per width, the steps at the largest batch that ran (the loaded steady state): what each width cost and gave
        "by_width_at_max_batch": by_width(trace),
    }
    cost_model = getattr(scheduler.policy, "cost_model", None)
    if cost_model is not None:
        out["step_measured_over_predicted_p50"] = statistics.median(
            (t["step_ms"] - t["draft_ms"]) / cost_model.target_step_ms(t["batch"], t["width"] + 1, t["batch"] + t["drafted"]) for t in trace
        )
    return out


def by_width(trace: list[dict]) -> dict[str, dict]:
    """Steps of the trace at its largest batch, grouped by width: count, median step ms (all of it) and forward ms,
    mean tokens emitted per step and emitted tokens per ms of step (the goodput each width actually delivered)."""
    top = max(t["batch"] for t in trace)
    out = {}
    for width in sorted({t["width"] for t in trace if t["batch"] == top}):
        steps = [t for t in trace if t["batch"] == top and t["width"] == width]
        out[str(width)] = {
            "batch": top, "count": len(steps), "step_ms_p50": statistics.median(t["step_ms"] for t in steps),
            "forward_ms_p50": statistics.median(t["forward_ms"] for t in steps),
            "emitted_mean": statistics.fmean(t["emitted"] for t in steps),
            "tokens_per_ms": sum(t["emitted"] for t in steps) / sum(t["step_ms"] for t in steps),
        }
    return out


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


def plot(summary: list[dict], out: Path) -> None:
    """Medians over repeats with min-max bars: throughput, TTFT p50, ITL p50, per lane against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for lane in dict.fromkeys(r["lane"] for r in summary):
        rows = [r for r in summary if r["lane"] == lane]
        xs = [r["concurrency"] for r in rows]
        style = {"marker": "o", "label": lane, "linewidth": 2.5 if lane == "adaptive" else 1.2}
        for ax, key in zip(axes, ("throughput_tok_s", "ttft_p50_ms", "itl_p50_ms")):
            median = np.array([r[key]["median"] for r in rows])
            spread = np.array([[r[key]["median"] - r[key]["min"], r[key]["max"] - r[key]["median"]] for r in rows]).T
            ax.errorbar(xs, median, yerr=spread, capsize=3, **style)
    for ax, title in zip(axes, ("throughput, steady state (tokens/s)", "TTFT p50 (ms)", "ITL p50 (ms, per step)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_title(title + "; median, min-max bars")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out)


METRICS = ("throughput_tok_s", "throughput_whole_tok_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "tpot_mean_ms", "acceptance_rate", "mean_gamma")


def aggregate(rows: list[dict]) -> list[dict]:
    """One summary per (lane, C): median, min and max over repeats of every metric."""
    summary = []
    for lane in dict.fromkeys(r["lane"] for r in rows):
        for concurrency in sorted({r["concurrency"] for r in rows if r["lane"] == lane}):
            point = [r for r in rows if r["lane"] == lane and r["concurrency"] == concurrency]
            entry = {"lane": lane, "concurrency": concurrency, "repeats": len(point)}
            for key in METRICS:
                values = [r[key] for r in point if r.get(key) is not None]
                entry[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
            summary.append(entry)
    return summary


def goals(rows: list[dict], summary: list[dict]) -> tuple[list[str], list[dict]]:
    """The issue's goals per concurrency: adaptive median throughput / the best other lane's median (and the
    paired per-repeat ratios against that lane), and at C=1 the ITL p50 against the best fixed-gamma lane."""
    lines, verdicts = [], []
    for concurrency in sorted({r["concurrency"] for r in summary}):
        point = {r["lane"]: r for r in summary if r["concurrency"] == concurrency}
        others = {lane: r for lane, r in point.items() if lane != "adaptive"}
        if "adaptive" not in point or not others:
            continue
        best = max(others, key=lambda lane: others[lane]["throughput_tok_s"]["median"])
        ratio = point["adaptive"]["throughput_tok_s"]["median"] / others[best]["throughput_tok_s"]["median"]
        paired = paired_ratios(rows, concurrency, best)
        verdict = {"concurrency": concurrency, "best_other": best, "ratio": ratio, "paired_ratios": paired, "met": ratio >= 0.95}
        lines.append(
            f"C={concurrency}: adaptive / best other ({best}) = {ratio:.2f}x (medians; paired per repeat "
            f"{', '.join(f'{x:.2f}' for x in paired)}) {'met' if ratio >= 0.95 else 'MISSED'} (goal >= 0.95)"
        )
        fixed = {lane: r for lane, r in others.items() if lane.startswith("fixed")}
        if concurrency == 1 and fixed:
            best_fixed = max(fixed, key=lambda lane: fixed[lane]["throughput_tok_s"]["median"])
            mine, theirs = point["adaptive"]["itl_p50_ms"]["median"], fixed[best_fixed]["itl_p50_ms"]["median"]
            verdict.update(best_fixed=best_fixed, itl_p50_ms=mine, best_fixed_itl_p50_ms=theirs, itl_met=mine <= theirs)
            lines.append(
                f"C=1: ITL p50 adaptive {mine:.1f} ms vs best fixed ({best_fixed}) {theirs:.1f} ms (medians) "
                f"{'met' if mine <= theirs else 'MISSED'}; TPOT mean {point['adaptive']['tpot_mean_ms']['median']:.1f} "
                f"vs {fixed[best_fixed]['tpot_mean_ms']['median']:.1f} ms"
            )
        verdicts.append(verdict)
    return lines, verdicts


def paired_ratios(rows: list[dict], concurrency: int, lane: str) -> list[float]:
    """adaptive / lane throughput per repeat at one concurrency (the two points ran back to back)."""
    mine = {r["repeat"]: r["throughput_tok_s"] for r in rows if r["concurrency"] == concurrency and r["lane"] == "adaptive"}
    theirs = {r["repeat"]: r["throughput_tok_s"] for r in rows if r["concurrency"] == concurrency and r["lane"] == lane}
    return [mine[k] / theirs[k] for k in sorted(mine) if k in theirs]


def lane_order(labels: list[str], index: int, order: str = "rotate") -> list[str]:
    """The lanes' order in round `index` (bench_slices.py: warm-up rounds counted; here: repeat + the
    concurrency's index, so each concurrency's repeats run consecutive rows). rotate: a cyclic shift by `index`, so every
    round's lanes start from a different one, but each lane always follows the same lane (the one before it in
    the list, or the previous round's last), and inherits the requests in flight, and their estimates, from it.
    balanced: a Williams design: round i runs (base + i) mod n with base 0, 1, n-1, 2, n-2, ..., and for odd n
    every second block of n rounds runs those orders reversed; over 2n rounds (n for even n) every lane runs at
    every position equally often and follows every other lane equally often (first-order carry-over balanced)."""
    n = len(labels)
    if order == "rotate":
        shift = index % n
        return labels[shift:] + labels[:shift]
    if order != "balanced":
        raise ValueError(f"order={order!r} is unknown: use rotate or balanced")
    base = [0]
    for k in range(1, n):
        base.append((k + 1) // 2 if k % 2 else n - k // 2)
    row = [labels[(b + index) % n] for b in base]
    return row[::-1] if n % 2 and (index // n) % 2 else row


def lane_label(lane: str, gamma: int, gamma_max: int) -> tuple[str, str, int]:
    """(policy name, label, gamma). A '#tag' makes a second lane of the same policy, its own scheduler, labelled
    'fixed g=4 #b': the order A/B runs one policy twice, after different lanes (bench/bench_serving.py --lanes
    fixed=8,fixed=4,fixed=2,fixed=4#b)."""
    name, gamma = parse_lane(lane, gamma_max if lane.startswith("adaptive") else gamma)
    tag = lane.partition("#")[2]
    label = f"fixed g={gamma}" if name == "fixed" else name
    label += "".join(f" {key}={value:g}" if isinstance(value, float) else f" {key}={value}" for key, value in lane_options(lane).items())
    return name, f"{label} #{tag}" if tag else label, gamma


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--draft", default="ngram", help="ngram, or a draft model name / path (e.g. default)")
    parser.add_argument("--dtype", default="auto", help="auto (the runtime's default), float32 or bfloat16")
    parser.add_argument("--gamma", type=int, default=4, help="gamma of the plain `fixed` lane")
    parser.add_argument("--gamma-max", type=int, default=None, help="adaptive lane's gamma_max (default --gamma)")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the interleaved sweep (medians over them)")
    parser.add_argument("--requests-per-point", type=int, default=6, help="requests per point: ceil(this / C) per client, >= 2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lanes", default="off,fixed,adaptive", help="comma list of off, fixed, fixed=G, adaptive")
    parser.add_argument("--prompts", default="repetitive", choices=sorted(PROMPTS))
    parser.add_argument("--order", choices=("rotate", "balanced"), default="rotate",
                        help="lane order per repeat: rotate (a cyclic shift: each lane always follows the same one) or balanced "
                             "(Williams: each lane follows every other equally often over 2 x lanes repeats; see lane_order)")
    parser.add_argument("--http", action="store_true", help="through the real server and a streaming HTTP client")
    parser.add_argument("--out", type=Path, default=Path("bench/out/serving"))
    parser.add_argument("--merge", default=None, help="comma list of results.json files: print their goals together and plot them (no run)")
    args = parser.parse_args()
    if args.merge:
        merge([Path(p) for p in args.merge.split(",")], args.out)
        return
    if args.repeats < 1 or args.requests_per_point < 1:
        raise SystemExit(f"--repeats {args.repeats} / --requests-per-point {args.requests_per_point}: both must be >= 1")

    console = Console(width=190)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    dtype = resolve_dtype(args.dtype)
    gamma_max = args.gamma_max if args.gamma_max is not None else args.gamma
    target = load_model(args.target, dtype=dtype)
    draft = args.draft if args.draft in ("none", "ngram") else load_draft(args.draft, target, dtype)
    texts = PROMPTS[args.prompts]
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in texts]
    max_seq_len = max(int(p.numel()) for p in prompts) + args.max_tokens + 1
    lanes = args.lanes.split(",")
    if args.http and any(lane_prior_weight(lane) is not None for lane in lanes):
        raise SystemExit(f"--lanes {args.lanes}: a :prior=W lane runs in process only (the server takes the scheduler's default weight); drop --http")
    cost_model = None
    if any(lane.startswith("adaptive") for lane in lanes):
        with console.status("calibrating the adaptive policy's cost model"):
            start = time.perf_counter()
            cost_model = calibrate_cost_model(target.model, None if isinstance(draft, str) else draft.model, gamma_max=gamma_max)
        console.print(f"cost model ({time.perf_counter() - start:.0f} s): {cost_model.to_dict()}")
    schedulers: dict[tuple[str, int], Scheduler] = {}
    rows = []
    sweep_start = time.perf_counter()
    with Progress(console=console) as progress:
        task = progress.add_task("sweep", total=args.repeats * len(lanes) * len(concurrencies))
        for repeat in range(args.repeats):
            for index, concurrency in enumerate(concurrencies):
                per_client = max(2, math.ceil(args.requests_per_point / concurrency))
                for lane in lane_order(lanes, repeat + index, args.order):
                    name, label, gamma = lane_label(lane, args.gamma, gamma_max)
                    if args.http:
                        policy = lane_policy(lane, gamma, copy.deepcopy(cost_model))
                        row = http_lane(target, draft, policy, concurrency, max_seq_len, texts, per_client, args.max_tokens)
                    else:
                        scheduler = schedulers.get((label, concurrency))
                        if scheduler is None:
                            # each scheduler learns its own copy of the calibration, as a server of its own would
                            policy = lane_policy(lane, gamma, copy.deepcopy(cost_model))
                            weight = lane_prior_weight(lane)
                            scheduler = schedulers[(label, concurrency)] = Scheduler(
                                target, draft, policy, num_slots=concurrency, max_seq_len=max_seq_len, max_waiting=concurrency,
                                **({} if weight is None else {"request_prior_weight": weight}),
                            )
                            scheduler.start()
                            run_point(scheduler, prompts, concurrency, 1, args.max_tokens)  # warm-up: one full request per client
                            scheduler.stop()
                        scheduler.start()
                        try:
                            row = run_point(scheduler, prompts, concurrency, per_client, args.max_tokens)
                        finally:
                            scheduler.stop()
                    rows.append({"lane": label, "repeat": repeat, **row})
                    progress.advance(task)
    sweep_s = time.perf_counter() - sweep_start

    summary = aggregate(rows)
    report(console, args, target, dtype, summary, rows)
    lines, verdicts = goals(rows, summary)
    for line in lines:
        console.print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "args": {k: str(v) for k, v in vars(args).items()}, "dtype": str(dtype),
        "path": "HTTP (server + streaming client)" if args.http else "in process", "sweep_s": sweep_s,
        "cost_model": cost_model.to_dict() if cost_model else None,  # the calibration; each scheduler learnt a copy:
        "cost_models": {f"{label} C={c}": s.policy.cost_model.to_dict() for (label, c), s in schedulers.items() if hasattr(s.policy, "cost_model")},
        "goals": lines, "verdicts": verdicts,
        "summary": summary, "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2))
    plot(summary, args.out / "serving_sweep.png")
    for key, learnt in record["cost_models"].items():
        console.print(f"{key} cost model after the sweep (live correction per grid point): {learnt['live_correction']}")
    console.print(f"sweep {sweep_s:.0f} s; wrote {args.out / 'results.json'} and {args.out / 'serving_sweep.png'}")


def merge(paths: list[Path], out: Path) -> None:
    """Several runs (e.g. low and high concurrencies, each under its own lock) as one sweep: goals and plot."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from serving_table import pooled_goals, pooled_rows  # serving_table imports this module: import late

    rows = pooled_rows([str(path) for path in paths])  # a file's repeats numbered after the previous file's
    summary = aggregate(rows)
    for line in goals(rows, summary)[0] + pooled_goals(rows):
        print(line)
    out.mkdir(parents=True, exist_ok=True)
    plot(summary, out / "serving_sweep.png")
    print(f"wrote {out / 'serving_sweep.png'}")


def load_draft(name: str, target, dtype: torch.dtype):
    """A draft model by name or path; `default` = the target's registered default draft (as `specgate serve`)."""
    from specgate.drafting import make_drafter

    return make_drafter(name, target, dtype=dtype).draft


def report(console: Console, args, target, dtype: torch.dtype, summary: list[dict], rows: list[dict]) -> None:
    """The table: medians over repeats (min-max for throughput); x off = median ratio to the off lane."""
    path = "HTTP (server + streaming client)" if args.http else "in process"
    table = Table(title=f"closed-loop serving sweep, {path}: {target.name} {str(dtype).removeprefix('torch.')}, draft {args.draft}, "
                  f"{args.prompts} prompts, {args.max_tokens} tokens/request, medians of {args.repeats} interleaved repeats")
    for column in ("lane", "C", "tok/s median [min-max]", "x off", "TTFT p50/p95 ms", "ITL p50/p95 ms", "TPOT ms", "AR", "mean gamma"):
        table.add_column(column)
    baseline = {r["concurrency"]: r["throughput_tok_s"]["median"] for r in summary if r["lane"] == "off"}

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value["median"] if isinstance(value, dict) else value, spec)

    for r in summary:
        speed = r["throughput_tok_s"]
        ratio = speed["median"] / baseline[r["concurrency"]] if r["concurrency"] in baseline else None
        table.add_row(
            r["lane"], str(r["concurrency"]), f"{speed['median']:.1f} [{speed['min']:.1f}-{speed['max']:.1f}]", fmt(ratio, ".2f"),
            f"{fmt(r['ttft_p50_ms'], '.0f')} / {fmt(r['ttft_p95_ms'], '.0f')}", f"{fmt(r['itl_p50_ms'], '.0f')} / {fmt(r['itl_p95_ms'], '.0f')}",
            fmt(r["tpot_mean_ms"]), fmt(r["acceptance_rate"], ".2f"), fmt(r["mean_gamma"], ".2f"),
        )
    console.print(table)
    for r in rows:
        if r["lane"] == "adaptive" and r.get("steps"):
            steps = r["steps"]
            console.print(
                f"adaptive C={r['concurrency']} repeat {r['repeat']}: forward p50 {steps['forward_ms_p50']:.0f} ms "
                f"(step measured/predicted {steps.get('step_measured_over_predicted_p50', float('nan')):.2f}), rest of step "
                f"{steps['other_ms_p50']:.0f} ms, mean width {steps['mean_width']:.2f}, width changes {steps['width_changes']:.2f} per step"
            )


if __name__ == "__main__":
    main()
