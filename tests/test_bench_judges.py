"""specgate.bench's lanes, clients, judges and tables, on inputs whose answers are computed here independently.

The judge's pooled throughput, paired ratios, bootstrap interval and verdict are checked on synthetic rounds with a
negative control just below the line; the held-out pick on lanes that trade places with the noise (and a control
where one lane is better in every round); the balanced lane order by counting positions and predecessors; the
closed loop on a real scheduler (tiny random model); the bench_perf.py summary against medians taken here.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from specgate.bench import judges, lanes, lockstep, tables
from specgate.bench.clients import ClosedLoop


def test_lane_labels_tags_and_options():
    assert lanes.lane_label("fixed=4#b", 2, 8) == ("fixed", "fixed g=4 #b", 4)
    assert lanes.lane_label("fixed=4", 2, 8) == ("fixed", "fixed g=4", 4)
    assert lanes.lane_label("fixed", 2, 8) == ("fixed", "fixed g=2", 2)
    assert lanes.lane_label("adaptive#2", 2, 8) == ("adaptive", "adaptive #2", 8)
    assert lanes.base_lane("fixed g=4 #b") == "fixed g=4" and lanes.is_twin("fixed g=4 #b") and not lanes.is_twin("fixed g=4")
    with pytest.raises(ValueError, match="'fixd=4'.*off, fixed, fixed=G or adaptive"):
        lanes.lane_label("fixd=4", 2, 8)
    # an adaptive variant: its scheduler weighs the traffic's acceptance by W pseudo-tests in a request's estimate
    assert lanes.lane_label("adaptive:prior=1", 2, 8) == ("adaptive", "adaptive prior=1", 8)
    assert lanes.lane_label("adaptive:prior=1#b", 2, 8) == ("adaptive", "adaptive prior=1 #b", 8)
    assert lanes.lane_prior_weight("adaptive:prior=2.5") == 2.5 and lanes.lane_prior_weight("adaptive") is None
    for bad in ("adaptive:prior=0", "adaptive:prior=x"):
        with pytest.raises(ValueError, match="the option must be :prior=W > 0"):
            lanes.lane_label(bad, 2, 8)
    with pytest.raises(ValueError, match="the option 'weight' is unknown: use prior=, margin=, probe="):
        lanes.lane_label("adaptive:weight=1", 2, 8)
    with pytest.raises(ValueError, match="options are for adaptive lanes only"):
        lanes.lane_label("fixed=4:margin=0", 2, 8)
    # several options, in the order given; the policy gets them, the scheduler's weight stays apart
    assert lanes.lane_label("adaptive:prior=16:margin=0:probe=0", 2, 8)[1] == "adaptive prior=16 margin=0 probe=0"
    with pytest.raises(ValueError, match=":margin=0 <= M < 0.5"):
        lanes.lane_label("adaptive:margin=0.7", 2, 8)
    from specgate.serving import AdaptivePolicy, CostModel

    cost = CostModel(target_ms={(1, 1): 10.0, (1, 2): 12.0})
    policy = lanes.lane_policy("adaptive:prior=16:margin=0:probe=0", 8, cost)
    assert isinstance(policy, AdaptivePolicy) and (policy.margin, policy.probe_every, policy.gamma_max) == (0.0, 0, 8)
    plain = lanes.lane_policy("adaptive:prior=16", 8, cost)  # the weight is the scheduler's: the policy is the default one
    assert (plain.margin, plain.probe_every) == (AdaptivePolicy(cost).margin, AdaptivePolicy(cost).probe_every)
    assert lanes.lane_policy("fixed=4", 4, None).gamma == 4


def test_each_adaptive_lane_gets_its_prior_weight_and_its_own_copy_of_the_calibration(tiny_model_dir):
    """make_lanes with adaptive:prior=2: that lane's scheduler blends 2 pseudo-tests of the traffic's acceptance into a
    request's estimate (the others the default), and every adaptive lane learns its own copy of the one calibration
    (a shared object would let one lane's steps move another's prices)."""
    from specgate.models import load_model
    from specgate.serving import CostModel
    from specgate.serving.acceptance import REQUEST_PRIOR_WEIGHT

    target = load_model(str(tiny_model_dir("llama")))
    prompts = [torch.tensor([1, 5, 6, 7, 5, 6, 7])]
    cost = CostModel(target_ms={(b, t): 10.0 * b + 2.0 * t for b in (1, 2) for t in range(1, 5)})
    built = lockstep.make_lanes(target, ["fixed=2", "adaptive", "adaptive:prior=2"], 2, prompts, 4, 0.0, 3, cost)
    assert [lane.label for lane in built] == ["fixed g=2", "adaptive", "adaptive prior=2"]
    assert [lane.scheduler.request_prior_weight for lane in built] == [REQUEST_PRIOR_WEIGHT, REQUEST_PRIOR_WEIGHT, 2.0]
    models = [lane.scheduler.policy.cost_model for lane in built[1:]]
    assert len({id(m) for m in models} | {id(cost)}) == 3 and all(m.target_ms == cost.target_ms for m in models)


def perf_report(step_over_floor: float, own: float, hf: float, theory_ratio: float) -> dict:
    lanes = {"own baseline": own, "transformers greedy": hf, "own n-gram": 3 * own, "transformers prompt lookup": hf, "own draft model": own}
    predicted = {"leviathan": 4.0, "lengths": 3.5, "lengths_and_verify_cost": 3.0}
    lane = {
        "alpha": 0.9, "acceptance_rate": 0.8, "c": 0.001, "acceptance_length": 3.5, "gamma": 4, "expected_tokens_at_gamma": 4.1,
        "mean_draft_length": 3.2, "steps_by_draft_length": [1, 0, 0, 0, 9], "same_tokens_as_baseline": True,
        "measured": {"decode_phase": 3.0 * theory_ratio, "end_to_end": 2.5}, "predicted": predicted,
        "decode_phase_over_predicted": {k: theory_ratio * 3.0 / v for k, v in predicted.items()},
        "end_to_end_over_predicted": {k: 2.5 / v for k, v in predicted.items()},
    }
    return {"dtypes": {"bfloat16": {
        "floor": {"read_gb_s": 20.0, "floor_ms": 25.0, "step_ms": 25.0 * step_over_floor, "step_over_floor": step_over_floor, "verify_over_step": 1.3},
        "lanes": {name: {"tokens_per_s": v} for name, v in lanes.items()},
        "ratios": {"own baseline / transformers greedy": own / hf, "own n-gram / transformers prompt lookup": 3 * own / hf},
        "theory": {"ngram": lane},
        "verification_cost": {"over_one_token": [1.0, 1.1, 1.2]},
    }}}


def test_perf_summary_medians():
    reports = [perf_report(1.1, 30.0, 12.0, 0.9), perf_report(1.3, 33.0, 11.0, 1.0), perf_report(1.2, 20.0, 16.0, 0.8)]
    out = tables.perf_summary([(f"run_{name}", report) for name, report in zip("abc", reports)])
    rows = {line.split("|")[1].strip(): line for line in out if line.startswith("| ")}
    assert "| run_b | 20.0 | 25.0 | 32.5 | 1.30x |" in rows["run_b"]
    assert rows["step / floor (median of the run's rounds)"].endswith("| 1.10 | 1.30 | 1.20 | **1.20** |")
    baseline = statistics.median([30 / 12, 33 / 11, 20 / 16])
    assert rows["own baseline / transformers greedy"].endswith(f"| **{baseline:.2f}** |")
    assert rows["ngram: decode phase / predicted (lengths and verify cost)"].endswith("| 0.90 | 1.00 | 0.80 | **0.90** |")
    assert "V(t), median over repeats: t=1 1.00, t=2 1.10, t=3 1.20" in out
    theory = next(line for line in out if line.startswith("ngram: alpha"))
    assert "alpha 0.900" in theory and f"measured decode-phase speedup {statistics.median([2.7, 3.0, 2.4]):.2f}x" in theory


def slice_row(lane: str, round_: int, tokens: int, wall_s: float) -> dict:
    return {"lane": lane, "round": round_, "tokens": tokens, "wall_s": wall_s, "steps": 10, "itl_chunks": [[40.0, 2], [60.0, 1]], "widths": [2, 4]}


def test_summary_pools_rounds_and_pairs_them():
    """judges.summarize on synthetic rounds: pooled throughput = tokens / seconds over the measured rounds
    (the warm-up round -1 left out), the best other lane by that, paired ratios per round, a bootstrap interval
    that holds the pooled ratio, and the verdict against 0.95 (a negative control just below the line)."""
    slices = [slice_row("off", -1, 1, 1.0), slice_row("adaptive", -1, 1, 1.0)]  # warm-up: would sink adaptive
    for r, (off, fixed, adaptive) in enumerate([(100, 300, 290), (120, 330, 340), (90, 270, 255)]):
        slices += [slice_row("off", r, off, 3.0), slice_row("fixed g=4", r, fixed, 3.0), slice_row("adaptive", r, adaptive, 3.0)]
    summary = judges.summarize(slices, ["off", "fixed g=4", "adaptive"], [0, 1, 2])
    lanes = summary["lanes"]
    assert lanes["off"]["throughput_tok_s"] == pytest.approx(310 / 9) and lanes["adaptive"]["tokens"] == 885
    assert lanes["off"]["itl_p50_ms"] == 50.0 and lanes["off"]["mean_width"] == 3.0
    assert lanes["off"]["itl_token_p50_ms"] == 20.0 and lanes["off"]["itl_token_mean_ms"] == pytest.approx(100 / 3)
    assert summary["best_other"] == "fixed g=4" and summary["ratio"] == pytest.approx(885 / 900)
    assert summary["paired_ratios"] == pytest.approx([290 / 300, 340 / 330, 255 / 270])
    low, high = summary["ci95"]
    assert low <= summary["ratio"] <= high and summary["met"]
    below = [dict(s, tokens=int(s["tokens"] * 0.9)) if s["lane"] == "adaptive" else s for s in slices]
    assert not judges.summarize(below, ["off", "fixed g=4", "adaptive"], [0, 1, 2])["met"]


def test_latencies_per_chunk_and_per_token():
    """judges.split_latencies on chunks whose answers are known: one sample per chunk, and each chunk's interval
    split evenly over its tokens for the per-token samples."""
    chunk, token = judges.split_latencies([[40.0, 4], [40.0, 1], [60.0, 2], [60.0, 1]])
    assert chunk == pytest.approx([40.0, 40.0, 60.0, 60.0])
    assert token == pytest.approx([10.0] * 4 + [40.0] + [30.0] * 2 + [60.0])
    stats = judges.lane_stats([{**slice_row("off", 0, 10, 1.0), "itl_chunks": [[40.0, 4], [60.0, 2]]}])
    assert stats["itl_token_mean_ms"] == pytest.approx((4 * 10.0 + 2 * 30.0) / 6) and stats["itl_p50_ms"] == pytest.approx(50.0)


def test_closed_loop_replaces_each_finished_request_on_a_real_scheduler(tiny_model_dir):
    """ClosedLoop on a real scheduler (tiny random model): each finished request is replaced at once (C requests in
    the system after every step), every request runs to its max_tokens (EOS ignored), and with a spread the lengths
    vary within max_tokens * (1 +- spread); a spread out of range is refused."""
    from specgate.models import load_model
    from specgate.serving import OffPolicy, Scheduler

    target = load_model(str(tiny_model_dir("llama")))
    prompts = [torch.cat([torch.tensor([1]), torch.arange(5, 9).repeat(3)]), torch.cat([torch.tensor([1]), torch.arange(20, 23).repeat(4)])]
    scheduler = Scheduler(target, "ngram", OffPolicy(), num_slots=2, max_seq_len=64)
    loop = ClosedLoop(scheduler, prompts, 2, max_tokens=6)
    for _ in range(30):
        scheduler.step()
        assert len(scheduler.running) + len(scheduler.waiting) == 2 and loop.sent == loop.finished + 2
    ended = [r for r in loop.requests.values() if r.finish_reason is not None]
    assert len(ended) == loop.finished >= 4 and all(r.finish_reason == "length" and len(r.tokens) == 6 for r in ended)
    spread = ClosedLoop(Scheduler(target, "ngram", OffPolicy(), num_slots=4, max_seq_len=64), prompts, 4, max_tokens=10, spread=0.5)
    lengths = [r.max_tokens for r in spread.scheduler.waiting]
    assert len(lengths) == 4 and all(5 <= n <= 15 for n in lengths) and len(set(lengths)) > 1
    with pytest.raises(ValueError, match="spread=1.5"):
        ClosedLoop(scheduler, prompts, 1, max_tokens=10, spread=1.5)


def test_held_out_ratio_picks_the_best_lane_of_the_other_rounds():
    """judges.held_out: round r is judged against the lane with the best throughput over the other rounds.
    Two fixed lanes that trade places with the noise (each 330 in two rounds, 270 in the third) and an adaptive lane
    at 300 throughout: the best lane of all rounds measures 930 / 9 s, so `ratio` = 900 / 930 < 1 (and < 0.97),
    while the lane an operator would have picked from the other rounds made 870 tokens in the rounds it was picked
    for, so held_out = 900 / 870 > 1. A negative control: with one lane better in every round (the noise does not
    decide), the held-out pick is that lane in every round and both ratios agree."""
    slices = []
    for r, (a, b) in enumerate([(330, 330), (330, 270), (270, 330)]):
        slices += [slice_row("fixed g=2", r, a, 3.0), slice_row("fixed g=4", r, b, 3.0), slice_row("adaptive", r, 300, 3.0)]
    summary = judges.summarize(slices, ["fixed g=2", "fixed g=4", "adaptive"], [0, 1, 2])
    assert summary["best_other"] == "fixed g=2" and summary["ratio"] == pytest.approx(900 / 930)
    # round 0: both others tie elsewhere (600 each) -> the first, g=2 (330); round 1: g=4 wins rounds 0, 2 (660 vs
    # 600) -> g=4 (270); round 2: g=2 wins rounds 0, 1 (660 vs 600) -> g=2 (270)
    held = summary["held_out"]
    assert held["picks"] == {"fixed g=2": 2, "fixed g=4": 1}
    assert held["ratio"] == pytest.approx(900 / (330 + 270 + 270)) and held["met"]
    low, high = held["ci95"]
    assert low <= held["ratio"] <= high
    clear = [dict(s, tokens=s["tokens"] + 100) if s["lane"] == "fixed g=2" else s for s in slices]
    control = judges.summarize(clear, ["fixed g=2", "fixed g=4", "adaptive"], [0, 1, 2])
    assert control["held_out"]["picks"] == {"fixed g=2": 3}
    assert control["held_out"]["ratio"] == pytest.approx(control["ratio"]) and not control["held_out"]["met"]
    assert "chosen on the other rounds (fixed g=2 3 rounds)" in tables.verdict_line(16, control)


def test_balanced_order_balances_positions_and_predecessors():
    """lanes.lane_order: with the default rotation, each lane always follows the same lane (what the
    balanced order fixes: the lane after fixed gamma 8 inherited its requests in flight every round); balanced
    (Williams) puts every lane at every position and after every other lane equally often, over 2n rounds for odd n
    and n for even n, for n = 2..6; and an unknown order is refused."""
    from collections import Counter

    labels = ["off", "fixed g=2", "fixed g=4", "fixed g=8", "adaptive"]
    rotated = [lanes.lane_order(labels, i) for i in range(10)]
    assert all(sorted(r) == sorted(labels) for r in rotated)
    assert {a for r in rotated for a, b in zip(r, r[1:]) if b == "adaptive"} == {"fixed g=8"}
    for n in range(2, 7):
        names = [f"l{i}" for i in range(n)]
        rounds = [lanes.lane_order(names, i, "balanced") for i in range(2 * n if n % 2 else n)]
        assert all(sorted(r) == names for r in rounds)
        positions = Counter((r.index(lane), lane) for r in rounds for lane in r)
        follows = Counter((a, b) for r in rounds for a, b in zip(r, r[1:]))
        assert len(positions) == n * n and len(set(positions.values())) == 1
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    with pytest.raises(ValueError, match="order='random'"):
        lanes.lane_order(labels, 0, "random")
