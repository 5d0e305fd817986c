"""Wide verification forwards (batch x tokens past 64 rows): the C path's row limit for bf16 weights, old against new.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_rows.py [--shapes 16x4,16x5,8x9,12x9,16x9] [--repeats 7]

Why: a serving step at concurrency B verifying gamma drafts per request scores B x (gamma + 1) tokens in one
forward. Up to 64 real tokens the runtime ran the whole decoder stack as one C call; past 64 every layer went back
to torch ops, where each bf16 weight is upcast to float32 in chunks before a float32 GEMM. On Gemma-3-270M that
doubled a step for 25% more rows (the serving calibration of 2026-12-01, docs/BENCHMARKS.md: batch 16 x 4 tokens 259 ms,
x 5 tokens 538 ms; batch 8 x 8 252 ms, x 9 543 ms), so fixed gamma 4 at concurrency 16 and gamma 8 at 8 ran
into a cliff that is the runtime's, not speculation's.

What: for each shape, a target forward with the bf16 row limit at `--old` and at the runtime's, interleaved repeat
by repeat in one process: the median ms of each and new / old (the method: specgate.bench.rows). The 64-row
shapes (16x4, 8x8), which both limits run the same way, are the noise floor of the comparison.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.bench.rows import old_new_ms, parse_shapes, rows_table
from specgate.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--shapes", default="16x4,8x8,16x5,8x9,12x9,16x9", help="comma list of BATCHxTOKENS")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--old", type=int, default=64, help="the previous bf16 row limit (layers and head)")
    args = parser.parse_args()
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    model = load_model(args.target, dtype=torch.bfloat16).model
    console = Console(width=160)
    with Progress(console=console) as progress:
        task = progress.add_task("forwards", total=args.repeats * len(shapes) * 2)
        times = old_new_ms(model, shapes, args.repeats, args.old, lambda: progress.advance(task))
    for line in rows_table(times, args.old, args.repeats):
        console.print(line)


if __name__ == "__main__":
    main()
