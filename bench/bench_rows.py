"""Wide verification forwards (batch x tokens past 64 rows): the C path's row limit for bf16 weights, old against new.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_rows.py [--shapes 16x4,16x5,8x9,12x9,16x9] [--repeats 7]

Why: a serving step at concurrency B verifying gamma drafts per request scores B x (gamma + 1) tokens in one
forward. Up to 64 real tokens the runtime ran the whole decoder stack as one C call; past 64 every layer went back
to torch ops, where each bf16 weight is upcast to float32 in chunks before a float32 GEMM. On Gemma-3-270M that
doubled a step for 25% more rows (the serving calibration of 2026-12-01, docs/BENCHMARKS.md: batch 16 x 4 tokens 259 ms,
x 5 tokens 538 ms; batch 8 x 8 252 ms, x 9 543 ms), so fixed gamma 4 at concurrency 16 and gamma 8 at 8 ran
into a cliff that is the runtime's, not speculation's.

What: for each shape, a target forward of B rows x T tokens (positions after a 100-token prefill, logits into a
kept buffer, as the scheduler does) with the C path's bf16 row limit at `--old` (64, the previous limit) and at
the runtime's (native.BF16_LAYER_MAX_ROWS / BF16_HEAD_MAX_ROWS), interleaved repeat by repeat in one process:
the median ms of each and new / old. Also the 64-row shapes (16x4, 8x8), which both limits run the same way:
their ratio is the noise floor of the comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.models import load_model, native
from specgate.models.transformer import LogitsBuffer


def forward_ms(model, batch: int, tokens: int, context: int = 100) -> float:
    cache = model.new_cache(batch, context + tokens + 1)
    buffer = LogitsBuffer(model.vocab_size)
    generator = torch.Generator().manual_seed(batch * 100 + tokens)
    with torch.inference_mode():
        prompt = torch.randint(4, 1000, (batch, context), generator=generator)  # [B, L]
        model.forward(prompt, torch.arange(context)[None].expand(batch, -1), cache, torch.arange(batch), logits=False)
        ids = torch.randint(4, 1000, (batch, tokens), generator=generator)  # [B, T]
        positions = torch.arange(context, context + tokens)[None].expand(batch, -1)  # [B, T]
        model.forward(ids, positions, cache, torch.arange(batch), out=buffer.view(batch, tokens))  # warm-up
        start = time.perf_counter()
        model.forward(ids, positions, cache, torch.arange(batch), out=buffer.view(batch, tokens))
        return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--shapes", default="16x4,8x8,16x5,8x9,12x9,16x9", help="comma list of BATCHxTOKENS")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--old", type=int, default=64, help="the previous bf16 row limit (layers and head)")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    model = load_model(args.target, dtype=torch.bfloat16).model
    new = (native.BF16_LAYER_MAX_ROWS, native.BF16_HEAD_MAX_ROWS)
    times: dict = {(s, lane): [] for s in shapes for lane in ("old", "new")}
    console = Console(width=160)
    with Progress(console=console) as progress:
        task = progress.add_task("forwards", total=args.repeats * len(shapes) * 2)
        for repeat in range(args.repeats):
            for shape in shapes:
                for lane in (("old", "new") if repeat % 2 == 0 else ("new", "old")):
                    native.BF16_LAYER_MAX_ROWS, native.BF16_HEAD_MAX_ROWS = (args.old, args.old) if lane == "old" else new
                    times[(shape, lane)].append(forward_ms(model, *shape))
                    progress.advance(task)
    native.BF16_LAYER_MAX_ROWS, native.BF16_HEAD_MAX_ROWS = new
    console.print(f"bf16 weights, row limit old {args.old} / new {new[0]} (layers), {new[1]} (head); median of {args.repeats}, interleaved")
    console.print("| batch x tokens | rows | old limit ms | new limit ms | new / old |")
    console.print("|---|---|---|---|---|")
    for batch, tokens in shapes:
        old_ms, new_ms = (statistics.median(times[((batch, tokens), lane)]) for lane in ("old", "new"))
        console.print(f"| {batch} x {tokens} | {batch * tokens} | {old_ms:.0f} | {new_ms:.0f} | {new_ms / old_ms:.2f} |")


if __name__ == "__main__":
    main()
