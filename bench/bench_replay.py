"""Offline replay of the serving loop: the real policies and acceptance estimates, step costs from a measured trace.

Run: .venv/bin/python bench/bench_replay.py --costs bench/out/slices_run14/results.json --concurrency 1,2,4,8,16 --out bench/out/replay

Why: on this VM a sliced sweep (bench_slices.py) takes 19 minutes and its intervals are +-5-8%, so it cannot tell
apart two policies 2% apart, nor say where a policy loses. Greedy decoding with n-gram drafts is deterministic:
each prompt's output is fixed, and so is every lookup proposal (a function of the context) and what it would
have accepted at any gamma. The replay runs the closed loop of bench_slices.py (same prompts, lengths, order)
without the model: each step, the lookups and the per-request acceptance estimates (the scheduler's own
Scheduler._lookups, Scheduler._score_proposals and AcceptanceStats), the policy's choice (the real policy objects)
and its cost: the mean measured step time, in the --costs trace, of full-batch decode steps at that batch with
that many real tokens (batch + drafts: the C stack runs only a step's real tokens), times log-normal noise
(--noise), and optionally a slow host factor shared by consecutive steps (--drift, --drift-s: an
Ornstein-Uhlenbeck process in replayed time, as this VM's speed wanders). The adaptive lane's cost model starts from the calibration recorded in that trace and learns from the
replayed steps (CostModel.observe), as it does while serving. A new request adds --prefill-ms.

With --sliced S the lanes take turns on one loop, S seconds each per round, as bench_slices.py runs them on the
machine (replay_lanes): they hand each other the requests in flight and the acceptance estimates.

Lanes: off, fixed gamma, adaptive, `adaptive-real` (the ablation AdaptivePolicy.real_token_prices: steps priced at
their real tokens), `adaptive-cut` (real-token prices and AdaptivePolicy.cut_rows: with lookup drafts a width may
leave rows out on their estimates), `adaptive-cells` (real-token prices whose live correction is learnt per real-token
count, CostModel.real_cells), and `oracle`, which knows each row's true match length and runs the width with
the most true tokens per true ms this step: the bound of any rule that picks one width per step from this step's
prospects. It is not a policy (the future is not known while serving); it says how much of the gap to it is the
acceptance estimates'. The greedy outputs are generated once with the target alone (--target) and kept in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import PROMPTS, resolve_dtype  # noqa: E402

from specgate.drafting import NgramDrafter  # noqa: E402
from specgate.serving import Scheduler, make_policy  # noqa: E402
from specgate.serving.acceptance import FLAT_PRIOR, REQUEST_PRIOR_WEIGHT, TRAFFIC_DECAY, AcceptanceStats  # noqa: E402
from specgate.serving.policy import AdaptivePolicy, CostModel, SpeculationPolicy, fold_rate, monotone, read_rate  # noqa: E402


def greedy_outputs(target_name: str, dtype: str, length: int) -> dict:
    """Each repetitive prompt's ids and its greedy continuation of `length` tokens (target alone, EOS ignored)."""
    from specgate.models import load_model
    from specgate.sampling import SamplingParams
    from specgate.serving import Request

    target = load_model(target_name, dtype=resolve_dtype(dtype))
    prompts = [target.tokenizer(p)["input_ids"] for p in PROMPTS["repetitive"]]
    scheduler = Scheduler(target, "none", make_policy("off"), num_slots=len(prompts), max_seq_len=max(map(len, prompts)) + length + 1)
    requests = [Request(torch.tensor(p), SamplingParams(temperature=0.0), max_tokens=length, ignore_eos=True) for p in prompts]
    for request in requests:
        scheduler.submit(request)
    scheduler.run_until_idle()
    return {"prompts": prompts, "outputs": [list(r.tokens) for r in requests]}


def cost_table(trace_record: dict) -> tuple[dict[int, tuple[list[int], list[float]]], dict]:
    """Per batch size: real tokens -> mean step ms (full-batch decode steps of every lane, >= 5 samples, made
    non-decreasing), and the adaptive lane's calibrated grid, from a bench_slices.py --keep-steps results.json."""
    samples: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    calibration = None
    for point in trace_record["points"]:
        batch = point["concurrency"]
        if point.get("adaptive"):
            calibration = point["adaptive"]["cost_model"]["target_ms"]
        for piece in point["slices"]:
            for step in piece.get("trace", [])[1:]:
                if step["batch"] == batch and not step["prefill_tokens"]:
                    samples[batch][batch + step["drafted"]].append(step["step_ms"])
    if not samples or calibration is None:
        raise SystemExit("--costs needs a bench_slices.py results.json written with --keep-steps and an adaptive lane")
    table = {}
    for batch, by_real in samples.items():
        kept = sorted((real, statistics.fmean(ms)) for real, ms in by_real.items() if len(ms) >= 5)
        table[batch] = ([r for r, _ in kept], list(np.maximum.accumulate([ms for _, ms in kept])))
    return table, {(int(b), int(t)): float(ms) for b, t, ms in calibration}


def step_ms(table: dict, batch: int, real_tokens: int) -> float:
    reals, ms = table[batch]
    if real_tokens > reals[-1]:
        return ms[-1] * real_tokens / reals[-1]
    return float(np.interp(real_tokens, reals, ms))


class OraclePolicy(SpeculationPolicy):
    """Not a policy: told each row's true match length (`truth`), runs the width of most true tokens per ms
    (objective "goodput"), or of most true tokens - rate * ms, rate the tokens per ms it has realized at the batch
    size (objective "throughput", AdaptivePolicy's: decayed sums, the goodput rule until RATE_MIN_STEPS)."""

    name = "oracle"

    def __init__(self, gamma_max: int, table: dict, objective: str = "goodput") -> None:
        self.gamma_max, self.table, self.truth, self.objective = gamma_max, table, None, objective
        self.rate_counts: dict[int, list[float]] = {}

    def observe_step(self, batch, width_tokens, target_ms, emitted=None, drafted=None) -> None:
        fold_rate(self.rate_counts, batch, float(emitted or 0), target_ms)

    @property
    def max_gamma(self) -> int:
        return self.gamma_max

    def choose(self, acceptance, caps=None) -> list[int]:
        batch = len(acceptance)

        rate = read_rate(self.rate_counts, batch) if self.objective == "throughput" else None

        def goodput(width: int) -> float:
            gammas = [min(width, cap) for cap in caps]
            tokens = sum(1 + min(m, g) for m, g in zip(self.truth, gammas))
            ms = step_ms(self.table, batch, batch + sum(gammas))
            return tokens / ms if rate is None else tokens - rate * ms

        best = max(range(self.gamma_max + 1), key=goodput)
        return [min(best, cap) for cap in caps]


def replay(policy: SpeculationPolicy, data: dict, table: dict, concurrency: int, **kwargs) -> dict:
    """One lane's closed loop for `seconds` of replayed time: tokens per second and mean width (replay_lanes)."""
    return replay_lanes({"lane": policy}, data, table, concurrency, **kwargs)["lane"]


def replay_lanes(policies: dict[str, SpeculationPolicy], data: dict, table: dict, concurrency: int, *, seconds: float,
                 noise: float, prefill_ms: float, max_tokens: int, spread: float, seed: int, drift: float = 0.0,
                 drift_s: float = 2.0, slice_s: float | None = None, order: str = "rotate", lookup_tokens: int | None = None) -> dict:
    """The closed loop for `seconds` of replayed time per lane: per lane, tokens per second and mean width.

    One lane (slice_s None): it serves alone. Several (slice_s seconds): they take turns on ONE loop, as in
    bench_slices.py, one slice each per round in lane_order(order), handing each other the requests in flight and
    the acceptance estimates; a lane's throughput is the tokens committed in its slices over their time (prefills
    counted in the slice they fall in). lookup_tokens: Scheduler.lookup_tokens (None: the running lane's max gamma).
    Each step's cost is the table's times exp(iid N(0, noise) + x), x the host's drift: an Ornstein-Uhlenbeck
    process in replayed time with standard deviation `drift` and correlation time `drift_s` (0: none)."""
    from bench_slices import lane_order

    labels = list(policies)
    if slice_s is None and len(labels) != 1:
        raise ValueError(f"{len(labels)} lanes need slice_s (seconds per slice) to take turns on one loop")
    prompts, outputs = data["prompts"], data["outputs"]
    lengths, noise_rng = random.Random(concurrency), np.random.default_rng(seed)  # bench_slices.py's length stream
    # what the scheduler's own _lookups and _score_proposals read, so the replay proposes and scores as it does
    holder = SimpleNamespace(traffic_acceptance=AcceptanceStats(TRAFFIC_DECAY), draft_kind="ngram", policy=None, lookup_tokens=lookup_tokens,
                             request_prior_weight=REQUEST_PRIOR_WEIGHT)
    low, high = round(max_tokens * (1 - spread)), round(max_tokens * (1 + spread))
    clock, sent = 0.0, 0
    totals = {label: {"emitted": 0, "ms": 0.0, "widths": []} for label in labels}
    host = float(noise_rng.normal(0.0, drift)) if drift else 0.0  # the drift's log factor x, stationary start
    turn, slice_end = 0, (slice_s or seconds) * 1e3

    def lane_of(turn: int) -> str:  # the turn-th slice's lane: round turn // n, place turn % n
        return lane_order(labels, turn // len(labels), order)[turn % len(labels)]

    def new_request(client: int) -> tuple[SimpleNamespace, dict]:
        nonlocal sent, clock
        index = (client + sent) % len(prompts)
        request = SimpleNamespace(index=index, tokens=[], acceptance_stats=AcceptanceStats(), acceptance=None,
                                  max_tokens=max(1, lengths.randint(low, high)))
        context = torch.zeros(len(prompts[index]) + request.max_tokens + 1, dtype=torch.int64)  # [S] as the scheduler's
        context[: len(prompts[index])] = torch.tensor(prompts[index])
        sent += 1
        clock += prefill_ms
        return request, {"proposals": [], "ngram": NgramDrafter(), "context": context, "length": len(prompts[index])}

    running = [new_request(client) for client in range(concurrency)]  # slot i serves client i
    if slice_s is None:
        totals[labels[0]]["ms"] = clock  # the first prefills: the lone lane's time
    while clock < seconds * 1e3 * len(labels):
        if clock >= slice_end:  # the next lane's turn
            turn, slice_end = turn + 1, clock + slice_s * 1e3
        label = lane_of(turn)
        policy, mine, started = policies[label], totals[label], clock
        holder.policy = policy
        batch = len(running)
        requests, states = [r for r, _ in running], [state for _, state in running]
        budgets = [r.max_tokens - len(r.tokens) - 1 for r in requests]
        lookups = Scheduler._lookups(holder, requests, states, budgets)
        caps = [min(len(p), b) for p, b in zip(lookups, budgets)]
        matches = []
        for r, proposal in zip(requests, lookups):
            truth = outputs[r.index][len(r.tokens) : len(r.tokens) + len(proposal)]
            matches.append(next((k for k, (a, b) in enumerate(zip(truth, proposal)) if a != b), len(truth)))
        if isinstance(policy, OraclePolicy):
            policy.truth = matches
        prior = holder.traffic_acceptance.profile(FLAT_PRIOR)
        gammas = policy.choose([r.acceptance_stats.profile(prior, REQUEST_PRIOR_WEIGHT) for r in requests], caps)  # as Scheduler's default
        gammas = [max(0, min(int(g), cap)) for g, cap in zip(gammas, caps)]
        for r, state, proposal in zip(requests, states, lookups):
            if proposal:
                state["proposals"].append((len(r.tokens), proposal, 0))
        width = max(gammas)
        base = step_ms(table, batch, batch + sum(gammas))
        if drift:  # the OU process over this step's duration (exact discretisation)
            keep = math.exp(-base / (1e3 * drift_s))
            host = host * keep + drift * math.sqrt(1.0 - keep * keep) * float(noise_rng.normal())
        ms = base * float(np.exp(noise_rng.normal(0.0, noise) + host))
        clock += ms
        committed = 0
        for slot, (r, state, gamma, matched) in enumerate(zip(requests, states, gammas, matches)):
            count = min(min(matched, gamma) + 1, r.max_tokens - len(r.tokens))
            tokens = outputs[r.index][len(r.tokens) : len(r.tokens) + count]
            r.tokens.extend(tokens)
            state["context"][state["length"] : state["length"] + count] = torch.tensor(tokens, dtype=torch.int64)
            state["length"] += count
            committed += count
            final = len(r.tokens) >= r.max_tokens
            Scheduler._score_proposals(holder, r, state, final)
            if final:  # the client sends its next request at once (closed loop)
                running[slot] = new_request(slot)
        policy.observe_step(batch, width + 1, ms, committed, drafted=sum(gammas))
        mine["emitted"] += committed
        mine["ms"] += clock - started
        mine["widths"].append(width)
    return {
        label: {"throughput_tok_s": t["emitted"] / t["ms"] * 1e3 if t["ms"] else 0.0,
                "mean_width": statistics.fmean(t["widths"]) if t["widths"] else 0.0, "steps": len(t["widths"])}
        for label, t in totals.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", type=Path, required=True, help="bench_slices.py --keep-steps results.json: step costs and calibration")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--lanes", default="off,fixed=2,fixed=4,fixed=8,adaptive,oracle")
    parser.add_argument("--gamma-max", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=300.0, help="replayed seconds per lane and seed")
    parser.add_argument("--seeds", type=int, default=3, help="noise seeds per lane (the mean is reported)")
    parser.add_argument("--noise", type=float, default=0.1, help="log-normal sigma on each step's cost")
    parser.add_argument("--drift", type=float, default=0.0,
                        help="standard deviation (log) of a slow host factor shared by consecutive steps (0: iid noise only)")
    parser.add_argument("--drift-s", type=float, default=2.0, help="the drift's correlation time in replayed seconds")
    parser.add_argument("--sliced", type=float, default=None,
                        help="seconds per slice: the lanes take turns on one loop as in bench_slices.py (default: each lane alone)")
    parser.add_argument("--order", choices=("rotate", "balanced"), default="rotate", help="with --sliced: bench_slices.py's lane order")
    parser.add_argument("--full-lookups", action="store_true", help="with --sliced: every lane's lookups gamma-max long (bench_slices.py)")
    parser.add_argument("--prefill-ms", type=float, default=15.0, help="added per admitted request")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--length-spread", type=float, default=0.5)
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/out/replay"))
    args = parser.parse_args()

    console = Console(width=190)
    args.out.mkdir(parents=True, exist_ok=True)
    cached = args.out / "greedy_outputs.json"
    length = round(args.max_tokens * (1 + args.length_spread)) + args.gamma_max + 1
    if cached.exists() and len(json.loads(cached.read_text())["outputs"][0]) >= length:
        data = json.loads(cached.read_text())
    else:
        with console.status("greedy outputs of the target alone"):
            data = greedy_outputs(args.target, args.dtype, length)
        cached.write_text(json.dumps(data))
    table, calibration = cost_table(json.loads(args.costs.read_text()))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    lanes = args.lanes.split(",")

    def make(lane: str) -> SpeculationPolicy:
        if lane == "oracle":
            return OraclePolicy(args.gamma_max, table)
        if lane == "oracle-rate":
            return OraclePolicy(args.gamma_max, table, objective="throughput")
        if lane == "adaptive-rate":  # the default's padded prices, objective throughput
            return AdaptivePolicy(monotone(CostModel(target_ms=dict(calibration))), gamma_max=args.gamma_max, objective="throughput")
        if lane in ("adaptive", "adaptive-real", "adaptive-cut", "adaptive-cells"):  # real-token prices, rows cut too, cells by real tokens
            cost = monotone(CostModel(target_ms=dict(calibration), real_cells=lane == "adaptive-cells"))
            policy = AdaptivePolicy(cost, gamma_max=args.gamma_max, real_token_prices=lane != "adaptive")
            policy.cut_rows = lane == "adaptive-cut"
            return policy
        if lane.startswith("fixed="):
            return make_policy("fixed", gamma=int(lane.split("=")[1]))
        if lane == "off":
            return make_policy("off")
        raise SystemExit(f"--lanes entry {lane!r} is unknown: use off, fixed=G, adaptive, adaptive-real, adaptive-cut, adaptive-cells or oracle")

    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "points": []}
    with Progress(console=console) as progress:
        task = progress.add_task("replay", total=len(concurrencies) * len(lanes) * args.seeds)
        for concurrency in concurrencies:
            if concurrency not in table:
                raise SystemExit(f"--costs has no full-batch steps at concurrency {concurrency}: measure it with bench_slices.py first")
            point = {"concurrency": concurrency, "lanes": {}}
            # --sliced: all lanes take turns on one loop; else each lane alone. One run per seed, means per lane.
            for group in [lanes] if args.sliced else [[lane] for lane in lanes]:
                runs = []
                for seed in range(args.seeds):
                    runs.append(replay_lanes({lane: make(lane) for lane in group}, data, table, concurrency, seconds=args.seconds,
                                             noise=args.noise, drift=args.drift, drift_s=args.drift_s, prefill_ms=args.prefill_ms,
                                             max_tokens=args.max_tokens, spread=args.length_spread, seed=seed, slice_s=args.sliced,
                                             order=args.order, lookup_tokens=args.gamma_max if args.full_lookups and args.sliced else None))
                    progress.advance(task, len(group))
                point["lanes"].update({lane: {k: statistics.fmean(r[lane][k] for r in runs) for k in runs[0][lane]} for lane in group})
            results["points"].append(point)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    console.print("| C | " + " | ".join(lanes) + " | adaptive / best fixed | adaptive / oracle |")
    console.print("|---" * (len(lanes) + 3) + "|")
    for point in results["points"]:
        speeds = {lane: v["throughput_tok_s"] for lane, v in point["lanes"].items()}
        fixed = [v for lane, v in speeds.items() if not lane.startswith(("adaptive", "oracle"))]
        cells = " | ".join(f"{speeds[lane]:.1f} (w {point['lanes'][lane]['mean_width']:.2f})" for lane in lanes)
        ratio = f"{speeds['adaptive'] / max(fixed):.3f}" if "adaptive" in speeds and fixed else "-"
        bound = f"{speeds['adaptive'] / speeds['oracle']:.3f}" if {"adaptive", "oracle"} <= speeds.keys() else "-"
        console.print(f"| {point['concurrency']} | {cells} | {ratio} | {bound} |")
    console.print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
