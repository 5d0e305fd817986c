"""The EAGLE head on a quantized target (--dtype gguf, the default runtime of the GGUF target, or int8): the head
reads the target's embedding through exact dequantization, the target's passes give it final-norm states on the
quantized path too, a head saved against the float model of the same weights loads (another model's does not),
and greedy decoding with the head equals target-only decoding in generate and in the scheduler's ragged batches.

A tiny random Gemma-3 quantized to Q8_0 on load (int8) stands in for the GGUF: it runs the same QuantWeight /
QuantEmbedding code. The echo head (test_eagle_drafting) makes drafts both accepted and rejected. The real
Gemma-3-270M Q4_K_M GGUF is checked in one slow test.
"""

import pytest
import torch
from test_eagle_drafting import GREEDY, assert_true_states, draft_map, echo_head, random_head
from test_serving_scheduler import make_prompts, reference_tokens, run_staggered

from specgate.drafting import NoDrafter, eagle, make_drafter
from specgate.drafting.eagle_drafter import EagleDrafter
from specgate.engine import generate
from specgate.models import load_model, native
from specgate.models.transformer import QuantEmbedding
from specgate.serving import Request, Scheduler, TablePolicy


@pytest.fixture(scope="module")
def float_target(tiny_model_dir):
    return load_model(str(tiny_model_dir("gemma3")))


@pytest.fixture(scope="module")
def quantized(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("gemma3")), dtype="int8")
    assert isinstance(loaded.model.embed_tokens, QuantEmbedding) and loaded.model.native_stack() is not None
    return loaded


@pytest.fixture(scope="module")
def echo_dir(float_target, tmp_path_factory):
    """The echo head saved against the float model: served on its int8 copy below (trained on float, served quantized)."""
    return eagle.save_head(echo_head(float_target.model), tmp_path_factory.mktemp("echo-float"), {"target": "tiny-gemma3"})


def test_the_head_reads_the_quantized_embedding_exactly(quantized, float_target):
    model = quantized.model
    head = echo_head(model)
    table = model.embed_tokens.weight.dequantize()  # [V, H] gguf.quants' numpy dequantization: the oracle
    assert head.rows.dtype == torch.float32 and torch.equal(head.rows, table[head.d2t])
    ids = torch.randint(0, 512, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(head.embed_tokens(ids), model.embed_tokens(ids) * model.args.embed_scale)
    float_rows = float_target.model.embed_tokens.weight[head.d2t]
    assert not torch.equal(head.rows, float_rows)  # Q8_0 rounded: the quantized target's values, not the checkpoint's
    torch.testing.assert_close(head.rows, float_rows, rtol=0, atol=float(float_rows.abs().max()) / 100)


def test_the_quantized_forward_returns_final_norm_states(quantized):
    """forward(return_hidden=True) on QuantWeights, ragged, with and without logits, through the C stack: the
    final-norm state of the per-layer torch path (eagle.target_features), and the logits it scores."""
    model = quantized.model
    ids = torch.randint(4, 512, (2, 6), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1]])
    valid = positions >= 0
    with torch.inference_mode():
        alone = model.forward(ids, positions, model.new_cache(2, 6), torch.arange(2), logits=False, return_hidden=True)
        logits, hidden = model.forward(ids, positions, model.new_cache(2, 6), torch.arange(2), return_hidden=True)
    expected = eagle.target_features(model, torch.where(valid, ids, 0), [eagle.FEATURE_FINAL_NORM])[:, :, 0]  # [2, 6, H]
    torch.testing.assert_close(alone[valid], hidden[valid])
    torch.testing.assert_close(hidden[valid], expected[valid], rtol=1e-4, atol=1e-4)
    table = model.embed_tokens.weight.dequantize()
    scored = hidden[valid].contiguous()
    if native.int8_activations():  # the head's products see x rounded to int8 per 32-block (llama.cpp's method)
        scored = native.round_activations(scored)
    torch.testing.assert_close(logits[valid], scored @ table.T, rtol=1e-4, atol=1e-4)


def test_a_head_saved_against_the_float_model_loads_onto_its_quantized_copy_only(quantized, float_target, echo_dir, tiny_model_dir, tmp_path):
    """The fingerprint rule (eagle.load_head): dequantized values within 5% of the sample's largest magnitude. Q8_0 of
    the same weights passes, both ways; another model of the same shapes fails, float or quantized."""
    loaded = eagle.load_head(echo_dir, quantized)
    assert torch.equal(loaded.rows, quantized.model.embed_tokens.weight.dequantize()[loaded.d2t])
    back = eagle.save_head(random_head(quantized.model), tmp_path / "int8-head", {"target": "tiny-gemma3 int8"})
    assert eagle.load_head(back, float_target) is not None
    other = tiny_model_dir("gemma3", seed=1)  # same shapes, other values
    with pytest.raises(ValueError, match=r"other embedding values .* use the target it was trained on \('tiny-gemma3'\)"):
        eagle.load_head(echo_dir, load_model(str(other), dtype="int8"))
    with pytest.raises(ValueError, match=r"other embedding values .*'tiny-gemma3 int8'"):
        eagle.load_head(back, load_model(str(other)))


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_generate_with_the_head_on_the_quantized_target_equals_target_only(quantized, echo_dir, gamma):
    generator = torch.Generator().manual_seed(0)
    drafter = make_drafter(f"eagle:{echo_dir}", quantized)
    drafted = accepted = 0
    for length in (4, 9, 14):
        prompt = [1] + torch.randint(4, 512, (length,), generator=generator).tolist()
        baseline = generate(prompt, quantized, NoDrafter(), 0, GREEDY, max_new_tokens=20)
        result = generate(prompt, quantized, drafter, gamma, GREEDY, max_new_tokens=20)
        assert result.tokens == baseline.tokens and result.stats.lossless
        assert_true_states(quantized.model, drafter.state, prompt + result.tokens)
        drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    assert 0 < accepted < drafted  # drafts both accepted and rejected


def test_scheduler_greedy_ragged_batch_on_the_quantized_target_equals_target_only(quantized, echo_dir):
    """Staggered requests, fewer slots than requests, chunked prefill (states arriving chunk by chunk), a gamma
    changing with the batch, all on QuantWeights: each request's tokens equal target-only greedy decoding."""
    head = eagle.load_head(echo_dir, quantized)
    prompts = make_prompts(4, seed=2)
    max_tokens = [18, 24, 12, 20]
    policy = TablePolicy([(1, 1, 4), (2, 2, 2), (3, 3, 3)])
    scheduler = Scheduler(quantized, draft=head, policy=policy, num_slots=3, max_seq_len=64, prefill_chunk_tokens=8)
    requests = [Request(p, GREEDY, max_tokens=m, seed=i) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    run_staggered(scheduler, requests, join_after_steps=[0, 0, 1, 3])
    for request, prompt, budget in zip(requests, prompts, max_tokens):
        assert request.tokens == reference_tokens(quantized, prompt, budget), request.request_id
    drafted = sum(r.stats.drafted_tokens for r in requests)
    accepted = sum(r.stats.accepted_tokens for r in requests)
    assert 0 < accepted < drafted and scheduler.draft_kind == "eagle"


# --- the real Gemma-3-270M Q4_K_M GGUF ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_random_head_on_the_gguf_target_decodes_exactly(tmp_path):
    """A head saved against the GGUF de-quantised to float32 loads onto the GGUF's own blocks (--dtype gguf, what
    users get by default: its Q8_0 embedding dequantizes to equal values), and greedy decoding with the untrained
    (random) head equals target-only decoding for 24 tokens."""
    from specgate.drafting.eagle_train import default_d2t
    from specgate.models.loading import default_gguf_path

    gguf_target = load_model("gemma-3-270m", dtype="gguf")
    assert gguf_target.model.quantized
    float_model = load_model(str(default_gguf_path()), dtype=torch.float32).model
    d2t = default_d2t()
    torch.manual_seed(0)
    head = eagle.EagleHead(eagle.EagleConfig.for_target(float_model.args, d2t.numel(), [eagle.FEATURE_FINAL_NORM])).attach_target(float_model, d2t)
    saved = eagle.save_head(head.eval(), tmp_path / "head", {"target": "gemma-3-270m (GGUF as float32)"})
    float_rows = head.rows
    del head, float_model
    loaded = eagle.load_head(saved, gguf_target)
    assert torch.equal(loaded.rows, float_rows)
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    baseline = generate(prompt, gguf_target, NoDrafter(), 0, GREEDY, max_new_tokens=24)
    result = generate(prompt, gguf_target, EagleDrafter(loaded, gguf_target), 3, GREEDY, max_new_tokens=24)
    assert result.tokens == baseline.tokens and result.stats.drafted_tokens > 0
