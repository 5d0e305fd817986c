"""bench/serving_table.py and bench/perf_summary.py, the tools that turn benchmark JSON into docs/BENCHMARKS.md tables.

serving_table pools several bench_serving.py results.json files: its medians, "x off" ratios and goal verdicts are
checked on synthetic rows whose answers are known, and the repeat renumbering is checked with a negative control
(without it, two files' repeat 0 would be paired with each other's points). perf_summary is checked on a synthetic
bench_perf.py report: every median it prints is the median of the per-repeat values. bench_slices.py's summary
(pooled throughput, paired ratios, bootstrap interval, verdict) is checked on synthetic slices with a negative
control just below the line, and its closed loop and slices on a real scheduler (tiny random model).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_bench

load = load_bench


def serving_row(lane: str, concurrency: int, repeat: int, tok_s: float) -> dict:
    return {
        "lane": lane, "concurrency": concurrency, "repeat": repeat, "throughput_tok_s": tok_s, "throughput_whole_tok_s": tok_s,
        "ttft_p50_ms": 100.0, "ttft_p95_ms": 150.0, "itl_p50_ms": 40.0 if lane == "adaptive" else 50.0, "itl_p95_ms": 60.0,
        "tpot_mean_ms": 10.0, "acceptance_rate": None if lane == "off" else 0.8, "mean_gamma": 0.0 if lane == "off" else 3.0,
    }


def write_results(path: Path, rows: list[dict]) -> str:
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_serving_table_medians_ratios_and_goals(tmp_path, capsys):
    table = load("serving_table")
    first = [serving_row("off", 1, r, v) for r, v in enumerate([10.0, 12.0, 11.0])]
    first += [serving_row("fixed g=4", 1, r, v) for r, v in enumerate([30.0, 36.0, 33.0])]
    first += [serving_row("adaptive", 1, r, v) for r, v in enumerate([31.0, 35.0, 29.0])]
    second = [serving_row("off", 1, 0, 13.0), serving_row("fixed g=4", 1, 0, 20.0), serving_row("adaptive", 1, 0, 40.0)]
    paths = [write_results(tmp_path / "a.json", first), write_results(tmp_path / "b.json", second)]
    table.main(paths)
    out = capsys.readouterr().out
    lines = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert list(lines) == ["lane", "off", "fixed g=4", "adaptive"]  # off, fixed gammas, then adaptive
    # medians over the 4 pooled repeats: off 11.5 [10-13], fixed 31.5 [20-36], adaptive 33.0 [29-40]
    assert "| 11.5 [10.0-13.0] | 1.00 |" in lines["off"]
    assert "| 31.5 [20.0-36.0] | 2.74 |" in lines["fixed g=4"]
    assert "| 33.0 [29.0-40.0] | 2.87 |" in lines["adaptive"]
    # adaptive / best other = 33 / 31.5; paired per repeat: 31/30, 35/36, 29/33 and (second file) 40/20
    assert "adaptive / best other (fixed g=4) = 1.05x (medians; paired per repeat 1.03, 0.97, 0.88, 2.00) met" in out
    assert "ITL p50 adaptive 40.0 ms vs best fixed (fixed g=4) 50.0 ms (medians) met" in out


def test_serving_table_renumbers_repeats_per_file(tmp_path):
    table = load("serving_table")
    serving = load("bench_serving")
    first = [serving_row("fixed g=2", 2, 0, 10.0), serving_row("adaptive", 2, 0, 10.0)]
    second = [serving_row("fixed g=2", 2, 0, 20.0), serving_row("adaptive", 2, 0, 5.0)]
    paths = [write_results(tmp_path / "a.json", first), write_results(tmp_path / "b.json", second)]
    rows = table.pooled_rows(paths)
    assert sorted({row["repeat"] for row in rows}) == [0, 1]
    assert serving.paired_ratios(rows, 2, "fixed g=2") == [1.0, 0.25]  # each file's points paired with each other
    # negative control: pooled without renumbering, repeat 0 of one file overwrites the other's
    naive = first + second
    assert serving.paired_ratios(naive, 2, "fixed g=2") != [1.0, 0.25]


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


def test_perf_summary_medians(tmp_path, capsys):
    summary = load("perf_summary")
    reports = [perf_report(1.1, 30.0, 12.0, 0.9), perf_report(1.3, 33.0, 11.0, 1.0), perf_report(1.2, 20.0, 16.0, 0.8)]
    paths = []
    for i, report in enumerate(reports):
        path = tmp_path / f"run_{'abc'[i]}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    summary.main(paths)
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "| run_b | 20.0 | 25.0 | 32.5 | 1.30x |" in rows["run_b"]
    assert rows["step / floor (median of the run's rounds)"].endswith("| 1.10 | 1.30 | 1.20 | **1.20** |")
    baseline = statistics.median([30 / 12, 33 / 11, 20 / 16])
    assert rows["own baseline / transformers greedy"].endswith(f"| **{baseline:.2f}** |")
    assert rows["ngram: decode phase / predicted (lengths and verify cost)"].endswith("| 0.90 | 1.00 | 0.80 | **0.90** |")
    assert "V(t), median over repeats: t=1 1.00, t=2 1.10, t=3 1.20" in out


def test_serving_table_pools_windows_with_a_bootstrap_over_repeats(tmp_path, capsys):
    table = load("serving_table")
    fixed = [100.0, 110.0, 90.0, 105.0, 95.0, 100.0]
    share = [0.99, 0.95, 1.00, 0.96, 0.98, 0.94]
    windows = [3.0, 2.5, 3.5, 3.0, 2.0, 4.0]

    def rows(scale: float) -> list[dict]:
        out = []
        for r, (tok_s, window) in enumerate(zip(fixed, windows)):
            for lane, speed in (("off", 40.0), ("fixed g=4", tok_s), ("adaptive", scale * share[r] * tok_s)):
                out.append({**serving_row(lane, 4, r, speed), "window_s": window, "window_steps": 30})
        # a repeat where only adaptive ran (an interrupted sweep) is left out of the pool, not counted against nobody
        out.append({**serving_row("adaptive", 4, 6, 1000.0), "window_s": 3.0})
        return out

    lines = table.pooled_goals(rows(1.0))
    # the ratio of pooled throughputs: tokens over seconds summed over repeats 0-5, each lane
    expected = sum(s * f * w for s, f, w in zip(share, fixed, windows)) / sum(f * w for f, w in zip(fixed, windows))
    assert len(lines) == 1 and lines[0].startswith(f"C=4: adaptive / best other (fixed g=4) = {expected:.3f} [")
    low, high = (float(x) for x in lines[0].split("[")[1].split("]")[0].split("-"))
    assert min(share) - 0.005 <= low <= expected <= high <= max(share) + 0.005 and high - low > 0.005  # repeats resampled
    assert "pooled over 6 repeats" in lines[0] and f"held out {expected:.3f}" in lines[0] and lines[0].endswith("met (goal >= 0.95)")
    # negative control: the same repeats at 0.93x are below the line
    assert table.pooled_goals(rows(0.93))[0].endswith("MISSED (goal >= 0.95)")
    table.main([write_results(tmp_path / "a.json", rows(1.0))])
    assert "Pooled windows" in capsys.readouterr().out


def test_serving_table_twin_lanes_pool_with_their_setting_and_control_the_judge(tmp_path, capsys):
    """A tagged twin ('fixed g=4 #b', bench_serving's lane fixed=4#b) is more of its setting in the goal, not one
    more candidate, and twin_controls judges it against its setting as adaptive is judged; --lanes judges among
    the lanes named, so that files with different lane sets pool."""
    table = load("serving_table")
    twin = [1.20, 1.00, 1.15, 1.05]  # the twin's throughput share of its setting's, per repeat (mean 1.10)

    def rows(adaptive: float) -> list[dict]:
        out = []
        for r, share in enumerate(twin):
            for lane, tok_s in (("off", 50.0), ("fixed g=4", 100.0), ("fixed g=4 #b", 100.0 * share), ("adaptive", adaptive)):
                out.append({**serving_row(lane, 4, r, tok_s), "window_s": 2.0})
        return out

    # the setting pooled over both schedulers: (100 + 110) / 2 = 105 over equal windows, so adaptive at 105 is 1.000
    # (had the twin been a candidate of its own, the judge would divide by its 110: 0.955)
    lines = table.pooled_goals(rows(105.0))
    assert lines[0].startswith("C=4: adaptive / best other (fixed g=4) = 1.000 [") and "pooled over 4 repeats" in lines[0]
    assert table.pooled_goals(rows(105.0 * 0.93))[0].endswith("MISSED (goal >= 0.95)")  # negative control
    control = table.twin_controls(rows(105.0))
    assert len(control) == 1 and control[0].startswith("C=4: fixed g=4 #b / fixed g=4 = 1.100 [1.0")
    assert "over 4 repeats" in control[0] and "range 1.00-1.20" in control[0]
    # --lanes: a file without the off lane pools with one that has it (else none of its repeats is complete)
    without_off = [row for row in rows(105.0) if row["lane"] != "off"]
    mixed = table.pooled_rows([write_results(tmp_path / "a.json", rows(105.0)), write_results(tmp_path / "b.json", without_off)])
    assert "pooled over 4 repeats" in table.pooled_goals(mixed)[0]
    assert "pooled over 8 repeats" in table.pooled_goals(mixed, ["fixed g=4", "adaptive"])[0]
    table.main(["--lanes", "fixed g=4,adaptive", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert "(judged among fixed g=4, adaptive only)" in out and "Twin controls" in out
    assert out.index("| fixed g=4 | 4 |") < out.index("| fixed g=4 #b | 4 |") < out.index("| adaptive | 4 |")  # lane_rank


def test_serving_table_forwards_at_each_lanes_most_run_width():
    table = load("serving_table")

    def row(lane, repeat, cells):
        return {**serving_row(lane, 4, repeat, 100.0), "steps": {"by_width_at_max_batch": {
            str(w): {"count": n, "forward_ms_p50": f} for w, (n, f) in cells.items()}}}

    rows = [
        row("fixed g=4", 0, {4: (30, 80.0)}), row("fixed g=4", 1, {4: (30, 90.0)}),
        row("adaptive", 0, {2: (10, 50.0), 5: (20, 95.0)}), row("adaptive", 1, {5: (25, 97.0)}),  # width 5: 45 of 55
        {**serving_row("off", 4, 0, 50.0), "steps": {}},  # no trace: left out
    ]
    lines = table.forward_lines(rows)
    assert lines == [
        "C=4 fixed g=4: width 4 (60 of 60 full-batch steps), forward p50 per repeat 80.0, 90.0 ms, mean 85.0",
        "C=4 adaptive: width 5 (45 of 55 full-batch steps), forward p50 per repeat 95.0, 97.0 ms, mean 96.0",
    ]


def test_serving_lane_tags_make_a_second_scheduler_of_one_setting():
    serving = load("bench_serving")
    assert serving.lane_label("fixed=4#b", 2, 8) == ("fixed", "fixed g=4 #b", 4)
    assert serving.lane_label("fixed=4", 2, 8) == ("fixed", "fixed g=4", 4)
    assert serving.lane_label("adaptive#2", 2, 8) == ("adaptive", "adaptive #2", 8)
    with pytest.raises(ValueError, match="'fixd=4'.*off, fixed, fixed=G or adaptive"):
        serving.lane_label("fixd=4", 2, 8)
    # an adaptive variant: its schedulers weigh the traffic's acceptance by W pseudo-tests in a request's estimate
    assert serving.lane_label("adaptive:prior=1", 2, 8) == ("adaptive", "adaptive prior=1", 8)
    assert serving.lane_label("adaptive:prior=1#b", 2, 8) == ("adaptive", "adaptive prior=1 #b", 8)
    assert serving.lane_prior_weight("adaptive:prior=2.5") == 2.5 and serving.lane_prior_weight("adaptive") is None
    for bad in ("adaptive:prior=0", "adaptive:prior=x"):
        with pytest.raises(ValueError, match="the option must be :prior=W > 0"):
            serving.lane_label(bad, 2, 8)
    with pytest.raises(ValueError, match="the option 'weight' is unknown: use prior=, margin=, probe=, objective="):
        serving.lane_label("adaptive:weight=1", 2, 8)
    with pytest.raises(ValueError, match="options are for adaptive lanes only"):
        serving.lane_label("fixed=4:margin=0", 2, 8)
    # several options, in the order given; the policy gets them, the scheduler's weight stays apart
    assert serving.lane_label("adaptive:prior=16:margin=0:probe=0", 2, 8)[1] == "adaptive prior=16 margin=0 probe=0"
    with pytest.raises(ValueError, match=":margin=0 <= M < 0.5"):
        serving.lane_label("adaptive:margin=0.7", 2, 8)
    from specgate.serving.policy import AdaptivePolicy, CostModel

    cost = CostModel(target_ms={(1, 1): 10.0, (1, 2): 12.0})
    policy = serving.lane_policy("adaptive:prior=16:margin=0:probe=0:objective=throughput", 8, cost)
    assert isinstance(policy, AdaptivePolicy) and (policy.margin, policy.probe_every, policy.objective, policy.gamma_max) == (0.0, 0, "throughput", 8)
    plain = serving.lane_policy("adaptive:prior=16", 8, cost)  # the weight is the scheduler's: the policy is the default one
    assert (plain.margin, plain.probe_every, plain.objective) == (AdaptivePolicy(cost).margin, AdaptivePolicy(cost).probe_every, "goodput")
    assert serving.lane_policy("fixed=4", 4, None).gamma == 4


def test_serving_table_judges_an_adaptive_variant(tmp_path, capsys):
    """--judge 'adaptive prior=1': the variant is judged as adaptive is (among --lanes), the default adaptive lane
    renamed 'adaptive (default)' and left out unless named."""
    table = load("serving_table")
    rows = []
    for r in range(4):
        for lane, tok_s in (("fixed g=4", 100.0), ("adaptive", 99.0), ("adaptive prior=1", 90.0)):
            rows.append({**serving_row(lane, 4, r, tok_s), "window_s": 2.0})
    judged = table.judge_rows(rows, "adaptive prior=1")
    assert sorted({row["lane"] for row in judged}) == ["adaptive", "adaptive (default)", "fixed g=4"]
    assert table.pooled_goals(judged, ["fixed g=4", "adaptive"])[0].startswith("C=4: adaptive / best other (fixed g=4) = 0.900 [")
    assert table.pooled_goals(rows, ["fixed g=4", "adaptive"])[0].startswith("C=4: adaptive / best other (fixed g=4) = 0.990 [")  # control
    # unrestricted, the default adaptive lane is one more candidate: 90 / 100 still (the best other is fixed g=4)
    assert "= 0.900 [" in table.pooled_goals(judged)[0]
    path = write_results(tmp_path / "a.json", rows)
    table.main(["--lanes", "fixed g=4,adaptive", "--judge", "adaptive prior=1", path])
    out = capsys.readouterr().out
    assert "(judging adaptive prior=1 as adaptive)" in out and "= 0.900 [" in out
    with pytest.raises(SystemExit, match="no such lane"):
        table.judge_rows(rows, "adaptive prior=2")


def test_serving_merge_pairs_each_files_repeats(tmp_path, capsys):
    serving = load("bench_serving")
    first = [{**serving_row(lane, 2, 0, v), "window_s": 3.0} for lane, v in (("fixed g=2", 10.0), ("adaptive", 10.0))]
    second = [{**serving_row(lane, 2, 0, v), "window_s": 3.0} for lane, v in (("fixed g=2", 20.0), ("adaptive", 5.0))]
    paths = [Path(write_results(tmp_path / "a.json", first)), Path(write_results(tmp_path / "b.json", second))]
    serving.merge(paths, tmp_path / "out")
    out = capsys.readouterr().out
    # both files' repeat 0 kept, each paired with its own (without renumbering the second overwrote the first)
    assert "paired per repeat 1.00, 0.25" in out
    assert "= 0.500 [0.25-1.00] pooled over 2 repeats" in out  # (30 + 15) / (30 + 60) tokens over equal windows
    assert (tmp_path / "out" / "serving_sweep.png").exists()


def test_serving_sweep_end_to_end_in_balanced_order(tiny_model_dir, tmp_path, monkeypatch):
    """bench_serving.py's main on a tiny random model: every (repeat, concurrency) runs each lane once, in the order
    lane_order gives (--order balanced: a Williams design, so adaptive does not always follow the same lane), and
    results.json holds what serving_table pools (a steady-state window per point)."""
    serving = load("bench_serving")
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [
        "bench_serving.py", "--target", str(tiny_model_dir("llama")), "--concurrency", "1,2", "--repeats", "2",
        "--requests-per-point", "4", "--max-tokens", "6", "--lanes", "off,fixed=2,fixed=3,adaptive", "--gamma-max", "3",
        "--order", "balanced", "--out", str(out),
    ])
    serving.main()
    rows = json.loads((out / "results.json").read_text())["rows"]
    labels = ["off", "fixed g=2", "fixed g=3", "adaptive"]
    assert len(rows) == 2 * 2 * len(labels)
    for block, (repeat, index) in enumerate((r, i) for r in range(2) for i in range(2)):
        ran = rows[block * len(labels) : (block + 1) * len(labels)]
        assert {row["repeat"] for row in ran} == {repeat} and {row["concurrency"] for row in ran} == {(1, 2)[index]}
        assert [row["lane"] for row in ran] == serving.lane_order(labels, repeat + index, "balanced")
    # negative control: the rotation puts adaptive after the same lane in every block, the balanced order does not
    before = {serving.lane_order(labels, k, "balanced")[serving.lane_order(labels, k, "balanced").index("adaptive") - 1] for k in range(4)}
    assert len(before) > 1 and len({serving.lane_order(labels, k)[serving.lane_order(labels, k).index("adaptive") - 1] for k in range(4)}) == 1
    assert all(row["tokens"] == row["requests"] * 6 for row in rows)  # every request ran to its max_tokens (EOS ignored)


def test_serving_adaptive_variant_lane_gets_its_weight_and_each_scheduler_its_own_cost_model(tiny_model_dir, tmp_path, monkeypatch):
    """--lanes ...,adaptive:prior=2: that lane's schedulers blend 2 pseudo-tests of the traffic's acceptance into a
    request's estimate (the others the default 8), and every adaptive scheduler learns its own copy of the one
    calibration (runs 31-36 shared one object between concurrencies), each kept in results.json."""
    from specgate.serving.acceptance import REQUEST_PRIOR_WEIGHT

    serving = load("bench_serving")
    made = []

    class Recording(serving.Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(serving, "Scheduler", Recording)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [
        "bench_serving.py", "--target", str(tiny_model_dir("llama")), "--concurrency", "1,2", "--repeats", "1",
        "--requests-per-point", "2", "--max-tokens", "5", "--lanes", "fixed=2,adaptive,adaptive:prior=2", "--gamma-max", "3", "--out", str(out),
    ])
    serving.main()
    assert sorted(s.request_prior_weight for s in made) == [2.0, 2.0] + [REQUEST_PRIOR_WEIGHT] * 4
    models = [s.policy.cost_model for s in made if hasattr(s.policy, "cost_model")]
    assert len(models) == 4 and len({id(m) for m in models}) == 4
    record = json.loads((out / "results.json").read_text())
    assert set(record["cost_models"]) == {"adaptive C=1", "adaptive C=2", "adaptive prior=2 C=1", "adaptive prior=2 C=2"}
    assert all(m["observations"] > 0 for m in record["cost_models"].values()) and record["cost_model"]["observations"] == 0
    assert {row["lane"] for row in record["rows"]} == {"fixed g=2", "adaptive", "adaptive prior=2"}
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--target", str(tiny_model_dir("llama")), "--http", "--lanes", "adaptive:prior=2"])
    with pytest.raises(SystemExit, match="runs in process only"):
        serving.main()


def test_diag_shapes_times_each_case_after_its_predecessor(tiny_model_dir, monkeypatch, capsys):
    diag = load("diag_shapes")
    assert diag.parse_case("w4<w8", 4) == ("w4<w8", [4] * 4, [8] * 4)
    assert diag.parse_case("4/4/2/0<w4", 4) == ("4/4/2/0<w4", [4, 4, 2, 0], [4] * 4)
    with pytest.raises(ValueError, match="needs 'TIMED<BEFORE'"):
        diag.parse_case("w4", 4)
    with pytest.raises(ValueError, match="lists 3 rows, the batch is 4"):
        diag.parse_case("4/4/2<w4", 4)
    monkeypatch.setattr(sys, "argv", ["diag_shapes.py", "--target", str(tiny_model_dir("llama")), "--batch", "2", "--context", "12",
                                      "--rounds", "3", "--cases", "w2<w2,2/0<w3,w3<w0"])
    diag.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("batch 2, context 12, 3 rounds") and len(lines) == 4
    assert lines[1].split()[0] == "w2<w2" and lines[1].endswith("ratio 1.000")  # the first case is the reference
    assert [line.split()[0] for line in lines[2:]] == ["2/0<w3", "w3<w0"] and all(float(line.split()[2]) > 0 for line in lines[1:])


def test_diag_ragged_groups_full_batch_steps_by_rows_able_to_draft():
    diag = load("diag_ragged")
    trace = [
        {"batch": 8, "rows_caps": [8] * 8, "emitted": 32, "step_ms": 160.0, "width": 4},  # all rows
        {"batch": 8, "rows_caps": [8] * 7 + [0], "emitted": 20, "step_ms": 100.0, "width": 2},  # all but 1
        {"batch": 8, "rows_caps": [4, 4, 4, 0, 0, 1, 3, 0], "emitted": 12, "step_ms": 60.0, "width": 1},  # 3 rows reach 4
        {"batch": 8, "rows_caps": [4, 4, 4, 0, 0, 1, 3, 0], "emitted": 18, "step_ms": 90.0, "width": 4},
        {"batch": 8, "rows_caps": [0] * 8, "emitted": 8, "step_ms": 40.0, "width": 0},
        {"batch": 7, "rows_caps": [8] * 7, "emitted": 30, "step_ms": 10.0, "width": 4},  # not a full batch: left out
    ]
    groups: dict = {}
    diag.efficiency(trace, 8, 4, groups)
    assert groups == {"all": [1, 32, 160.0, 4], "all but 1-2": [1, 20, 100.0, 2], "3-5": [2, 30, 150.0, 5], "0-2": [1, 8, 40.0, 0]}
    assert diag.group_of([8] * 6 + [0, 0], 8, 4) == "all but 1-2" and diag.group_of([8] * 5 + [0] * 3, 8, 4) == "3-5"


def test_diag_plans_groups_full_batch_steps_by_the_width_chosen():
    diag = load("diag_plans")

    def step(width, emitted, step_ms, predicted_ms, goodputs, batch=4):
        plans = [[w, 4 * w, 30.0 + 10.0 * w] for w in range(len(goodputs))]
        return {"batch": batch, "width": width, "emitted": emitted, "step_ms": step_ms, "draft_ms": 0.0, "predicted_ms": predicted_ms,
                "predicted_tokens": emitted - 1.0, "predicted_goodputs": goodputs, "predicted_plans": plans}

    trace = [
        step(2, 10, 50.0, 45.0, [0.10, 0.15, 0.20]),
        step(2, 8, 50.0, 55.0, [0.12, 0.17, 0.18]),
        step(1, 6, 40.0, 40.0, [0.10, 0.16, 0.15]),
        step(2, 99, 1.0, 1.0, [9.0, 9.0, 9.0], batch=3),  # not a full batch: left out
        {**step(1, 5, 40.0, 40.0, [0.1, 0.1]), "predicted_ms": None},  # no prediction (not the adaptive policy's plan)
    ]
    groups = diag.by_chosen_width(trace, 4)
    assert sorted(groups) == [1, 2] and groups[2]["steps"] == 2 and groups[1]["steps"] == 1
    assert groups[2]["measured_ms"] == 50.0 and groups[2]["predicted_ms"] == 50.0 and groups[2]["tokens"] == 9.0 and groups[2]["predicted_tokens"] == 8.0
    assert groups[2]["tokens_per_ms"] == 18 / 100.0
    assert groups[2]["plans"] == {0: (0.11, 30.0), 1: (0.16, 40.0), 2: (0.19, 50.0)}  # means over the two width-2 steps
    assert groups[1]["plans"][1] == (0.16, 40.0)


def test_serving_table_needs_files():
    with pytest.raises(SystemExit) as exit_info:
        load("serving_table").main([])
    code = exit_info.value.code  # a message: Python prints it and exits with status 1
    assert isinstance(code, str) and code.startswith("usage: serving_table.py") and "RESULTS.json" in code


def test_serving_by_width_groups_the_largest_batch():
    serving = load("bench_serving")
    trace = [
        {"batch": 4, "width": 0, "step_ms": 50.0, "forward_ms": 40.0, "emitted": 4},  # not the largest batch: left out
        {"batch": 8, "width": 0, "step_ms": 60.0, "forward_ms": 50.0, "emitted": 8},
        {"batch": 8, "width": 0, "step_ms": 80.0, "forward_ms": 70.0, "emitted": 8},
        {"batch": 8, "width": 2, "step_ms": 100.0, "forward_ms": 90.0, "emitted": 20},
    ]
    out = serving.by_width(trace)
    assert list(out) == ["0", "2"]
    assert out["0"] == {"batch": 8, "count": 2, "step_ms_p50": 70.0, "forward_ms_p50": 60.0, "emitted_mean": 8.0, "tokens_per_ms": 16 / 140}
    assert out["2"]["tokens_per_ms"] == 0.2 and out["2"]["count"] == 1


def slice_row(lane: str, round_: int, tokens: int, wall_s: float) -> dict:
    return {"lane": lane, "round": round_, "tokens": tokens, "wall_s": wall_s, "steps": 10, "itl_chunks": [[40.0, 2], [60.0, 1]], "widths": [2, 4]}


def test_slices_summary_pools_rounds_and_pairs_them():
    """bench_slices.summarize on synthetic slices: pooled throughput = tokens / seconds over the measured rounds
    (the warm-up round -1 left out), the best other lane by that, paired ratios per round, a bootstrap interval
    that holds the pooled ratio, and the verdict against 0.95 (a negative control just below the line)."""
    slices = [slice_row("off", -1, 1, 1.0), slice_row("adaptive", -1, 1, 1.0)]  # warm-up: would sink adaptive
    for r, (off, fixed, adaptive) in enumerate([(100, 300, 290), (120, 330, 340), (90, 270, 255)]):
        slices += [slice_row("off", r, off, 3.0), slice_row("fixed g=4", r, fixed, 3.0), slice_row("adaptive", r, adaptive, 3.0)]
    summary = load("bench_slices").summarize(slices, ["off", "fixed g=4", "adaptive"], [0, 1, 2])
    lanes = summary["lanes"]
    assert lanes["off"]["throughput_tok_s"] == pytest.approx(310 / 9) and lanes["adaptive"]["tokens"] == 885
    assert lanes["off"]["itl_p50_ms"] == 50.0 and lanes["off"]["mean_width"] == 3.0
    assert lanes["off"]["itl_token_p50_ms"] == 20.0 and lanes["off"]["itl_token_mean_ms"] == pytest.approx(100 / 3)
    assert summary["best_other"] == "fixed g=4" and summary["ratio"] == pytest.approx(885 / 900)
    assert summary["paired_ratios"] == pytest.approx([290 / 300, 340 / 330, 255 / 270])
    low, high = summary["ci95"]
    assert low <= summary["ratio"] <= high and summary["met"]
    below = [dict(s, tokens=int(s["tokens"] * 0.9)) if s["lane"] == "adaptive" else s for s in slices]
    assert not load("bench_slices").summarize(below, ["off", "fixed g=4", "adaptive"], [0, 1, 2])["met"]


def test_slices_pool_merges_sweeps_round_by_round(tmp_path):
    """bench_slices.pool: two sweeps' stored points (results.json keeps no step intervals) pooled per concurrency,
    rounds renumbered so that the second sweep's rounds are new rounds, warm-up rounds left out, a concurrency
    only one sweep has left out; the pooled ratio is the tokens / seconds ratio over both."""
    def point(c, rows):
        slices = [{k: v for k, v in slice_row(*row).items() if k not in ("itl_chunks", "widths")} for row in rows]  # as run 30 kept them
        return {"concurrency": c, "summary": {"lanes": {"fixed g=2": {}, "adaptive": {}}}, "slices": slices}
    first = {"points": [
        point(4, [("fixed g=2", -1, 1, 1.0), ("adaptive", -1, 900, 1.0), ("fixed g=2", 0, 100, 1.0), ("adaptive", 0, 90, 1.0),
                  ("fixed g=2", 1, 100, 1.0), ("adaptive", 1, 100, 1.0)]),
        point(8, [("fixed g=2", 0, 100, 1.0), ("adaptive", 0, 100, 1.0), ("fixed g=2", 1, 100, 1.0), ("adaptive", 1, 100, 1.0)]),
    ]}
    second = {"points": [point(4, [("fixed g=2", 0, 200, 2.0), ("adaptive", 0, 160, 2.0), ("fixed g=2", 1, 100, 1.0), ("adaptive", 1, 95, 1.0)])]}
    pooled = load("bench_slices").pool([first, second])
    assert [c for c, _ in pooled] == [4]
    summary = pooled[0][1]
    assert summary["ratio"] == pytest.approx((445 / 5) / (500 / 5)) and len(summary["paired_ratios"]) == 4
    assert summary["paired_ratios"] == pytest.approx([0.9, 1.0, 0.8, 0.95]) and not summary["met"]
    assert summary["lanes"]["adaptive"]["itl_p50_ms"] is None
    load("bench_slices").plot({"points": [{"concurrency": c, "summary": s} for c, s in pooled]}, tmp_path / "pooled.png")  # --pool --plot
    assert (tmp_path / "pooled.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a record written with --keep-steps keeps each step's end time and per-row counts: pooled ITL from its trace
    trace = [{"end_s": 1.0, "rows_emitted": [1], "rows_before": [3]}, {"end_s": 1.05, "rows_emitted": [5], "rows_before": [4]}]
    kept = {"points": [point(4, [("fixed g=2", 0, 100, 1.0), ("adaptive", 0, 100, 1.0)])]}
    kept["points"][0]["slices"][1]["trace"] = trace
    lanes = load("bench_slices").pool([kept])[0][1]["lanes"]
    assert lanes["adaptive"]["itl_p50_ms"] == pytest.approx(50.0) and lanes["adaptive"]["itl_token_p50_ms"] == pytest.approx(10.0)
    assert lanes["fixed g=2"]["itl_p50_ms"] is None
    # an A/B sweep with two adaptive lanes: --judge picks the one judged as `adaptive`; the other is left out of
    # the lanes it is judged against (negative control: without --judge the second adaptive lane is an "other")
    ab = {"points": [{"concurrency": 4, "summary": {"lanes": {"fixed g=2": {}, "adaptive": {}, "adaptive-cells": {}}}, "slices": [
        {k: v for k, v in slice_row(*row).items() if k not in ("itl_chunks", "widths")}
        for row in [("fixed g=2", 0, 100, 1.0), ("adaptive", 0, 150, 1.0), ("adaptive-cells", 0, 120, 1.0)]]}]}
    judged = load("bench_slices").pool([ab], "adaptive-cells")[0][1]
    assert list(judged["lanes"]) == ["fixed g=2", "adaptive"] and judged["ratio"] == pytest.approx(1.2)
    assert load("bench_slices").pool([ab])[0][1]["best_other"] == "adaptive-cells"
    with pytest.raises(SystemExit, match="adaptive-x"):
        load("bench_slices").pool([ab], "adaptive-x")


def test_slices_inter_token_latencies_per_chunk_and_per_token():
    """bench_slices.inter_token_latencies on a trace whose answers are known: one chunk sample per request and step
    (the interval since the previous step), that interval split over the request's tokens for the per-token
    samples, the slice's first step left out, and a request's first token (its TTFT) in neither."""
    trace = [
        {"end_s": 10.000, "rows_emitted": [3, 1], "rows_before": [5, 2]},  # first step of the slice: left out
        {"end_s": 10.040, "rows_emitted": [4, 1], "rows_before": [8, 3]},  # 40 ms: 4 tokens and 1 token
        {"end_s": 10.100, "rows_emitted": [2, 1, 3], "rows_before": [12, 4, 0]},  # 60 ms; the third row's first tokens
    ]
    chunk, token = load("bench_slices").inter_token_latencies(trace)
    assert chunk == pytest.approx([40.0, 40.0, 60.0, 60.0])
    assert token == pytest.approx([10.0] * 4 + [40.0] + [30.0] * 2 + [60.0])  # no 20 ms x 3 from the new row


def test_slices_closed_loop_on_a_real_scheduler(tiny_model_dir):
    """ClosedLoop + run_slice on a real scheduler (tiny random model): clients are replaced as they finish, the
    policy can be swapped between slices, and a slice's tokens are exactly the tokens its steps committed."""
    from specgate.models import load_model
    from specgate.serving import FixedPolicy, OffPolicy, Scheduler

    bench = load("bench_slices")
    target = load_model(str(tiny_model_dir("llama")))
    prompts = [torch.cat([torch.tensor([1]), torch.arange(5, 9).repeat(3)]), torch.cat([torch.tensor([1]), torch.arange(20, 23).repeat(4)])]
    scheduler = Scheduler(target, "ngram", OffPolicy(), num_slots=2, max_seq_len=64)
    loop = bench.ClosedLoop(scheduler, prompts, 2, max_tokens=6)
    first = bench.run_slice(scheduler, 0.0, min_steps=12)  # sized in steps: a slow or fast host runs the same slice
    assert first["steps"] == 12 and first["tokens"] == 24 and loop.finished == 4  # off: 1 token a step each, 6 per request
    scheduler.policy = FixedPolicy(3)
    second = bench.run_slice(scheduler, 0.0, min_steps=12)
    assert second["steps"] == 12 and loop.finished > 4 and loop.sent == loop.finished + 2
    assert set(first["widths"]) == {0} and max(second["widths"]) > 0
    assert first["tokens"] >= first["steps"]  # off: every decode step commits one token per running request
    assert second["tokens"] == sum(t["emitted"] for t in scheduler.trace)
    steps = scheduler.trace
    continuing = [(e, b) for t in steps[1:] for e, b in zip(t["rows_emitted"], t["rows_before"]) if b > 0 and e > 0]
    assert [e for _, e in second["itl_chunks"]] == [e for e, _ in continuing] and continuing  # kept in results.json
    chunk, token = bench.slice_latencies(json.loads(json.dumps(second)))  # read back as a pool reads it
    assert len(chunk) == len(continuing) and len(token) == sum(e for e, _ in continuing)
    assert sum(token) == pytest.approx(sum(chunk), rel=1e-3)  # each chunk split over its tokens
    assert all(sum(t["rows_emitted"]) == t["emitted"] and len(t["rows_before"]) == t["batch"] for t in steps)
    # varied lengths (--length-spread): every request's max_tokens within max_tokens * (1 +- spread), not all alike
    spread = bench.ClosedLoop(Scheduler(target, "ngram", OffPolicy(), num_slots=4, max_seq_len=64), prompts, 4, max_tokens=10, spread=0.5)
    lengths = [r.max_tokens for r in spread.scheduler.waiting]
    assert len(lengths) == 4 and all(5 <= n <= 15 for n in lengths) and len(set(lengths)) > 1
    with pytest.raises(ValueError, match="spread=1.5"):
        bench.ClosedLoop(scheduler, prompts, 1, max_tokens=10, spread=1.5)


def test_replay_follows_the_output_and_its_costs():
    """bench_replay.replay on synthetic greedy outputs and a cost table whose answers are known: with speculation
    off every step commits one token per row at the table's one-token price; a copy-heavy output that lookups
    predict gives fixed gamma 4 more tokens per step than off; the oracle (true match lengths) is at least as fast
    as every fixed lane on the same replay, and a cost table built from a trace is made non-decreasing."""
    bench = load("bench_replay")
    pattern = list(range(10, 20))
    data = {"prompts": [pattern + pattern[:3]], "outputs": [pattern[3:] + pattern * 12]}  # the output copies the prompt
    table = {2: ([2, 4, 6, 10, 18], [20.0, 24.0, 28.0, 40.0, 80.0])}
    common = {"seconds": 30.0, "noise": 0.0, "prefill_ms": 0.0, "max_tokens": 40, "spread": 0.0, "seed": 0}
    off = bench.replay(bench.make_policy("off"), data, table, 2, **common)
    assert off["throughput_tok_s"] == pytest.approx(2 / 20.0 * 1e3) and off["mean_width"] == 0.0
    fixed = {g: bench.replay(bench.make_policy("fixed", gamma=g), data, table, 2, **common)["throughput_tok_s"] for g in (1, 2, 4, 8)}
    assert fixed[4] > 2.0 * off["throughput_tok_s"]  # lookups copy the prompt: most drafts accepted
    oracle = bench.replay(bench.OraclePolicy(8, table), data, table, 2, **common)["throughput_tok_s"]
    assert oracle >= max(fixed.values()) * (1 - 1e-9)
    record = {"points": [{
        "concurrency": 2, "adaptive": {"cost_model": {"target_ms": [[1, 1, 10.0], [2, 1, 20.0]]}},
        "slices": [{"trace": [{"batch": 2, "drafted": 0, "prefill_tokens": 0, "step_ms": 99.0}]  # a slice's first step is left out
                   + [{"batch": 2, "drafted": d, "prefill_tokens": 0, "step_ms": ms} for d, ms in [(0, 20.0), (2, 30.0), (4, 25.0)] * 5]
                   + [{"batch": 2, "drafted": 8, "prefill_tokens": 40, "step_ms": 500.0}] * 5}],  # prefill steps left out
    }]}
    costs, calibration = bench.cost_table(record)
    assert costs[2] == ([2, 4, 6], [20.0, 30.0, 30.0]) and calibration == {(1, 1): 10.0, (2, 1): 20.0}


def test_slices_step_table_groups_full_batch_decode_steps_by_width():
    """bench_slices.step_table: per (C, lane, width) only measured full-batch decode steps (warm-up rounds, prefill
    steps, partial batches and each slice's first step left out), medians and sums as stated; the adaptive lane's
    mean predictions, "-" for lanes without any; a record without traces is refused."""
    bench = load("bench_slices")

    def step(width, ms, emitted, batch=2, prefill=0, predicted=None):
        return {"batch": batch, "width": width, "drafted": 2 * width, "emitted": emitted, "step_ms": ms, "forward_ms": ms - 3.0,
                "prefill_tokens": prefill, "predicted_ms": predicted, "predicted_tokens": None if predicted is None else emitted + 1.0}

    first = step(2, 999.0, 99)  # a slice's first step: left out
    record = {"points": [{"concurrency": 2, "slices": [
        {"lane": "adaptive", "round": 0, "trace": [first, step(2, 40.0, 4, predicted=41.0), step(2, 50.0, 6, predicted=49.0), step(2, 45.0, 5, predicted=45.0),
                                                    step(2, 80.0, 9, prefill=30), step(2, 20.0, 2, batch=1)]},
        {"lane": "adaptive", "round": -1, "trace": [first, step(2, 500.0, 1)]},  # warm-up round
        {"lane": "fixed g=4", "round": 0, "trace": [first, step(4, 60.0, 8)]},
    ]}]}
    rows = bench.step_table(record)
    assert rows[2] == "| 2 | adaptive | 2 | 3 | 45.0 | 42.0 | 3.00 | 5.00 | 0.1111 | 45.0 / 6.00 |"
    assert rows[3] == "| 2 | fixed g=4 | 4 | 1 | 60.0 | 57.0 | 3.00 | 8.00 | 0.1333 | - |" and len(rows) == 4
    with pytest.raises(SystemExit, match="keep-steps"):
        bench.step_table({"points": [{"concurrency": 2, "slices": [{"lane": "off", "round": 0, "tokens": 1}]}]})


def test_slices_held_out_ratio_picks_the_best_lane_of_the_other_rounds():
    """bench_slices.held_out: round r is judged against the lane with the best throughput over the other rounds.
    Two fixed lanes that trade places with the noise (each 330 in two rounds, 270 in the third) and an adaptive lane
    at 300 throughout: the best lane of all rounds measures 930 / 9 s, so `ratio` = 900 / 930 < 1 (and < 0.97),
    while the lane an operator would have picked from the other rounds made 870 tokens in the rounds it was picked
    for, so held_out = 900 / 870 > 1. A negative control: with one lane better in every round (the noise does not
    decide), the held-out pick is that lane in every round and both ratios agree."""
    bench = load("bench_slices")
    slices = []
    for r, (a, b) in enumerate([(330, 330), (330, 270), (270, 330)]):
        slices += [slice_row("fixed g=2", r, a, 3.0), slice_row("fixed g=4", r, b, 3.0), slice_row("adaptive", r, 300, 3.0)]
    summary = bench.summarize(slices, ["fixed g=2", "fixed g=4", "adaptive"], [0, 1, 2])
    assert summary["best_other"] == "fixed g=2" and summary["ratio"] == pytest.approx(900 / 930)
    # round 0: both others tie elsewhere (600 each) -> the first, g=2 (330); round 1: g=4 wins rounds 0, 2 (660 vs
    # 600) -> g=4 (270); round 2: g=2 wins rounds 0, 1 (660 vs 600) -> g=2 (270)
    held = summary["held_out"]
    assert held["picks"] == {"fixed g=2": 2, "fixed g=4": 1}
    assert held["ratio"] == pytest.approx(900 / (330 + 270 + 270)) and held["met"]
    low, high = held["ci95"]
    assert low <= held["ratio"] <= high
    clear = [dict(s, tokens=s["tokens"] + 100) if s["lane"] == "fixed g=2" else s for s in slices]
    control = bench.summarize(clear, ["fixed g=2", "fixed g=4", "adaptive"], [0, 1, 2])
    assert control["held_out"]["picks"] == {"fixed g=2": 3}
    assert control["held_out"]["ratio"] == pytest.approx(control["ratio"]) and not control["held_out"]["met"]
    assert "chosen on the other rounds (fixed g=2 3 rounds)" in bench.line(16, control)


def test_slices_balanced_order_balances_positions_and_predecessors():
    """bench_slices.lane_order: with the default rotation, each lane always follows the same lane (what the
    balanced order fixes: the lane after fixed gamma 8 inherited its requests in flight every round); balanced
    (Williams) puts every lane at every position and after every other lane equally often, over 2n rounds for odd n
    and n for even n, for n = 2..6; and an unknown order is refused."""
    from collections import Counter

    bench = load("bench_slices")
    labels = ["off", "fixed g=2", "fixed g=4", "fixed g=8", "adaptive"]
    rotated = [bench.lane_order(labels, i) for i in range(10)]
    assert all(sorted(r) == sorted(labels) for r in rotated)
    assert {a for r in rotated for a, b in zip(r, r[1:]) if b == "adaptive"} == {"fixed g=8"}
    for n in range(2, 7):
        names = [f"l{i}" for i in range(n)]
        rounds = [bench.lane_order(names, i, "balanced") for i in range(2 * n if n % 2 else n)]
        assert all(sorted(r) == names for r in rounds)
        positions = Counter((r.index(lane), lane) for r in rounds for lane in r)
        follows = Counter((a, b) for r in rounds for a, b in zip(r, r[1:]))
        assert len(positions) == n * n and len(set(positions.values())) == 1
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    with pytest.raises(ValueError, match="order='random'"):
        bench.lane_order(labels, 0, "random")


def test_replay_lanes_take_turns_on_one_loop():
    """bench_replay.replay_lanes with slices: the lanes share one loop (one request stream), each runs its slices
    and is credited with their tokens and time only. Off and fixed gamma 4 sliced: each lane's throughput is its
    own price (off: 2 tokens per 20 ms step exactly, as alone), both get about `seconds` of time, and gamma 4
    still beats off; several lanes without slices are refused (they could not share one loop)."""
    bench = load("bench_replay")
    pattern = list(range(10, 20))
    data = {"prompts": [pattern + pattern[:3]], "outputs": [pattern[3:] + pattern * 12]}
    table = {2: ([2, 4, 6, 10, 18], [20.0, 24.0, 28.0, 40.0, 80.0])}
    common = {"seconds": 30.0, "noise": 0.0, "prefill_ms": 0.0, "max_tokens": 40, "spread": 0.0, "seed": 0}
    lanes = {"off": bench.make_policy("off"), "fixed g=4": bench.make_policy("fixed", gamma=4)}
    out = bench.replay_lanes(lanes, data, table, 2, slice_s=1.0, order="balanced", **common)
    alone = bench.replay(bench.make_policy("fixed", gamma=4), data, table, 2, **common)
    assert out["off"]["throughput_tok_s"] == pytest.approx(2 / 20.0 * 1e3) and out["off"]["mean_width"] == 0.0
    assert out["fixed g=4"]["throughput_tok_s"] > 2.0 * out["off"]["throughput_tok_s"]
    assert out["fixed g=4"]["throughput_tok_s"] == pytest.approx(alone["throughput_tok_s"], rel=0.1)
    steps = {lane: v["steps"] for lane, v in out.items()}
    assert steps["off"] * 20.0 == pytest.approx(30e3, rel=0.05)  # its ~30 s, in 1 s slices
    with pytest.raises(ValueError, match="2 lanes need slice_s"):
        bench.replay_lanes(lanes, data, table, 2, **common)


def test_counterfactual_rebuilds_each_row_and_prices_every_width(tiny_model_dir):
    """bench_counterfactual on a real closed loop (tiny random model, n-gram lookups of 8): every traced row is
    rebuilt from its prompt and the target-alone greedy output (no step flagged), so on a fixed lane's own states
    the counterfactual at its own gamma commits exactly the tokens it committed live, and at width 0 one per row;
    the adaptive lane's plans are all priced. Negative control: an output with one token dropped after a few makes the
    steps that read past it disagree with what was committed, and they are flagged, not counted."""
    from specgate.models import load_model
    from specgate.sampling import SamplingParams
    from specgate.serving import AdaptivePolicy, CostModel, FixedPolicy, OffPolicy, Request, Scheduler

    bench, slices = load("bench_counterfactual"), load("bench_slices")
    target = load_model(str(tiny_model_dir("llama")))
    prompts = [torch.cat([torch.tensor([1]), torch.arange(5, 9).repeat(3)]), torch.cat([torch.tensor([1]), torch.arange(20, 23).repeat(4)])]
    alone = Scheduler(target, "none", OffPolicy(), num_slots=2, max_seq_len=64)
    requests = [alone.submit(Request(p, SamplingParams(temperature=0.0), max_tokens=30, ignore_eos=True)) for p in prompts]
    alone.run_until_idle()
    data = {"prompts": [p.tolist() for p in prompts], "outputs": [list(r.tokens) for r in requests]}
    scheduler = Scheduler(target, "ngram", FixedPolicy(2), num_slots=2, max_seq_len=64, lookup_tokens=8)
    loop = slices.ClosedLoop(scheduler, prompts, 2, max_tokens=12, spread=0.5)
    adaptive = AdaptivePolicy(CostModel({(b, t): 10.0 * b + 2.0 * b * t for b in (1, 2) for t in range(1, 10)}), gamma_max=8)
    pieces = []
    for index, policy in enumerate([FixedPolicy(2), adaptive, FixedPolicy(2), adaptive]):
        scheduler.policy = policy
        piece = slices.run_slice(scheduler, 0.0, min_steps=150)  # steps, not seconds: a loaded host must not empty a slice
        pieces.append({"lane": "fixed g=2" if isinstance(policy, FixedPolicy) else "adaptive", "round": index // 2, **piece})
    record = {"points": [{"concurrency": 2, "requests": loop.issued, "adaptive": {"cost_model": adaptive.cost_model.to_dict()},
                          "slices": pieces}]}
    [point] = bench.analyse(record, data, 8)
    fixed, mine = point["lanes"]["fixed g=2"], point["lanes"]["adaptive"]
    full = sum(1 for p in pieces if p["lane"] == "fixed g=2" for t in p["trace"][1:] if t["batch"] == 2 and not t["prefill_tokens"])
    assert fixed["steps"] >= full > 0 and fixed.get("diverged", 0) == 0 and mine.get("diverged", 0) == 0
    assert fixed["w2_tokens"] == fixed["own_tokens"] == fixed["live_tokens"] > fixed["w0_tokens"] == 2 * fixed["steps"]
    assert fixed["oracle_tokens"] / fixed["oracle_ms"] >= max(fixed[f"w{w}_tokens"] / fixed[f"w{w}_ms"] for w in bench.WIDTHS) - 1e-12
    assert mine["pred_ms_chosen"] > 0 and mine["true_tokens_chosen"] == mine["own_tokens"] == mine["live_tokens"]
    assert any(line.startswith("| 2 | adaptive |") for line in bench.report([point]))
    tampered = {"prompts": data["prompts"], "outputs": [o[:3] + o[4:] + [0] for o in data["outputs"]]}  # one token dropped
    [bad] = bench.analyse(record, tampered, 8)
    assert bad["lanes"]["fixed g=2"]["diverged"] > 0 and bad["lanes"]["fixed g=2"].get("steps", 0) < fixed["steps"]


def test_acceptance_scores_rank_prior_weights_by_how_well_they_predict():
    """bench_acceptance.py --prior-weights: each weight's re-blended estimates are scored on every tested position
    (Brier, log loss). A weight whose estimates equal the rows' true rate scores the Brier of a fair coin at that
    rate; one whose estimates scatter around it scores worse (the negative control: the same data, ranked the
    other way round if the columns are swapped)."""
    import numpy as np

    bench = load("bench_acceptance")
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(500):
        rows = []
        for _ in range(4):
            m = int(rng.random() < 0.8)  # position 1 accepted at 0.8; position 2 never proposed (len 1)
            noisy = float(rng.choice([0.5, 0.99]))
            rows.append({"m": m, "len": 1, "resolved": True, "profile": [noisy], "cap": 1, "gamma": 1, "alternatives": [[0.8], [noisy]]})
        steps.append({"rows": rows, "token_factor": 1.0})
    estimated, realized = bench.position_tests(steps, key=lambda row: row["alternatives"][0])
    assert list(estimated) == [1] and len(estimated[1]) == 2000 and abs(np.mean(realized[1]) - 0.8) < 0.03
    lines = bench.shrinkage_lines(steps, [8.0, 1.0])
    good, bad = (line.split(" | ") for line in lines[-2:])
    assert good[0] == "| 8" and bad[0] == "| 1" and good[1] == bad[1] == "2000"
    y = np.array(realized[1])
    assert float(good[2]) == pytest.approx(np.mean((0.8 - y) ** 2), abs=1e-4) and float(good[2]) < float(bad[2])
    assert float(good[3]) < float(bad[3])  # log loss too
    swapped = [{**step, "rows": [{**row, "alternatives": row["alternatives"][::-1]} for row in step["rows"]]} for step in steps]
    first, second = (line.split(" | ") for line in bench.shrinkage_lines(swapped, [8.0, 1.0])[-2:])
    assert float(first[2]) > float(second[2])
