"""Diagnosis: how efficient each lane's full-batch steps are, grouped by how many rows could draft.

bench_serving.py's closed loop (one length for every request, so the C requests turn over together), one scheduler
per lane, lanes rotated per repeat, a trace per point. A full-batch decode step is grouped by the rows whose drafts
available (`rows_caps`: the lookup's length, capped by the budget) reach --full-cap; per group and lane: steps,
tokens committed per ms of step, mean width. Where few rows can draft, a policy that prices the padded rectangle
(the adaptive default) runs narrower than fixed gamma 4; this shows what that costs per step. Lanes: fixed gamma
2 and 4, the adaptive policy (padded price), and the adaptive policy with `real_token_prices` (a step priced at its
real tokens), each adaptive lane on its own copy of one calibration.

Run (C=8, 4 repeats, ~7 min on the 2-core VM, alone under flock /tmp/specgate-heavy.lock):
    .venv/bin/python bench/diag_ragged.py --concurrency 8 --repeats 4
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import PROMPTS, run_point  # noqa: E402

from specgate.models import load_model  # noqa: E402
from specgate.serving import Scheduler, calibrate_cost_model, make_policy  # noqa: E402
from specgate.serving.policy import AdaptivePolicy  # noqa: E402


def group_of(caps: list[int], batch: int, full_cap: int) -> str:
    """A full-batch step's group by its rows able to draft >= full_cap tokens: all, all but 1-2, 3-5, or 0-2."""
    full = sum(c >= full_cap for c in caps)
    if full == batch:
        return "all"
    return "all but 1-2" if full >= batch - 2 else ("3-5" if full >= 3 else "0-2")


def efficiency(trace: list[dict], batch: int, full_cap: int, into: dict[str, list[float]]) -> None:
    """Adds each full-batch step of the trace to its group: [steps, tokens committed, step ms, width sum]."""
    for step in trace:
        if step["batch"] == batch:
            group = into.setdefault(group_of(step["rows_caps"], batch, full_cap), [0, 0.0, 0.0, 0.0])
            group[0] += 1
            group[1] += step["emitted"]
            group[2] += step["step_ms"]
            group[3] += step["width"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--requests-per-point", type=int, default=48)
    parser.add_argument("--full-cap", type=int, default=4, help="a row counts as able to draft with at least this many drafts available")
    args = parser.parse_args()
    target = load_model(args.target, dtype=torch.bfloat16)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS["repetitive"]]
    max_seq_len = max(int(p.numel()) for p in prompts) + 64 + 1
    cost = calibrate_cost_model(target.model, None, gamma_max=8)
    policies = {
        "fixed g=2": make_policy("fixed", gamma=2), "fixed g=4": make_policy("fixed", gamma=4),
        "adaptive": AdaptivePolicy(copy.deepcopy(cost), gamma_max=8),
        "adaptive real-token price": AdaptivePolicy(copy.deepcopy(cost), gamma_max=8, real_token_prices=True),
    }
    c = args.concurrency
    schedulers = {}
    for label, policy in policies.items():
        scheduler = schedulers[label] = Scheduler(target, "ngram", policy, num_slots=c, max_seq_len=max_seq_len, max_waiting=c)
        scheduler.start()
        run_point(scheduler, prompts, c, 1, 64)  # warm-up: one request per client
        scheduler.stop()
    groups: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)
    speed: dict[str, float] = collections.defaultdict(float)
    labels = list(policies)
    for repeat in range(args.repeats):
        for label in labels[repeat % len(labels):] + labels[: repeat % len(labels)]:
            scheduler = schedulers[label]
            scheduler.start()
            row = run_point(scheduler, prompts, c, max(2, args.requests_per_point // c), 64)
            scheduler.stop()
            speed[label] += row["throughput_tok_s"] / args.repeats
            efficiency(scheduler.trace, c, args.full_cap, groups[label])
    for label in labels:
        parts = ", ".join(
            f"{name}: {g[0]} steps {g[1] / g[2]:.4f} tok/ms width {g[3] / g[0]:.2f}" for name, g in sorted(groups[label].items())
        )
        print(f"{label}: {speed[label]:.1f} tok/s (mean of steady windows); full-batch steps by rows able to draft {args.full_cap}+: {parts}")


if __name__ == "__main__":
    main()
