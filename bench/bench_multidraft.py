"""Would tree (multi-draft) verification pay for the shipped EAGLE head on this runtime? Root acceptance with k
drafts against the cost of one more verified token.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_multidraft.py [--drafts 4] [--trials 32]

What: on the held-out bench_draft prompts (teacher-forced), the root's acceptance with 1..k drafts, greedy (the
target's argmax among the head's top k) and at temperature 1 (recursive rejection sampling without replacement,
Monte Carlo); and V(t), a batch-1 target pass of t tokens at the prompts' length in 1-token passes (the GGUF
runtime). A tree can pay only where an extra draft's gain exceeds the forward's cost of one more verified token
(V's mean slope; necessary, not sufficient: the method and its reasoning are in specgate.bench.multidraft).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from specgate.bench import floor
from specgate.bench.multidraft import greedy_top_k, multidraft_table, recursive_rejection, root_distributions
from specgate.bench.workloads import held_out_prompts
from specgate.drafting import make_drafter
from specgate.models import load_model

POSITION = 222  # the held-out prompts' length (tokens): where the verify cost is measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", type=int, default=4, help="the most drafts at the root (k)")
    parser.add_argument("--trials", type=int, default=32, help="Monte Carlo runs per position at temperature 1")
    args = parser.parse_args()
    if args.drafts < 2:
        parser.error(f"--drafts {args.drafts}: compare at least 2 drafts at the root (>= 2)")
    if args.trials < 1:
        parser.error(f"--trials {args.trials}: run at least one trial (>= 1)")
    target = load_model("gemma-3-270m", dtype="gguf")
    head = make_drafter("default", target).head
    with tempfile.TemporaryDirectory() as tmp:
        prompts = held_out_prompts(Path(tmp))
    console = Console(width=160)
    acceptance: dict[str, dict[str, list[float]]] = {}
    generator = torch.Generator().manual_seed(0)
    with Progress(console=console) as progress:
        task = progress.add_task("categories, then verify cost", total=len(prompts) + 1)
        for category, texts in prompts.items():
            p, q, top = root_distributions(target, head, texts, temperature=1.0)
            acceptance[category] = {"greedy": greedy_top_k(q, top, args.drafts),
                                    "T=1": recursive_rejection(p, q, args.drafts, args.trials, generator)}
            progress.advance(task)
        verify_cost, _ = floor.verification_cost(target.model, POSITION, widest=5, steps=9, rounds=3)
        progress.advance(task)
    for line in multidraft_table(acceptance, verify_cost):
        console.print(line)


if __name__ == "__main__":
    main()
