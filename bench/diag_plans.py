"""Diagnosis: what the adaptive policy predicted for every width at the steps it ran, and what those steps did.

bench_serving.py's closed loop (greedy, 64 tokens a request, the "repetitive" prompts, n-gram drafts) on one adaptive
scheduler (gamma_max 8, its own calibration), a trace per point. Per point, the full-batch decode steps grouped
by the width the policy chose: steps, step ms measured (without draft passes) against predicted, tokens committed
against predicted, tokens per ms of step; then, per chosen width, the mean predicted goodput (tokens per ms) and
price of every width's plan at those steps (`Scheduler.trace`'s predicted_goodputs and predicted_plans). Shows
whether a choice rests on a wrong price, a wrong token estimate, or a flat landscape where widths differ by
less than the host's noise.

Run (C=4, 4 points of 48 requests, ~4 min on the 2-core VM with the calibration, alone under
flock /tmp/specgate-heavy.lock):
    .venv/bin/python bench/diag_plans.py --concurrency 4 --points 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import PROMPTS, resolve_dtype, run_point  # noqa: E402

from specgate.models import load_model  # noqa: E402
from specgate.serving import Scheduler, calibrate_cost_model, make_policy  # noqa: E402


def by_chosen_width(trace: list[dict], batch: int) -> dict[int, dict]:
    """Full-batch steps with a prediction, by the width chosen: count, mean measured / predicted step ms (measured
    without the draft passes, as the policy prices a step), mean committed / predicted tokens, tokens per ms of the
    whole step, and per plan width the mean predicted goodput and price at those steps."""
    out: dict[int, dict] = {}
    steps = [t for t in trace if t["batch"] == batch and t.get("predicted_ms") is not None]
    for width in sorted({t["width"] for t in steps}):
        chosen = [t for t in steps if t["width"] == width]
        plans: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for t in chosen:
            for goodput, (plan_width, _, ms) in zip(t.get("predicted_goodputs") or [], t.get("predicted_plans") or []):
                plans[int(plan_width)].append((goodput, ms))
        out[width] = {
            "steps": len(chosen),
            "measured_ms": statistics.fmean(t["step_ms"] - t["draft_ms"] for t in chosen),
            "predicted_ms": statistics.fmean(t["predicted_ms"] for t in chosen),
            "tokens": statistics.fmean(t["emitted"] for t in chosen),
            "predicted_tokens": statistics.fmean(t["predicted_tokens"] for t in chosen),
            "tokens_per_ms": sum(t["emitted"] for t in chosen) / sum(t["step_ms"] for t in chosen),
            "plans": {w: (statistics.fmean(g for g, _ in v), statistics.fmean(ms for _, ms in v)) for w, v in sorted(plans.items())},
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--points", type=int, default=4)
    parser.add_argument("--requests-per-point", type=int, default=48)
    parser.add_argument("--min-steps", type=int, default=5, help="print the plans of chosen widths with at least this many steps")
    args = parser.parse_args()
    target = load_model(args.target, dtype=resolve_dtype(args.dtype))
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS["repetitive"]]
    max_seq_len = max(int(p.numel()) for p in prompts) + 64 + 1
    cost = calibrate_cost_model(target.model, None, gamma_max=8)
    c = args.concurrency
    print(f"calibration at batch {c} (ms by tokens per row {cost.tokens}):", [round(cost.calibrated_ms(c, t), 1) for t in cost.tokens])
    scheduler = Scheduler(target, "ngram", make_policy("adaptive", gamma=8, cost_model=cost), num_slots=c, max_seq_len=max_seq_len, max_waiting=c)
    scheduler.start()
    run_point(scheduler, prompts, c, 1, 64)  # warm-up: one request per client
    scheduler.stop()
    for point in range(args.points):
        scheduler.start()
        row = run_point(scheduler, prompts, c, max(2, args.requests_per_point // c), 64)
        scheduler.stop()
        print(f"point {point}: {row['throughput_tok_s']:.1f} tok/s (steady window), mean gamma {row['mean_gamma']:.2f}")
        for width, g in by_chosen_width(scheduler.trace, c).items():
            print(f"  chose w{width}: {g['steps']:3d} steps, ms {g['measured_ms']:6.1f} measured / {g['predicted_ms']:6.1f} predicted, "
                  f"tokens {g['tokens']:5.1f} / {g['predicted_tokens']:5.1f}, {g['tokens_per_ms']:.3f} tok/ms")
            if g["steps"] >= args.min_steps and g["plans"]:
                print("      predicted goodput / ms of each width's plan there: "
                      + " ".join(f"w{w}:{gp:.3f}/{ms:.0f}" for w, (gp, ms) in g["plans"].items()))


if __name__ == "__main__":
    main()
