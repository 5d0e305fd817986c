"""Paired, interleaved rounds: how the gate measures throughput so that neither warm-up nor drift decides.

A *round* is one server's steady-state window at one load. A *block* gives every server under comparison one
round at every load, the servers in alternating order (forward in even blocks, reversed in odd ones: ABBA for
two servers), so a linear drift of the machine lands on every server alike over two blocks. Every server of a
block gets the same request sequence (a permutation seeded by the block), and one server gets traffic at a time:
the others sit idle, so two measured servers never share the cores.

Inside a round:
- closed loop at concurrency n: n workers each send their next request when the previous one ends. The window
  opens once each of the first n requests has streamed its first token (ramp-up excluded), stays open
  `window_s`, and the load is kept up after it closes until every request that started inside it has finished
  (so none of them speeds up in a draining server); the requests still running are then cancelled;
- open loop (Poisson arrivals at `qps`, seeded by the block): the window opens after a warm-up of
  `poisson_warmup_s(window_s)` and closes `window_s` later; arrivals continue until the requests that arrived
  inside it have finished.
The server's Prometheus counters are read when the window opens and when it closes: acceptance comes from
their deltas over exactly the window. Throughput, closed loop: the output tokens streamed inside the window / its
length (each chunk carries the tokens apportioned to it, `client.apportion`); open loop: the output tokens of the
requests that arrived inside the window / the time from its opening until the last of them finished (as `vllm bench
serve` divides by the benchmark's duration: a server that keeps up shows the offered rate, one that falls behind
stretches the span; counting tokens streamed inside the window would add the arrivals' edge effects to the noise).
Latencies (TTFT, ITL, TPOT) come from the requests that started inside the window.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specgate.gate import client as gate_client
from specgate.gate import prom

STEPS_PER_WINDOW = 150  # a window spans at least this many decode steps: one step is under 0.7% of it
RAMP_TIMEOUT_S = 120.0


@dataclass
class Load:
    """A load shape: closed loop at `concurrency`, or open-loop Poisson arrivals at `qps` (set once known)."""

    name: str  # "c1", "c4", "poisson"
    concurrency: int | None = None
    qps: float | None = None

    @property
    def closed(self) -> bool:
        return self.concurrency is not None


def closed(concurrency: int) -> Load:
    return Load(f"c{concurrency}", concurrency=concurrency)


POISSON = "poisson"


def poisson_warmup_s(window_s: float) -> float:
    """Arrivals before an open-loop window opens: a third of the window, at most 1.5 s (the queue reaches its regime)."""
    return min(window_s / 3.0, 1.5)


@dataclass
class Window:
    """One round of one server at one load: the steady-state window and the requests that started inside it."""

    config: str
    load: str
    block: int
    window_s: float
    tokens: float  # closed loop: output tokens streamed inside the window; open loop: those of the requests that arrived in it
    ramp_s: float  # from the round's start to the window's
    round_s: float  # the whole round, ramp and drain included
    sent: int  # requests sent in the round
    failed: int  # requests of the round that failed (cancelled ones excepted)
    spec: prom.SpecWindow | None  # counter deltas over the window (None: the server exports none)
    qps: float | None = None
    ttft_s: list[float] = field(default_factory=list)  # one per request that started inside the window and finished
    e2e_s: list[float] = field(default_factory=list)
    itl_s: list[list[float]] = field(default_factory=list)  # per request: its per-token ITL samples
    decode_s: float = 0.0  # sum of e2e - TTFT over those requests
    decode_tokens: int = 0  # sum of their completion tokens after the first
    chunk_gap_p50_s: float | None = None
    stage: str = ""  # the gate's stage that measured it ("screen" or "confirm")
    span_s: float | None = None  # open loop: from the window's opening to the last of its requests finishing

    @property
    def duration_s(self) -> float:
        """The throughput's denominator: the window (closed loop) or the span of its requests (open loop)."""
        return self.span_s if self.span_s else self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def tpot_s(self) -> float | None:
        """Decode time per output token of the window's requests (TPOT pooled over them)."""
        return self.decode_s / self.decode_tokens if self.decode_tokens > 0 else None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("spec", "itl_s")}
        out["spec"] = self.spec.to_dict() if self.spec is not None else None
        out["tokens_per_s"], out["tpot_s"] = self.tokens_per_s, self.tpot_s
        return out


class ServerGone(RuntimeError):
    """The server died or stopped answering during a round."""


Scrape = Callable[[], Awaitable[prom.SpecSnapshot | None]]


@dataclass
class Target:
    """One server under measurement: its client, a scrape of its counters, and a health check."""

    name: str
    client: gate_client.Client
    scrape: Scrape
    healthy: Callable[[], Awaitable[bool]]


def block_order(names: Sequence[str], block: int) -> list[str]:
    """Forward in even blocks, reversed in odd ones (ABBA for two; every server's mean position equal over two)."""
    return list(names) if block % 2 == 0 else list(reversed(names))


def block_sequence(specs: Sequence[gate_client.RequestSpec], block: int, seed: int) -> list[gate_client.RequestSpec]:
    """The block's request order: a permutation of `specs` seeded by the block, the same for every server."""
    order = np.random.default_rng([seed, block]).permutation(len(specs))
    return [specs[i] for i in order]


def cycle(specs: Sequence[gate_client.RequestSpec]) -> Iterator[gate_client.RequestSpec]:
    while True:
        yield from specs


def arrivals_s(qps: float, block: int, seed: int, horizon_s: float) -> list[float]:
    """Poisson arrival times over [0, horizon_s), seeded by the block (the same for every server of the block)."""
    rng = np.random.default_rng([seed, block, 7919])
    times, t = [], 0.0
    while t < horizon_s:
        times.append(t)
        t += float(rng.exponential(1.0 / qps))
    return times


class _Round:
    """The bookkeeping of one round: its records, the window's edges, and when its measured requests are done."""

    def __init__(self, target: Target, load: Load, block: int) -> None:
        self.target, self.load, self.block = target, load, block
        self.start = time.perf_counter()
        self.records: list[gate_client.RequestRecord] = []
        self.opened_at: float | None = None  # window edges, seconds from the round's start
        self.closed_at: float | None = None
        self.done = asyncio.Event()  # every request that started inside the window has finished

    def now(self) -> float:
        return time.perf_counter() - self.start

    def new_record(self) -> gate_client.RequestRecord:
        load = self.load.concurrency if self.load.closed else (self.load.qps or 0.0)
        record = gate_client.RequestRecord(self.target.name, self.load.name, "", "", float(load), start_s=self.now(), block=self.block)
        self.records.append(record)
        return record

    def measured(self, record: gate_client.RequestRecord) -> bool:
        return self.opened_at is not None and self.opened_at <= record.start_s and (self.closed_at is None or record.start_s < self.closed_at)

    def check_done(self) -> None:
        if self.closed_at is None:
            return
        pending = [r for r in self.records if self.measured(r) and r.e2e_s is None and r.error is None]
        if not pending:
            self.done.set()


async def _send(round_: _Round, spec: gate_client.RequestSpec, on_first_token: Callable[[], None] | None = None) -> gate_client.RequestRecord:
    record = round_.new_record()
    record.prompt_id, record.category = spec.prompt_id, spec.category
    await round_.target.client.complete(spec, record, on_first_token)
    round_.check_done()
    return record


async def closed_round(target: Target, load: Load, specs: Sequence[gate_client.RequestSpec], block: int, window_s: float) -> tuple[_Round, Any, Any]:
    """Run one closed-loop round; (its bookkeeping, the counters when the window opened, when it closed)."""
    n = int(load.concurrency or 1)
    round_ = _Round(target, load, block)
    sequence = cycle(specs)
    first_tokens = [0]
    ramped = asyncio.Event()

    def first_token() -> None:
        first_tokens[0] += 1
        if first_tokens[0] >= n:
            ramped.set()

    async def worker(index: int) -> None:
        await _send(round_, next(sequence), first_token)  # the first n requests set the ramp
        while not round_.done.is_set():
            await _send(round_, next(sequence))

    tasks = [asyncio.create_task(worker(i)) for i in range(n)]
    before, after = await _window(round_, tasks, ramped.wait(), window_s)
    return round_, before, after


def recorded_arrivals(specs: Sequence[gate_client.RequestSpec], horizon_s: float) -> list[tuple[float, gate_client.RequestSpec]]:
    """A request log's own arrivals (spec.arrival_s, from its first request) in its order, replayed again after its
    last request (one mean gap later) until `horizon_s`: the log's rate and burstiness, as long as a round needs."""
    ordered = sorted(specs, key=lambda spec: spec.arrival_s or 0.0)
    period = replay_period_s(ordered)
    out: list[tuple[float, gate_client.RequestSpec]] = []
    offset = 0.0
    while offset < horizon_s:
        out += [(offset + (spec.arrival_s or 0.0), spec) for spec in ordered if offset + (spec.arrival_s or 0.0) < horizon_s]
        offset += period
    return out


def replay_period_s(specs: Sequence[gate_client.RequestSpec]) -> float:
    """How long one pass of a log's arrivals lasts when replayed in a loop: its span plus one mean gap (1 s for a
    log of one request or of simultaneous ones)."""
    last = max(spec.arrival_s or 0.0 for spec in specs)
    return last + (last / (len(specs) - 1) if len(specs) > 1 and last > 0 else 1.0)


async def open_round(target: Target, load: Load, specs: Sequence[gate_client.RequestSpec], block: int, window_s: float, seed: int,
                     recorded: bool = False) -> tuple[_Round, Any, Any]:
    """Run one open-loop round: arrivals from the block's seeded Poisson process at load.qps, or (recorded) the
    requests' own arrival times in their own order."""
    round_ = _Round(target, load, block)
    warmup = poisson_warmup_s(window_s)
    horizon = warmup + 4.0 * window_s + 60.0  # far more than the round needs
    if recorded:
        schedule = recorded_arrivals(specs, horizon)
    else:
        sequence = cycle(specs)
        schedule = [(at, next(sequence)) for at in arrivals_s(float(load.qps or 1.0), block, seed, horizon)]
    requests: list[asyncio.Task] = []

    async def arrive() -> None:
        for at, spec in schedule:
            if round_.done.is_set():
                return
            await asyncio.sleep(max(at - round_.now(), 0.0))
            requests.append(asyncio.create_task(_send(round_, spec)))

    arrivals = asyncio.create_task(arrive())
    before, after = await _window(round_, [arrivals], asyncio.sleep(warmup), window_s, requests)
    return round_, before, after


async def _window(round_: _Round, tasks: list[asyncio.Task], ramp: Awaitable[Any], window_s: float,
                  extra: list[asyncio.Task] | None = None) -> tuple[Any, Any]:
    """Open the window after `ramp`, close it window_s later, keep the load until the window's requests finish,
    then cancel what still runs. A server that stops answering ends the round with ServerGone."""
    everything = lambda: tasks + (extra or [])  # noqa: E731 (open-loop requests join as they arrive)
    try:
        await _guarded(round_, ramp, RAMP_TIMEOUT_S, everything)
        round_.opened_at = round_.now()
        before = await round_.target.scrape()
        await asyncio.sleep(max(window_s - (round_.now() - round_.opened_at), 0.0))
        round_.closed_at = round_.opened_at + window_s
        after = await round_.target.scrape()
        round_.check_done()
        await _guarded(round_, round_.done.wait(), RAMP_TIMEOUT_S + window_s, everything)
    finally:
        for task in everything():
            task.cancel()
        await asyncio.gather(*everything(), return_exceptions=True)
    return before, after


async def _guarded(round_: _Round, waiting: Awaitable[Any], timeout_s: float, tasks: Callable[[], list[asyncio.Task]]) -> None:
    """Await `waiting`, failing fast when every request errs (a dead server) or the wait outlasts timeout_s."""
    waiter = asyncio.ensure_future(waiting)
    deadline = time.perf_counter() + timeout_s
    try:
        while not waiter.done():
            await asyncio.wait([waiter], timeout=0.05)
            failed = [r for r in round_.records if r.error and r.error != gate_client.CANCELLED]
            if len(failed) >= 3 and not await round_.target.healthy():
                raise ServerGone(f"{len(failed)} requests failed ({failed[0].error}) and /health does not answer")
            if all(t.done() for t in tasks()) and not waiter.done() and round_.records and all(r.error for r in round_.records):
                raise ServerGone(f"every request failed ({round_.records[0].error})")
            if time.perf_counter() > deadline:
                raise ServerGone(f"no progress within {timeout_s:.0f} s")
    finally:
        if not waiter.done():
            waiter.cancel()


def summarise_round(round_: _Round, before: prom.SpecSnapshot | None, after: prom.SpecSnapshot | None) -> Window:
    """The Window of a finished round: tokens streamed inside it, the counters' deltas, the measured requests."""
    t0, t1 = float(round_.opened_at or 0.0), float(round_.closed_at or 0.0)
    measured = [r for r in round_.records if round_.measured(r) and r.ok]
    span = None
    if round_.load.closed:
        tokens = float(sum(count for r in round_.records for at, count in zip(r.chunk_times_s, r.chunk_tokens) if t0 <= r.start_s + at < t1))
    else:
        tokens = float(sum(r.completion_tokens for r in measured))
        span = max((r.start_s + (r.e2e_s or 0.0) for r in measured), default=t1) - t0
    gaps = [g for r in measured for g in r.chunk_gaps_s]
    window = Window(
        config=round_.target.name, load=round_.load.name, block=round_.block, window_s=t1 - t0, tokens=tokens, ramp_s=t0,
        round_s=round_.now(), sent=len(round_.records),
        failed=sum(1 for r in round_.records if r.error and r.error != gate_client.CANCELLED),
        spec=prom.spec_window(before, after) if before is not None and after is not None else None,
        qps=round_.load.qps, ttft_s=[r.ttft_s for r in measured if r.ttft_s is not None],
        e2e_s=[r.e2e_s for r in measured if r.e2e_s is not None], itl_s=[r.itl_s for r in measured if r.itl_s],
        decode_s=sum(r.e2e_s - r.ttft_s for r in measured if r.e2e_s is not None and r.ttft_s is not None and r.completion_tokens > 1),
        decode_tokens=sum(r.completion_tokens - 1 for r in measured if r.ttft_s is not None and r.completion_tokens > 1),
        chunk_gap_p50_s=float(np.median(gaps)) if gaps else None, span_s=span,
    )
    return window


def window_length_s(round_s: float, step_s: float | None) -> float:
    """The window: --round-s, or longer where STEPS_PER_WINDOW steps need more time."""
    return max(round_s, STEPS_PER_WINDOW * step_s) if step_s and math.isfinite(step_s) else round_s
