"""Serving throughput per speculation setting, each lane its own server, all lanes stepped in lockstep.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_lockstep.py --concurrency 1,2,4,8,16 --requests 200 --out bench/out/lockstep
     .venv/bin/python bench/bench_lockstep.py --table bench/out/lockstep/results.json   # the markdown table again (a comma list: runs together, --plot P.png)

Why another serving benchmark: on this shared 2-core VM the host's speed moves by 20-40% within seconds, and
both earlier designs sample it in pieces of seconds per lane: bench_serving.py runs a point of ~20 s per lane
(twin lanes of one setting came out 5% apart over 12 repeats, run 36), bench_slices.py swaps the policy of ONE
scheduler every few seconds (its lanes then share the requests in flight and their acceptance estimates). Here
every lane is a whole server of its own: its own Scheduler (KV slots, per-request estimates, policy and, for
the adaptive lane, its own copy of the calibrated cost model) with its own C closed-loop clients (no think time,
each finished request replaced at once). Every lane serves the same sequence of requests: the k-th request its
clients send has the k-th prompt and length (uniform in max_tokens * (1 +- --length-spread)), whichever client
sends it. The lanes share the process and the loaded model, and take turns one scheduler step at a time: each
tick steps every lane once, in a Williams order per tick (each lane at each place and after each other lane
equally often), and waits at the end of each block of requests (below) until every lane has done it. A step is
~30-250 ms, so lanes that keep pace see the same host moments to within a block's drift, and the host's drift
cancels in their ratios instead of deciding them.

A lane's clock is the sum of its own steps' wall times: in a closed loop with no think time a server is never
idle, so that sum is the time the lane would have taken alone, and every figure is in it. Each lane measures the
same work: the requests sent k-th for --warmup-requests <= k < warmup + --requests (a lane steps, its clients
keeping its batch full, until those are done). A step's wall time is shared evenly by the requests it ran, so each
request carries its part of the clock (the shares add up to the clock; prefills included: each lane prefills its
own requests) and:
- throughput = the measured requests' tokens / their shares of the clock;
- ITL per chunk (vLLM's convention) = the lane-clock interval between a request's consecutive token-emitting
  steps; per token (SGLang's) = that interval split over the tokens the step handed it (bench_slices.split_latencies);
- TTFT = from the step in which the client sent it (the lane's clock at that step's end) to its first token.
The measured requests are cut into --blocks blocks of consecutive k, the same requests in every lane (the prompts
are accepted at different rates: blocks of equal time, or of equal numbers of finishes, would hold different work,
and the tokens in flight at their edges); a block is a round of bench_slices.summarize:
adaptive / the best other lane is a ratio of pooled throughputs with a 95% bootstrap interval over blocks (what
another sample of requests would give), paired per-block ratios and a held-out figure (the best other lane
picked on the other blocks); `itl_vs_best`: adaptive / that lane for ITL, with intervals. A lane tagged `#b`
(`fixed=4#b`) is a twin, a second server of one setting, in step with it in work and in time: twin / its setting
measures what is left of the host's noise and of the lanes' order; it is never a candidate for the best lane.
What lockstep cannot show: a lane's effect on the others' speed through shared caches (the model weights,
0.5 GB in bfloat16, stream from memory every step in every lane alike; the twin control bounds what is left).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import PROMPTS, lane_label, lane_order, lane_policy, lane_prior_weight, resolve_dtype  # noqa: E402
from bench_slices import ClosedLoop, held_out_text, plot, summarize  # noqa: E402
from bench_slices import table as slices_table  # noqa: E402
from serving_table import base_lane  # noqa: E402

from specgate.models import load_model  # noqa: E402
from specgate.serving import Scheduler, calibrate_cost_model  # noqa: E402


PLOT_TITLES = ("throughput (tokens/s), each lane its own server, stepped in lockstep", "adaptive / best other lane (95% bootstrap CI over blocks)")


class Lane:
    """One server: a scheduler, its closed-loop clients and its own clock (the sum of its steps' wall times, s).
    Per request (by request_id): its place in the sequence sent, its tokens, its share of the steps it ran in,
    its inter-token chunks and its TTFT, all on the lane's clock."""

    def __init__(self, label: str, scheduler: Scheduler, loop: ClosedLoop) -> None:
        self.label, self.scheduler, self.loop = label, scheduler, loop
        self.clock_s = 0.0
        self.sequence = {request_id: k for k, request_id in enumerate(loop.issued)}  # request_id -> k-th sent
        self.arrival_s = {request_id: 0.0 for request_id in loop.issued}  # lane clock at submit
        self.last_emit_s: dict[str, float] = {}  # lane clock of the request's latest token-emitting step
        self.tokens: dict[str, int] = {}
        self.cost_s: dict[str, float] = {}  # the request's share of the wall time of each step it ran in
        self.chunks: dict[str, list[list[float]]] = {}  # [ms, tokens] per token-emitting step after its first
        self.ttft_ms: dict[str, float] = {}
        self.widths: dict[str, list[int]] = {}  # the step's width, per step the request decoded in
        self.shapes: dict[str, list[list[float]]] = {}  # "batch x width" -> [step ms, predicted ms or None, tokens] per decode step
        scheduler.trace = []

    def step(self) -> None:
        """One scheduler step, timed; its wall time shared evenly by the requests it ran (decoded, or prefilled
        where nothing decoded): a step's time has no owner among its rows, and the shares add up to the clock."""
        self.scheduler.trace = []
        start = time.perf_counter()
        self.scheduler.step()
        wall_s = time.perf_counter() - start
        self.clock_s += wall_s
        for request_id in self.loop.issued.keys() - self.sequence.keys():  # sent during this step, in order
            self.sequence[request_id] = len(self.sequence)
            self.arrival_s[request_id] = self.clock_s
        decodes = self.scheduler.trace  # at most one decode step per scheduler step
        rows = [row for decode in decodes for row in decode["rows_id"]] or [r.request_id for r in self.scheduler.running]
        for request_id in rows:
            self.cost_s[request_id] = self.cost_s.get(request_id, 0.0) + wall_s / len(rows)
        for decode in decodes:
            predicted = decode.get("predicted_ms")
            self.shapes.setdefault(f"{decode['batch']}x{decode['width']}", []).append(
                [round(1e3 * wall_s, 2), None if predicted is None else round(predicted, 2), decode["emitted"]])
            for request_id, emitted, before in zip(decode["rows_id"], decode["rows_emitted"], decode["rows_before"]):
                self.widths.setdefault(request_id, []).append(decode["width"])
                if emitted <= 0:
                    continue
                self.tokens[request_id] = self.tokens.get(request_id, 0) + emitted
                if before == 0:
                    self.ttft_ms[request_id] = 1e3 * (self.clock_s - self.arrival_s[request_id])
                else:
                    self.chunks.setdefault(request_id, []).append([round(1e3 * (self.clock_s - self.last_emit_s[request_id]), 3), emitted])
                self.last_emit_s[request_id] = self.clock_s

    def done(self, request_id: str) -> bool:
        """The request committed all its tokens (EOS is ignored: it runs to its max_tokens). One that ended
        otherwise (an error, a timeout) raises: the lanes would no longer measure the same work, and the run would
        wait for it forever."""
        request = getattr(self.loop, "requests", {}).get(request_id)
        if request is not None and request.finish_reason not in (None, "length"):
            raise RuntimeError(f"lane {self.label!r}: request {request_id} ended {request.finish_reason!r} ({request.error}) before its "
                               f"max_tokens; every lane must serve the same requests to the end: fix the cause and run again")
        return self.tokens.get(request_id, 0) >= self.loop.issued[request_id][1]

    def done_up_to(self, count: int) -> int:
        """How many of the first `count` requests sent are done."""
        return sum(1 for request_id, k in self.sequence.items() if k < count and self.done(request_id))

    def piece(self, block: int, first: int, stop: int) -> dict:
        """The requests sent k-th for first <= k < stop, as bench_slices.summarize reads a slice: their tokens over
        their shares of the lane's time, their ITL chunks and widths, and their TTFTs."""
        ids = [request_id for request_id, k in self.sequence.items() if first <= k < stop]
        return {
            "lane": self.label, "round": block, "requests": len(ids), "tokens": sum(self.tokens.get(i, 0) for i in ids),
            "wall_s": sum(self.cost_s.get(i, 0.0) for i in ids), "steps": sum(len(self.widths.get(i, [])) for i in ids),
            "itl_chunks": [c for i in ids for c in self.chunks.get(i, [])], "widths": [w for i in ids for w in self.widths.get(i, [])],
            "ttft_ms": [self.ttft_ms[i] for i in ids if i in self.ttft_ms],
        }


def make_lanes(target, lanes: list[str], concurrency: int, prompts: list[torch.Tensor], max_tokens: int, spread: float,
               gamma_max: int, cost_model) -> list[Lane]:
    """One server per lane at this concurrency, each with the same clients: the k-th request any lane's clients send
    has the same prompt and length in every lane (ClosedLoop sequenced, one seed)."""
    max_seq_len = max(int(p.numel()) for p in prompts) + round(max_tokens * (1 + spread)) + 1
    built = []
    for lane in lanes:
        _, label, gamma = lane_label(lane, 4, gamma_max)
        policy = lane_policy(lane, gamma, copy.deepcopy(cost_model))  # each learns its own copy
        weight = lane_prior_weight(lane)
        scheduler = Scheduler(target, "ngram", policy, num_slots=concurrency, max_seq_len=max_seq_len, max_waiting=concurrency,
                              **({} if weight is None else {"request_prior_weight": weight}))
        built.append(Lane(label, scheduler, ClosedLoop(scheduler, prompts, concurrency, max_tokens, spread, seed=concurrency, sequenced=True)))
    return built


def run_lockstep(lanes: list[Lane], requests: int, blocks: int, warmup_requests: int, progress=None) -> list[dict]:
    """Measure the requests sent k-th, warmup_requests <= k < warmup_requests + requests, the same ones in every
    lane, in `blocks` blocks of consecutive k; one piece per (lane, block) (Lane.piece).

    Ticks step every lane once, in a Williams order per tick, and a lane steps (its clients keeping its batch
    full) until the requests up to the end of the current block are done, then waits for the others: a barrier
    at the end of the warm-up and of every block. Why: lanes that keep pace on the whole still drift apart by
    seconds within a run (one lane's easy stretch is another's hard one), and this host has slow stretches of
    seconds; without the barrier one lane's block lands in a slow stretch and the other lane's in a fast one,
    and the per-block ratios, the bootstrap's rounds, carry the host's noise again (a first version without it,
    at C=1, paired block ratios of 0.4 to 4.5 around a pooled 1.0). A lane waiting at the barrier does not step,
    so its clock, and what it measures, do not move."""
    labels = [lane.label for lane in lanes]
    by_label = {lane.label: lane for lane in lanes}
    bounds = [warmup_requests + requests * b // blocks for b in range(blocks + 1)]
    tick = 0
    for barrier in bounds:
        while True:
            done = {lane.label: lane.done_up_to(barrier) for lane in lanes}
            if progress is not None:
                progress(sum(lane.done_up_to(bounds[-1]) for lane in lanes))
            if all(n == barrier for n in done.values()):
                break
            for label in lane_order(labels, tick, "balanced"):
                if done[label] < barrier:
                    by_label[label].step()
            tick += 1
    return [lane.piece(b, bounds[b], bounds[b + 1]) for lane in lanes for b in range(blocks)]


def is_twin(label: str) -> bool:
    """A tagged lane ('fixed g=4 #b'): a second server of its setting (serving_table.base_lane)."""
    return base_lane(label) != label


def judge(pieces: list[dict], labels: list[str], blocks: int) -> dict:
    """bench_slices.summarize over the blocks, twins left out of the lanes judged; each twin against its setting as
    adaptive is judged (its distance from 1 is the judge's own noise); TTFT percentiles per lane."""
    rounds = list(range(blocks))
    judged = [label for label in labels if not is_twin(label)]
    summary = summarize([p for p in pieces if p["lane"] in judged], judged, rounds)
    for label in judged:
        ttft = [x for p in pieces if p["lane"] == label for x in p["ttft_ms"]]
        summary["lanes"][label]["ttft_p50_ms"] = float(np.percentile(ttft, 50)) if ttft else None
        summary["lanes"][label]["ttft_p95_ms"] = float(np.percentile(ttft, 95)) if ttft else None
    if "best_other" in summary:
        summary["itl_vs_best"] = itl_ratios(pieces, "adaptive", summary["best_other"], rounds)
    summary["twins"] = {}
    for twin in [label for label in labels if is_twin(label)]:
        base = base_lane(twin)
        if base not in judged:
            continue
        pair = [{**p, "lane": "adaptive"} if p["lane"] == twin else p for p in pieces if p["lane"] in (twin, base)]
        control = summarize(pair, ["adaptive", base], rounds)
        summary["twins"][twin] = {"against": base, "ratio": control["ratio"], "ci95": control["ci95"],
                                  "throughput_tok_s": control["lanes"]["adaptive"]["throughput_tok_s"]}
    return summary


def itl_ratios(pieces: list[dict], lane: str, other: str, rounds: list[int], seed: int = 0) -> dict:
    """lane / other for ITL per chunk p50 and per token mean (lower is better: <= 1 is no worse), each with a 95%
    bootstrap interval over blocks (a block's chunks of both lanes kept together: the same requests, the same host)."""
    chunks = {(p["lane"], p["round"]): p["itl_chunks"] for p in pieces if p["lane"] in (lane, other)}

    def ratios(picked: list[int]) -> tuple[float, float]:
        mine = [c for r in picked for c in chunks.get((lane, r), [])]
        theirs = [c for r in picked for c in chunks.get((other, r), [])]
        if not mine or not theirs:
            return math.nan, math.nan
        per_chunk = float(np.median([ms for ms, _ in mine]) / np.median([ms for ms, _ in theirs]))
        per_token = (sum(ms for ms, _ in mine) / sum(n for _, n in mine)) / (sum(ms for ms, _ in theirs) / sum(n for _, n in theirs))
        return per_chunk, per_token

    rng = random.Random(seed)
    boot = np.array([ratios([rng.choice(rounds) for _ in rounds]) for _ in range(1000)])
    chunk, token = ratios(rounds)
    return {
        "chunk_p50": chunk, "chunk_p50_ci95": [float(np.nanpercentile(boot[:, 0], 2.5)), float(np.nanpercentile(boot[:, 0], 97.5))],
        "token_mean": token, "token_mean_ci95": [float(np.nanpercentile(boot[:, 1], 2.5)), float(np.nanpercentile(boot[:, 1], 97.5))],
    }


def line(concurrency: int, summary: dict) -> str:
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


def table(record: dict) -> list[str]:
    """Markdown: one row per (C, lane), with TTFT, then the verdict per C (line)."""
    return slices_table(record, verdict=line, ttft=True)


def shape_table(record: dict) -> list[str]:
    """Markdown: per (C, lane, shape) of the full-batch decode steps: count, median step ms (the lane's clock, the
    whole scheduler step), the adaptive lane's mean predicted ms (its plan's target step, live correction in)
    over the mean measured, and tokens per ms (sum / sum)."""
    rows = ["| C | lane | batch x width | steps | step ms (median) | predicted / measured (mean) | tokens per step | tokens / ms |",
            "|---|---|---|---|---|---|---|---|"]
    for point in record["points"]:
        for lane, shapes in point.get("shapes", {}).items():
            for shape, steps in sorted(shapes.items(), key=lambda kv: [int(x) for x in kv[0].split("x")]):
                if int(shape.split("x")[0]) != point["concurrency"]:
                    continue
                predicted = [(p, ms) for ms, p, _ in steps if p is not None]
                ratio = f"{sum(p for p, _ in predicted) / sum(ms for _, ms in predicted):.3f}" if predicted else "-"
                rows.append(f"| {point['concurrency']} | {lane} | {shape} | {len(steps)} | {statistics.median(ms for ms, _, _ in steps):.1f} | "
                            f"{ratio} | {statistics.fmean(n for _, _, n in steps):.2f} | {sum(n for _, _, n in steps) / sum(ms for ms, _, _ in steps):.4f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto", help="auto (the runtime's default), float32 or bfloat16")
    parser.add_argument("--gamma-max", type=int, default=8, help="adaptive lane's gamma_max")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--lanes", default="off,fixed=2,fixed=4,fixed=8,adaptive,fixed=4#b",
                        help="comma list of off, fixed=G, adaptive, adaptive:key=value[:key=value] (prior, margin, probe, objective: "
                             "bench_serving.lane_options), each with an optional #tag (a twin)")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per lane and concurrency (the same ones in every lane)")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of requests / blocks finishes: the bootstrap's rounds")
    parser.add_argument("--warmup-requests", type=int, default=0, help="requests every lane finishes before measuring (default 2 x C)")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean tokens per request")
    parser.add_argument("--length-spread", type=float, default=0.5, help="each request's max_tokens is uniform in max_tokens * (1 +- this)")
    parser.add_argument("--prompts", default="repetitive", choices=sorted(PROMPTS))
    parser.add_argument("--out", type=Path, default=Path("bench/out/lockstep"))
    parser.add_argument("--table", default=None, help="comma list of results.json: print their markdown tables, judged again (no run)")
    parser.add_argument("--plot", type=Path, default=None, help="with --table, plot their points together into this PNG")
    args = parser.parse_args()
    if args.table:
        record = {"points": []}
        for path in args.table.split(","):  # several runs' points, each judged again from its kept blocks
            run = json.loads(Path(path).read_text())
            for point in run["points"]:
                record["points"].append({**point, "summary": judge(point["blocks"], point["lanes"], int(run["args"]["blocks"]))})
        record["points"].sort(key=lambda point: point["concurrency"])
        print("\n".join(table(record) + [""] + shape_table(record)))
        if args.plot:
            plot(record, args.plot, titles=PLOT_TITLES)
            print(f"wrote {args.plot}")
        return
    lanes = args.lanes.split(",")
    if args.blocks < 2 or args.requests < args.blocks or args.warmup_requests < 0:
        raise SystemExit(f"--requests {args.requests} (>= --blocks), --blocks {args.blocks} (>= 2), --warmup-requests {args.warmup_requests} (>= 0)")
    labels = [lane_label(lane, 4, args.gamma_max)[1] for lane in lanes]  # parses every lane before the model loads
    if len(set(labels)) < len(labels):
        raise SystemExit(f"--lanes {args.lanes}: two lanes have one label; tag a second server of one setting (fixed=4#b)")

    console = Console(width=190)
    dtype = resolve_dtype(args.dtype)
    target = load_model(args.target, dtype=dtype)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS[args.prompts]]
    cost_model = None
    if any(lane.startswith("adaptive") for lane in lanes):
        with console.status("calibrating the adaptive policy's cost model"):
            cost_model = calibrate_cost_model(target.model, None, gamma_max=args.gamma_max)
        console.print(f"cost model: {cost_model.to_dict()['target_ms']}")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "dtype": str(dtype), "points": []}
    start = time.perf_counter()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with Progress(console=console) as progress:
        for concurrency in concurrencies:
            warmup = args.warmup_requests or 2 * concurrency
            task = progress.add_task(f"C={concurrency}: requests finished, all lanes", total=len(lanes) * (warmup + args.requests))
            built = make_lanes(target, lanes, concurrency, prompts, args.max_tokens, args.length_spread, args.gamma_max, cost_model)
            pieces = run_lockstep(built, args.requests, args.blocks, warmup, progress=lambda done, task=task: progress.update(task, completed=done))
            summary = judge(pieces, labels, args.blocks)
            adaptive = next((lane for lane in built if lane.label == "adaptive"), None)
            record["points"].append({
                "concurrency": concurrency, "summary": summary,
                "requests_finished": {lane.label: lane.loop.finished for lane in built},
                "adaptive": adaptive.scheduler.policy.describe() if adaptive is not None else None,
                "cost_models": {lane.label: lane.scheduler.policy.cost_model.to_dict() for lane in built if hasattr(lane.scheduler.policy, "cost_model")},
                "lanes": labels, "blocks": pieces,  # --table judges these again
                "shapes": {lane.label: lane.shapes for lane in built},  # every decode step, warm-up included
            })
            console.print(line(concurrency, summary))
            del built, adaptive
    record["sweep_s"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=1))
    plot(record, args.out / "serving_lockstep.png", titles=PLOT_TITLES)
    console.print(f"sweep {record['sweep_s']:.0f} s; wrote {args.out / 'results.json'} and {args.out / 'serving_lockstep.png'}")
    for row in table(record) + [""] + shape_table(record):
        console.print(row)


if __name__ == "__main__":
    main()
