"""specgate.bench's shared timing helpers and the pure parts of the moved benchmark methods, against values computed
by hand: medians and the middle run, the alternating lane order, interleaved calls (a fake clock), the Monte Carlo
record, bench_rows' shapes and alternation, the overload checks (with failing controls), the perf section's
theory comparison, bench_draft's and bench_assisted's summaries, and the tables they print.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from specgate.bench import assisted, draft, engine, montecarlo, overload, perf, rows, tables, timing


def test_median_and_the_middle_run():
    assert timing.median([3.0, 1.0, 2.0]) == 2.0
    assert timing.median([4.0, 1.0, 3.0, 2.0]) == 2.5  # even count: the mean of the middle two
    runs = [{"wall_s": 3.0, "id": "c"}, {"wall_s": 1.0, "id": "a"}, {"wall_s": 2.0, "id": "b"}, {"wall_s": 4.0, "id": "d"}]
    assert timing.middle(runs, key=lambda r: r["wall_s"])["id"] == "c"  # a run that happened: the upper middle
    assert timing.middle(runs[:3], key=lambda r: r["wall_s"])["id"] == "b"
    with pytest.raises(ValueError, match="repeats >= 1"):
        timing.median([])


def test_turn_order_alternates_and_interleaved_calls_take_turns(monkeypatch):
    assert [timing.turn_order("AB", k, alternate=True) for k in range(4)] == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    assert timing.turn_order(["A", "B", "C"], 1) == ["A", "B", "C"]
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls: list[str] = []
    times = timing.interleaved_s({"A": lambda: calls.append("A"), "B": lambda: calls.append("B")}, repeats=3, alternate=True)
    assert calls == ["A", "B", "B", "A", "A", "B"]
    assert times == {"A": [1.0, 1.0, 1.0], "B": [1.0, 1.0, 1.0]}  # each call read the clock twice, 1 s apart


def test_median_call_warms_up_untimed(monkeypatch):
    clock = iter([0.0, 10.0, 10.0, 13.0, 20.0, 21.0, 30.0, 35.0])  # (start, end) of the 4 timed calls: 10, 3, 1, 5 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls = []
    assert timing.median_call_s(lambda: calls.append(1), repeats=4, warmup=2) == 4.0  # (3 + 5) / 2
    assert len(calls) == 6


def test_montecarlo_loop_and_record():
    assert montecarlo.textbook_loop(100, 1.0, 4) == 500  # every draft accepted: gamma + 1 tokens an iteration
    assert montecarlo.textbook_loop(100, 0.0, 4) == 100  # none: the target's own token only
    runs = {"python": [(2.0, 2.7), (1.0, 2.9)], "numpy": [(0.1, 2.8), (0.2, 2.6)]}
    report = montecarlo.montecarlo_report(runs, 0.7, 4, python_iterations=1000, numpy_iterations=10_000)
    assert report["python_iterations_per_s_median"] == 750.0 and report["numpy_iterations_per_s_median"] == 75_000.0
    assert report["ratio_of_medians"] == 100.0
    assert report["python_iterations_per_s_range"] == [500.0, 1000.0]
    assert report["python_acceptance_length"] == pytest.approx(2.8) and report["numpy_acceptance_length"] == pytest.approx(2.7)
    assert report["closed_form_expected_tokens"] == pytest.approx((1 - 0.7**5) / 0.3)
    order = []
    small = montecarlo.alternating_runs(0.7, 2, 1000, 1000, 2, 0, lambda name, repeat, total: (order.append((name, repeat)), lambda n: None)[1])
    assert order == [("python", 0), ("numpy", 0), ("python", 1), ("numpy", 1)]
    assert [len(v) for v in small.values()] == [2, 2]


def test_rows_shapes_alternation_and_table(monkeypatch):
    assert rows.parse_shapes("16x4,8x9") == [(16, 4), (8, 9)]
    for bad in ("16x", "16x4x2", "0x4", ""):
        with pytest.raises(ValueError, match="BATCHxTOKENS"):
            rows.parse_shapes(bad)
    seen = []
    monkeypatch.setattr(rows, "forward_ms", lambda model, b, t: seen.append((b, t, rows.native.BF16_LAYER_MAX_ROWS)) or 1.0 * b)
    new = rows.native.BF16_LAYER_MAX_ROWS
    times = rows.old_new_ms(None, [(2, 3)], repeats=2, old=8)
    assert seen == [(2, 3, 8), (2, 3, new), (2, 3, new), (2, 3, 8)]  # old first, then new first
    assert rows.native.BF16_LAYER_MAX_ROWS == new  # the limit is restored
    table = rows.rows_table({(2, 3): {"old": [10.0, 30.0], "new": [5.0, 15.0]}}, 8, 2)
    assert table[1] == "| batch x tokens | rows | old limit ms | new limit ms | new / old |"
    assert table[-1] == "| 2 x 3 | 6 | 20 | 10 | 0.50 |"


def passing_overload() -> dict:
    return {"unanswered_or_malformed": 0, "refused_without_retry_after": 0, "client_timeouts": 0, "rss_start_mib": 400.0,
            "rss_peak_mib": 500.0, "metrics_after": {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_slots_in_use": 0.0},
            "sigterm_exit_code": 0}


def test_overload_counts_and_checks_with_failing_controls():
    outcomes = [{"status": 200, "ok": True, "latency_s": 2.0, "retry_after": None}, {"status": 200, "ok": True, "latency_s": 1.0, "retry_after": None},
                {"status": 429, "ok": True, "latency_s": 0.1, "retry_after": "1"}, {"status": 503, "ok": True, "latency_s": 0.2, "retry_after": None},
                {"status": "client timeout (ReadTimeout)", "ok": False, "latency_s": 9.0}]
    counts = overload.outcome_counts(outcomes)
    assert counts["statuses"] == {"200": 2, "429": 1, "503": 1, "client timeout (ReadTimeout)": 1}
    assert (counts["served"], counts["refused_429_503"], counts["refused_without_retry_after"]) == (2, 2, 1)
    assert (counts["unanswered_or_malformed"], counts["client_timeouts"]) == (1, 1)
    assert counts["served_latency_p50_s"] == 2.0 and counts["served_latency_max_s"] == 2.0 and counts["refused_latency_max_s"] == 0.2
    assert all(overload.overload_checks(passing_overload(), 256.0).values())
    failures = {"client_timeouts": 1, "rss_peak_mib": 700.0, "sigterm_exit_code": -9, "refused_without_retry_after": 1,
                "metrics_after": {"num_requests_running": 1.0, "num_requests_waiting": 0.0, "kv_slots_in_use": 1.0}}
    for key, value in failures.items():  # each one alone fails exactly one check
        checks = overload.overload_checks({**passing_overload(), key: value}, 256.0)
        assert sum(not ok for ok in checks.values()) == 1, key
    assert not all(overload.overload_checks({**passing_overload(), "metrics_after": {}}, 256.0).values())


def fake_stats(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"prefill_ms": 0.0, "draft_ms_total": 0.0, "drafted_tokens": 0, "measured_alpha": None, "acceptance_rate": None,
                              "acceptance_length": 1.0, "steps_by_draft_length": [], **fields})


def test_theory_comparison_against_leviathan_by_hand():
    baseline = {"tokens": list(range(10)), "wall_s": 2.0, "stats": fake_stats(verify_ms_total=100.0, iterations=10)}  # 10 ms a step
    stats = fake_stats(verify_ms_total=60.0, iterations=5, measured_alpha=0.5, draft_ms_total=10.0, drafted_tokens=10,
                       acceptance_rate=0.5, acceptance_length=2.0, steps_by_draft_length=[0, 0, 5])
    lane = {"tokens": list(range(10)), "wall_s": 1.0, "stats": stats}
    t = perf.theory_comparison(lane, baseline, [1.0, 1.0, 1.0], gamma=2)
    assert t["c"] == pytest.approx(0.1)  # 1 ms a drafted token / 10 ms a target step
    leviathan = (1 - 0.5**3) / ((1 - 0.5) * (2 * 0.1 + 1))
    assert t["predicted"]["leviathan"] == pytest.approx(leviathan)
    assert t["predicted"]["lengths"] == pytest.approx(leviathan)  # every step drafted gamma tokens
    assert t["predicted"]["lengths_and_verify_cost"] == pytest.approx(leviathan)  # V(t) = 1 for every t
    assert t["measured"] == {"decode_phase": 2.0, "end_to_end": 2.0}
    assert t["decode_phase_over_predicted"]["leviathan"] == pytest.approx(2.0 / leviathan)
    assert t["expected_tokens_at_gamma"] == pytest.approx(1.75) and t["mean_draft_length"] == 2.0 and t["same_tokens_as_baseline"]
    dearer = perf.theory_comparison(lane, baseline, [1.0, 1.2, 1.5], gamma=2)
    assert dearer["predicted"]["lengths_and_verify_cost"] < leviathan  # a 3-token pass that costs more predicts less


def test_demo_commands_read_the_demo_target_only():
    makefile = "VENV ?= .venv\ndemo: install\n\t$(VENV)/bin/specgate a \\\n\t  --b 1\n\t$(VENV)/bin/python x.py\ntest:\n\tpytest\n"
    commands = perf.demo_commands(makefile)
    assert [shlex.split(c) for c in commands] == [[".venv/bin/specgate", "a", "--b", "1"], [".venv/bin/python", "x.py"]]


def draft_stats(wall_s: float, prefill_ms: float, **counts) -> dict:
    return {"wall_s": wall_s, "new_tokens": 10, "prefill_ms": prefill_ms, "accepted_tokens": 0, "rejections": 0, "drafted_tokens": 0,
            "iterations": 10, "draft_ms_total": 0.0, "verify_ms_total": 150.0, **counts}


def test_draft_summary_by_hand():
    lane_stats = draft_stats(1.0, 500.0, accepted_tokens=10, rejections=5, drafted_tokens=20, draft_ms_total=20.0, verify_ms_total=100.0)
    row = {"category": "code", "baseline": {"tokens": [1, 2], "stats": draft_stats(2.0, 500.0)}, "draft-model g2": {"tokens": [1, 2], "stats": lane_stats}}
    built = {"baseline": (None, 0, 0.0), "draft-model g2": (None, 2, 0.0)}
    summary = draft.summarise([row, dict(row)], ["baseline", "draft-model g2"], built)["code"]
    assert summary["baseline"] == {"tokens_per_s": 5.0, "speedup": 1.0, "decode_speedup": 1.0, "ms_per_step": 15.0}
    lane = summary["draft-model g2"]
    assert lane["speedup"] == 2.0 and lane["decode_speedup"] == pytest.approx(3.0)  # decode 1 s vs 3 s over both prompts
    assert lane["alpha"] == pytest.approx(2 / 3) and lane["acceptance_rate"] == 0.5 and lane["acceptance_length"] == 2.0
    assert lane["c"] == pytest.approx(0.1) and lane["identical_to_baseline"]
    assert lane["theory_speedup"] == pytest.approx((1 - (2 / 3) ** 3) / ((1 - 2 / 3) * 1.2))
    assert lane["speedup_ci95"] == [2.0, 2.0] and lane["acceptance_length_ci95"] == [2.0, 2.0]  # two identical runs
    assert "speedup_ci95" not in summary["baseline"]
    assert draft.choose_lanes("") == draft.DEFAULT_LANES and "self-spec 6L g2" not in draft.DEFAULT_LANES
    assert "eagle g3" in draft.DEFAULT_LANES and "draft-model g3" in draft.DEFAULT_LANES
    with pytest.raises(ValueError, match=r"unknown lane\(s\) \['nope'\]"):
        draft.choose_lanes("baseline,nope")


def test_draft_summary_cis_resample_the_prompt_runs():
    """Two runs, one at 1.0x and AL 1, one at 4.0x and AL 3: a quarter of the resamples draw the first twice, a
    quarter the second twice, so the 95% percentile CI runs from the one to the other; one run has no CI."""
    slow = draft_stats(2.0, 0.0, accepted_tokens=0, rejections=10, drafted_tokens=10, iterations=10)
    fast = draft_stats(0.5, 0.0, accepted_tokens=20, rejections=0, drafted_tokens=20, iterations=10)
    base = {"tokens": [], "stats": draft_stats(2.0, 0.0)}
    rows = [{"category": "code", "baseline": base, "lane": {"tokens": [], "stats": stats}} for stats in (slow, fast)]
    built = {"baseline": (None, 0, 0.0), "lane": (None, 2, 0.0)}
    lane = draft.summarise(rows, ["baseline", "lane"], built)["code"]["lane"]
    assert lane["speedup"] == pytest.approx(1.6) and lane["speedup_ci95"] == pytest.approx([1.0, 4.0])
    assert lane["acceptance_length"] == 2.0 and lane["acceptance_length_ci95"] == pytest.approx([1.0, 3.0])
    single = draft.summarise(rows[:1], ["baseline", "lane"], built)["code"]["lane"]
    assert single["speedup"] == 1.0 and single["speedup_ci95"] is None and single["acceptance_length_ci95"] is None


def test_assisted_pooled_acceptance_summary_and_rotation():
    runs = [{"accepted": 3, "rejections": 1, "iterations": 2, "drafted": 4, "draft_ms": 4.0, "verify_ms": 10.0},
            {"accepted": 1, "rejections": 1, "iterations": 2, "drafted": 4, "draft_ms": 4.0, "verify_ms": 10.0}]
    assert assisted.pooled_acceptance(runs) == {"alpha": 4 / 6, "acceptance_rate": 0.5, "acceptance_length": 2.0,
                                                "draft_ms_per_token": 1.0, "verify_ms_per_step": 5.0}
    assert assisted.pooled_acceptance([{**r, "draft_ms": 0} for r in runs]).keys() >= {"alpha"}
    order: list[str] = []

    def lane(name):
        def run(ids, n):
            if n != 8:  # not the warm-up
                order.append(name)
            return {"tokens": [1] * n, "wall_s": {"own baseline": 1.0, "transformers greedy": 2.0, "own x": 0.5}[name],
                    "iterations": n, "drafted": 0, "accepted": 0, "rejections": 0}
        return run

    lanes = {name: lane(name) for name in ("own baseline", "transformers greedy", "own x")}
    jobs = [("code", 0, [5, 6]), ("code", 1, [7]), ("prose", 0, [8])]
    records = assisted.run_prompts(lanes, jobs, 4, [1])
    b, g, x = lanes
    assert order == [b, g, x, g, x, b, x, b, g]  # the order rotates prompt by prompt: no lane always first
    assert [list(r["lanes"]) for r in records] == [list(lanes)] * 3  # recorded in the lanes' order
    summary = assisted.summarise(records, list(lanes), [("own x", "transformers greedy")], [("own baseline", "own x")])
    assert list(summary) == ["all", "code", "prose"] and summary["code"]["prompts"] == 2
    assert summary["all"]["lanes"]["own x"]["median_speedup_over_own_baseline"] == 2.0
    assert summary["all"]["ratios"]["own x / transformers greedy"] == {"median": 4.0, "min": 4.0, "max": 4.0}
    assert summary["all"]["same_acceptance_counts"]["own baseline = own x"] == 3
    report = {"command": "c", "machine": "m", "max_new_tokens": 4, "dtype": "float32", "summary": summary}
    lines = assisted.assisted_tables(report)
    assert "| own x | 8.0 | 2.00x | - | 1.00 | 3/3 / 3/3 |" in lines


def test_engine_row_and_tables_by_hand():
    def run(tokens, wall_s, al=None):
        return {"tokens": tokens, "wall_s": wall_s, "stats": SimpleNamespace(acceptance_length=al)}

    row = engine.prompt_row({"own baseline": run([1, 2, 3, 4], 2.0), "own n-gram": run([1, 2, 3, 4], 0.5, 2.5),
                             "transformers greedy": run([1, 2, 3, 4], 1.0), "transformers prompt lookup": run([1, 2, 3, 5], 1.0)})
    assert row["tokens_per_s"]["own n-gram"] == 8.0 and row["ngram_acceptance_length"] == 2.5
    assert row["ratios"]["own n-gram / own baseline (goal >= 2)"] == 4.0
    assert row["ratios"]["own baseline / transformers greedy (goal >= 1)"] == 0.5
    assert row["same_tokens_as_own_baseline"]["transformers prompt lookup"] is False
    lines = engine.engine_tables({"p": row})
    assert lines[0] == "| prompt | own baseline tok/s | own n-gram tok/s | transformers greedy tok/s | transformers prompt lookup tok/s | n-gram AL |"
    assert lines[2] == "| p | 2.0 | 8.0 | 4.0 | 4.0 | 2.50 |"
    assert "| p | 4.00x | 2.00x | 0.50x | 1.00x |" in lines


def test_perf_report_sections_print_only_what_ran():
    report = {"machine": {"cpu": "x", "cores": 2, "torch": "t", "cpu_capability": "AVX2", "threads": 2, "native_bf16": True,
                          "default_dtype": "bfloat16", "load_average_start": [0, 0, 0]}, "load_average_end": [0, 0, 0], "dtypes": {},
              "head": [{"rows": 1, "f_linear_ms": 30.94, "onednn_ms": 35.4}]}
    lines = tables.perf_report(report)
    assert lines[1:] == ["head:\n| rows | f_linear_ms | onednn_ms |", "|---|---|---|", "| 1 | 30.9 | 35.4 |", ""]
