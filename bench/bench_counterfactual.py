"""Counterfactuals of a measured sweep: what every width would have made in the states each lane really served.

Run: .venv/bin/python bench/bench_counterfactual.py --trace bench/out/slices_run28/results.json --outputs bench/out/replay_run24/greedy_outputs.json

Why: the replay (bench_replay.py) puts the adaptive policy at 0.99-1.04x the best fixed gamma with a sweep's own
step costs, while the sweep measured 0.90-0.95 at concurrency 2-8; the replay models the loop, so either its
states or its decisions differ from the machine's. Greedy decoding with n-gram drafts is deterministic, so a
sweep's trace (bench_slices.py --keep-steps, which names each row's request and records what the policy was given)
says, for every step that ran, each row's true match length: its context is its prompt plus the greedy output so
far, its lookup proposal a function of that context. Each step can then be re-decided offline, on the same state:
- the tokens every width w would have committed (each row drafting min(its lookups, w), as the adaptive plans and
  the fixed lanes do), priced at the sweep's mean step time for that many real tokens at that batch (the replay's
  cost table, bench_replay.cost_table): so each fixed width, the lane's own choices and the per-step best width
  (oracle) are compared on one lane's states, without the host's noise;
- for the adaptive lane, its predictions per width (expected tokens from its acceptance estimates, price from its
  live cost model, both in the trace) against those truths, and the choice each half of the prediction makes when
  the other half is true: whether the estimates or the prices cost it the gap.
A check first: each row's committed tokens must equal what its true match allows (a row whose live greedy output
left the target-alone output, by a near-tie computed in another shape, is counted and its steps skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import cost_table, greedy_outputs, step_ms  # noqa: E402

from specgate.drafting import NgramDrafter  # noqa: E402
from specgate.serving.policy import CostModel  # noqa: E402

WIDTHS = (0, 1, 2, 3, 4, 5, 6, 8)


def row_truths(step: dict, requests: dict, data: dict, lookup: int) -> list[tuple[int, int, int]] | None:
    """Per row (full lookups cap, true match length, tokens left) for one traced step; None if a row's committed
    tokens disagree with the target-alone greedy output (the live output diverged) or its request is unknown."""
    rows = []
    for rid, before, emitted, drafts in zip(step["rows_id"], step["rows_before"], step["rows_emitted"], step["rows_drafts"]):
        if rid not in requests:
            return None
        index, max_tokens = requests[rid]
        prompt, output = data["prompts"][index], data["outputs"][index]
        context = torch.tensor(prompt + output[:before], dtype=torch.int64)
        budget = max_tokens - before - 1
        proposal = NgramDrafter().propose(context, max(1, min(lookup, budget))).tokens.tolist()
        truth = output[before : before + len(proposal)]
        match = next((k for k, (a, b) in enumerate(zip(truth, proposal)) if a != b), len(truth))
        left = max_tokens - before
        if min(min(match, drafts) + 1, left) != emitted:
            return None
        rows.append((min(len(proposal), budget), match, left))
    return rows


def true_tokens(rows: list[tuple[int, int, int]], width: int) -> tuple[int, int]:
    """(committed tokens, drafts) of this step had every row drafted min(cap, width)."""
    gammas = [min(cap, width) for cap, _, _ in rows]
    return sum(min(min(m, g) + 1, left) for (_, m, left), g in zip(rows, gammas)), sum(gammas)


def analyse(record: dict, data: dict, lookup: int) -> list[dict]:
    """Per concurrency and lane: realized tokens per ms, and on its own states the counterfactual widths."""
    table, grid = cost_table(record)
    calibration = CostModel(target_ms=grid)  # the adaptive lane's calibration, as recorded
    out = []
    for point in record["points"]:
        batch, requests = point["concurrency"], point.get("requests")
        if not requests:
            raise SystemExit("--trace needs a bench_slices.py --keep-steps results.json that names its requests (this version's)")
        if batch not in table:
            continue
        lanes: dict[str, dict] = defaultdict(lambda: defaultdict(float))
        for piece in point["slices"]:
            if piece["round"] < 0:
                continue
            acc = lanes[piece["lane"]]
            for step in piece.get("trace", []):
                if step["batch"] != batch:
                    continue
                rows = row_truths(step, requests, data, lookup)
                if rows is None:
                    acc["diverged"] += 1
                    continue
                acc["steps"] += 1
                acc["live_tokens"] += step["emitted"]
                acc["live_ms"] += step["step_ms"]
                chosen, drafted = step["emitted"], step["drafted"]
                acc["own_tokens"] += chosen
                acc["own_ms"] += step_ms(table, batch, batch + drafted)
                goodputs = {}
                for width in WIDTHS:
                    tokens, drafts = true_tokens(rows, width)
                    cost = step_ms(table, batch, batch + drafts)
                    acc[f"w{width}_tokens"] += tokens
                    acc[f"w{width}_ms"] += cost
                    goodputs[width] = (tokens, cost)
                best = max(goodputs.values(), key=lambda v: v[0] / v[1])
                acc["oracle_tokens"] += best[0]
                acc["oracle_ms"] += best[1]
                plans = step.get("predicted_plans")
                if plans:  # adaptive: its predicted (tokens, ms) per plan against the truth
                    predicted = {}
                    for (width, drafts, ms), goodput in zip(plans, step["predicted_goodputs"]):
                        tokens, real = true_tokens(rows, width)
                        # (lane adaptive) its live correction on the calibration at the plan's real tokens (real_token_prices)
                        ms_real = ms * calibration.calibrated_ms(batch, 1 + drafts / batch) / calibration.calibrated_ms(batch, 1 + width)
                        predicted[width] = (goodput * ms, ms, tokens, step_ms(table, batch, batch + real), ms_real)
                    rules = [("estimates", lambda v: v[2] / v[1]), ("prices", lambda v: v[0] / v[3]), ("both", lambda v: v[0] / v[1])]
                    if piece["lane"] == "adaptive":  # the default's padded prices, re-read at the plans' real tokens
                        rules.append(("real", lambda v: v[0] / v[4]))
                    for name, pick in rules:
                        width = max(sorted(predicted), key=lambda w: pick(predicted[w]))  # first of ties: the narrowest
                        acc[f"true_{name}_tokens"] += predicted[width][2]
                        acc[f"true_{name}_ms"] += predicted[width][3]
                    mine = predicted.get(step["width"])
                    if mine is not None:
                        acc["pred_tokens_chosen"] += mine[0]
                        acc["true_tokens_chosen"] += mine[2]
                        acc["pred_ms_chosen"] += mine[1]
                        acc["table_ms_chosen"] += mine[3]
                    for width, (pt, pm, tt, tm, _) in predicted.items():
                        acc[f"pw{width}_pred_tokens"] += pt
                        acc[f"pw{width}_true_tokens"] += tt
                        acc[f"pw{width}_pred_ms"] += pm
                        acc[f"pw{width}_table_ms"] += tm
                        acc[f"pw{width}_n"] += 1
        out.append({"concurrency": batch, "lanes": {lane: dict(v) for lane, v in lanes.items()}})
    return out


def rate(acc: dict, key: str) -> float:
    return acc.get(f"{key}_tokens", 0.0) / acc[f"{key}_ms"] if acc.get(f"{key}_ms") else float("nan")


def report(points: list[dict]) -> list[str]:
    lines = ["Tokens per ms on each lane's own states (true tokens at the sweep's mean step time per real tokens; "
             "live = as measured):", "",
             "| C | lane | steps (diverged) | live | own choices | " + " | ".join(f"w={w}" for w in WIDTHS) + " | oracle |",
             "|---" * (len(WIDTHS) + 6) + "|"]
    for point in points:
        for lane, acc in sorted(point["lanes"].items()):
            cells = " | ".join(f"{rate(acc, f'w{w}'):.4f}" for w in WIDTHS)
            lines.append(f"| {point['concurrency']} | {lane} | {int(acc['steps'])} ({int(acc.get('diverged', 0))}) | "
                         f"{acc['live_tokens'] / acc['live_ms']:.4f} | {rate(acc, 'own'):.4f} | {cells} | {rate(acc, 'oracle'):.4f} |")
    lines += ["", "Adaptive lanes: predictions against the truth on its states (per width: predicted / true tokens, predicted / "
              "table ms, summed over the steps that priced the width), and the choice with one half of the prediction "
              "replaced by the truth:", ""]
    for point, lane in [(p, lane) for p in points for lane in sorted(p["lanes"]) if lane.startswith("adaptive")]:
        acc = point["lanes"][lane]
        if not acc.get("pred_ms_chosen"):
            continue
        widths = sorted(int(k[2:-2]) for k in acc if k.startswith("pw") and k.endswith("_n"))
        cells = "; ".join(
            f"w{w}: tokens {acc[f'pw{w}_pred_tokens'] / acc[f'pw{w}_true_tokens']:.3f}, ms {acc[f'pw{w}_pred_ms'] / acc[f'pw{w}_table_ms']:.3f}"
            for w in widths if acc[f"pw{w}_true_tokens"] and acc[f"pw{w}_table_ms"])
        lines.append(f"- C={point['concurrency']} {lane}: chosen plans: predicted / true tokens {acc['pred_tokens_chosen'] / acc['true_tokens_chosen']:.3f}, "
                     f"predicted / table ms {acc['pred_ms_chosen'] / acc['table_ms_chosen']:.3f}; {cells}")
        lines.append(f"  argmax of its predictions {rate(acc, 'true_both'):.4f}, with true tokens {rate(acc, 'true_estimates'):.4f}, "
                     f"with table prices {rate(acc, 'true_prices'):.4f}, "
                     + (f"its correction on the calibration at the plans' real tokens {rate(acc, 'true_real'):.4f}, " if acc.get("true_real_ms") else "")
                     + f"oracle {rate(acc, 'oracle'):.4f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="bench_slices.py --keep-steps results.json (this version: rows named)")
    parser.add_argument("--outputs", type=Path, default=Path("bench/out/replay/greedy_outputs.json"),
                        help="the target-alone greedy outputs (bench_replay.py's cache; generated here if missing)")
    parser.add_argument("--out", type=Path, default=None, help="write the counterfactual sums as JSON here")
    args = parser.parse_args()
    record = json.loads(args.trace.read_text())
    gamma_max = int(record["args"]["gamma_max"])
    length = round(int(record["args"]["max_tokens"]) * (1 + float(record["args"]["length_spread"]))) + gamma_max + 1
    if args.outputs.exists() and len(json.loads(args.outputs.read_text())["outputs"][0]) >= length:
        data = json.loads(args.outputs.read_text())
    else:
        data = greedy_outputs(record["args"]["target"], record["args"]["dtype"], length)
        args.outputs.parent.mkdir(parents=True, exist_ok=True)
        args.outputs.write_text(json.dumps(data))
    points = analyse(record, data, gamma_max)
    if args.out:
        args.out.write_text(json.dumps(points, indent=1))
    print("\n".join(report(points)))


if __name__ == "__main__":
    main()
