"""The EAGLE head (specgate.drafting.eagle) and its recipe's training loop, on a tiny random Gemma-3."""

from __future__ import annotations

import pytest
import torch

from specgate.drafting import eagle
from specgate.drafting.eagle_train import HeadData, HeadTrainConfig, batch_rows, train_head

DRAFT_VOCAB = 96


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from specgate.models import load_model

    path = tiny_model_dir("gemma3")
    return path, load_model(str(path)).model


def _ids(rows: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


def _head(model, layers=(0, eagle.FEATURE_FINAL_NORM), seed: int = 0) -> eagle.EagleHead:
    torch.manual_seed(seed)
    d2t = torch.arange(DRAFT_VOCAB) * 5 % model.vocab_size  # [V_d] distinct target ids
    return eagle.EagleHead(eagle.EagleConfig.for_target(model.args, DRAFT_VOCAB, layers)).attach_target(model, d2t)


def test_target_features_match_the_runtime_and_transformers(tiny):
    from transformers import AutoModelForCausalLM

    path, model = tiny
    ids = _ids(2, 12, model.vocab_size)
    feats = eagle.target_features(model, ids, [0, 1, eagle.FEATURE_FINAL_NORM])  # [B, T, 3, H]
    assert feats.shape == (2, 12, 3, model.args.hidden_size)
    cache = model.new_cache(2, 12)
    _, hidden = model.forward(ids, torch.arange(12)[None].expand(2, 12), cache, torch.arange(2), return_hidden=True)
    torch.testing.assert_close(feats[:, :, 2], hidden.float(), rtol=1e-5, atol=1e-5)  # the runtime's own final-norm state
    torch.testing.assert_close(model.norm(feats[:, :, 1]), feats[:, :, 2], rtol=1e-5, atol=1e-5)  # last layer = pre-norm
    reference = AutoModelForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        states = reference(input_ids=ids, output_hidden_states=True).hidden_states  # embeddings, layer 0, ...
    torch.testing.assert_close(feats[:, :, 0], states[1].float(), rtol=1e-4, atol=1e-4)


def test_head_shapes_and_size(tiny):
    _, model = tiny
    head = _head(model)
    ids, feats = _ids(2, 10, model.vocab_size), torch.randn(2, 10, 2, model.args.hidden_size)
    results = head.unrolled(ids, feats, steps=3)
    assert len(results) == 3
    for logits, out in results:
        assert logits.shape == (2, 10, DRAFT_VOCAB) and out.shape == (2, 10, model.args.hidden_size)
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    assert head.size_bytes() == 2 * trainable
    assert "rows" not in head.state_dict() and "embed" not in head.state_dict()  # frozen parts come from the target


def test_cached_steps_with_own_feature_feedback_equal_the_unrolled_form(tiny):
    """A draft chain through the cache (target features for the context, then the head's own output fed back)
    gives the logits the unrolled training form computes at the chain's indices: the training-time-test mask is
    the draft-time attention."""
    _, model = tiny
    head = _head(model).eval()
    T, steps = 12, 3
    ids = _ids(1, T + 1, model.vocab_size, seed=3)
    feats = eagle.target_features(model, ids, head.config.feature_layers)[:, :T]  # h_0..h_{T-1}
    tokens = ids[:, 1:]  # x_1..x_T: index j reads (h_j, x_{j+1})
    with torch.no_grad():
        unrolled = head.unrolled(tokens, feats, steps)
    for start in (0, 4, 8):
        cache = head.new_cache(1, T + 2)
        slots = torch.tensor([0])
        with torch.no_grad():
            projected = head.project_target(feats[:, : start + 1])  # [1, start + 1, H]
        logits, out = head.step(tokens[:, : start + 1], projected, torch.arange(start + 1)[None], cache, slots)
        torch.testing.assert_close(logits[0, -1], unrolled[0][0][0, start], rtol=1e-4, atol=1e-4)
        for step in range(1, steps):
            index = start + step
            logits, out = head.step(tokens[:, index : index + 1], out[:, -1:], torch.tensor([[index]]), cache, slots)
            torch.testing.assert_close(logits[0, -1], unrolled[step][0][0, index], rtol=1e-4, atol=1e-4)


def test_draft_greedy_feeds_its_own_tokens_and_features(tiny):
    _, model = tiny
    head = _head(model).eval()
    ids = _ids(1, 9, model.vocab_size, seed=5)
    feats = eagle.target_features(model, ids, head.config.feature_layers)
    cache, slots = head.new_cache(1, 16), torch.tensor([0])
    with torch.no_grad():
        projected = head.project_target(feats[:, :7])
    head.step(ids[:, 1:7], projected[:, :6], torch.arange(6)[None], cache, slots)  # context: positions 0..5
    drafted = head.draft_greedy(int(ids[0, 7]), projected[0, 6], 6, cache, 0, gamma=3)
    assert drafted.shape == (3,) and set(drafted.tolist()) <= set(head.d2t.tolist())
    # the same chain by hand: each step's argmax (through d2t) is the next step's token, its output the next feature
    logits, out = head.step(ids[:, 7:8], projected[:, 6:7], torch.tensor([[6]]), cache, slots)
    first = int(head.d2t[logits[0, -1].argmax()])
    logits, _ = head.step(torch.tensor([[first]]), out, torch.tensor([[7]]), cache, slots)
    assert [first, int(head.d2t[logits[0, -1].argmax()])] == drafted[:2].tolist()


def _synthetic(model, rows: int = 8, length: int = 16) -> HeadData:
    ids = _ids(rows, length, model.vocab_size, seed=7)
    feats = eagle.target_features(model, ids, [0, eagle.FEATURE_FINAL_NORM])
    return HeadData(ids, feats, feats[:, :, 1].clone())


def test_training_reduces_the_loss(tiny):
    _, model = tiny
    head = _head(model)
    config = HeadTrainConfig(steps=40, batch_size=4, lr=3e-3, warmup_steps=2, unroll_steps=2, checkpoint_every=1000)
    losses = train_head(head, _synthetic(model), config, checkpoint=None)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_resume_equals_an_uninterrupted_run(tiny, tmp_path):
    _, model = tiny
    data = _synthetic(model)
    config = HeadTrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=2, unroll_steps=2, checkpoint_every=3)
    straight = _head(model)
    straight_losses = train_head(straight, data, config, checkpoint=tmp_path / "a.pt")
    interrupted = _head(model)
    train_head(interrupted, data, config, checkpoint=tmp_path / "b.pt", stop_after=3)
    resumed = _head(model, seed=123)  # a fresh process's head: everything must come from the checkpoint
    resumed_losses = train_head(resumed, data, config, checkpoint=tmp_path / "b.pt")
    assert resumed_losses == straight_losses
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name


def test_batch_rows_is_a_pure_function_of_the_step():
    assert torch.equal(batch_rows(5, 20, 4, 0), batch_rows(5, 20, 4, 0))
    epoch = torch.cat([batch_rows(step, 20, 4, 0) for step in range(5)])
    assert sorted(epoch.tolist()) == list(range(20))  # one epoch visits every window once


def test_sample_temperature_defaults_to_the_trained_q_and_must_be_positive(tiny):
    import dataclasses

    _, model = tiny
    config = _head(model).config
    assert config.sample_temperature == 1.0
    saved = config.to_dict()
    del saved["sample_temperature"]
    assert eagle.EagleConfig.from_dict(saved) == config  # a head saved before the field loads as trained
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"sample_temperature={bad}: use a finite value > 0"):
            dataclasses.replace(config, sample_temperature=bad)


def test_sampled_acceptance_is_the_overlap_of_p_and_the_tempered_q_at_each_step(tiny):
    _, model = tiny
    head = _head(model, layers=(eagle.FEATURE_FINAL_NORM,), seed=2).eval()
    ids = _ids(2, 10, model.vocab_size, seed=5)
    rates = eagle.sampled_acceptance(head, model, ids, (0.5, 1.0), 3)  # [2, 3]
    assert rates.shape == (2, 3)
    with torch.no_grad():  # by hand: every index with a chain at every step (j >= 2), averaged per row, then over rows
        logits = model.forward(ids, torch.arange(10)[None].expand(2, 10), model.new_cache(2, 10), torch.arange(2))
        p = torch.softmax(logits[:, 3:9].float(), -1)[..., head.d2t]  # [B, 6, V_d]
        feats = eagle.target_features(model, ids, head.config.feature_layers)[:, :8]
        steps = head.unrolled(ids[:, 1:9], feats, 3)
    for k, t in enumerate((0.5, 1.0)):
        for s, (draft_logits, _) in enumerate(steps):
            q = torch.softmax(draft_logits[:, 2:].float() / t, -1)
            assert float(rates[k, s]) == pytest.approx(float(torch.minimum(p, q).sum(-1).mean()), abs=1e-5)
    assert float(rates[0].sub(rates[1]).abs().max()) > 1e-3  # the temperature changes the overlap
    with pytest.raises(ValueError, match="at least steps \\+ 2 = 5 tokens"):
        eagle.sampled_acceptance(head, model, ids[:, :4], (1.0,), 3)
    with pytest.raises(ValueError, match="values > 0"):
        eagle.sampled_acceptance(head, model, ids, (0.0,), 1)


def test_chain_acceptance_counts_prefixes(tiny):
    _, model = tiny
    head = _head(model).eval()
    ids = _ids(2, 20, model.vocab_size, seed=9)
    feats = eagle.target_features(model, ids, head.config.feature_layers)
    scored = torch.ones_like(ids, dtype=torch.bool)
    result = eagle.chain_acceptance(head, ids, feats, scored, gamma=4)
    prefix = result["prefix_match"]
    assert all(a >= b for a, b in zip(prefix, prefix[1:])) and 1.0 <= result["acceptance_length"] <= 5.0
    assert eagle.chain_acceptance(head, ids, feats, torch.zeros_like(scored), gamma=4)["chains"] == 0
    assert eagle.expected_acceptance_length([1.0, 1.0]) == 3.0 and eagle.expected_acceptance_length([0.5, 0.5]) == 1.75


def test_continue_text_greedy_follows_the_argmax_and_sampling_is_seeded_and_never_banned(tiny):
    from specgate.drafting.eagle_train import continue_text

    _, model = tiny
    prompts = _ids(3, 5, model.vocab_size, seed=3)
    greedy = continue_text(model, prompts, 6)
    assert torch.equal(greedy[:, :5], prompts)
    logits = model.forward(greedy, torch.arange(11)[None].expand(3, 11), model.new_cache(3, 11), torch.arange(3))  # [B, T, V]
    assert torch.equal(greedy[:, 5:], logits[:, 4:10].argmax(-1))  # each new token is the full-vocabulary argmax
    allowed = torch.tensor([5, 9, 11, 17, 23, 31, 37, 41])
    banned = tuple(t for t in range(model.vocab_size) if t not in allowed.tolist())  # sampling must keep to `allowed`
    runs = [continue_text(model, prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(7), banned=banned) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])  # one seed, one text
    assert torch.isin(runs[0][:, 5:], allowed).all()
    others = [continue_text(model, prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(seed), banned=banned) for seed in (8, 9)]
    assert any(not torch.equal(other, runs[0]) for other in others)  # the generator, not a fixed rule, picks the samples


def test_windows_split_over_sources_and_reference_topics_hold_out_a_disjoint_set():
    import random

    from specgate.drafting import distill
    from specgate.drafting.eagle_train import _windows

    sources = [[[1] * 40], [[2] * 40], [[3] * 40]]  # one document each, every token naming its source
    windows = _windows(sources, 7, 8, 0, random.Random(0))  # [7, 8]
    assert windows.shape == (7, 8) and windows[:, 0].eq(0).all()
    assert windows[:, 1].tolist() == [1, 1, 1, 2, 2, 3, 3]  # 7 = 3 + 2 + 2, the first source takes the remainder
    train, held = distill.reference_texts(), distill.reference_texts(held_out=True)
    names = {name for name, _ in train}
    assert held and not names & {name for name, _ in held}
    from pydoc_data.topics import topics

    assert names | {name for name, _ in held} == set(topics) and len(held) == -(-len(topics) // distill.HELD_OUT_TOPIC_EVERY)


def test_evaluate_reports_every_held_out_category_in_row_order(tiny):
    from specgate.drafting.eagle_train import evaluate, heldout_rows_of

    _, model = tiny
    head = _head(model, layers=(eagle.FEATURE_FINAL_NORM,)).eval()
    ids = _ids(6, 14, model.vocab_size, seed=4)
    stored = eagle.target_features(model, ids, [eagle.FEATURE_FINAL_NORM])  # [B, T, 1, H]
    from specgate.drafting.eagle_train import STORED_LAYERS

    features = torch.zeros(6, 14, len(STORED_LAYERS), model.args.hidden_size)
    features[:, :, STORED_LAYERS.index(eagle.FEATURE_FINAL_NORM)] = stored[:, :, 0]
    rows = {"code": 1, "prose": 2, "docs": 3}
    result = evaluate(head, {"ids": ids, "features": features}, 4, rows, gamma=3)
    assert list(result) == ["code", "prose", "docs"]
    for name, start, count in (("code", 0, 1), ("prose", 1, 2), ("docs", 3, 3)):
        scored = torch.zeros(count, 14, dtype=torch.bool)
        scored[:, 4:] = True
        alone = eagle.chain_acceptance(head, ids[start : start + count], stored[start : start + count], scored, 3)
        assert result[name]["chains"] == alone["chains"]
        assert result[name]["prefix_match"] == pytest.approx(alone["prefix_match"])
    old_plan = {"heldout_code_rows": 2, "heldout": ids}  # a plan from before the reference topics were held out
    assert heldout_rows_of(old_plan) == {"code": 2, "prose": 4}
    assert heldout_rows_of({"heldout_rows": rows}) == rows
