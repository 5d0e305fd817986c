"""The gate's decision on synthetic measurements: each criterion passes on a good run and can fail on its own."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from specgate.gate import client, decision, quality
from specgate.gate.workload import MathItem


def level(n: int, tps: float, ttft: float, itl: float, decode_s: float, tokens: int, requests: int, accepted: float = 0.0, drafts: float = 0.0, draft_len: float = 4.0) -> dict:
    spec = None
    if drafts:
        spec = {"num_accepted_tokens": accepted, "num_drafts": drafts, "acceptance_length": 1 + accepted / drafts, "mean_draft_len": draft_len}
    return {"concurrency": n, "output_tokens_per_s": tps, "ttft_p95_s": ttft, "itl_p95_s": itl, "decode_s_sum": decode_s,
            "output_tokens": tokens, "ok": requests, "spec": spec}


def good_run() -> tuple[dict, dict, dict, decision.Thresholds]:
    # baseline: 1000 tokens over 10 requests, 990 steps of 50 ms; speculation: AL 2.5 and steps of 60 ms
    baseline = {"name": "baseline", "gamma": 0, "sweep": [level(1, 20.0, 0.1, 0.05, 49.5, 1000, 10), level(4, 60.0, 0.2, 0.07, 69.3, 1000, 10)],
                "memory": {"peak_rss_mib": 1000.0, "mem_total_mib": 24000.0, "preemptions": 0.0}}
    spec = {"name": "ngram", "draft": "ngram", "gamma": 4,
            "sweep": [level(1, 40.0, 0.1, 0.025, 23.4, 1000, 10, accepted=600, drafts=400), level(4, 90.0, 0.21, 0.05, 35.1, 1000, 10, accepted=600, drafts=400)],
            "memory": {"peak_rss_mib": 1100.0, "mem_total_mib": 24000.0, "preemptions": 0.0}}
    q = {"greedy": {"pairs": 8, "matches": 8, "rate": 1.0, "mismatches": []},
         "math": {"delta": 0.0, "delta_ci95": (-0.1, 0.1), "within_noise": True, "speculative_em": 0.5, "baseline_em": 0.5, "mcnemar_p": 1.0},
         "loglik": {"pairs": 8, "p_value": 0.6, "significance": 0.01, "flagged": False, "speculative_mean": -2.0, "baseline_mean": -2.0}}
    return baseline, spec, q, decision.Thresholds(target_concurrency=4)


def verdict_of(baseline, spec, q, t):
    verdict, criteria = decision.decide(baseline, spec, q, t)
    return verdict, {c.name: c for c in criteria}


def test_a_good_run_is_go_with_every_criterion_reported():
    verdict, by_name = verdict_of(*good_run())
    assert set(by_name) == set(decision.CRITERIA)
    assert verdict == "GO", [c.reason for c in by_name.values() if not c.passed]
    for c in by_name.values():
        assert set(c.to_dict()) == {"name", "value", "threshold", "pass", "reason", "binding"}


def _break(name: str, run):
    baseline, spec, q, t = run
    if name == "acceptance_above_alpha_min":  # AL 1.05 at a step cost 1.2x: alpha far below alpha_min
        for lv in spec["sweep"]:
            lv["spec"].update(num_accepted_tokens=20, acceptance_length=1.05)
            lv["decode_s_sum"] = lv["decode_s_sum"] * 3.0
    elif name == "throughput_at_target_concurrency":
        spec["sweep"][1]["output_tokens_per_s"] = 50.0
    elif name == "ttft_p95_at_target_concurrency":
        spec["sweep"][1]["ttft_p95_s"] = 0.25  # > 0.2 * 1.1
    elif name == "itl_p95_at_target_concurrency":
        spec["sweep"][1]["itl_p95_s"] = 0.07  # equal is not better
    elif name == "memory_headroom":
        spec["memory"]["peak_rss_mib"] = 23000.0
    elif name == "greedy_exact_match":
        q["greedy"].update(matches=7, rate=7 / 8, mismatches=[{"prompt_id": "x"}])
    elif name == "math_exact_match_delta":
        q["math"].update(delta=-0.3, delta_ci95=(-0.5, -0.1), within_noise=False)
    elif name == "sampled_loglik_shift":
        q["loglik"].update(p_value=1e-5, flagged=True)
    elif name == "lossless":
        spec["lossy"] = "typical"
    elif name == "completed":
        spec["failure"] = "server process 123 killed by signal 9 during phase 'c4'"
    return baseline, spec, q, t


@pytest.mark.parametrize("name", decision.CRITERIA)
def test_each_criterion_fails_alone(name):
    """A binding criterion failing alone makes NO-GO; a target (TTFT, ITL, memory) fails alone and stays a
    reported target, until the user makes it binding with --require."""
    verdict, by_name = verdict_of(*_break(name, copy.deepcopy(good_run())))
    assert [n for n, c in by_name.items() if not c.passed] == [name]
    target = {v: k for k, v in decision.TARGETS.items()}.get(name)
    assert verdict == ("GO" if target else "NO-GO")
    assert by_name[name].binding is (target is None)
    assert verdict == ("GO" if all(c.passed for c in by_name.values() if c.binding) else "NO-GO")  # the rule itself
    if target:
        baseline, spec, q, t = _break(name, copy.deepcopy(good_run()))
        t.require = (target,)
        verdict, by_name = verdict_of(baseline, spec, q, t)
        assert verdict == "NO-GO" and by_name[name].binding


def test_require_names_only_targets():
    with pytest.raises(ValueError, match="--require speed is not a target"):
        decision.Thresholds(require=("speed",)).validate()


def test_another_engine_is_lossless_only_when_exact_match_and_loglik_pass():
    baseline, spec, q, t = good_run()
    spec["engine"] = "llama.cpp"
    verdict, by_name = verdict_of(baseline, spec, q, t)
    assert verdict == "GO" and by_name["lossless"].value is True and "inferred" in by_name["lossless"].reason
    q["greedy"].update(matches=7, rate=7 / 8, mismatches=[{"prompt_id": "x"}])
    verdict, by_name = verdict_of(baseline, spec, q, t)
    assert by_name["lossless"].value == "unknown" and not by_name["lossless"].passed and "greedy exact match" in by_name["lossless"].reason
    q["greedy"].update(matches=8, rate=1.0, mismatches=[])
    q["loglik"] = {"reason": "not scored"}  # no log-likelihood test: not proven, so unknown
    assert verdict_of(baseline, spec, q, t)[1]["lossless"].value == "unknown"
    spec["engine"] = "specgate"  # our verifier is proven exact by check-lossless: lossless without the inference
    assert verdict_of(baseline, spec, q, t)[1]["lossless"].passed


def test_preemptions_beyond_the_baseline_fail_memory_and_missing_levels_fail_loudly():
    baseline, spec, q, t = good_run()
    spec["memory"]["preemptions"] = 3.0
    assert not verdict_of(baseline, spec, q, t)[1]["memory_headroom"].passed
    t.target_concurrency = 8  # never measured
    by_name = verdict_of(*good_run()[:3], t)[1]
    assert not by_name["throughput_at_target_concurrency"].passed and "not measured" in by_name["throughput_at_target_concurrency"].reason


def _bisect(f, lo: float = 0.0, hi: float = 1.0 - 1e-12) -> float:
    """The root of an increasing f on [lo, hi] (the test's own solver, independent of the code's brentq)."""
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def _expected_tokens(a: float, g: int) -> float:
    return sum(a**i for i in range(g + 1))  # 1 + a + ... + a^g = (1 - a^(g+1)) / (1 - a)


def test_analysis_agrees_with_closed_forms_for_alpha_c_speedup_and_alpha_min():
    baseline, spec, _, _ = good_run()
    a = decision.analyse(baseline, spec, gamma_max=8)
    row = a["per_concurrency"][0]
    assert row["alpha"] == pytest.approx(_bisect(lambda x: _expected_tokens(x, 4) - 2.5), abs=1e-9)  # AL 2.5 = E[T]
    # steps: baseline 49.5 / 990 = 50 ms; speculation 23.4 / (1000 - 600 - 10) = 60 ms -> c = (1.2 - 1) / 4
    assert row["c"] == pytest.approx(0.05)
    assert row["predicted_speedup"] == pytest.approx(2.5 / (4 * 0.05 + 1))  # S = E[T] / (g c + 1)
    assert row["measured_speedup"] == pytest.approx(2.0)
    assert a["alpha_min"] == pytest.approx(_bisect(lambda x: _expected_tokens(x, 4) - (4 * 0.05 + 1)), abs=1e-6)  # S(alpha_min) = 1
    assert a["paying_range"] == [1, 4] and all(r["recommended_gamma"] >= 1 for r in a["per_concurrency"])
    s = decision.schedule_exports(a, "ngram", max_num_seqs=8)
    ranges = s["vllm_speculative_config"]["num_speculative_tokens_per_batch_size"]
    assert ranges[0][:2] == [1, 1] and ranges[1][:2] == [2, 4] and ranges[-1] == [5, 8, 0]
    assert s["tensorrt_llm"]["draft_len_schedule"]["8"] == 0 and "--speculative-num-steps" in s["sglang_flags"]
    assert s["specgate"].startswith("--policy table --gamma-table '1-1:")
    head = decision.schedule_exports(a, "default", max_num_seqs=8, head=decision.is_specgate_head("default", "gemma-3-270m"))
    assert head["vllm_speculative_config"] is None and head["sglang_flags"] == [] and head["tensorrt_llm"] is None
    assert "not a checkpoint vLLM" in head["sglang_note"] and "eagle3:PATH" in head["sglang_note"] and head["specgate"] == s["specgate"]
    assert decision.is_specgate_head("eagle:/x/head", None) and not decision.is_specgate_head("ngram", "gemma-3-270m")
    assert not decision.is_specgate_head("default", "another-model") and not decision.is_specgate_head("/drafts/small", "gemma-3-270m")
    spec["sweep"][1]["output_tokens_per_s"] = 50.0  # stops paying at 4 -> gamma 0 there
    a = decision.analyse(baseline, spec)
    assert a["paying_range"] == [1, 1] and a["per_concurrency"][1]["recommended_gamma"] == 0


def test_alpha_uses_the_engines_measured_draft_length():
    """An engine whose drafts run longer than the configured gamma (llama.cpp's ngram-simple drafts its m-gram,
    48 tokens by default, whatever --spec-draft-n-max says): alpha solves E[T](alpha, measured g) = AL."""
    baseline, spec, _, _ = good_run()
    for lv in spec["sweep"]:  # 5 drafts, 122 draft tokens, 34 accepted: g = 24.4 -> 24, AL = 1 + 34 / 5
        lv["spec"].update(num_drafts=5, num_draft_tokens=122, num_accepted_tokens=34, acceptance_length=1 + 34 / 5, mean_draft_len=24.4)
    row = decision.analyse(baseline, spec)["per_concurrency"][0]
    assert row["gamma"] == 24
    assert row["alpha"] == pytest.approx(_bisect(lambda x: _expected_tokens(x, 24) - (1 + 34 / 5)), abs=1e-9)


def test_itl_is_apportioned_per_token_and_tpot_defined():
    assert client.apportion(7, [3, 3, 6]) == [2, 2, 3]
    assert sum(client.apportion(10, [1, 5, 1, 1])) == 10
    # chunks at 0.1 s (1 token), 0.3 s (2 tokens), 0.4 s (1 token): ITL samples 0.1, 0.1, 0.1
    assert client.token_latencies([0.1, 0.3, 0.4], [4, 8, 4], 4) == pytest.approx([0.1, 0.1, 0.1])


def test_math_pairing_bootstrap_and_loglik_test_flag_a_shift_and_only_a_shift():
    items = [MathItem(str(i), f"What is {i} + 1?", str(i + 1)) for i in range(40)]
    right = {str(i): f" {i + 1}" for i in range(40)}
    half = {str(i): (f" {i + 1}" if i % 2 else " 0") for i in range(40)}
    same = quality.paired_math(items, right, right)
    assert same["delta"] == 0.0 and same["within_noise"] and same["baseline_em"] == 1.0
    worse = quality.paired_math(items, right, half)
    assert worse["delta"] == pytest.approx(-0.5) and not worse["within_noise"] and worse["mcnemar_p"] < 1e-4
    rng = np.random.default_rng(0)
    base = {str(i): (float(rng.normal(-2.0, 0.3)) * 20, 20) for i in range(24)}
    null = {str(i): (float(rng.normal(-2.0, 0.3)) * 20, 20) for i in range(24)}
    shifted = {str(i): (float(rng.normal(-1.2, 0.3)) * 20, 20) for i in range(24)}
    assert not quality.loglik_two_sample(base, null).flagged
    flagged = quality.loglik_two_sample(base, shifted)
    assert flagged.flagged and flagged.p_value < 0.01 and flagged.speculative_perplexity < flagged.baseline_perplexity


def test_greedy_mismatches_are_listed_with_positions_and_both_continuations():
    g = quality.greedy_exact_match({"a": "hello world", "b": "same"}, {"a": "hello there", "b": "same"}, {"a": "prose"})
    m = g["mismatches"][0]
    assert g["rate"] == 0.5 and m["first_diff_char"] == 6 and m["category"] == "prose"
    assert (m["context"], m["baseline"], m["speculative"]) == ("hello ", "world", "there")

    class Words:  # a word-level tokenizer: the first differing token is the second word
        def encode(self, text, add_special_tokens=False):
            return [hash(w) for w in text.split(" ")]

    quality.add_token_positions(g, {"a": "hello world"}, {"a": "hello there"}, Words())
    assert m["first_diff_token"] == 1


def test_thresholds_reject_bad_values():
    with pytest.raises(ValueError, match="--memory-headroom"):
        decision.Thresholds(memory_headroom=1.5).validate()
    with pytest.raises(ValueError, match="--target-concurrency"):
        decision.Thresholds(target_concurrency=0).validate()


@pytest.mark.parametrize("kind, source_tps, source_verdict, expected", [
    ("schedule", 40.0, "GO", "recommended"),  # the schedule ran faster: it is the advice
    ("schedule", 60.0, "GO", "default"),  # the configuration it came from ran faster: what ran is the advice
    ("schedule", 60.0, "NO-GO", "recommended"),  # faster but NO-GO: a GO schedule stays
    ("config", 60.0, "GO", "recommended"),  # a configuration launched again as it ran: its second run is the verdict
])
def test_a_schedule_that_measured_worse_than_its_source_gives_way_to_it(kind, source_tps, source_verdict, expected):
    from specgate.gate.recommend import Advice
    from specgate.gate.report import _recommendation

    def result(tps: float) -> dict:
        return {"engine": "specgate", "command": f"serve {tps}", "sweep": [{"concurrency": 1, "output_tokens_per_s": tps}]}

    def config(verdict: str, ratio: float) -> dict:
        return {"verdict": verdict, "analysis": {"per_concurrency": [{"concurrency": 1, "measured_speedup": ratio}]}}

    results = {"recommended": result(50.0), "default": result(source_tps)}
    configs = {"recommended": config("GO", 1.4), "default": config(source_verdict, 1.6)}
    advice = Advice(kind, "default", "default passed every binding criterion")
    rec = _recommendation(advice, configs, results, {"engine": "specgate"}, 1, "recommended")
    assert rec["config"] == expected and rec["based_on"] == "default" and rec["measured"]
    assert rec["verdict"] == configs[expected]["verdict"] and rec["command"] == results[expected]["command"]
    assert rec["throughput_ratio"] == {"1": configs[expected]["analysis"]["per_concurrency"][0]["measured_speedup"]}
    if expected == "default":
        assert rec["kind"] == "config" and "ran 50 tok/s against 60 for `default` at concurrency 1" in rec["reason"]
    else:
        assert rec["kind"] == kind and rec["reason"] == advice.reason
