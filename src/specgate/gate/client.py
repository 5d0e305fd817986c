"""An async OpenAI-compatible streaming client that times every request, and the two load shapes.

Per request (seconds, client clock, from sending the request):
- TTFT: until the first streamed chunk carrying text;
- e2e: until the stream ends ([DONE]);
- ITL (inter-token latency, per token): a chunk arriving d s after the previous one and carrying k tokens
  gives k samples of d / k (speculative decoding streams several tokens per chunk; counting chunks as tokens,
  as some benchmarks do, would make it look slower than it is). k is apportioned from the request's
  completion_tokens (the `usage` of the final chunk) in proportion to each chunk's characters;
- chunk gap: the raw time between chunks (what a reader sees), kept beside ITL;
- TPOT (time per output token after the first): (e2e - TTFT) / (completion_tokens - 1).

Load shapes: `closed_loop` (C workers, each sends its next request when the previous one ends) and
`open_loop` (Poisson arrivals at a target QPS, whatever the server's state).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestSpec:
    prompt_id: str
    category: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = True
    stop: list[str] | None = None
    top_p: float | None = None  # a replayed log's own sampling settings (None: the engine's default)
    top_k: int | None = None
    arrival_s: float | None = None  # a replayed log's arrival time, from its first request (--arrivals recorded)


@dataclass
class RequestRecord:
    """One request's timings and output (the per-request JSONL row)."""

    config: str
    phase: str
    prompt_id: str
    category: str
    load: float  # concurrency (closed loop) or QPS (open loop)
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0  # relative to the phase start
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    chunk_gaps_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)  # each text chunk's arrival, from sending the request
    chunk_tokens: list[int] = field(default_factory=list)  # tokens apportioned to each chunk (sum = completion_tokens)
    block: int | None = None  # the paired round (block) of a measured window
    draft_tokens: int | None = None  # from the response's `timings` (llama.cpp: draft_n), where the engine sends them
    accepted_tokens: int | None = None  # (llama.cpp: draft_n_accepted)
    draft_steps: int | None = None  # the request's drafts (specgate's `timings.draft_steps`; llama.cpp sends none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CANCELLED = "cancelled: the round ended while it ran"


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split `total` tokens over chunks in proportion to `weights` (characters), each chunk >= 1 when possible."""
    n = len(weights)
    if n == 0:
        return []
    if total <= n:
        return [1] * total + [0] * (n - total)
    base = [1] * n
    extra = total - n
    w = np.asarray(weights, dtype=float)
    share = w / w.sum() * extra if w.sum() > 0 else np.full(n, extra / n)
    floors = np.floor(share).astype(int)
    remainder = extra - int(floors.sum())
    order = np.argsort(-(share - floors), kind="stable")[:remainder]
    floors[order] += 1
    return [b + int(f) for b, f in zip(base, floors)]


def token_latencies(chunk_times_s: list[float], tokens: list[int]) -> list[float]:
    """Per-token ITL samples from chunk arrival times and the tokens apportioned to each chunk (module docstring)."""
    out: list[float] = []
    for i in range(1, len(chunk_times_s)):
        gap = chunk_times_s[i] - chunk_times_s[i - 1]
        if tokens[i] > 0:
            out.extend([gap / tokens[i]] * tokens[i])
    return out


class Client:
    """Streams /v1/completions from one OpenAI-compatible endpoint (httpx, one connection pool)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0), limits=httpx.Limits(max_connections=256))

    async def close(self) -> None:
        await self.http.aclose()

    def _body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": spec.ignore_eos,
        }
        if self.model:
            body["model"] = self.model
        if spec.seed is not None:
            body["seed"] = spec.seed
        if spec.stop:
            body["stop"] = spec.stop
        if spec.top_p is not None:
            body["top_p"] = spec.top_p
        if spec.top_k is not None:
            body["top_k"] = spec.top_k
        return body

    async def complete(self, spec: RequestSpec, record: RequestRecord, on_first_token: Callable[[], None] | None = None) -> RequestRecord:
        """Send one streamed completion and fill `record` (errors are recorded, never raised); `on_first_token` is
        called when the first chunk with text arrives."""
        start = time.perf_counter()
        chunk_times: list[float] = []
        chunk_chars: list[int] = []
        pieces: list[str] = []
        try:
            async with self.http.stream("POST", f"{self.base_url}/v1/completions", json=self._body(spec)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    record.error = f"HTTP {response.status_code}: {body[:200]}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        record.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                        return record
                    if obj.get("usage"):
                        record.completion_tokens = int(obj["usage"].get("completion_tokens", 0))
                    read_timings(obj.get("timings"), record)
                    for choice in obj.get("choices") or []:
                        text = choice.get("text") or ""
                        if text:
                            if not chunk_times and on_first_token is not None:
                                on_first_token()
                            chunk_times.append(time.perf_counter() - start)
                            chunk_chars.append(len(text))
                            pieces.append(text)
                        if choice.get("finish_reason"):
                            record.finish_reason = choice["finish_reason"]
        except asyncio.CancelledError:  # a round ended with this request in flight: its chunks so far still count
            record.error, record.chunk_times_s, record.chunk_tokens = CANCELLED, chunk_times, [1] * len(chunk_times)
            raise
        except Exception as exc:  # connection refused / reset / timeout: the server may have died
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            return record
        record.e2e_s = time.perf_counter() - start
        record.text = "".join(pieces)
        if chunk_times:
            record.ttft_s = chunk_times[0]
            record.completion_tokens = record.completion_tokens or len(chunk_times)
            record.chunk_gaps_s = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
            record.chunk_times_s = chunk_times
            record.chunk_tokens = apportion(max(record.completion_tokens, len(chunk_times)), chunk_chars)
            record.itl_s = token_latencies(chunk_times, record.chunk_tokens)
            if record.completion_tokens > 1:
                record.tpot_s = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)
        record.ok = True
        return record


def read_timings(timings: Any, record: RequestRecord) -> None:
    """llama.cpp's per-response `timings`: drafted and accepted tokens of this request (absent elsewhere)."""
    if isinstance(timings, dict) and "draft_n" in timings:
        record.draft_tokens = int(timings["draft_n"])
        record.accepted_tokens = int(timings.get("draft_n_accepted", 0))
        if "draft_steps" in timings:
            record.draft_steps = int(timings["draft_steps"])


def sum_timings(records: Sequence[RequestRecord]) -> dict[str, int] | None:
    """Drafted and accepted tokens summed over the requests that reported timings; None when none did."""
    timed = [r for r in records if r.draft_tokens is not None]
    if not timed:
        return None
    return {"draft_tokens": sum(r.draft_tokens for r in timed), "accepted_tokens": sum(r.accepted_tokens or 0 for r in timed), "requests": len(timed)}


@dataclass
class PhaseResult:
    records: list[RequestRecord]
    wall_s: float

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]


async def closed_loop(
    client: Client, specs: list[RequestSpec], concurrency: int, *, config: str, phase: str,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseResult:
    """Send every spec with `concurrency` workers; each starts its next request when the previous one ends."""
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def worker() -> None:
        while True:
            try:
                spec = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            record = RequestRecord(config, phase, spec.prompt_id, spec.category, concurrency, start_s=time.perf_counter() - start)
            records.append(await client.complete(spec, record))
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return PhaseResult(records, time.perf_counter() - start)


async def open_loop(
    client: Client, specs: list[RequestSpec], qps: float, *, config: str, phase: str, seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseResult:
    """Send the specs at Poisson arrival times (rate `qps` per second, seeded), not waiting for answers."""
    if not qps > 0:
        raise ValueError(f"--qps {qps} must be > 0 (requests per second of the open-loop Poisson arrivals)")
    gaps_s = np.random.default_rng(seed).exponential(1.0 / qps, size=len(specs))
    arrivals_s = np.cumsum(gaps_s) - gaps_s[0]  # the first request at t = 0
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def one(spec: RequestSpec, at_s: float) -> None:
        await asyncio.sleep(max(at_s - (time.perf_counter() - start), 0.0))
        record = RequestRecord(config, phase, spec.prompt_id, spec.category, qps, start_s=time.perf_counter() - start)
        records.append(await client.complete(spec, record))
        if on_done is not None:
            on_done(record)

    await asyncio.gather(*(one(spec, float(at)) for spec, at in zip(specs, arrivals_s)))
    return PhaseResult(records, time.perf_counter() - start)


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summarise(result: PhaseResult) -> dict[str, Any]:
    """Latency percentiles and throughput of one phase (over its successful requests)."""
    ok = result.ok
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    gaps = [x for r in ok for x in r.chunk_gaps_s]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(result.records), "ok": len(ok), "failed": len(result.records) - len(ok), "wall_s": result.wall_s,
        "output_tokens": tokens, "decode_s_sum": sum(r.e2e_s - r.ttft_s for r in ok if r.e2e_s is not None and r.ttft_s is not None),
        "output_tokens_per_s": tokens / result.wall_s if result.wall_s > 0 else None,
        "requests_per_s": len(ok) / result.wall_s if result.wall_s > 0 else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_s": percentile(itl, 50), "itl_p95_s": percentile(itl, 95),
        "chunk_gap_p50_s": percentile(gaps, 50), "chunk_gap_p95_s": percentile(gaps, 95),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p95_s": percentile(tpot, 95),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
        "errors": sorted({r.error for r in result.records if r.error})[:5],
    }
