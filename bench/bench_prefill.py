"""Prefill on the GGUF runtime: a long prompt in chunks through the C stack against the dequantize-and-multiply path.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_prefill.py [--lengths 64,161,222,480,1000] [--repeats 5] [--compare chunking|attention]

Why: a prompt's prefill is the time to first token, and in a short completion a large share of the whole request:
on the held-out bench_draft prompts (222 tokens) it was ~0.5 s against ~1.1 s for 64 greedy tokens, which held the
speculative lanes' end-to-end speedup well below their decode speedup. Past QUANT_MAX_ROWS (160) tokens the
runtime left its C kernels for a path that dequantizes every weight per call.

What: per length, the median ms of a prefill each way, interleaved repeat by repeat in one process, and chunked /
upcast (the method: specgate.bench.prefill). Lengths within the limit run the same way both times: the noise floor.
--compare attention: the C stack's attention in its AVX2 and AVX-512 variants instead, the same way.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import Progress

from specgate.bench.prefill import COMPARISONS, lanes_ms, parse_lengths, prefill_table
from specgate.models import load_model, native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m", help="a .gguf, or the embedded default (its Q4_K_M blocks)")
    parser.add_argument("--lengths", default="64,161,222,480,1000", help="comma list of prompt lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="chunking",
                        help="chunking: chunks through the C stack vs the upcast path; attention: the stack's AVX-512 attention vs AVX2")
    args = parser.parse_args()
    try:
        lengths = parse_lengths(args.lengths)
    except ValueError as error:
        parser.error(f"--lengths: {error}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: time at least one prefill each way (>= 1)")
    model = load_model(args.target, dtype="gguf").model
    console = Console(width=160)
    with Progress(console=console) as progress:
        task = progress.add_task("prefills", total=args.repeats * len(lengths) * 2)
        try:
            times = lanes_ms(model, lengths, args.repeats, args.compare, lambda: progress.advance(task))
        except ValueError as error:
            parser.error(f"--compare {args.compare}: {error}")
    for line in prefill_table(times, native.QUANT_MAX_ROWS, args.repeats):
        console.print(line)


if __name__ == "__main__":
    main()
