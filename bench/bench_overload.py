"""Overload: 10x the server's capacity for 60 s on loopback; every request must be answered and nothing leak.

The server is a real `specgate serve` subprocess (default Gemma-3-270M float32, n-gram drafts, fixed gamma
4, 8 KV slots, 64 waiting). Two phases, one process: capacity (closed-loop clients), then open-loop Poisson
arrivals at --factor x capacity; the checks (every request answered, no hung connection, RSS bounded, /metrics
idle afterwards, SIGTERM exits 0) must all hold for PASS. The method: specgate.bench.overload.
Run it under the shared lock (it loads Gemma and keeps both cores busy for ~3 minutes):
    flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_overload.py --json-out out/overload.json
Quick check of the script on a small model:
    .venv/bin/python bench/bench_overload.py --target PATH --capacity-s 5 --duration-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from specgate.bench.overload import OverloadSettings, run_overload


def parse_args() -> argparse.Namespace:
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
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    console = Console(stderr=True)
    settings = OverloadSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(OverloadSettings)})
    with Progress(console=console, transient=True) as progress:
        result = asyncio.run(run_overload(settings, progress))
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
