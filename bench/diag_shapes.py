"""Does a verification forward cost more after another shape, or with ragged rows? Gemma-3-270M, one batch size.

Run (batch 4, ~3 min on the 2-core VM, alone under flock /tmp/specgate-heavy.lock):
    .venv/bin/python bench/diag_shapes.py --batch 4 --rounds 40

The serving runs at C=4 (runs 32 and 36, docs/BENCHMARKS.md) measured the adaptive scheduler's width-4 target
forwards 8-14% slower than fixed gamma 4's, with as many or fewer tokens. The adaptive lane changes width about
every other step and gives rows different draft counts; fixed gamma 4 mostly repeats one shape. This times, in one
process and interleaved, the width-4 forward (batch x 5 tokens, as the scheduler calls it: one kept logits block,
then the max/argmax pass) right after a forward of another shape ("w4 after w8": the step before had 8 drafts a
row), and ragged width-4 forwards (some rows with fewer drafts, padded as the scheduler pads them). Each round
runs every case once in a shuffled order; a case is its preceding forward, untimed, then the timed one. Reported:
the median and the mean of the per-round times, and each case's median paired ratio to "w4 after w4".
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import resolve_dtype  # noqa: E402

from specgate.models import load_model, native  # noqa: E402
from specgate.models.transformer import LogitsBuffer  # noqa: E402


def parse_case(text: str, batch: int) -> tuple[str, list[int], list[int]]:
    """'w4<w8' -> (label, drafts per row of the timed forward, of the forward before). A width is wN (every row N
    drafts) or a '/'-joined list of per-row drafts (4/4/2/0)."""
    timed, _, before = text.partition("<")
    if not before:
        raise ValueError(f"case {text!r} needs 'TIMED<BEFORE', e.g. w4<w8 or 4/4/2/0<w4")

    def rows(part: str) -> list[int]:
        if part.startswith("w"):
            return [int(part[1:])] * batch
        drafts = [int(x) for x in part.split("/")]
        if len(drafts) != batch:
            raise ValueError(f"case {text!r}: {part!r} lists {len(drafts)} rows, the batch is {batch}")
        return drafts

    return text, rows(timed), rows(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=120, help="positions already in each row's cache")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--cases", default="w4<w4,w4<w8,w4<w1,w4<w0,4/4/4/0<w4,4/4/2/0<w4,4/4/2/0<w8,w8<w8,w8<w4")
    args = parser.parse_args()
    cases = [parse_case(c, args.batch) for c in args.cases.split(",")]
    model = load_model(args.target, dtype=resolve_dtype(args.dtype)).model
    batch, context = args.batch, args.context
    cache = model.new_cache(batch, context + 16)
    buffer = LogitsBuffer(model.vocab_size)
    buffer.view(batch, 9)  # the block at its largest before any timing, as a serving scheduler's after one wide step
    slots = torch.arange(batch)
    generator = torch.Generator().manual_seed(0)

    def forward(drafts: list[int]) -> float:
        width = max(drafts)
        ids = torch.randint(0, model.vocab_size, (batch, width + 1), generator=generator)
        positions = torch.full((batch, width + 1), -1, dtype=torch.int64)
        for row, n in enumerate(drafts):
            positions[row, : n + 1] = torch.arange(context - 1, context + n)
        start = time.perf_counter()
        logits = model.forward(ids, positions, cache, slots, out=buffer.view(batch, width + 1))
        native.max_argmax(logits)
        return 1e3 * (time.perf_counter() - start)

    times: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    with torch.inference_mode():
        prompt = torch.randint(0, model.vocab_size, (batch, context - 1), generator=generator)
        model.forward(prompt, torch.arange(context - 1)[None].expand(batch, -1), cache, slots, logits=False)
        for label, timed, before in cases:  # warm-up
            forward(before), forward(timed)
        rng = random.Random(0)
        for _ in range(args.rounds):
            order = list(cases)
            rng.shuffle(order)
            for label, timed, before in order:
                forward(before)
                times[label].append(forward(timed))
    base = times[cases[0][0]]
    print(f"batch {batch}, context {context}, {args.rounds} rounds (ms; paired ratio to {cases[0][0]}, median over rounds)")
    for label, _, _ in cases:
        ratio = statistics.median(t / b for t, b in zip(times[label], base))
        print(f"  {label:16s} median {statistics.median(times[label]):7.1f}  mean {statistics.fmean(times[label]):7.1f}  ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
