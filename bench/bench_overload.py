"""Overload: 10x the server's capacity for 60 s on loopback; every request must be answered and nothing leak.

The server is a real `specgate serve` subprocess (default Gemma-3-270M float32, n-gram drafts, fixed gamma
4, 8 KV slots, 64 waiting). Two phases, one process:
  1. capacity: `--max-num-seqs` closed-loop clients for `--capacity-s` seconds; capacity C = completed
     requests / second (each request: a prompt from a fixed pool, `--max-tokens` tokens, ignore_eos, greedy).
  2. overload: open-loop Poisson arrivals at `--factor` x C for `--duration-s` seconds, each request with a
     client timeout (`--client-timeout-s`), then wait for every answer.
Checks (all must hold for PASS):
  - every request is answered: HTTP 200 with a completion, or 429 / 503 carrying Retry-After and an
    OpenAI-style error object; no other status, no transport error;
  - no hung connection: zero client timeouts;
  - memory bounded: server RSS (VmRSS from /proc/PID/status, sampled every 0.5 s) peaks less than
    `--rss-growth-mib` above its value at the start of the overload phase;
  - afterwards /metrics shows 0 running, 0 waiting and 0 KV slots in use;
  - SIGTERM then drains the idle server and it exits 0.
Run it under the shared lock (it loads Gemma and keeps both cores busy for ~3 minutes):
    flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_overload.py --json-out out/overload.json
Quick check of the script on a small model:
    .venv/bin/python bench/bench_overload.py --target PATH --capacity-s 5 --duration-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

PROMPTS = [
    "Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy: apple,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue in two sentences.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
console = Console(stderr=True)


def rss_mib(pid: int) -> float:
    """Resident set size of process pid in MiB, from /proc/PID/status (VmRSS, kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gauges(url: str) -> dict[str, float]:
    wanted = ("num_requests_running", "num_requests_waiting", "kv_slots_in_use")
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in wanted:
            if line.startswith(f"specgate:{name}{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def start_server(args) -> tuple[subprocess.Popen, dict]:
    cmd = [
        sys.executable, "-m", "specgate", "serve", "--target", args.target, "--draft", "ngram", "--policy", "fixed", "--gamma", "4",
        "--port", "0", "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting), "--dtype", args.dtype, "--json",
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


async def one_request(client: httpx.AsyncClient, args, outcomes: list[dict]) -> None:
    body = {"prompt": random.choice(PROMPTS), "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    record: dict = {"start_s": start}
    try:
        response = await client.post("/v1/completions", json=body)
        record["status"] = response.status_code
        record["retry_after"] = response.headers.get("retry-after")
        payload = response.json()
        if response.status_code == 200:
            record["ok"] = payload["usage"]["completion_tokens"] == args.max_tokens
        else:
            record["ok"] = set(payload.get("error", {})) == {"message", "type", "param", "code"}
    except httpx.TimeoutException as exc:
        record["status"], record["ok"] = f"client timeout ({type(exc).__name__})", False
    except httpx.HTTPError as exc:
        record["status"], record["ok"] = f"transport error ({type(exc).__name__})", False
    record["latency_s"] = time.perf_counter() - start
    outcomes.append(record)


async def capacity_phase(client, args, progress) -> tuple[float, list[dict]]:
    outcomes: list[dict] = []
    task = progress.add_task("capacity (closed loop)", total=args.capacity_s)
    deadline = time.perf_counter() + args.capacity_s

    async def worker() -> None:
        while time.perf_counter() < deadline:
            await one_request(client, args, outcomes)

    start = time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(args.max_num_seqs)]
    while not all(w.done() for w in workers):
        progress.update(task, completed=min(time.perf_counter() - start, args.capacity_s))
        await asyncio.sleep(0.5)
    wall_s = time.perf_counter() - start
    done = sum(1 for o in outcomes if o["status"] == 200)
    return done / wall_s, outcomes


async def overload_phase(client, args, rate_per_s: float, pid: int, progress) -> tuple[list[dict], list[tuple[float, float]], float]:
    outcomes: list[dict] = []
    rss: list[tuple[float, float]] = []
    rng = random.Random(args.seed)
    tasks = []
    task = progress.add_task(f"overload ({rate_per_s:.1f} req/s)", total=args.duration_s)
    start = time.perf_counter()
    next_arrival, next_sample = start, start
    while time.perf_counter() - start < args.duration_s:
        now = time.perf_counter()
        if now >= next_sample:
            rss.append((now - start, rss_mib(pid)))
            next_sample += 0.5
            progress.update(task, completed=now - start)
        if now >= next_arrival:
            tasks.append(asyncio.create_task(one_request(client, args, outcomes)))
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


async def main_async(args) -> dict:
    proc, info = start_server(args)
    url = info["url"]
    try:
        timeout = httpx.Timeout(args.client_timeout_s, connect=10.0, pool=args.client_timeout_s)
        limits = httpx.Limits(max_connections=args.max_connections, max_keepalive_connections=args.max_connections)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
            with Progress(console=console, transient=True) as progress:
                capacity, warm = await capacity_phase(client, args, progress)
                rss_start = rss_mib(proc.pid)
                outcomes, rss, sent_s = await overload_phase(client, args, args.factor * capacity, proc.pid, progress)
        after = gauges(url)
        statuses = Counter(str(o["status"]) for o in outcomes)
        refused = [o for o in outcomes if o["status"] in (429, 503)]
        unanswered = [o for o in outcomes if not o["ok"] or o["status"] not in (200, 429, 503)]
        no_retry_after = [o for o in refused if not o["retry_after"]]
        timeouts = [o for o in outcomes if "timeout" in str(o["status"])]
        served = sorted(o["latency_s"] for o in outcomes if o["status"] == 200)
        rss_peak = max(r for _, r in rss)
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=120)
        result = {
            "target": args.target, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "max_waiting": args.max_waiting, "max_tokens": args.max_tokens,
            "capacity_req_per_s": capacity, "capacity_requests": len(warm), "factor": args.factor,
            "offered_req_per_s": args.factor * capacity, "duration_s": args.duration_s, "sent": len(outcomes),
            "sent_req_per_s": len(outcomes) / sent_s, "statuses": dict(statuses),
            "served": len(served), "refused_429_503": len(refused), "refused_without_retry_after": len(no_retry_after),
            "unanswered_or_malformed": len(unanswered), "client_timeouts": len(timeouts),
            "served_latency_p50_s": served[len(served) // 2] if served else None,
            "served_latency_max_s": served[-1] if served else None,
            "refused_latency_max_s": max((o["latency_s"] for o in refused), default=None),
            "rss_start_mib": rss_start, "rss_peak_mib": rss_peak, "rss_end_mib": rss[-1][1],
            "metrics_after": after, "sigterm_exit_code": exit_code,
        }
        checks = {
            "every request answered (200, or 429/503 with Retry-After)": not unanswered and not no_retry_after,
            "no hung connection (0 client timeouts)": not timeouts,
            f"RSS peak < start + {args.rss_growth_mib} MiB": rss_peak < rss_start + args.rss_growth_mib,
            "metrics after: 0 running, 0 waiting, 0 KV slots": after and all(v == 0 for v in after.values()) and len(after) == 3,
            "SIGTERM exit 0": exit_code == 0,
        }
        result["checks"] = checks
        result["verdict"] = "PASS" if all(checks.values()) else "FAIL"
        return result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m", help="Model to serve (gemma-3-270m or a local HF dir).")
    parser.add_argument("--dtype", default="float32", help="Weights dtype of the served model (specgate serve --dtype).")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--factor", type=float, default=10.0, help="Offered load / measured capacity.")
    parser.add_argument("--client-timeout-s", type=float, default=180.0)
    parser.add_argument("--max-connections", type=int, default=512)
    parser.add_argument("--rss-growth-mib", type=float, default=256.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None, help="Also write the result JSON here.")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    for name, ok in result["checks"].items():
        console.print(f"{'[green]ok[/]' if ok else '[bold red]FAILED[/]'}  {name}")
    console.print(f"verdict: {result['verdict']}")
    sys.exit(0 if result["verdict"] == "PASS" else 1)


if __name__ == "__main__":
    main()
