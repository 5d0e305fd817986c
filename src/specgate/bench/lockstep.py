"""The lockstep serving benchmark: every lane its own server, all lanes stepped in turn, each on its own clock.

Why: on a shared host the speed moves by 20-40% within seconds; a design that gives each lane its own stretch of
time (separate points, or slices of one scheduler) lets the host decide a 5% comparison. Here every lane is a whole
server (its own Scheduler: KV slots, per-request estimates, policy and its own copy of the calibration) with its
own C closed-loop clients, every lane serves the same sequence of requests (ClosedLoop sequenced), and the lanes
take turns one scheduler step at a time, in a Williams order per tick, waiting for each other at the end of each
block of requests. A lane's clock is the sum of its own steps' wall times (a closed loop with no think time is
never idle); a step's time is shared evenly by the requests it ran, so each request carries its part of the
clock, and throughput, TTFT and ITL are read on it. The blocks are the judge's rounds (judges.judge).
What lockstep cannot show: a lane's effect on the others' speed through shared caches (the twin control bounds
what is left).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.bench.clients import ClosedLoop
from specgate.bench.judges import judge
from specgate.bench.lanes import lane_label, lane_order, lane_policy, lane_prior_weight
from specgate.bench.tables import verdict_line
from specgate.serving import Scheduler


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
        self.shapes: dict[str, list[list]] = {}  # "batch x width" -> [step ms, predicted ms or None, tokens] per decode step
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
            self._record(decode, wall_s)

    def _record(self, decode: dict, wall_s: float) -> None:
        """A decode step's shape and, per row, its width, tokens, TTFT (first tokens) or ITL chunk (later ones)."""
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
        """The request committed all its tokens (EOS is ignored). One that ended otherwise (an error, a timeout)
        raises: the lanes would no longer measure the same work, and the run would wait for it forever."""
        request = getattr(self.loop, "requests", {}).get(request_id)
        if request is not None and request.finish_reason not in (None, "length"):
            raise RuntimeError(f"lane {self.label!r}: request {request_id} ended {request.finish_reason!r} ({request.error}) before its "
                               f"max_tokens; every lane must serve the same requests to the end: fix the cause and run again")
        return self.tokens.get(request_id, 0) >= self.loop.issued[request_id][1]

    def done_up_to(self, count: int) -> int:
        """How many of the first `count` requests sent are done."""
        return sum(1 for request_id, k in self.sequence.items() if k < count and self.done(request_id))

    def piece(self, block: int, first: int, stop: int) -> dict:
        """The requests sent k-th for first <= k < stop, as the judge reads a round: their tokens over their shares
        of the lane's time, their ITL chunks and widths, and their TTFTs."""
        ids = [request_id for request_id, k in self.sequence.items() if first <= k < stop]
        return {
            "lane": self.label, "round": block, "requests": len(ids), "tokens": sum(self.tokens.get(i, 0) for i in ids),
            "wall_s": sum(self.cost_s.get(i, 0.0) for i in ids), "steps": sum(len(self.widths.get(i, [])) for i in ids),
            "itl_chunks": [c for i in ids for c in self.chunks.get(i, [])], "widths": [w for i in ids for w in self.widths.get(i, [])],
            "ttft_ms": [self.ttft_ms[i] for i in ids if i in self.ttft_ms],
        }


def lane_labels(lanes: list[str], gamma_max: int) -> list[str]:
    """Every lane parsed (before a model loads); two lanes with one label are refused."""
    labels = [lane_label(lane, 4, gamma_max)[1] for lane in lanes]
    if len(set(labels)) < len(labels):
        raise ValueError(f"lanes {','.join(lanes)}: two lanes have one label; tag a second server of one setting (fixed=4#b)")
    return labels


def make_lanes(target, lanes: list[str], concurrency: int, prompts: list[torch.Tensor], max_tokens: int, spread: float,
               gamma_max: int, cost_model) -> list[Lane]:
    """One server per lane at this concurrency, each with the same clients: the k-th request any lane's clients send
    has the same prompt and length in every lane (ClosedLoop sequenced, one seed). Each adaptive lane learns its own
    copy of the calibration."""
    max_seq_len = max(int(p.numel()) for p in prompts) + round(max_tokens * (1 + spread)) + 1
    built = []
    for lane in lanes:
        _, label, gamma = lane_label(lane, 4, gamma_max)
        policy = lane_policy(lane, gamma, copy.deepcopy(cost_model))
        weight = lane_prior_weight(lane)
        scheduler = Scheduler(target, "ngram", policy, num_slots=concurrency, max_seq_len=max_seq_len, max_waiting=concurrency,
                              **({} if weight is None else {"request_prior_weight": weight}))
        built.append(Lane(label, scheduler, ClosedLoop(scheduler, prompts, concurrency, max_tokens, spread, seed=concurrency, sequenced=True)))
    return built


def run_lockstep(lanes: list[Lane], requests: int, blocks: int, warmup_requests: int, progress=None) -> list[dict]:
    """Measure the requests sent k-th, warmup_requests <= k < warmup_requests + requests, the same ones in every
    lane, in `blocks` blocks of consecutive k; one piece per (lane, block) (Lane.piece).

    Ticks step every lane once, in a Williams order per tick, and a lane steps (its clients keeping its batch full)
    until the requests up to the end of the current block are done, then waits for the others: a barrier at the end
    of the warm-up and of every block. Without it one lane's block lands in a slow stretch of the host and the
    other's in a fast one (a first version without it paired block ratios of 0.4 to 4.5 around a pooled 1.0 at
    C=1). A lane waiting at the barrier does not step, so its clock does not move. progress(done requests)."""
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


def point_record(concurrency: int, lanes: list[Lane], labels: list[str], pieces: list[dict], blocks: int) -> dict:
    """What results.json keeps of one concurrency: the verdict, the blocks (judged again by retable), the step shapes."""
    adaptive = next((lane for lane in lanes if lane.label == "adaptive"), None)
    return {
        "concurrency": concurrency, "summary": judge(pieces, labels, blocks),
        "requests_finished": {lane.label: lane.loop.finished for lane in lanes},
        "adaptive": adaptive.scheduler.policy.describe() if adaptive is not None else None,
        "cost_models": {lane.label: lane.scheduler.policy.cost_model.to_dict() for lane in lanes if hasattr(lane.scheduler.policy, "cost_model")},
        "lanes": labels, "blocks": pieces,
        "shapes": {lane.label: lane.shapes for lane in lanes},  # every decode step, warm-up included
    }


def sweep(target, lanes: list[str], concurrencies: list[int], prompts: list[torch.Tensor], *, requests: int, blocks: int,
          warmup_requests: int, max_tokens: int, spread: float, gamma_max: int, cost_model, console: Console) -> list[dict]:
    """One lockstep run per concurrency (warmup_requests 0: 2 x C), with a progress bar; the points of results.json."""
    if blocks < 2 or requests < blocks or warmup_requests < 0:
        raise ValueError(f"requests {requests} (>= blocks), blocks {blocks} (>= 2), warmup_requests {warmup_requests} (>= 0)")
    labels = lane_labels(lanes, gamma_max)
    points = []
    with Progress(console=console) as progress:
        for concurrency in concurrencies:
            warmup = warmup_requests or 2 * concurrency
            task = progress.add_task(f"C={concurrency}: requests finished, all lanes", total=len(lanes) * (warmup + requests))
            built = make_lanes(target, lanes, concurrency, prompts, max_tokens, spread, gamma_max, cost_model)
            pieces = run_lockstep(built, requests, blocks, warmup, progress=lambda done, task=task: progress.update(task, completed=done))
            points.append(point_record(concurrency, built, labels, pieces, blocks))
            console.print(verdict_line(concurrency, points[-1]["summary"]))
            del built
    return points


def retable(paths: list[Path]) -> dict:
    """Several runs' results.json as one record, every point judged again from its kept blocks, sorted by C."""
    points = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        for point in run["points"]:
            points.append({**point, "summary": judge(point["blocks"], point["lanes"], int(run["args"]["blocks"]))})
    return {"points": sorted(points, key=lambda point: point["concurrency"])}
