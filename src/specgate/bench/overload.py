"""Overload (bench/bench_overload.py): a real `specgate serve` subprocess at `factor` x its capacity on loopback.

Two phases, one process:
  1. capacity: `max_num_seqs` closed-loop clients for `capacity_s` seconds; capacity C = completed requests / second
     (each request: a prompt from workloads.OVERLOAD_PROMPTS, `max_tokens` tokens, ignore_eos, greedy).
  2. overload: open-loop Poisson arrivals at `factor` x C for `duration_s` seconds, each request with a client
     timeout, then wait for every answer.
Checks (overload_checks; all must hold for PASS): every request answered (HTTP 200 with a completion, or 429 / 503
with Retry-After and an OpenAI-style error object); no hung connection; server RSS (VmRSS, sampled every 0.5 s)
peaks less than `rss_growth_mib` above its value at the start of the overload; afterwards /metrics shows 0
running, 0 waiting and 0 KV slots in use; SIGTERM drains the idle server and it exits 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specgate.bench.workloads import OVERLOAD_PROMPTS


@dataclass
class OverloadSettings:
    """bench_overload.py's knobs (its --help says what each does)."""

    target: str = "gemma-3-270m"
    dtype: str = "float32"
    max_num_seqs: int = 8
    max_waiting: int = 64
    max_tokens: int = 32
    capacity_s: float = 20.0
    duration_s: float = 60.0
    factor: float = 10.0
    client_timeout_s: float = 180.0
    max_connections: int = 512
    rss_growth_mib: float = 256.0
    seed: int = 0


def rss_mib(pid: int) -> float:
    """Resident set size of process pid in MiB, from /proc/PID/status (VmRSS, kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gauges(url: str) -> dict[str, float]:
    """The server's running, waiting and KV-slot gauges from /metrics."""
    wanted = ("num_requests_running", "num_requests_waiting", "kv_slots_in_use")
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in wanted:
            if line.startswith(f"specgate:{name}{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def start_server(s: OverloadSettings) -> tuple[subprocess.Popen, dict]:
    """`specgate serve` (n-gram drafts, fixed gamma 4, port 0) and the JSON it prints once listening."""
    cmd = [
        sys.executable, "-m", "specgate", "serve", "--target", s.target, "--draft", "ngram", "--policy", "fixed", "--gamma", "4",
        "--port", "0", "--max-num-seqs", str(s.max_num_seqs), "--max-waiting", str(s.max_waiting), "--dtype", s.dtype, "--json",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    text = ""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the server exited before listening: {proc.stderr.read()[-2000:]}")
        text += line
        try:
            return proc, json.loads(text)
        except json.JSONDecodeError:
            continue


async def one_request(client: httpx.AsyncClient, max_tokens: int, outcomes: list[dict]) -> None:
    """One completion; appends {start_s, status, retry_after, ok, latency_s} (ok: a full completion, or a
    well-formed error object)."""
    body = {"prompt": random.choice(OVERLOAD_PROMPTS), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    record: dict = {"start_s": start}
    try:
        response = await client.post("/v1/completions", json=body)
        record["status"] = response.status_code
        record["retry_after"] = response.headers.get("retry-after")
        payload = response.json()
        if response.status_code == 200:
            record["ok"] = payload["usage"]["completion_tokens"] == max_tokens
        else:
            record["ok"] = set(payload.get("error", {})) == {"message", "type", "param", "code"}
    except httpx.TimeoutException as exc:
        record["status"], record["ok"] = f"client timeout ({type(exc).__name__})", False
    except httpx.HTTPError as exc:
        record["status"], record["ok"] = f"transport error ({type(exc).__name__})", False
    record["latency_s"] = time.perf_counter() - start
    outcomes.append(record)


async def capacity_phase(client, s: OverloadSettings, progress) -> tuple[float, list[dict]]:
    """(completed requests / s, outcomes) of max_num_seqs closed-loop clients over capacity_s seconds."""
    outcomes: list[dict] = []
    task = progress.add_task("capacity (closed loop)", total=s.capacity_s)
    deadline = time.perf_counter() + s.capacity_s

    async def worker() -> None:
        while time.perf_counter() < deadline:
            await one_request(client, s.max_tokens, outcomes)

    start = time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(s.max_num_seqs)]
    while not all(w.done() for w in workers):
        progress.update(task, completed=min(time.perf_counter() - start, s.capacity_s))
        await asyncio.sleep(0.5)
    done = sum(1 for o in outcomes if o["status"] == 200)
    return done / (time.perf_counter() - start), outcomes


async def overload_phase(client, s: OverloadSettings, rate_per_s: float, pid: int, progress) -> tuple[list[dict], list[tuple[float, float]], float]:
    """Poisson arrivals at rate_per_s for duration_s, then every answer awaited: (outcomes, [(s, RSS MiB)], send s)."""
    outcomes: list[dict] = []
    rss: list[tuple[float, float]] = []
    rng = random.Random(s.seed)
    tasks = []
    task = progress.add_task(f"overload ({rate_per_s:.1f} req/s)", total=s.duration_s)
    start = time.perf_counter()
    next_arrival, next_sample = start, start
    while time.perf_counter() - start < s.duration_s:
        now = time.perf_counter()
        if now >= next_sample:
            rss.append((now - start, rss_mib(pid)))
            next_sample += 0.5
            progress.update(task, completed=now - start)
        if now >= next_arrival:
            tasks.append(asyncio.create_task(one_request(client, s.max_tokens, outcomes)))
            next_arrival += rng.expovariate(rate_per_s)
            continue
        await asyncio.sleep(min(next_arrival, next_sample) - now)
    sent_s = time.perf_counter() - start
    drain = progress.add_task("waiting for every answer", total=len(tasks))
    while not all(t.done() for t in tasks):
        rss.append((time.perf_counter() - start, rss_mib(pid)))
        progress.update(drain, completed=sum(t.done() for t in tasks))
        await asyncio.sleep(0.5)
    progress.update(drain, completed=len(tasks))
    return outcomes, rss, sent_s


def outcome_counts(outcomes: list[dict]) -> dict[str, Any]:
    """Statuses, served / refused / unanswered / timeouts and the latencies, from the overload's outcomes."""
    refused = [o for o in outcomes if o["status"] in (429, 503)]
    served = sorted(o["latency_s"] for o in outcomes if o["status"] == 200)
    return {
        "statuses": dict(Counter(str(o["status"]) for o in outcomes)), "served": len(served), "refused_429_503": len(refused),
        "refused_without_retry_after": sum(1 for o in refused if not o["retry_after"]),
        "unanswered_or_malformed": sum(1 for o in outcomes if not o["ok"] or o["status"] not in (200, 429, 503)),
        "client_timeouts": sum(1 for o in outcomes if "timeout" in str(o["status"])),
        "served_latency_p50_s": served[len(served) // 2] if served else None,
        "served_latency_max_s": served[-1] if served else None,
        "refused_latency_max_s": max((o["latency_s"] for o in refused), default=None),
    }


def overload_checks(result: dict[str, Any], rss_growth_mib: float) -> dict[str, bool]:
    """The PASS conditions, by name, on a result record."""
    after = result["metrics_after"]
    return {
        "every request answered (200, or 429/503 with Retry-After)": not result["unanswered_or_malformed"] and not result["refused_without_retry_after"],
        "no hung connection (0 client timeouts)": not result["client_timeouts"],
        f"RSS peak < start + {rss_growth_mib} MiB": result["rss_peak_mib"] < result["rss_start_mib"] + rss_growth_mib,
        "metrics after: 0 running, 0 waiting, 0 KV slots": bool(after) and all(v == 0 for v in after.values()) and len(after) == 3,
        "SIGTERM exit 0": result["sigterm_exit_code"] == 0,
    }


async def run_overload(s: OverloadSettings, progress) -> dict[str, Any]:
    """Both phases on a fresh server, its gauges after, SIGTERM; the result record with its checks and verdict."""
    proc, info = start_server(s)
    url = info["url"]
    try:
        timeout = httpx.Timeout(s.client_timeout_s, connect=10.0, pool=s.client_timeout_s)
        limits = httpx.Limits(max_connections=s.max_connections, max_keepalive_connections=s.max_connections)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
            capacity, warm = await capacity_phase(client, s, progress)
            rss_start = rss_mib(proc.pid)
            outcomes, rss, sent_s = await overload_phase(client, s, s.factor * capacity, proc.pid, progress)
        after = gauges(url)
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=120)
        result = {
            "target": s.target, "dtype": s.dtype, "max_num_seqs": s.max_num_seqs, "max_waiting": s.max_waiting, "max_tokens": s.max_tokens,
            "capacity_req_per_s": capacity, "capacity_requests": len(warm), "factor": s.factor,
            "offered_req_per_s": s.factor * capacity, "duration_s": s.duration_s, "sent": len(outcomes),
            "sent_req_per_s": len(outcomes) / sent_s, **outcome_counts(outcomes),
            "rss_start_mib": rss_start, "rss_peak_mib": max(r for _, r in rss), "rss_end_mib": rss[-1][1],
            "metrics_after": after, "sigterm_exit_code": exit_code,
        }
        result["checks"] = overload_checks(result, s.rss_growth_mib)
        result["verdict"] = "PASS" if all(result["checks"].values()) else "FAIL"
        return result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
