"""Judges: pooled throughput per lane and adaptive / the best other lane, with bootstrap intervals over rounds.

A round (a lockstep block) is a piece per lane: {"lane", "round", "tokens", "wall_s", "steps", "itl_chunks": [[ms,
tokens], ...], "widths": [...], "ttft_ms": [...]}. Throughput pools a lane's pieces (tokens / seconds summed over
rounds); the bootstrap resamples whole rounds (a round's lanes stay together: they shared its host moments and its
requests). The goal line is adaptive >= 0.95 x the best other lane.
"""

from __future__ import annotations

import math
import random
import statistics

import numpy as np

from specgate.bench.lanes import base_lane, is_twin

GOAL = 0.95
BOOTSTRAP_SAMPLES = 2000


def split_latencies(chunks: list) -> tuple[list[float], list[float]]:
    """(ms, tokens) chunks -> inter-token latencies (ms) in the two conventions of the serving benchmarks:
    - per chunk (vLLM's `vllm bench serve` ITL): one sample per chunk; with speculation a step hands a request
      1..gamma+1 tokens at once, so this is the step time;
    - per token (SGLang's bench_serving ITL): the chunk's interval divided evenly over its tokens, one sample per
      token; the time a streamed token waits on average, lower when a step lands more tokens."""
    return [ms for ms, _ in chunks], [ms / emitted for ms, emitted in chunks for _ in range(emitted)]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def lane_stats(pieces: list[dict]) -> dict:
    """One lane's pieces pooled: throughput (tokens / s), ITL percentiles in both conventions, mean width."""
    tokens, wall = sum(p["tokens"] for p in pieces), sum(p["wall_s"] for p in pieces)
    latencies = [split_latencies(p.get("itl_chunks", [])) for p in pieces]
    chunk = [x for c, _ in latencies for x in c]
    token = [x for _, t in latencies for x in t]
    widths = [w for p in pieces for w in p.get("widths", [])]
    return {
        "throughput_tok_s": tokens / wall if wall else None, "tokens": tokens, "seconds": wall,
        "steps": sum(p["steps"] for p in pieces),
        "itl_p50_ms": percentile(chunk, 50), "itl_p95_ms": percentile(chunk, 95),
        "itl_token_p50_ms": percentile(token, 50), "itl_token_p95_ms": percentile(token, 95),
        "itl_token_mean_ms": statistics.fmean(token) if token else None,
        "mean_width": statistics.fmean(widths) if widths else None,
    }


def round_sums(pieces: list[dict], lanes: list[str], rounds: list[int]) -> dict[tuple[str, int], list[float]]:
    """(lane, round) -> [tokens, seconds]."""
    sums = {(lane, r): [0, 0.0] for lane in lanes for r in rounds}
    for p in pieces:
        if (p["lane"], p["round"]) in sums:
            sums[(p["lane"], p["round"])][0] += p["tokens"]
            sums[(p["lane"], p["round"])][1] += p["wall_s"]
    return sums


def summarize(pieces: list[dict], lanes: list[str], rounds: list[int], seed: int = 0) -> dict:
    """Per lane its pooled stats (lane_stats); with an `adaptive` lane and another: the best other lane by pooled
    throughput, ratio = adaptive / it, its 95% bootstrap interval over rounds, the per-round paired ratios, the
    verdict `met` (ratio >= 0.95) and, over >= 2 rounds, the held-out ratio (held_out)."""
    out: dict = {"lanes": {lane: lane_stats([p for p in pieces if p["lane"] == lane and p["round"] in rounds]) for lane in lanes}}
    if "adaptive" not in lanes or len(lanes) < 2:
        return out
    others = [lane for lane in lanes if lane != "adaptive"]
    best = max(others, key=lambda lane: out["lanes"][lane]["throughput_tok_s"] or 0.0)
    sums = round_sums(pieces, ["adaptive", best], rounds)

    def ratio_of(picked: list[int]) -> float:
        mine = sum(sums[("adaptive", r)][0] for r in picked) / sum(sums[("adaptive", r)][1] for r in picked)
        theirs = sum(sums[(best, r)][0] for r in picked) / sum(sums[(best, r)][1] for r in picked)
        return mine / theirs

    rng = random.Random(seed)
    boot = [ratio_of([rng.choice(rounds) for _ in rounds]) for _ in range(BOOTSTRAP_SAMPLES)]
    paired = [ratio_of([r]) for r in rounds]
    ratio = out["lanes"]["adaptive"]["throughput_tok_s"] / out["lanes"][best]["throughput_tok_s"]
    out.update({
        "best_other": best, "ratio": ratio, "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "paired_ratios": paired, "paired_median": statistics.median(paired), "met": ratio >= GOAL,
    })
    if len(rounds) >= 2:
        out["held_out"] = held_out(pieces, others, rounds, seed)
    return out


def held_out(pieces: list[dict], others: list[str], rounds: list[int], seed: int = 0) -> dict:
    """Adaptive against the best other lane chosen without the round it is judged on (leave one round out).

    Why: `ratio` divides by the best lane measured in the same rounds, the maximum of several noisy estimates,
    which is biased up (the winner's curse). Here round r's comparison lane is the best of the OTHER rounds pooled,
    as an operator who picked the setting from a benchmark would then run it; the ratio is adaptive's pooled
    throughput over the picked lanes' throughput in the rounds they were picked for. Its interval resamples rounds
    with the picks held."""
    sums = round_sums(pieces, ["adaptive", *others], rounds)
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
    boot = [ratio_of([rng.choice(rounds) for _ in rounds]) for _ in range(BOOTSTRAP_SAMPLES)]
    counts = {lane: sum(1 for r in rounds if picks[r] == lane) for lane in others if any(picks[r] == lane for r in rounds)}
    return {"ratio": ratio, "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))], "picks": counts, "met": ratio >= GOAL}


def itl_ratios(pieces: list[dict], lane: str, other: str, rounds: list[int], seed: int = 0) -> dict:
    """lane / other for ITL per chunk p50 and per token mean (lower is better: <= 1 is no worse), each with a 95%
    bootstrap interval over rounds (a round's chunks of both lanes kept together: the same requests, the same host)."""
    chunks = {(p["lane"], p["round"]): p["itl_chunks"] for p in pieces if p["lane"] in (lane, other)}

    def ratios(picked: list[int]) -> tuple[float, float]:
        mine = [c for r in picked for c in chunks.get((lane, r), [])]
        theirs = [c for r in picked for c in chunks.get((other, r), [])]
        if not mine or not theirs:
            return math.nan, math.nan
        per_chunk = float(np.median([ms for ms, _ in mine]) / np.median([ms for ms, _ in theirs]))
        per_token = (sum(ms for ms, _ in mine) / sum(n for _, n in mine)) / (sum(ms for ms, _ in theirs) / sum(n for _, n in theirs))
        return per_chunk, per_token

    rng = random.Random(seed)
    boot = np.array([ratios([rng.choice(rounds) for _ in rounds]) for _ in range(1000)])
    chunk, token = ratios(rounds)
    return {
        "chunk_p50": chunk, "chunk_p50_ci95": [float(np.nanpercentile(boot[:, 0], 2.5)), float(np.nanpercentile(boot[:, 0], 97.5))],
        "token_mean": token, "token_mean_ci95": [float(np.nanpercentile(boot[:, 1], 2.5)), float(np.nanpercentile(boot[:, 1], 97.5))],
    }


def twin_controls(pieces: list[dict], labels: list[str], judged: list[str], rounds: list[int]) -> dict:
    """Each twin ('fixed g=4 #b') judged against its setting as adaptive is judged: its distance from 1 is what the
    host and the lanes' order alone do to a ratio."""
    controls = {}
    for twin in [label for label in labels if is_twin(label) and base_lane(label) in judged]:
        base = base_lane(twin)
        pair = [{**p, "lane": "adaptive"} if p["lane"] == twin else p for p in pieces if p["lane"] in (twin, base)]
        control = summarize(pair, ["adaptive", base], rounds)
        controls[twin] = {"against": base, "ratio": control["ratio"], "ci95": control["ci95"],
                          "throughput_tok_s": control["lanes"]["adaptive"]["throughput_tok_s"]}
    return controls


def judge(pieces: list[dict], labels: list[str], blocks: int) -> dict:
    """The lockstep verdict: summarize over the blocks with twins left out of the lanes judged, TTFT p50 / p95 per
    lane, ITL adaptive / the best other lane (itl_ratios), and each twin's control (twin_controls)."""
    rounds = list(range(blocks))
    judged = [label for label in labels if not is_twin(label)]
    summary = summarize([p for p in pieces if p["lane"] in judged], judged, rounds)
    for label in judged:
        ttft = [x for p in pieces if p["lane"] == label for x in p["ttft_ms"]]
        summary["lanes"][label]["ttft_p50_ms"] = percentile(ttft, 50)
        summary["lanes"][label]["ttft_p95_ms"] = percentile(ttft, 95)
    if "best_other" in summary:
        summary["itl_vs_best"] = itl_ratios(pieces, "adaptive", summary["best_other"], rounds)
    summary["twins"] = twin_controls(pieces, labels, judged, rounds)
    return summary
