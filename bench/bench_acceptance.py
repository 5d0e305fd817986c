"""How well the serving scheduler's live acceptance estimates predict what its lookup drafts then do.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_acceptance.py --concurrency 4 --seconds 150 --out bench/out/acceptance_c4

One scheduler (n-gram drafts, greedy, the bench_serving.py "repetitive" prompts, closed loop as bench_slices.py)
serves for --seconds with one policy. Every decode step records, per running request, the acceptance profile
the policy was given (conditional rates per draft position), its cap and gamma, and the lookup proposal (up to
8 tokens). Greedy output is deterministic, so once the requests have produced their tokens each proposal's true
match length is known, and with it what ANY gamma would have accepted at that step. Reported:
- per draft position k, the mean estimated a_k against the rate at which position k was accepted given 1..k-1
  were (calibration of the estimates);
- the same by quantile of the estimate (how much a request's own estimate tells: regression to the mean);
- grouped by the width the policy chose, the accepted drafts per row predicted (estimates x the adaptive policy's
  token factor) and realized had width W run, for W = 1..8: the counterfactual the policy's choice rests on;
- with --prior-weights 1,2,4,8,16,32: each request's estimate re-blended from the same counts with each weight of
  the traffic's profile, scored (Brier, log loss) on every tested position: the weight that predicts the next
  drafts best (run 41 set acceptance.REQUEST_PRIOR_WEIGHT by it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import PROMPTS, resolve_dtype  # noqa: E402
from bench_slices import ClosedLoop  # noqa: E402

from specgate.models import load_model  # noqa: E402
from specgate.serving import Scheduler, calibrate_cost_model, make_policy  # noqa: E402
from specgate.serving.acceptance import FLAT_PRIOR  # noqa: E402


def collect(args) -> dict:
    target = load_model(args.target, dtype=resolve_dtype(args.dtype))
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS["repetitive"]]
    max_seq_len = max(int(p.numel()) for p in prompts) + round(args.max_tokens * 1.5) + 1
    cost = calibrate_cost_model(target.model, None, gamma_max=8) if args.policy == "adaptive" else None
    policy = make_policy(args.policy, gamma=args.gamma, cost_model=cost)
    scheduler = Scheduler(target, "ngram", policy, num_slots=args.concurrency, max_seq_len=max_seq_len, max_waiting=args.concurrency)
    log: list[dict] = []
    lookups, choose = scheduler._lookups, policy.choose

    weights = [float(w) for w in args.prior_weights.split(",")] if args.prior_weights else []

    def recording_lookups(running, states, budgets):  # the proposals, with where each request stood
        out = lookups(running, states, budgets)
        prior = scheduler.traffic_acceptance.profile(FLAT_PRIOR)  # what the step's profiles blend in (same stats)
        log.append({"rows": [(r, len(r.tokens), list(p)) for r, p in zip(running, out)],
                    "alternatives": [[r.acceptance_stats.profile(prior, weight=w)[:8].tolist() for w in weights] for r in running]})
        return out

    def recording_choose(acceptance, caps=None):  # what the policy was told and chose
        gammas = choose(acceptance, caps)
        factor = policy.token_factor() if hasattr(policy, "token_factor") else 1.0
        log[-1].update(profiles=[np.asarray(a, dtype=float)[:8].tolist() for a in acceptance], caps=list(caps), gammas=list(gammas), token_factor=factor)
        return gammas

    scheduler._lookups, policy.choose = recording_lookups, recording_choose
    loop = ClosedLoop(scheduler, prompts, args.concurrency, args.max_tokens, 0.5, seed=args.concurrency)
    start = time.perf_counter()
    with Progress() as progress:
        task = progress.add_task(f"serving C={args.concurrency}", total=args.seconds)
        while (elapsed := time.perf_counter() - start) < args.seconds:
            scheduler.step()
            progress.update(task, completed=elapsed)
    steps = []
    for entry in log:
        if "gammas" not in entry:
            continue
        rows = []
        for (request, at, proposal), profile, cap, gamma, alternatives in zip(entry["rows"], entry["profiles"], entry["caps"], entry["gammas"], entry["alternatives"]):
            known = request.tokens[at : at + len(proposal)]
            matched = next((k for k, (a, b) in enumerate(zip(known, proposal)) if a != b), len(known))
            resolved = matched < len(known) or len(known) == len(proposal)
            row = {"m": matched, "len": len(proposal), "resolved": resolved, "profile": profile, "cap": cap, "gamma": int(gamma)}
            if weights:
                row["alternatives"] = [[round(x, 5) for x in a] for a in alternatives]
            rows.append(row)
        steps.append({"rows": rows, "token_factor": entry["token_factor"]})
    return {"args": {k: str(v) for k, v in vars(args).items()}, "requests_finished": loop.finished, "steps": steps, "prior_weights": weights}


def position_tests(steps: list[dict], key=lambda row: row["profile"]) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Every tested draft position k (1..8) of the rows: the estimate of a_k (key(row)[k-1]) and the outcome (1 if
    accepted). Position k is tested where positions 1..k-1 were accepted (the true match length m >= k - 1)."""
    estimated, realized = defaultdict(list), defaultdict(list)
    for step in steps:
        for row in step["rows"]:
            profile = key(row)
            for k in range(1, min(row["len"], 8) + 1):
                if row["m"] >= k - 1:
                    estimated[k].append(profile[k - 1])
                    realized[k].append(float(row["m"] >= k))
    return estimated, realized


def quantile_cells(estimated: np.ndarray, realized: np.ndarray) -> list[str]:
    """'mean estimated / accepted rate' of the rows split at the 10/25/50/75% quantiles of their estimate (5 cells)."""
    bins = np.searchsorted(np.quantile(estimated, [0.1, 0.25, 0.5, 0.75]), estimated, side="right")  # 0..4
    return [f"{estimated[bins == b].mean():.3f} / {realized[bins == b].mean():.3f}" if (bins == b).any() else "-" for b in range(5)]


def shrinkage_lines(steps: list[dict], weights: list[float]) -> list[str]:
    """The request estimates re-blended with other prior weights (the same counts and traffic prior at each step):
    the Brier score and log loss of every tested position, and the calibration of position 1 by quantile. The
    weight with the lowest scores predicts the next drafts best."""
    lines = ["", "Prior weight of a request's estimate (pseudo-tests of the traffic's profile; the scheduler's is "
             "acceptance.REQUEST_PRIOR_WEIGHT): scores over all tested positions 1-8, and position 1 by quantile (estimated / accepted)", "",
             "| prior weight | tests | Brier | log loss | a_1 lowest 10% | 10-25% | 25-50% | 50-75% | top 25% |", "|---|---|---|---|---|---|---|---|---|"]
    for index, weight in enumerate(weights):
        estimated, realized = position_tests(steps, key=lambda row, i=index: row["alternatives"][i])
        e = np.concatenate([np.array(estimated[k]) for k in estimated])
        y = np.concatenate([np.array(realized[k]) for k in realized])
        clipped = np.clip(e, 1e-6, 1 - 1e-6)
        brier = float(np.mean((e - y) ** 2))
        log_loss = float(-np.mean(y * np.log(clipped) + (1 - y) * np.log(1 - clipped)))
        cells = quantile_cells(np.array(estimated[1]), np.array(realized[1]))
        lines.append(f"| {weight:g} | {e.size} | {brier:.4f} | {log_loss:.4f} | " + " | ".join(cells) + " |")
    return lines


def report(record: dict, concurrency: int) -> list[str]:
    steps = [s for s in record["steps"] if len(s["rows"]) == concurrency and all(r["resolved"] for r in s["rows"])]
    lines = [f"{len(steps)} full-batch steps whose proposals are all resolved", "", "| position k | tests | mean estimated a_k | accepted rate |", "|---|---|---|---|"]
    estimated, realized = position_tests(steps)
    lines += [f"| {k} | {len(estimated[k])} | {np.mean(estimated[k]):.3f} | {np.mean(realized[k]):.3f} |" for k in sorted(estimated)]
    lines += ["", "By estimate (rows split at the 10/25/50/75% quantiles of their estimated a_k): mean estimated / accepted rate", ""]
    lines += ["| position k | lowest 10% | 10-25% | 25-50% | 50-75% | top 25% |", "|---|---|---|---|---|---|"]
    for k in (1, 2, 3):
        e, y = np.array(estimated[k]), np.array(realized[k])
        if not e.size:
            continue
        lines.append(f"| {k} | " + " | ".join(quantile_cells(e, y)) + " |")
    lines += ["", "| chosen width | steps | " + " | ".join(f"W={w}" for w in range(1, 9)) + " |", "|---" * 10 + "|"]
    by_width: dict[int, list] = defaultdict(list)
    for step in steps:
        by_width[max(r["gamma"] for r in step["rows"])].append(step)
    for width, group in sorted(by_width.items()):
        cells = []
        for w in range(1, 9):
            predicted = actual = 0.0
            for step in group:
                for row in step["rows"]:
                    g = min(w, row["cap"])
                    predicted += float(np.sum(np.cumprod(row["profile"][:g]))) * step["token_factor"] if g else 0.0
                    actual += min(row["m"], g)
            scale = 1.0 / (len(group) * concurrency)
            cells.append(f"{predicted * scale:.2f} / {actual * scale:.2f}")
        lines.append(f"| {width} | {len(group)} | " + " | ".join(cells) + " |")
    lines += ["", "cells: accepted drafts per row, predicted / realized, had width W run at those steps"]
    if record.get("prior_weights"):
        lines += shrinkage_lines(steps, record["prior_weights"])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed"])
    parser.add_argument("--gamma", type=int, default=8, help="fixed: gamma; adaptive: gamma_max")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prior-weights", default="", help="comma-separated prior weights to score the request estimates with (e.g. 1,2,4,8,16)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/acceptance"))
    parser.add_argument("--report", type=Path, default=None, help="print the tables of an existing results.json (no run)")
    args = parser.parse_args()
    if args.report:
        record = json.loads(args.report.read_text())
        print("\n".join(report(record, int(record["args"]["concurrency"]))))
        return
    record = collect(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record))
    console = Console(width=190)
    for line in report(record, args.concurrency):
        console.print(line)
    console.print(f"wrote {args.out / 'results.json'} ({record['requests_finished']} requests finished)")


if __name__ == "__main__":
    main()
