"""specgate.bench.lockstep: every lane its own server, stepped in turn, each timed on its own clock.

What would break the benchmark, and the test that catches it:
- a lane's latencies read off the shared wall clock (they would include the other lanes' steps): Lane.step on a
  stand-in scheduler under a fake clock, with another lane's time passing between its steps;
- lanes that serve different requests (the comparison would be of different work): the sequenced closed loop,
  and a real lockstep run in which two lanes of different speed were sent the same requests;
- a twin counted as a candidate for the best lane, or a twin judged on different work: the judge on synthetic
  pieces, and a real run whose twin committed exactly its setting's tokens block by block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from specgate.bench import judges, lockstep, tables
from specgate.bench.clients import ClosedLoop

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StandInScheduler:
    """Steps that take `step_s` each on the fake clock; in every step the two oldest requests emit `emitted` tokens."""

    def __init__(self, clock: FakeClock, loop, step_s: float, emitted: int) -> None:
        self.clock, self.loop, self.step_s, self.emitted = clock, loop, step_s, emitted
        self.trace: list[dict] = []
        self.running: list = []
        self.count = 0

    def step(self) -> bool:
        self.clock.now += self.step_s
        rows = list(self.loop.issued)[:2]
        before = [0 if self.count == 0 else self.emitted * self.count] * len(rows)
        self.trace.append({"emitted": self.emitted * len(rows), "batch": len(rows), "width": self.emitted - 1, "rows_id": rows,
                           "rows_emitted": [self.emitted] * len(rows), "rows_before": before})
        self.count += 1
        if self.count == 3:  # a client sends its next request during this step
            self.loop.issued["r9"] = [0, 8]
        return True


class StandInLoop:
    def __init__(self) -> None:
        self.issued = {"r0": [0, 12], "r1": [1, 12]}  # request_id -> [prompt index, max_tokens]
        self.finished = 0


def test_a_lane_times_its_requests_on_its_own_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(lockstep.time, "perf_counter", clock)
    loop = StandInLoop()
    lane = lockstep.Lane("fixed g=2", StandInScheduler(clock, loop, step_s=0.050, emitted=3), loop)
    for _ in range(4):
        lane.step()
        clock.now += 0.200  # another lane's step: the shared wall clock moves, this lane's does not
    assert lane.clock_s == pytest.approx(0.200)
    assert lane.ttft_ms == pytest.approx({"r0": 50.0, "r1": 50.0})
    assert [ms for ms, _ in lane.chunks["r0"]] == pytest.approx([50.0] * 3)  # on the wall clock each would be 250 ms
    assert lane.cost_s == pytest.approx({"r0": 0.100, "r1": 0.100})  # each of the 4 steps shared by its 2 rows
    assert lane.sequence == {"r0": 0, "r1": 1, "r9": 2} and lane.arrival_s["r9"] == pytest.approx(0.150)  # sent in step 3
    assert lane.done("r0") and not lane.done("r9") and lane.done_up_to(2) == 2 and lane.done_up_to(3) == 2
    piece = lane.piece(0, 0, 2)
    assert piece["tokens"] == 24 and piece["wall_s"] == pytest.approx(0.200) and piece["requests"] == 2
    assert len(piece["itl_chunks"]) == 6 and piece["ttft_ms"] == pytest.approx([50.0, 50.0]) and piece["widths"] == [2] * 8
    assert lane.piece(1, 2, 3)["tokens"] == 0  # r9 never ran
    assert lane.shapes == {"2x2": [[50.0, None, 6]] * 4}  # per decode step: ms on the lane's clock, no prediction, tokens
    loop.requests = {"r9": type("Ended", (), {"finish_reason": "error", "error": "NaN logits"})()}
    with pytest.raises(RuntimeError, match="request r9 ended 'error' \\(NaN logits\\) before its max_tokens"):
        lane.done_up_to(3)  # not a wait forever for a request that will never commit its tokens


def test_sequenced_clients_send_the_kth_prompt_whichever_client_sends_it(tiny_model_dir):
    from specgate.models import load_model
    from specgate.serving import OffPolicy, Scheduler

    target = load_model(str(tiny_model_dir("llama")))
    prompts = [torch.tensor([1, 5 + i, 6 + i, 7 + i]) for i in range(3)]

    def sent_in_order(sequenced: bool) -> list[int]:
        loop = ClosedLoop(Scheduler(target, "ngram", OffPolicy(), num_slots=2, max_seq_len=32), prompts, 2, 4, sequenced=sequenced)
        for client in (1, 1, 0, 1):  # clients finish in this order
            loop.submit(client)
        return [index for index, _ in loop.issued.values()]

    assert sent_in_order(True) == [0, 1, 2, 0, 1, 2]
    assert sent_in_order(False) != [0, 1, 2, 0, 1, 2]  # negative control: by client, the sequence depends on who finished


def test_lockstep_lanes_serve_the_same_requests_and_a_twin_matches_its_setting(tiny_model_dir):
    from specgate.models import load_model

    target = load_model(str(tiny_model_dir("llama")))
    prompts = [torch.cat([torch.tensor([1]), torch.arange(5 + i, 9 + i).repeat(3)]) for i in range(3)]
    lanes = lockstep.make_lanes(target, ["off", "fixed=3", "fixed=3#b"], 2, prompts, max_tokens=8, spread=0.5, gamma_max=4, cost_model=None)
    assert [lane.label for lane in lanes] == ["off", "fixed g=3", "fixed g=3 #b"]
    pieces = lockstep.run_lockstep(lanes, requests=6, blocks=3, warmup_requests=2)
    first = list(lanes[0].loop.issued.values())[:8]
    for lane in lanes:
        assert lane.done_up_to(8) == 8 and list(lane.loop.issued.values())[:8] == first  # the same 8 requests, all done
        assert lane.clock_s == pytest.approx(sum(lane.cost_s.values()))  # the shares add up to the clock
    mine = {(p["lane"], p["round"]): p for p in pieces}
    assert len(mine) == 9 and all(p["requests"] == 2 and p["wall_s"] > 0 for p in pieces)
    for block in range(3):  # each block: the same requests' tokens in every lane
        assert len({mine[(lane.label, block)]["tokens"] for lane in lanes}) == 1
        assert mine[("off", block)]["tokens"] == sum(n for _, n in first[2 + 2 * block : 4 + 2 * block])
        # greedy, one policy, the same requests: the twin did its setting's work in the same steps
        assert mine[("fixed g=3 #b", block)]["steps"] == mine[("fixed g=3", block)]["steps"]
        assert mine[("fixed g=3 #b", block)]["widths"] == mine[("fixed g=3", block)]["widths"]
    assert set(mine[("off", 0)]["widths"]) == {0} and max(mine[("fixed g=3", 0)]["widths"]) > 0  # each lane its own policy
    summary = judges.judge(pieces, [lane.label for lane in lanes], 3)
    assert set(summary["lanes"]) == {"off", "fixed g=3"} and "fixed g=3 #b" in summary["twins"]
    assert summary["lanes"]["off"]["ttft_p50_ms"] is not None


def piece(lane: str, block: int, tokens: int, wall_s: float) -> dict:
    return {"lane": lane, "round": block, "tokens": tokens, "wall_s": wall_s, "steps": 10, "itl_chunks": [[50.0, 2]],
            "widths": [2], "ttft_ms": [100.0 + block]}


def test_judge_leaves_twins_out_of_the_best_lane_and_controls_with_them():
    labels = ["fixed g=4", "adaptive", "fixed g=4 #b"]
    pieces = []
    for block in range(4):
        pieces += [piece("fixed g=4", block, 100, 1.0), piece("adaptive", block, 96, 1.0), piece("fixed g=4 #b", block, 110, 1.0)]
    summary = judges.judge(pieces, labels, 4)
    assert summary["best_other"] == "fixed g=4"  # the faster twin is not a candidate
    assert summary["ratio"] == pytest.approx(0.96) and summary["met"]
    assert summary["twins"]["fixed g=4 #b"]["ratio"] == pytest.approx(1.10)
    assert summary["lanes"]["adaptive"]["ttft_p50_ms"] == pytest.approx(101.5)
    assert summary["itl_vs_best"]["chunk_p50"] == pytest.approx(1.0)
    wider = [{**p, "itl_chunks": [[60.0, 3]]} if p["lane"] == "adaptive" else p for p in pieces]  # longer steps, more tokens each
    itl = judges.judge(wider, labels, 4)["itl_vs_best"]
    assert itl["chunk_p50"] == pytest.approx(1.2) and itl["token_mean"] == pytest.approx(0.8)  # (60 / 3) / (50 / 2)
    assert itl["token_mean_ci95"] == pytest.approx([0.8, 0.8])
    slower = [{**p, "tokens": 94} if p["lane"] == "adaptive" else p for p in pieces]
    assert not judges.judge(slower, labels, 4)["met"]  # negative control: 0.94 misses
    text = "\n".join(tables.lane_table({"points": [{"concurrency": 4, "summary": summary}]}))
    assert "control fixed g=4 #b / fixed g=4 = 1.100" in text and "| 4 | adaptive | 96.0 |" in text


def test_lockstep_sweep_end_to_end_and_its_table_judged_again(tiny_model_dir, tmp_path):
    """lockstep.sweep on a tiny random model (adaptive calibrated on it), written as bench_lockstep.py writes it, then
    bench_lockstep.py --table on that results.json (the thin command, in a subprocess): the table is judged again
    from the kept blocks and says what the run said."""
    from specgate.models import load_model
    from specgate.serving import calibrate_cost_model

    target = load_model(str(tiny_model_dir("llama")))
    prompts = [torch.cat([torch.tensor([1]), torch.arange(5 + i, 9 + i).repeat(3)]) for i in range(3)]
    cost_model = calibrate_cost_model(target.model, None, gamma_max=8)
    points = lockstep.sweep(target, ["off", "fixed=2", "adaptive", "fixed=2#b"], [2], prompts, requests=4, blocks=2, warmup_requests=0,
                            max_tokens=6, spread=0.5, gamma_max=8, cost_model=cost_model, console=Console(quiet=True))
    (point,) = points
    assert point["concurrency"] == 2 and set(point["summary"]["lanes"]) == {"off", "fixed g=2", "adaptive"}
    assert "fixed g=2 #b" in point["summary"]["twins"] and "adaptive" in point["cost_models"]
    assert all(n >= 4 + 4 for n in point["requests_finished"].values())  # warm-up 2 x C, then the measured 4
    steps = point["shapes"]["fixed g=2"]["2x2"]
    assert all(p is not None for shape in point["shapes"]["adaptive"].values() for _, p, _ in shape)  # its plans' prices
    assert all(p is None for _, p, _ in steps)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"args": {"blocks": "2"}, "points": points}))
    shown = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_lockstep.py"), "--table", str(results), "--plot", str(tmp_path / "again.png")],
                           capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}).stdout
    assert f"| 2 | fixed g=2 | 2x2 | {len(steps)} |" in shown  # the full-batch steps per shape
    assert f"adaptive / best other ({point['summary']['best_other']}) = {point['summary']['ratio']:.3f}x" in shown
    assert (tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="tag a second server"):
        lockstep.lane_labels(["fixed=2", "fixed=2"], 8)


class PacedLane:
    """A stand-in lane that finishes one request every `every` steps (requests in order)."""

    def __init__(self, label: str, every: int, log: list, lanes: list) -> None:
        self.label, self.every, self.log, self.lanes = label, every, log, lanes
        self.steps = 0

    def finished(self) -> int:
        return self.steps // self.every

    def step(self) -> None:
        self.steps += 1
        self.log.append([lane.finished() for lane in self.lanes])

    def done_up_to(self, count: int) -> int:
        return min(self.finished(), count)

    def piece(self, block: int, first: int, stop: int) -> dict:
        return {"lane": self.label, "round": block, "requests": stop - first}


def test_lockstep_waits_for_every_lane_at_each_block_barrier():
    def widest_gap(blocks: int) -> int:
        log, lanes = [], []
        lanes += [PacedLane("fast", 1, log, lanes), PacedLane("slow", 3, log, lanes)]
        pieces = lockstep.run_lockstep(lanes, requests=40, blocks=blocks, warmup_requests=4)
        assert [(p["lane"], p["round"]) for p in pieces] == [(lane, b) for lane in ("fast", "slow") for b in range(blocks)]
        assert all(lane.finished() == 44 for lane in lanes)
        return max(abs(fast - slow) for fast, slow in log)

    assert widest_gap(10) <= 4 + 1  # never more than a block (4 requests) apart
    assert widest_gap(2) > 10  # negative control: with two blocks the fast lane runs far ahead between barriers
