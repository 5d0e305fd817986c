"""specgate.bench's measuring code run for real on tiny random models (config from conftest.tiny_config, weights
random): the floor's byte count by hand, the record shapes of the floor, verification-cost, perf, engine, rows,
prefill, verifier and draft runs, and greedy lanes that must agree token for token (specgate's and transformers' greedy on
the same weights, n-gram drafts against the baseline). Sizes are tiny: these check the method, not the speed.
"""

from __future__ import annotations

import pytest
import torch

from specgate.bench import draft, engine, floor, perf, prefill, rows, verifier
from specgate.drafting import NgramDrafter, NoDrafter
from specgate.models import load_model


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir("gemma3")), dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_tiny(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32).eval()


def test_step_bytes_by_hand(tiny):
    # tiny gemma3: vocab 512, hidden 64, 2 layers, 4 query / 2 KV heads of 16, MLP 128, tied head, float32
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 4 * 64 + 2 * 16  # q, k+v, o, gate/up/down, 4 norms, q/k norms
    weights = 4 * (2 * per_layer + 512 * 64 + 64)  # + the tied embedding/head, the final norm
    nbytes = floor.step_bytes(tiny.model, position=9)
    assert nbytes["weights"] == weights
    assert nbytes["kv_cache"] == 2 * 2 * 2 * 16 * 10 * 4  # K and V, layers, KV heads, head_dim, positions 0..9, float32
    assert nbytes["embedding_row"] == 64 * 4 and nbytes["total"] == weights + nbytes["kv_cache"] + 64 * 4


def test_floor_rounds_and_verification_cost_records(tiny):
    ticks = []
    out = floor.floor_rounds(tiny.model, gamma=2, position=8, steps=2, rounds=2, probe=False, advance=lambda: ticks.append(1))
    assert len(out["rounds"]) == 2 and len(ticks) == 2 and out["verify_tokens"] == 3
    assert out["verify_over_step"] > 0 and "floor_ms" not in out  # no probe, no floor
    assert out["step_ms"] == pytest.approx(sorted(r["step_ms"] for r in out["rounds"])[0] / 2 + sorted(r["step_ms"] for r in out["rounds"])[1] / 2)
    ratios, ms = floor.verification_cost(tiny.model, position=8, widest=3, steps=2, rounds=2)
    assert ratios[0] == 1.0 and len(ratios) == len(ms) == 3 and all(v > 0 for v in ms)


def test_perf_lanes_figures_and_theory(tiny, hf_tiny):
    settings = perf.PerfSettings(max_new_tokens=6, gamma=2, theory_draft="none", theory_draft_gamma=1, verify_steps=1, rounds=1, lane_repeats=3)
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    lanes = perf.speculative_lanes(tiny, hf_tiny, prompt, settings, with_ngram=True, dtype=torch.float32)
    assert list(lanes) == ["own baseline", "transformers greedy", "own n-gram", "transformers prompt lookup"]
    results = perf.median_runs(lanes, settings.lane_repeats, settings.max_new_tokens)
    figures = perf.lane_figures(results)
    assert all(lane["same_tokens_as_own_baseline"] and lane["new_tokens"] == 6 for lane in figures["lanes"].values())
    assert set(figures["ratios"]) == {"own baseline / transformers greedy", "own n-gram / transformers prompt lookup",
                                      "own n-gram / own baseline (measured speedup)", "transformers prompt lookup / transformers greedy"}
    theory = perf.theory_section(tiny.model, results, settings)
    assert theory["verification_cost"]["tokens"] == [1, 2, 3] and list(theory["theory"]) == ["ngram"]
    assert theory["theory"]["ngram"]["same_tokens_as_baseline"] and theory["theory"]["ngram"]["gamma"] == 2


def test_engine_run_rows_agree(tiny, hf_tiny):
    prompts = {"copy": "copy: one two three four. copy: one two"}
    result = engine.run_engine(engine.engine_lanes(tiny, hf_tiny, gamma=2), prompts, max_new_tokens=5, warmup_prompt="hello")
    row = result["copy"]
    assert row["new_tokens"] == {lane: 5 for lane in row["new_tokens"]}
    assert all(row["same_tokens_as_own_baseline"].values())
    assert len(row["ratios"]) == 4 and row["ngram_acceptance_length"] >= 1.0


def test_rows_forward_and_verifier_small(tiny_model_dir):
    model = load_model(str(tiny_model_dir("gemma3")), dtype=torch.bfloat16).model
    times = rows.old_new_ms(model, [(2, 3)], repeats=2, old=4)
    assert [len(v) for v in times[(2, 3)].values()] == [2, 2] and all(ms > 0 for v in times[(2, 3)].values() for ms in v)
    inputs = verifier.realistic_inputs(batch=2, gamma=2, vocab=64)
    assert inputs.target_logits.shape == (2, 3, 64) and inputs.draft_tokens.shape == (2, 2)
    assert inputs.sparse_probs.values.shape == (2, 2, 64) and torch.isin(inputs.sparse_tokens, inputs.sparse_probs.support).all()
    lanes, mean_accepted = verifier.verifier_lanes(1, inputs)
    assert len(lanes) == 7 and 0 <= mean_accepted <= 2
    assert verifier.target_step_ms(1, target=str(tiny_model_dir("gemma3")), batch=2, gamma=2) > 0
    lines = verifier.verifier_lines(lanes, 100.0, "b")
    assert lines[0].endswith("(baseline: b)") and lines[1].endswith("of the target step")


def test_prefill_bench_times_both_ways_and_restores_the_rule(tiny_model_dir, monkeypatch):
    from specgate.models import native
    from specgate.models.native import DecodeStack

    model = load_model(str(tiny_model_dir("gemma3")), dtype="int8").model
    monkeypatch.setattr(native, "QUANT_MAX_ROWS", 8)
    runs: list[int] = []
    run = DecodeStack.run
    monkeypatch.setattr(DecodeStack, "run", lambda self, x, *a: (runs.append(x.shape[0]), run(self, x, *a))[1])
    with prefill.chunking(model, False):
        prefill.prefill_ms(model, 20)
    assert runs == []  # the upcast path: no stack call
    prefill.prefill_ms(model, 20)
    assert runs == [8, 8, 4]  # the model's own rule again: chunks of <= 8 through the stack
    times = prefill.lanes_ms(model, [4, 20], repeats=2)
    assert all(len(ms) == 2 and min(ms) > 0 for lanes in times.values() for ms in lanes.values())
    lines = prefill.prefill_table(times, 8, 2)
    assert len(lines) == 5 and lines[3].startswith("| 4 |") and lines[4].startswith("| 20 |")
    with pytest.raises(ValueError, match="comma list of prompt lengths"):
        prefill.parse_lengths("64,x")


def test_prefill_bench_attention_lanes_switch_the_stacks_variant_and_restore_it(tiny_model_dir, monkeypatch):
    from specgate.models import native

    if not native.attention_wide():
        pytest.skip("no AVX-512 attention on this CPU")
    model = load_model(str(tiny_model_dir("gemma3")), dtype="int8").model
    prefill.prefill_ms(model, 12)  # builds the stack
    stack = model.native_stack()
    built = stack.config.wide
    assert built & native.WIDE_ATTN
    caches, flags = {}, {}
    for wide in (False, True):
        with prefill.attention_variant(model, wide):
            flags[wide] = stack.config.wide
            cache = model.new_cache(1, 13)
            with torch.inference_mode():
                model.forward(torch.arange(4, 16)[None], torch.arange(12)[None], cache, torch.tensor([0]), logits=False)
            caches[wide] = cache.keys[-1].clone()  # the last layer's keys: they read the first layer's attention
    assert flags == {False: built & ~native.WIDE_ATTN, True: built} and stack.config.wide == built
    assert torch.allclose(caches[False], caches[True], atol=1e-4)  # the same attention in another summation order
    times = prefill.lanes_ms(model, [6], repeats=2, compare="attention")
    assert set(times[6]) == {"avx2", "avx512"} and prefill.prefill_table(times, 8, 2)[1].startswith("| prompt tokens | avx2 ms |")
    monkeypatch.setattr(native, "wide_vectors", lambda: False)
    with pytest.raises(ValueError, match="needs the C stack and AVX-512"):
        with prefill.attention_variant(model, True):
            pass


def test_draft_bench_records_and_summary(tiny, hf_tiny):
    built = {"baseline": (NoDrafter(), 0, 0.0), "default g2": (NgramDrafter(), 2, 0.0)}
    prompts = {"code": ["def f(x):\n    return x\ndef g(x):\n    return"], "prose": ["one two three one two"]}
    seen = []
    records = draft.run_draft_bench(tiny, built, hf_tiny, prompts, 4, lambda records: seen.append(len(records)))
    assert seen == [1, 2] and [r["category"] for r in records] == ["code", "prose"]
    assert records[0]["transformers greedy"]["stats"]["new_tokens"] == 4
    summary = draft.summarise(records, [*built, "transformers greedy"], built)
    assert set(summary) == {"code", "prose", "all"}
    assert summary["all"]["default g2"]["tokens_per_s"] == pytest.approx(8 / sum(r["default g2"]["stats"]["wall_s"] for r in records))
    lane = summary["code"]["default g2"]
    assert lane["identical_to_baseline"] and {"alpha", "c", "acceptance_length", "theory_speedup", "decode_speedup"} <= set(lane)
    assert records[0]["transformers greedy"]["tokens"] == records[0]["baseline"]["tokens"]  # greedy is exact in both libraries


def test_draft_bench_seeds_repeat_the_sampled_lanes_only(tiny):
    built = {"baseline": (NoDrafter(), 0, 0.0), "baseline T=1": (NoDrafter(), 0, 1.0), "ngram g2 T=1": (NgramDrafter(), 2, 1.0)}
    prompts = {"code": ["def f(x):\n    return x\ndef g(x):\n    return"], "prose": ["one two three one two"]}
    records = draft.run_draft_bench(tiny, built, None, prompts, 4, seeds=3)
    assert [(r["category"], r["seed"]) for r in records] == [("code", 1000), ("prose", 1000), ("code", 2000), ("prose", 2000),
                                                             ("code", 3000), ("prose", 3000)]
    assert "baseline" in records[0] and all(set(r) == {"category", "prompt", "seed", "baseline T=1", "ngram g2 T=1"} for r in records[2:])
    summary = draft.summarise(records, list(built), built)["code"]
    assert summary["ngram g2 T=1"]["speedup_ci95"] is not None  # 3 runs of the code prompt
    assert summary["baseline"]["tokens_per_s"] == pytest.approx(4 / records[0]["baseline"]["stats"]["wall_s"])  # its one run
    with pytest.raises(ValueError, match="seeds=0"):
        draft.run_draft_bench(tiny, built, None, prompts, 4, seeds=0)
