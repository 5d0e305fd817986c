"""Serving throughput per speculation setting, measured in interleaved time slices on ONE running scheduler.

Run: flock /tmp/specgate-heavy.lock .venv/bin/python bench/bench_slices.py --concurrency 1,2,4,8,16 --out bench/out/slices
     .venv/bin/python bench/bench_slices.py --table bench/out/slices/results.json   # the markdown table again
     .venv/bin/python bench/bench_slices.py --pool bench/out/a/results.json,bench/out/b/results.json  # sweeps pooled (--plot P.png)
     .venv/bin/python bench/bench_slices.py --steps bench/out/slices/results.json  # per-width step table (--keep-steps runs)

Why another serving benchmark: bench_serving.py runs each (lane, concurrency) point for 4-8 s and compares
medians of 3-5 repeats, but on this shared VM the host's speed moves by 20-40% within seconds (the off lane's
batch-4 step measured 41, 57 and 46 ms in three consecutive repeats of one sweep), so a point's throughput is
mostly the host state it happened to land on and 3-5 repeats cannot decide a 0.95 line. Here the host state is
shared out instead of sampled: for each concurrency C, one scheduler serves C closed-loop clients without a
pause (a client sends its next request the moment one finishes), and its speculation policy is swapped between
steps in round-robin, one slice of `--slice-s` seconds per lane per round, the lane order rotated per round.
Every lane thus sees the same requests in flight and the same mix of fast and slow host moments, a few seconds
apart, over `--rounds` rounds (`--order balanced`: a Williams design instead of the rotation, so that each lane
follows every other equally often: a lane inherits the requests in flight and their estimates from the lane
before it). Each lane keeps its own policy object across its slices, so the adaptive policy
keeps learning its traffic and its costs (its cost model observes only its own steps), as a running server does.

Per lane and C: throughput = tokens committed in its slices / their seconds (pooled over rounds), with a 95%
bootstrap interval over rounds of adaptive / the lane with the best pooled throughput; the per-round paired
ratios (slices of one round ran within seconds of each other); the same ratio against the best other lane chosen
without the round it is judged on (held_out: the best of several noisy lanes is biased up); ITL p50 / p95 in two conventions (see
inter_token_latencies): per chunk, as vLLM's benchmark counts it (the interval between a request's consecutive
steps, one sample per request and step: every running request commits >= 1 token per decode step), and per token,
as SGLang's does (that interval split evenly over the tokens it delivered). With speculation the two differ: a wider
step is a longer chunk interval but can be a shorter wait per token. A request's first token is its TTFT and is in
neither (before this version the per-chunk figure counted it; the first step of a slice is left out). TTFT is not reported here:
a request's prefill may straddle slices of two lanes (bench_serving.py reports TTFT). Greedy, n-gram drafts,
the bench_serving.py "repetitive" prompts, EOS ignored, each request's max_tokens uniform in 32..96 (mean 64,
`--length-spread 0.5`): with one length for all, the C requests of a closed loop without speculation finish in
the same step and prefill together, a wave that lands whole in one lane's slice (measured at C=16, 3 s slices:
prefill tokens per output token 0.55 in the off lane's slices against 0.29 in fixed gamma 2's).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import PROMPTS, lane_label, lane_order, resolve_dtype  # noqa: E402

from specgate.models import load_model  # noqa: E402
from specgate.sampling import SamplingParams  # noqa: E402
from specgate.serving import Request, Scheduler, calibrate_cost_model, make_policy  # noqa: E402
from specgate.serving.policy import AdaptivePolicy, CostModel, SpeculationPolicy  # noqa: E402


class ClosedLoop:
    """C clients with no think time: each finished request is replaced at once by the client's next one."""

    def __init__(self, scheduler: Scheduler, prompts: list[torch.Tensor], concurrency: int, max_tokens: int, spread: float = 0.0, seed: int = 0,
                 sequenced: bool = False) -> None:
        if not 0.0 <= spread < 1.0:
            raise ValueError(f"spread={spread} is out of range [0, 1): max_tokens varies uniformly in max_tokens * (1 +- spread)")
        self.scheduler, self.prompts, self.max_tokens, self.spread = scheduler, prompts, max_tokens, spread
        self.sequenced = sequenced  # the k-th request sent gets prompt k (mod the prompts) whichever client sends it
        self.rng = random.Random(seed)
        self.sent = 0
        self.finished = 0
        self.issued: dict[str, list[int]] = {}  # request_id -> [prompt index, max_tokens] (the traces name rows by id)
        self.requests: dict[str, Request] = {}  # request_id -> the request (its finish_reason once done)
        for client in range(concurrency):
            self.submit(client)

    def submit(self, client: int) -> None:
        index = (self.sent if self.sequenced else client + self.sent) % len(self.prompts)
        prompt = self.prompts[index]
        low, high = round(self.max_tokens * (1 - self.spread)), round(self.max_tokens * (1 + self.spread))
        length = max(1, self.rng.randint(low, high))  # varied lengths: clients do not finish (and prefill) in waves
        request = Request(prompt, SamplingParams(temperature=0.0), max_tokens=length, ignore_eos=True, seed=self.sent)
        request.sink = lambda event, client=client: self.done(client) if event[0] == "done" else None
        self.sent += 1
        self.scheduler.submit(request)
        self.issued[request.request_id] = [index, length]
        self.requests[request.request_id] = request

    def done(self, client: int) -> None:  # called on this thread, inside scheduler.step()
        self.finished += 1
        self.submit(client)


TRACE_KEYS = ("end_s", "batch", "width", "drafted", "emitted", "rows_emitted", "rows_before", "step_ms", "forward_ms",
              "prefill_tokens", "predicted_tokens", "predicted_ms", "predicted_goodputs", "rows_id", "rows_caps", "rows_drafts",
              "predicted_plans")


def make_lane_policy(name: str, gamma: int, cost_model: CostModel | None) -> SpeculationPolicy:
    """A lane's policy. `adaptive-real`: the adaptive policy with the ablation real_token_prices (a step priced at
    its real tokens, not its padded rectangle), on its own copy of the calibration, so the two adaptive lanes of
    one sweep are an A/B of the price alone (each learns from its own steps). bench/out/slices_ab23 ran this A/B
    at commit e540f22, where the real-token price was the default (lane `adaptive`) and the padded one the lane
    `adaptive-padded`. `adaptive-cells`: real-token prices whose live correction is learnt per real-token count
    (CostModel.real_cells), on a fresh model of the same calibration."""
    if name == "adaptive-real":
        return AdaptivePolicy(copy.deepcopy(cost_model), gamma_max=gamma, real_token_prices=True)
    if name == "adaptive-cells":  # real-token prices learnt per real-token count (CostModel.real_cells), its own model
        return AdaptivePolicy(dataclasses.replace(cost_model, real_cells=True), gamma_max=gamma, real_token_prices=True)
    return make_policy(name, gamma=gamma, cost_model=cost_model)


def run_slice(scheduler: Scheduler, seconds: float, min_steps: int = 0) -> dict:
    """Step the scheduler for `seconds` and at least `min_steps` steps (tests size a slice by steps, which a loaded
    host does not shrink); the slice's committed tokens, wall time and step intervals."""
    scheduler.trace = []
    start = time.perf_counter()
    steps = 0
    while time.perf_counter() - start < seconds or steps < min_steps:
        scheduler.step()
        steps += 1
    wall_s = time.perf_counter() - start
    trace = scheduler.trace
    return {
        "tokens": sum(t["emitted"] for t in trace), "wall_s": wall_s, "steps": len(trace),
        "itl_chunks": [[round(ms, 2), emitted] for ms, emitted in chunk_intervals(trace)], "widths": [t["width"] for t in trace],
        "trace": [{k: t[k] for k in TRACE_KEYS} for t in trace],
    }


def chunk_intervals(trace: list[dict]) -> list[tuple[float, int]]:
    """A slice's chunks: one (ms, tokens) per request and decode step, the interval since that request's previous
    step and the tokens the step handed it (the slice's first step left out: its interval began under the
    previous lane). A request's first token (a row with no tokens before the step) is its TTFT, not an ITL, and is
    left out."""
    chunks = []
    for previous, step in zip(trace, trace[1:]):
        interval = 1e3 * (step["end_s"] - previous["end_s"])
        chunks += [(interval, emitted) for emitted, before in zip(step["rows_emitted"], step["rows_before"]) if before > 0 and emitted > 0]
    return chunks


def split_latencies(chunks: list) -> tuple[list[float], list[float]]:
    """(ms, tokens) chunks -> inter-token latencies (ms) in the two conventions of the serving benchmarks:
    - per chunk (vLLM's `vllm bench serve` ITL): one sample per chunk; with speculation a step hands a request
      1..gamma+1 tokens at once, so this is the step time;
    - per token (SGLang's bench_serving ITL): the chunk's interval divided evenly over its tokens, one sample per
      token; the time a streamed token waits on average, lower when a step lands more tokens."""
    return [ms for ms, _ in chunks], [ms / emitted for ms, emitted in chunks for _ in range(emitted)]


def inter_token_latencies(trace: list[dict]) -> tuple[list[float], list[float]]:
    """A slice's inter-token latencies (ms), per chunk and per token, from its decode steps (chunk_intervals)."""
    return split_latencies(chunk_intervals(trace))


def slice_latencies(piece: dict) -> tuple[list[float], list[float]]:
    """A slice's (per chunk, per token) ITL samples: from its chunks (results.json written after run 30), or
    recomputed from its kept trace (a --keep-steps results.json of runs 15-29 read back); none where neither is
    there (run 30, or results.json written before the trace kept end_s and the per-row counts)."""
    if "itl_chunks" in piece:
        return split_latencies(piece["itl_chunks"])
    trace = piece.get("trace") or []
    if trace and all(k in trace[0] for k in ("end_s", "rows_emitted", "rows_before")):
        return inter_token_latencies(trace)
    return [], []


def summarize(slices: list[dict], lanes: list[str], rounds: list[int], seed: int = 0) -> dict:
    """Pooled throughput per lane, ITL percentiles, and adaptive / best other lane with a bootstrap interval."""
    out: dict = {"lanes": {}}
    for lane in lanes:
        mine = [s for s in slices if s["lane"] == lane and s["round"] in rounds]
        tokens, wall = sum(s["tokens"] for s in mine), sum(s["wall_s"] for s in mine)
        latencies = [slice_latencies(s) for s in mine]
        chunk = [x for c, _ in latencies for x in c]
        token = [x for _, t in latencies for x in t]
        widths = [w for s in mine for w in s.get("widths", [])]
        out["lanes"][lane] = {
            "throughput_tok_s": tokens / wall if wall else None, "tokens": tokens, "seconds": wall,
            "steps": sum(s["steps"] for s in mine),
            "itl_p50_ms": float(np.percentile(chunk, 50)) if chunk else None,
            "itl_p95_ms": float(np.percentile(chunk, 95)) if chunk else None,
            "itl_token_p50_ms": float(np.percentile(token, 50)) if token else None,
            "itl_token_p95_ms": float(np.percentile(token, 95)) if token else None,
            "itl_token_mean_ms": statistics.fmean(token) if token else None,
            "mean_width": statistics.fmean(widths) if widths else None,
        }
    if "adaptive" not in lanes or len(lanes) < 2:
        return out
    others = [lane for lane in lanes if lane != "adaptive"]
    best = max(others, key=lambda lane: out["lanes"][lane]["throughput_tok_s"] or 0.0)
    per_round = {}
    for r in rounds:
        sums = {lane: [0, 0.0] for lane in ("adaptive", best)}
        for s in slices:
            if s["round"] == r and s["lane"] in sums:
                sums[s["lane"]][0] += s["tokens"]
                sums[s["lane"]][1] += s["wall_s"]
        per_round[r] = sums
    ratio = out["lanes"]["adaptive"]["throughput_tok_s"] / out["lanes"][best]["throughput_tok_s"]
    rng = random.Random(seed)
    boot = []
    for _ in range(2000):  # resample rounds: the lanes of one round stay together (they shared its host state)
        pick = [rng.choice(rounds) for _ in rounds]
        a = sum(per_round[r]["adaptive"][0] for r in pick) / sum(per_round[r]["adaptive"][1] for r in pick)
        b = sum(per_round[r][best][0] for r in pick) / sum(per_round[r][best][1] for r in pick)
        boot.append(a / b)
    paired = [
        (per_round[r]["adaptive"][0] / per_round[r]["adaptive"][1]) / (per_round[r][best][0] / per_round[r][best][1]) for r in rounds
    ]
    out.update({
        "best_other": best, "ratio": ratio, "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "paired_ratios": paired, "paired_median": statistics.median(paired), "met": ratio >= 0.95,
    })
    if len(rounds) >= 2:
        out["held_out"] = held_out(slices, others, rounds, seed)
    return out


def held_out(slices: list[dict], others: list[str], rounds: list[int], seed: int = 0) -> dict:
    """Adaptive against the best other lane chosen without the round it is judged on (leave one round out).

    Why: `ratio` divides by the lane with the best throughput measured in the same rounds, the maximum of several
    noisy estimates, which is biased up (the winner's curse): where the lanes are within the noise of each other
    (C=16: off, gamma 2, 4 and 8 within 10% in run 22), adaptive / max(others) is below 1 even for a lane that
    is as good as each of them. Here round r's comparison lane is the best of the OTHER rounds pooled, as an
    operator who picked the setting from a benchmark would then run it, and the ratio is adaptive's pooled
    throughput over those lanes' throughput in the rounds they were picked for. Reported next to `ratio`, not
    instead of it; its interval resamples rounds with the picks held."""
    sums = {(lane, r): [0, 0.0] for lane in ["adaptive", *others] for r in rounds}
    for s in slices:
        if (s["lane"], s["round"]) in sums:
            sums[(s["lane"], s["round"])][0] += s["tokens"]
            sums[(s["lane"], s["round"])][1] += s["wall_s"]
    totals = {lane: [sum(sums[(lane, r)][i] for r in rounds) for i in (0, 1)] for lane in others}

    def rest(lane: str, r: int) -> float:
        tokens, wall = totals[lane][0] - sums[(lane, r)][0], totals[lane][1] - sums[(lane, r)][1]
        return tokens / wall if wall else 0.0

    picks = {r: max(others, key=lambda lane: rest(lane, r)) for r in rounds}

    def ratio_of(chosen: list[int]) -> float:
        adaptive = sum(sums[("adaptive", r)][0] for r in chosen) / sum(sums[("adaptive", r)][1] for r in chosen)
        picked = sum(sums[(picks[r], r)][0] for r in chosen) / sum(sums[(picks[r], r)][1] for r in chosen)
        return adaptive / picked

    ratio = ratio_of(rounds)
    rng = random.Random(seed)
    boot = [ratio_of([rng.choice(rounds) for _ in rounds]) for _ in range(2000)]
    counts = {lane: sum(1 for r in rounds if picks[r] == lane) for lane in others if any(picks[r] == lane for r in rounds)}
    return {"ratio": ratio, "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))], "picks": counts, "met": ratio >= 0.95}


def pool(records: list[dict], judge: str | None = None) -> list[tuple[int, dict]]:
    """Sweeps of the same code pooled: per concurrency that every record has, their measured slices together
    (rounds renumbered, so a bootstrap resamples the rounds of all of them), summarized again. Throughput and
    the ratio, and ITL where the records kept their traces (--keep-steps, this version's trace fields).
    judge: in an A/B sweep with several adaptive lanes, the one judged (as `adaptive`) against the other lanes
    but the other adaptive ones, which are left out (None: every lane as recorded)."""
    by_c: dict[int, list[dict]] = {}
    counts: dict[int, int] = {}
    lanes: dict[int, list[str]] = {}
    for record in records:
        for point in record["points"]:
            c = point["concurrency"]
            offset = counts.get(c, 0)
            measured = [s for s in point["slices"] if s["round"] >= 0]
            names = list(point["summary"]["lanes"])
            if judge is not None:
                if judge not in names:
                    raise SystemExit(f"--judge {judge!r} is not a lane of this sweep: its lanes are {', '.join(names)}")
                rename = {lane: "adaptive" if lane == judge else lane for lane in names if lane == judge or not lane.startswith("adaptive")}
                measured = [{**s, "lane": rename[s["lane"]]} for s in measured if s["lane"] in rename]
                names = list(rename.values())
            by_c.setdefault(c, []).extend({**s, "round": s["round"] + offset} for s in measured)
            counts[c] = offset + 1 + max(s["round"] for s in measured)
            lanes.setdefault(c, names)
    present = [c for c in by_c if all(any(p["concurrency"] == c for p in r["points"]) for r in records)]
    return [(c, summarize(by_c[c], lanes[c], list(range(counts[c])))) for c in sorted(present)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--dtype", default="auto", help="auto (the runtime's default), float32 or bfloat16")
    parser.add_argument("--gamma-max", type=int, default=8, help="adaptive lane's gamma_max")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--lanes", default="off,fixed=2,fixed=4,fixed=8,adaptive",
                        help="comma list of off, fixed=G, adaptive, adaptive-real (the ablation AdaptivePolicy.real_token_prices), "
                             "adaptive-cells (real-token prices learnt per real-token count, CostModel.real_cells)")
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds per concurrency (one slice per lane each)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and left out (prefill wave, first learning)")
    parser.add_argument("--slice-s", type=float, default=3.0, help="seconds per slice")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean tokens per request")
    parser.add_argument("--length-spread", type=float, default=0.5, help="each request's max_tokens is uniform in max_tokens * (1 +- this)")
    parser.add_argument("--order", choices=("rotate", "balanced"), default="rotate",
                        help="lane order per round: rotate (a cyclic shift: each lane always follows the same one) or "
                             "balanced (Williams: each lane follows every other equally often over 2 x lanes rounds)")
    parser.add_argument("--full-lookups", action="store_true",
                        help="every lane's n-gram proposals gamma-max long (Scheduler.lookup_tokens): a narrower lane's "
                             "slice then leaves every draft position's acceptance estimate fed for the next lane")
    parser.add_argument("--keep-steps", action="store_true", help="write every step's trace record (batch, width, ms, tokens) into results.json")
    parser.add_argument("--out", type=Path, default=Path("bench/out/slices"))
    parser.add_argument("--pool", default=None, help="comma list of results.json of sweeps of the same code: print adaptive / best other over all their rounds (no run)")
    parser.add_argument("--plot", type=Path, default=None, help="with --pool, plot the pooled sweeps into this PNG")
    parser.add_argument("--judge", default=None,
                        help="with --pool, an A/B sweep's adaptive lane to judge (e.g. adaptive-cells) against the non-adaptive lanes")
    parser.add_argument("--table", type=Path, default=None, help="print the markdown table of an existing results.json and plot it into --out (no run)")
    parser.add_argument("--steps", type=Path, default=None, help="per-width table of the full-batch decode steps of a --keep-steps results.json (no run)")
    args = parser.parse_args()
    if args.pool:
        pooled = pool([json.loads(Path(f).read_text()) for f in args.pool.split(",")], args.judge)
        if args.plot:
            plot({"points": [{"concurrency": c, "summary": summary} for c, summary in pooled]}, args.plot)
            print(f"wrote {args.plot}")
        for concurrency, summary in pooled:
            print(line(concurrency, summary))
            itl = [
                f"{lane} {ms(v['itl_p50_ms'])}/{ms(v['itl_p95_ms'])} chunk, {ms(v['itl_token_p50_ms'], 1)}/{ms(v['itl_token_p95_ms'], 1)}/{ms(v['itl_token_mean_ms'], 1)} token"
                for lane, v in summary["lanes"].items() if v["itl_p50_ms"] is not None
            ]
            if itl:
                print(f"  ITL p50/p95 ms per chunk, p50/p95/mean per token (records with traces): {'; '.join(itl)}")
        return
    if args.steps:
        print("\n".join(step_table(json.loads(args.steps.read_text()))))
        return
    if args.table:
        record = json.loads(args.table.read_text())
        print("\n".join(table(record)))
        args.out.mkdir(parents=True, exist_ok=True)
        plot(record, args.out / "serving_slices.png")
        print(f"wrote {args.out / 'serving_slices.png'}")
        return
    if args.rounds < 2 or args.slice_s <= 0 or args.warmup_rounds < 0:
        raise SystemExit(f"--rounds {args.rounds} (>= 2), --slice-s {args.slice_s} (> 0), --warmup-rounds {args.warmup_rounds} (>= 0)")

    console = Console(width=190)
    dtype = resolve_dtype(args.dtype)
    target = load_model(args.target, dtype=dtype)
    prompts = [torch.tensor(target.tokenizer(p)["input_ids"]) for p in PROMPTS["repetitive"]]
    max_seq_len = max(int(p.numel()) for p in prompts) + round(args.max_tokens * (1 + args.length_spread)) + 1
    lanes = args.lanes.split(",")
    parsed = [lane_label(lane, 4, args.gamma_max) for lane in lanes]  # (policy name, label, gamma)
    labels = [label for _, label, _ in parsed]
    cost_model = None
    if any(lane.startswith("adaptive") for lane in lanes):
        with console.status("calibrating the adaptive policy's cost model"):
            cost_model = calibrate_cost_model(target.model, None, gamma_max=args.gamma_max)
        console.print(f"cost model: {cost_model.to_dict()['target_ms']}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "dtype": str(dtype), "points": []}
    start = time.perf_counter()
    total = len(concurrencies) * (args.rounds + args.warmup_rounds) * len(lanes)
    with Progress(console=console) as progress:
        task = progress.add_task("slices", total=total)
        for concurrency in concurrencies:
            scheduler = Scheduler(target, "ngram", None, num_slots=concurrency, max_seq_len=max_seq_len, max_waiting=concurrency,
                                  lookup_tokens=args.gamma_max if args.full_lookups else None)
            policies = {label: make_lane_policy(name, gamma, cost_model) for name, label, gamma in parsed}
            loop = ClosedLoop(scheduler, prompts, concurrency, args.max_tokens, args.length_spread, seed=concurrency)
            slices = []
            for index in range(args.warmup_rounds + args.rounds):
                for label in lane_order(labels, index, args.order):
                    scheduler.policy = policies[label]
                    slices.append({"lane": label, "round": index - args.warmup_rounds, **run_slice(scheduler, args.slice_s)})
                    progress.advance(task)
            rounds = list(range(args.rounds))
            summary = summarize(slices, labels, rounds)
            policy = policies.get("adaptive")
            record["points"].append({
                "concurrency": concurrency, "summary": summary, "requests_finished": loop.finished,
                "requests": loop.issued if args.keep_steps else None,
                "adaptive": policy.describe() if policy is not None else None,
                "slices": [
                    {k: v for k, v in s.items() if k != "trace" or args.keep_steps}  # chunks and widths kept: pools read their ITL
                    for s in slices
                ],
            })
            console.print(line(concurrency, summary))
    record["sweep_s"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=None if args.keep_steps else 2))  # per-step traces: compact
    plot(record, args.out / "serving_slices.png")
    console.print(f"sweep {record['sweep_s']:.0f} s; wrote {args.out / 'results.json'} and {args.out / 'serving_slices.png'}")
    for row in table(record):
        console.print(row)


def plot(record: dict, out: Path, titles: tuple[str, str] = (
    "throughput (tokens/s), pooled over interleaved slices", "adaptive / best other lane (95% bootstrap CI over rounds)",
)) -> None:
    """Left: pooled throughput per lane against concurrency. Right: adaptive / the best other lane per
    concurrency, with its 95% bootstrap interval and the 0.95 goal line. titles: (left, right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = record["points"]
    xs = [p["concurrency"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for lane in points[0]["summary"]["lanes"]:
        ys = [p["summary"]["lanes"][lane]["throughput_tok_s"] for p in points]
        left.plot(xs, ys, marker="o", label=lane, linewidth=2.5 if lane == "adaptive" else 1.2)
    left.set_title(titles[0])
    judged = [p for p in points if "ratio" in p["summary"]]
    if judged:
        ratio = np.array([p["summary"]["ratio"] for p in judged])
        ci = np.array([p["summary"]["ci95"] for p in judged]).T
        right.errorbar([p["concurrency"] for p in judged], ratio, yerr=[ratio - ci[0], ci[1] - ratio], marker="o", capsize=4, color="black")
        for p in judged:
            right.annotate(p["summary"]["best_other"], (p["concurrency"], p["summary"]["ratio"]), textcoords="offset points", xytext=(6, 6), fontsize=8)
        right.axhline(0.95, color="red", linestyle="--", label="goal 0.95")
        right.axhline(1.0, color="gray", linewidth=0.8)
        right.legend()
    right.set_title(titles[1])
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (closed loop)")
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(out)


def line(concurrency: int, summary: dict) -> str:
    speeds = ", ".join(f"{lane} {v['throughput_tok_s']:.1f}" for lane, v in summary["lanes"].items())
    if "ratio" not in summary:
        return f"C={concurrency}: {speeds} tok/s"
    low, high = summary["ci95"]
    return (
        f"C={concurrency}: {speeds} tok/s; adaptive / best other ({summary['best_other']}) = {summary['ratio']:.3f}x "
        f"[95% CI {low:.3f}-{high:.3f}], paired per round median {summary['paired_median']:.3f} "
        f"{'met' if summary['met'] else 'MISSED'} (goal >= 0.95){held_out_text(summary)}"
    )


def held_out_text(summary: dict) -> str:
    if "held_out" not in summary:
        return ""
    h = summary["held_out"]
    picks = ", ".join(f"{lane} {n}" for lane, n in h["picks"].items())
    return (
        f"; against the best other chosen on the other rounds ({picks} rounds): {h['ratio']:.3f}x "
        f"[{h['ci95'][0]:.3f}-{h['ci95'][1]:.3f}] {'met' if h['met'] else 'MISSED'}"
    )


def step_table(record: dict) -> list[str]:
    """Markdown, from a --keep-steps record: per (C, lane, width) the measured full-batch decode steps (prefill
    steps and each slice's first step left out): count, median step and forward ms, median ms outside the forward
    (lookups, verification, commit, the policy), mean emitted tokens, tokens per ms (sum / sum), and for the
    adaptive lane its mean predicted ms and tokens."""
    rows = [
        "| C | lane | width | steps | step ms (median) | forward ms | outside forward ms | emitted | tokens / ms | predicted ms / tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in record["points"]:
        concurrency, groups = point["concurrency"], {}
        for piece in point["slices"]:
            if piece["round"] < 0:
                continue
            for step in piece.get("trace", [])[1:]:
                if step["batch"] == concurrency and not step["prefill_tokens"]:
                    groups.setdefault((piece["lane"], step["width"]), []).append(step)
        if not groups:
            raise SystemExit("--steps needs a results.json written with --keep-steps")
        for (lane, width), steps in sorted(groups.items()):
            predicted = [s for s in steps if s.get("predicted_ms") is not None]
            guess = (
                f"{statistics.fmean(s['predicted_ms'] for s in predicted):.1f} / {statistics.fmean(s['predicted_tokens'] for s in predicted):.2f}"
                if predicted else "-"
            )
            rows.append(
                f"| {concurrency} | {lane} | {width} | {len(steps)} | {statistics.median(s['step_ms'] for s in steps):.1f} | "
                f"{statistics.median(s['forward_ms'] for s in steps):.1f} | {statistics.median(s['step_ms'] - s['forward_ms'] for s in steps):.2f} | "
                f"{statistics.fmean(s['emitted'] for s in steps):.2f} | {sum(s['emitted'] for s in steps) / sum(s['step_ms'] for s in steps):.4f} | {guess} |"
            )
    return rows


def ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(record: dict, verdict=None, ttft: bool = False) -> list[str]:
    """Markdown: one row per (C, lane), then the verdict per C (verdict(concurrency, summary) -> text, default
    line; bench_lockstep.py passes its own, and ttft=True for its TTFT column)."""
    verdict = verdict or line
    rows = [
        f"| C | lane | tok/s | x off |{' TTFT p50 / p95 ms |' if ttft else ''} ITL per chunk p50 / p95 ms | ITL per token p50 / p95 / mean ms | mean width | steps |",
        "|---|---|---|---|" + ("---|" if ttft else "") + "---|---|---|---|",
    ]
    verdicts = []
    for point in record["points"]:
        lanes = point["summary"]["lanes"]
        off = lanes.get("off", {}).get("throughput_tok_s")
        for lane, v in lanes.items():
            x_off = f"{v['throughput_tok_s'] / off:.2f}" if off else "-"
            first = f" {ms(v.get('ttft_p50_ms'))} / {ms(v.get('ttft_p95_ms'))} |" if ttft else ""
            rows.append(
                f"| {point['concurrency']} | {lane} | {v['throughput_tok_s']:.1f} | {x_off} |{first} {ms(v['itl_p50_ms'])} / "
                f"{ms(v['itl_p95_ms'])} | {ms(v.get('itl_token_p50_ms'), 1)} / {ms(v.get('itl_token_p95_ms'), 1)} / "
                f"{ms(v.get('itl_token_mean_ms'), 1)} | {ms(v['mean_width'], 2)} | {v['steps']} |"
            )
        if "ratio" in point["summary"] or verdict is not line:
            verdicts.append("- " + verdict(point["concurrency"], point["summary"]))
    return rows + [""] + verdicts


if __name__ == "__main__":
    main()
