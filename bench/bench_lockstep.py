"""Serving throughput per speculation setting, each lane its own server, all lanes stepped in lockstep.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_lockstep.py --concurrency 1,2,4,8,16 --requests 200
     .venv/bin/python bench/bench_lockstep.py --table out/lockstep/results.json   # the tables again (a comma list: runs together, --plot P.png)

The method (clients, lanes, lockstep, judge) is specgate.bench: see specgate/bench/lockstep.py. Writes
results.json (every block kept, so --table judges it again) and serving_lockstep.png into --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console

from specgate.bench.lockstep import lane_labels, retable, sweep
from specgate.bench.tables import lane_table, plot_sweep, shape_table
from specgate.bench.workloads import SERVING_PROMPTS
from specgate.models import load_model, resolve_dtype
from specgate.serving import calibrate_cost_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto", help="auto (the runtime's default), float32 or bfloat16")
    parser.add_argument("--gamma-max", type=int, default=8, help="adaptive lanes' gamma_max")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--lanes", default="off,fixed=2,fixed=4,fixed=8,adaptive,fixed=4#b",
                        help="comma list of off, fixed=G, adaptive, adaptive:key=value[:key=value] (prior, margin, probe: "
                             "specgate.bench.lanes.LANE_OPTIONS), each with an optional #tag (a twin)")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per lane and concurrency (the same ones in every lane)")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of consecutive requests: the bootstrap's rounds")
    parser.add_argument("--warmup-requests", type=int, default=0, help="requests every lane finishes before measuring (default 2 x C)")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean tokens per request")
    parser.add_argument("--length-spread", type=float, default=0.5, help="each request's max_tokens is uniform in max_tokens * (1 +- this)")
    parser.add_argument("--prompts", default="repetitive", choices=sorted(SERVING_PROMPTS))
    parser.add_argument("--out", type=Path, default=Path("out/lockstep"))
    parser.add_argument("--table", default=None, help="comma list of results.json: print their tables, judged again (no run)")
    parser.add_argument("--plot", type=Path, default=None, help="with --table, plot their points together into this PNG")
    return parser.parse_args()


def run(args: argparse.Namespace) -> dict:
    lanes = args.lanes.split(",")
    try:
        lane_labels(lanes, args.gamma_max)  # every lane parsed before the model loads
    except ValueError as error:
        raise SystemExit(f"--lanes: {error}") from None
    console = Console(width=190)
    dtype = resolve_dtype(args.dtype)
    target = load_model(args.target, dtype=dtype)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in SERVING_PROMPTS[args.prompts]]
    cost_model = None
    if any(lane.startswith("adaptive") for lane in lanes):
        with console.status("calibrating the adaptive policy's cost model"):
            cost_model = calibrate_cost_model(target.model, None, gamma_max=args.gamma_max)
    start = time.perf_counter()
    points = sweep(target, lanes, [int(c) for c in args.concurrency.split(",")], prompts, requests=args.requests, blocks=args.blocks,
                   warmup_requests=args.warmup_requests, max_tokens=args.max_tokens, spread=args.length_spread,
                   gamma_max=args.gamma_max, cost_model=cost_model, console=console)
    return {"args": {k: str(v) for k, v in vars(args).items()}, "dtype": str(dtype), "points": points, "sweep_s": time.perf_counter() - start}


def main() -> None:
    args = parse_args()
    if args.table:
        record = retable([Path(path) for path in args.table.split(",")])
        print("\n".join(lane_table(record) + [""] + shape_table(record)))
        if args.plot:
            plot_sweep(record, args.plot)
            print(f"wrote {args.plot}")
        return
    record = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=1))
    plot_sweep(record, args.out / "serving_lockstep.png")
    print("\n".join(lane_table(record) + [""] + shape_table(record)))
    print(f"sweep {record['sweep_s']:.0f} s; wrote {args.out / 'results.json'} and {args.out / 'serving_lockstep.png'}")


if __name__ == "__main__":
    main()
