"""The gate per prompt category, on synthetic greedy phases: the rule per category (pays, loses, within noise, n/a),
the one accounting over a category's counter window, the summary sentence per engine, the verdict left to the mix,
and the report's per-category table and traffic section (with and without `traffic`)."""

from __future__ import annotations

import json
import math

import pytest
from test_gate_decision import PLAN, decide, good_pair, options

from specgate.gate import decision, prom
from specgate.gate import report as gate_report
from specgate.gate.records import ConfigRun
from specgate.gate.stats import LEVEL, split_level

PROMPTS = 6
# configuration TPOT / baseline TPOT per prompt k of each category
TPOT_FACTOR = {
    "code": lambda k: 0.6 * (1 + 0.02 * (-1) ** k),  # decode speedup ~1.67: pays
    "prose": lambda k: 1.3 * (1 + 0.02 * (-1) ** k),  # ~0.77: loses
    "mixed": lambda k: 1.0 + 0.25 * (-1) ** k,  # 0.8 and 1.25 in turn: the interval straddles 1 and 1 - margin
}
COUNTS = (100.0, 400.0, 200.0, 600.0)  # D, G, A, T: AR 0.5, AL 3, 1.5 tokens per step


def categories() -> dict[str, str]:
    return {f"{c}-{k}": c for c in (*TPOT_FACTOR, "grounded") for k in range(PROMPTS)}


def with_greedy_phase(base: ConfigRun, spec: ConfigRun, engine: str = "specgate") -> tuple[ConfigRun, ConfigRun]:
    """Fill both runs' greedy phase: per-prompt TPOTs (none of `grounded` on the configuration) and counter windows."""
    spec.engine = engine
    for pid, category in categories().items():
        k = int(pid.rsplit("-", 1)[1])
        base.greedy_tpot[pid] = 0.02 * (1 + 0.1 * k)  # prompts differ in level; the pairing removes that
        if category in TPOT_FACTOR:
            spec.greedy_tpot[pid] = base.greedy_tpot[pid] * TPOT_FACTOR[category](k)
    for category in (*TPOT_FACTOR, "grounded"):
        d, g, a, t = COUNTS
        exported = None if category == "prose" else t  # prose: T from the client's count
        spec.per_category[category] = prom.SpecWindow("specgate", d, g, a, [], generation_tokens=exported).to_dict()
        spec.per_category_latency[category] = {"requests": PROMPTS, "ok": PROMPTS, "output_tokens": int(t)}
        base.per_category[category] = prom.SpecWindow("specgate", 0, 0, 0, [], generation_tokens=t).to_dict()
    return base, spec


def analyse(engine: str = "specgate") -> dict[str, decision.CategoryAnalysis]:
    base, spec = with_greedy_phase(*good_pair(), engine)
    found = decision.analyse_categories(base, spec, categories(), options(), split_level(LEVEL, 4))
    return {a.category: a for a in found}


def test_a_faster_category_pays_a_slower_one_loses_and_a_straddling_one_is_within_noise():
    by = analyse()
    code, prose, mixed = by["code"], by["prose"], by["mixed"]
    assert code.state == decision.CategoryState.PAYS and code.decode_speedup.low > 1.0
    assert code.decode_speedup.estimate == pytest.approx(1 / 0.6, rel=0.01) and code.paired == code.prompts == PROMPTS
    assert prose.state == decision.CategoryState.LOSES and prose.decode_speedup.high < 1 - options().margin
    assert mixed.state == decision.CategoryState.WITHIN_NOISE and mixed.decode_speedup.low < 0.97 and mixed.decode_speedup.high > 1.0
    assert "lower bound" in code.reason and "upper bound" in prose.reason and "neither" in mixed.reason
    assert code.level == pytest.approx(0.9875)  # 95% family-wise over the four categories


def test_a_category_without_tpot_is_na_not_an_error_and_keeps_its_acceptance():
    grounded = analyse()["grounded"]
    assert grounded.state == decision.CategoryState.NA and grounded.decode_speedup is None and grounded.paired == 0
    assert grounded.acceptance.ar.estimate == pytest.approx(0.5) and grounded.acceptance.c is None  # no TPOT ratio: no c
    base, spec = good_pair()  # no greedy TPOT, no counter window, no prompt categories at all
    d = decide(base, spec)
    assert d.categories == [] and "not measured" in d.category_summary["sentence"]
    spec.per_category["code"] = None
    d = decision.decide_config(base, spec, "confirm", ["c1", "c4", "poisson"], decision.quality_of(base, spec, PLAN, options(), 1), options(), 0.95)
    assert [(a.category, a.state) for a in d.categories] == [("code", decision.CategoryState.NA)] and d.categories[0].acceptance.ar is None


def test_the_one_accounting_per_category():
    """D=100, G=400, A=200, T=600 (prose: T from the client): AR 0.5, AL 3, S = 400 steps; with the decode speedup s,
    r = 1.5 / s and c = (r - 1) S / G, so the predicted speedup (T/S) / r is the measured s."""
    by = analyse()
    for a in (by["code"], by["prose"]):
        acc, s = a.acceptance, a.decode_speedup.estimate
        assert acc.ar.estimate == pytest.approx(0.5) and acc.al.estimate == pytest.approx(3.0) and acc.draft_len == pytest.approx(4.0)
        assert acc.tokens_per_step.estimate == pytest.approx(1.5) and acc.ar.n == 1 and math.isinf(acc.ar.high)  # one window: no spread
        assert acc.c.estimate == pytest.approx((1.5 / s - 1.0) * 400 / 400)
        assert decision.expected_tokens(acc.alpha.estimate, 4.0) == pytest.approx(3.0)
    assert by["code"].acceptance.alpha_min.estimate == 0.0  # c < 0: any acceptance pays
    assert by["prose"].acceptance.alpha_min.estimate > by["prose"].acceptance.alpha.estimate  # it loses: alpha below alpha_min


def test_the_summary_names_the_losing_categories_per_engine():
    llama = decision.category_summary(list(analyse("llama.cpp").values()), "llama.cpp")
    assert llama["pays"] == ["code"] and llama["loses"] == ["prose"] and llama["within_noise"] == ["mixed"]
    assert llama["not_measured"] == ["grounded"] and llama["binding"] is False
    assert "this engine (llama.cpp) speculates for every request: the categories that lose (prose) pay for the others" in llama["sentence"]
    ours = decision.category_summary(list(analyse().values()), "specgate")["sentence"]
    assert ours.startswith("specgate can leave speculation off per request: categories that lose (prose) would be served without it")
    paying = [a for a in analyse().values() if a.category == "code"]
    assert decision.category_summary(paying, "vllm")["sentence"] == "no category loses beyond the margin; speculation pays on code"


def test_categories_are_reported_and_do_not_change_the_verdict():
    base, spec = good_pair()
    plain = decide(base, spec)
    with_greedy_phase(base, spec, "llama.cpp")
    o = options()
    d = decision.decide_config(base, spec, "confirm", ["c1", "c4", "poisson"], decision.quality_of(base, spec, PLAN, o, 1), o, 0.95, categories())
    assert d.verdict == plain.verdict == "GO" and [c.state for c in d.criteria] == [c.state for c in plain.criteria]
    assert {a.category: a.state.value for a in d.categories}["prose"] == "loses"
    out = d.to_dict()
    assert [a["category"] for a in out["categories"]] == ["code", "prose", "mixed", "grounded"] and out["category_summary"]["loses"] == ["prose"]
    result = decision.conclude(decision.Advice("config", "ngram", "best"), {"ngram": d}, None, {"baseline": base, "ngram": spec}, {}, [], None)
    assert result.category_summary is d.category_summary and result.verdict == "GO"


TRAFFIC = {"source": "builtin (24 prompts, 4 categories)", "prompts": 22, "skipped": {"longer than --max-seq-len": 2},
           "prompt_tokens": [30, 45, 60, 80, 120, 200] * 4, "output_tokens": [64] * 20 + [12, 40, 50, 64],
           "categories": {"code": 6, "prose": 6, "grounded": 5, "math": 5},
           "quantiles": {"prompt_tokens": {"p10": 30, "p50": 70, "p90": 200, "max": 200}, "output_tokens": {"p10": 50, "p50": 64, "p90": 64, "max": 64}}}


def gate_result() -> decision.GateResult:
    base, spec = with_greedy_phase(*good_pair(), "llama.cpp")
    o = options()
    d = decision.decide_config(base, spec, "confirm", ["c1", "c4", "poisson"], decision.quality_of(base, spec, PLAN, o, 1), o, 0.95, categories())
    stages = {"confirm": {"blocks": 6, "wall_s": 60.0, "level": 0.95, "looks": 1, "loads": ["c1", "c4", "poisson"]}}
    return decision.conclude(None, {}, d, {"baseline": base, "ngram": spec}, stages, [], None)


@pytest.mark.parametrize("traffic", [TRAFFIC, None])
def test_the_report_renders_the_per_category_table_and_the_traffic_section(tmp_path, traffic):
    report = gate_report.build_report(options(), PLAN, gate_result(), wall_s=1.0, traffic=traffic)
    written = gate_report.write_outputs(tmp_path, report, [])
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["recommendation"]["category_summary"]["loses"] == ["prose"] and saved["traffic"] == traffic
    assert [a["state"] for a in saved["configs"]["ngram"]["categories"]] == ["pays", "loses", "within noise", "n/a"]
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "## Per category (`ngram`)" in md and "| category | prompts | AR | AL | alpha | decode speedup [interval] | state | reason |" in md
    prose = next(line for line in md.splitlines() if line.startswith("| prose |"))
    assert "| 6 | 0.5 | 3 |" in prose and "| loses |" in prose and "upper bound" in prose
    assert "the categories that lose (prose) pay for the others" in md and "id='categories'" in page
    if traffic is None:
        assert "## Traffic" not in md and "plot-traffic" not in page and written["traffic"] is None
    else:
        assert "## Traffic" in md and "skipped: longer than --max-seq-len: 2" in md
        assert "- Prompt tokens: p10 30, p50 70, p90 200, max 200." in md and "code 6 (27%)" in md
        assert "id='plot-traffic'" in page and "id='traffic'" in page


def test_per_response_counts_give_the_category_acceptance_intervals_over_its_prompts():
    """Where responses carry `timings` (specgate, llama.cpp), AR per category is accepted / drafted pooled over the
    category's prompts with a bootstrap interval over them, and where they count drafts (specgate) AL and alpha too;
    without them the counters' point figures stay."""
    base, spec = with_greedy_phase(*good_pair())
    for pid, category in categories().items():
        k = int(pid.rsplit("-", 1)[1])
        if category == "code":
            spec.greedy_drafts[pid] = (40, 20 + (k % 3), 10)  # 20-22 of 40 accepted per prompt, in 10 drafts of 4
        elif category == "mixed":
            spec.greedy_drafts[pid] = (40, 20, 0)  # an engine that does not count drafts (llama.cpp): AR only
    by = {a.category: a for a in decision.analyse_categories(base, spec, categories(), options(), 0.95)}
    code = by["code"].acceptance
    accepted = sum(20 + (k % 3) for k in range(PROMPTS))
    assert code.ar.estimate == pytest.approx(accepted / (40 * PROMPTS)) and code.ar.n == PROMPTS
    assert 0.45 < code.ar.low < code.ar.estimate < code.ar.high < 0.6
    assert code.al.estimate == pytest.approx(1 + accepted / (10 * PROMPTS)) and code.al.low < code.al.estimate < code.al.high
    assert code.draft_len == 4 and code.alpha.estimate == pytest.approx(decision.alpha_from_al(code.al.estimate, 4))
    assert code.alpha.low < code.alpha.estimate < code.alpha.high
    mixed = by["mixed"].acceptance
    assert mixed.ar.estimate == pytest.approx(0.5) and not math.isfinite(mixed.al.high)  # AL from the counters: a point figure
    assert math.isinf(by["prose"].acceptance.ar.high)  # counters only: a point figure
