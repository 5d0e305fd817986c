"""Does a decode step cost more right after a wider one? Gemma-3-270M bf16, batch 16, in isolation.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_transition.py
Times batch-16 target forwards of 1 token per row (a step without drafts) and of 3 tokens per row (2 drafts each),
at position 200 of a 16-slot cache, into one kept logits buffer as the scheduler does: steady runs of one shape,
and the two shapes alternating. 3 rounds of 15 steps per case; medians per round. Written for the serving
diagnostic in docs/BENCHMARKS.md (Serving, run 5), where the adaptive lane's width-0 steps cost more than the off
lane's identical steps.
"""

from __future__ import annotations

import statistics
import time

import torch

from specgate.models import load_model

BATCH, CONTEXT, STEPS, ROUNDS = 16, 200, 15, 3


def main() -> None:
    model = load_model("gemma-3-270m", dtype=torch.bfloat16).model
    vocab = model.vocab_size
    cache = model.new_cache(BATCH, 512)
    buffer = torch.empty(BATCH * 9 * vocab)  # as Scheduler._logits_buffer: one block kept across steps
    slots = torch.arange(BATCH)
    with torch.inference_mode():
        ids = torch.ones(BATCH, CONTEXT, dtype=torch.int64)
        model.forward(ids, torch.arange(CONTEXT)[None].expand(BATCH, -1), cache, slots, logits=False)

        def step(width: int) -> float:
            ids = torch.ones(BATCH, width, dtype=torch.int64)  # [B, T]
            positions = torch.arange(CONTEXT, CONTEXT + width)[None].expand(BATCH, -1)  # [B, T]
            start = time.perf_counter()
            model.forward(ids, positions, cache, slots, out=buffer[: BATCH * width * vocab].view(BATCH, width, vocab))
            return (time.perf_counter() - start) * 1e3

        for _ in range(3):  # warm-up
            step(1), step(3)
        for index in range(ROUNDS):
            steady_1 = [step(1) for _ in range(STEPS)]
            pairs = [(step(3), step(1)) for _ in range(STEPS)]
            steady_3 = [step(3) for _ in range(STEPS)]
            print(f"round {index}: 16x1 steady {statistics.median(steady_1):.1f} ms | 16x1 right after 16x3 "
                  f"{statistics.median(p[1] for p in pairs):.1f} ms | 16x3 right after 16x1 {statistics.median(p[0] for p in pairs):.1f} ms | "
                  f"16x3 steady {statistics.median(steady_3):.1f} ms")


if __name__ == "__main__":
    main()
