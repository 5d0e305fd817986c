"""The EAGLE head as a drafter, on a tiny random Gemma-3: save / load against the right target only, the feature
flow (prefill and verification -> HeadState), q, and exactness in every lane (generate, the scheduler's ragged
batches, serve), greedy token for token and sampled by the lossless harness (engine.lossless_real).

Most tests use an "echo" head, built by hand: its output feature is the target's own state (fc passes the feature
through, the Block's residual branches are zeroed, its input norm undoes the final norm's scale), so it drafts
the token the target's latest known state predicts, again and again. On a tiny model's repeating output those
drafts are accepted, at each change of token they are rejected: acceptance is partial, and it is high only if
the engine hands the head the right states at the right positions.
"""

import dataclasses
import json
from pathlib import Path
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import uncertain_prefixes
from test_serving_scheduler import make_prompts, reference_tokens, run_staggered

from specgate.drafting import NoDrafter, eagle, make_drafter
from specgate.drafting.eagle_drafter import EagleDrafter, HeadCostProxy, HeadState
from specgate.engine import generate
from specgate.engine.lossless_real import run_model_check
from specgate.models import load_model, native
from specgate.sampling import SamplingParams, SparseProbs, logits_to_probs
from specgate.serving import FixedPolicy, Request, Scheduler, TablePolicy

GREEDY = SamplingParams(temperature=0.0)
DRAFT_VOCAB = 384  # of the tiny model's 512: some of its outputs cannot be drafted, so some drafts must fail


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(str(tiny_model_dir("gemma3")))


def draft_map(vocab: int, size: int = DRAFT_VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size]  # [V_d] distinct target ids, shuffled


def echo_head(model, d2t: torch.Tensor | None = None) -> eagle.EagleHead:
    """The head whose output is the target's state it read (module docstring)."""
    d2t = draft_map(model.vocab_size) if d2t is None else d2t
    torch.manual_seed(0)
    head = eagle.EagleHead(eagle.EagleConfig.for_target(model.args, d2t.numel(), [eagle.FEATURE_FINAL_NORM])).attach_target(model, d2t)
    hidden = model.args.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)  # x = input_norm(feature): the token's embedding is ignored
        head.input_norm.weight.copy_(1 / (1 + head.final_norm.weight) - 1)  # final_norm(out) ∝ the feature
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()  # out = x
    return head.eval()


def random_head(model, seed: int = 0, layers=(eagle.FEATURE_FINAL_NORM,)) -> eagle.EagleHead:
    """A head with every trainable weight drawn at random (none at its initial value), for the save / load checks."""
    torch.manual_seed(seed)
    d2t = draft_map(model.vocab_size, 96, seed)
    head = eagle.EagleHead(eagle.EagleConfig.for_target(model.args, 96, layers)).attach_target(model, d2t)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape) * 0.2)
    return head.eval()


@pytest.fixture(scope="module")
def echo_dir(target, tmp_path_factory):
    """The echo head saved with sample_temperature 0.7 (sampled drafts from a sharpened q): the exactness tests below
    run with the calibration in the draw, which only greedy rows ignore."""
    head = echo_head(target.model)
    head.config = dataclasses.replace(head.config, sample_temperature=0.7)
    return eagle.save_head(head, tmp_path_factory.mktemp("echo-head"), {"target": "tiny-gemma3"})


def prompt_features(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's final-norm states at every position of ids [L] -> [L, H]."""
    return eagle.target_features(model, ids[None], [eagle.FEATURE_FINAL_NORM])[0, :, 0]


def assert_true_states(model, state: HeadState, committed: list[int]) -> None:
    """The head state holds the target's own final-norm state at every position it knows, up to the one before the
    newest committed token (whose state the next verification computes)."""
    assert state.known == len(committed) - 1, (state.known, len(committed))
    expected = prompt_features(model, torch.tensor(committed))[: state.known]
    torch.testing.assert_close(state.features[: state.known], expected, rtol=1e-4, atol=1e-4)


def count_draft_kinds(drafter) -> dict[str, int]:
    """Wrap drafter.propose (an EagleDrafter's, one proposal, or an EagleProposer's, a list) to count the proposals
    with drafts by kind: "head" (head steps spent) or "lookup" (none). Returns the live counts."""
    kinds = {"head": 0, "lookup": 0}
    propose = drafter.propose

    def counting(*args):
        proposals = propose(*args)
        for proposal in proposals if isinstance(proposals, list) else [proposals]:
            if proposal.num_tokens:
                kinds["head" if proposal.forward_passes else "lookup"] += 1
        return proposals

    drafter.propose = counting
    return kinds


# --- save / load --------------------------------------------------------------------------------------------------


def test_save_writes_bf16_trainable_weights_and_load_restores_them(target, tmp_path):
    head = random_head(target.model)
    metadata = {"target": "tiny-gemma3", "data": "random windows", "steps": 123, "gamma": 2, "limits": ["toy model", "no prose"],
                "acceptance": {"code": {"conditional": [0.61, 0.52], "acceptance_length": 1.93}, "prose": {"conditional": [0.4], "acceptance_length": 1.4}}}
    out = eagle.save_head(head, tmp_path / "head", metadata)
    weights = load_file(str(out / eagle.HEAD_WEIGHTS_FILE))
    assert set(weights) == {n for n, p in head.named_parameters() if p.requires_grad}  # the frozen parts are the target's
    assert {w.dtype for w in weights.values()} == {torch.bfloat16} and "final_norm.weight" not in weights
    info = json.loads((out / eagle.HEAD_CONFIG_FILE).read_text())
    assert info["metadata"]["steps"] == 123 and info["target_fingerprint"]["embedding_shape"] == [512, 64]
    card = (out / eagle.MODEL_CARD_FILE).read_text()
    for text in ("tiny-gemma3", "random windows", "| 123 |", "| code | 0.610 | 0.520 | 1.930 |", "| prose | 0.400 | - |", "- no prose", "eagle:THIS_DIR"):
        assert text in card, text

    loaded = eagle.load_head(out, target)
    rounded = {n: p.detach().to(torch.bfloat16).float() for n, p in head.named_parameters() if p.requires_grad}
    for name, param in loaded.named_parameters():
        expected = rounded.get(name, head.final_norm.weight)
        assert torch.equal(param.detach(), expected), name
    assert torch.equal(loaded.d2t, head.d2t) and loaded.config == head.config
    ids, feats = torch.randint(4, 512, (1, 6)), torch.randn(1, 6, 64)
    positions = torch.arange(6)[None]
    with torch.no_grad():
        head.load_state_dict(rounded, strict=False)
        expected_logits, _ = head.step(ids, feats, positions, head.new_cache(1, 8), torch.tensor([0]))
    logits, _ = loaded.step(ids, feats, positions, loaded.new_cache(1, 8), torch.tensor([0]))
    torch.testing.assert_close(logits, expected_logits)


def test_loading_against_another_target_names_the_mismatch_and_the_fix(target, tiny_model_dir, echo_dir, tmp_path):
    other_weights = load_model(str(tiny_model_dir("gemma3", seed=1)))  # same shapes, other values
    with pytest.raises(ValueError, match=r"other embedding values .* use the target it was trained on \('tiny-gemma3'\)"):
        eagle.load_head(echo_dir, other_weights)
    other_vocab = load_model(str(tiny_model_dir("gemma3", vocab_size=640)))
    with pytest.raises(ValueError, match=r"embedding \[vocab, hidden\] = \[512, 64\].* has \[640, 64\].*train a head"):
        eagle.load_head(echo_dir, other_vocab)
    assert eagle.load_head(echo_dir, load_model(str(tiny_model_dir("gemma3")), dtype=torch.bfloat16)) is not None  # a bf16 copy passes
    with pytest.raises(ValueError, match="not a saved EAGLE head"):
        eagle.load_head(tmp_path, target)
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for file in echo_dir.iterdir():
        (tampered / file.name).write_bytes(file.read_bytes())
    d2t = load_file(str(tampered / "draft_vocab_map.safetensors"))["d2t"]
    save_file({"d2t": d2t.flip(0).contiguous()}, str(tampered / "draft_vocab_map.safetensors"))
    with pytest.raises(ValueError, match="sha256 differs"):
        eagle.load_head(tampered, target)


def test_a_training_checkpoint_exports_as_a_loadable_head_with_its_model_card(target, tmp_path):
    from specgate.drafting.eagle_train import HeadData, HeadTrainConfig, export_head, train_head

    head = random_head(target.model, seed=7)
    ids = torch.randint(4, 512, (4, 12), generator=torch.Generator().manual_seed(8))
    feats = eagle.target_features(target.model, ids, [eagle.FEATURE_FINAL_NORM])
    run = tmp_path / "run"
    train_head(head, HeadData(ids, feats, feats[:, :, 0].clone()), HeadTrainConfig(steps=2, batch_size=2, warmup_steps=1, bf16=False), run / "checkpoint.pt")
    heldout = {"code": {"conditional": [0.5, 0.25], "acceptance_length": 1.625}, "prose": {"conditional": [0.3, 0.1], "acceptance_length": 1.33}}
    (run / "metrics.json").write_text(json.dumps({"heldout": heldout, "train_positions": 48, "features": "final"}))
    out = export_head(run, target.model, head.d2t, tmp_path / "export", "tiny-gemma3")
    loaded = eagle.load_head(out, target)
    for name, param in head.named_parameters():
        if param.requires_grad:
            assert torch.equal(dict(loaded.named_parameters())[name].detach(), param.detach().to(torch.bfloat16).float()), name
    card = (out / eagle.MODEL_CARD_FILE).read_text()
    assert "| code | 0.500 | 0.250 | 1.625 |" in card and "48 training positions" in card and "| 2 |" in card
    assert "## Exactness" in card and "check-lossless --target TARGET --draft eagle:THIS_DIR" in card  # not run at export: says how


def test_a_head_on_features_the_runtime_does_not_give_is_refused(target):
    with pytest.raises(ValueError, match="final-norm state only"):
        EagleDrafter(random_head(target.model, layers=(0, eagle.FEATURE_FINAL_NORM)), target)


# --- the drafter ----------------------------------------------------------------------------------------------------


def test_a_proposal_is_the_heads_greedy_chain_on_the_target_features(target):
    """EagleDrafter, fed the prompt's states as the engine feeds them (positions 0..L-2), drafts what
    EagleHead.draft_greedy drafts by hand: context rows (h_j, x_{j+1}) for j < L-2, then the chain from (h_{L-2}, x_{L-1})."""
    head = random_head(target.model, seed=4)
    ids = torch.randint(4, 512, (9,), generator=torch.Generator().manual_seed(2))
    feats = prompt_features(target.model, ids)  # [L, H]
    drafter = EagleDrafter(head, target, stop_below=0.0)  # every chain gamma long
    drafter.begin(ids, GREEDY, None, 20)
    drafter.observe_features(0, feats[:-1])
    proposal = drafter.propose(ids, 4)
    cache, L = head.new_cache(1, 20), ids.numel()
    with torch.no_grad():
        projected = head.project_target(feats[None, :, None])  # [1, L, H]
    step = eagle.drafting_step(head)  # the drafters' step: the C kernels' where they run
    step(ids[None, 1 : L - 1], projected[:, : L - 2], torch.arange(L - 2)[None], cache, torch.tensor([0]))
    by_hand = head.draft_greedy(int(ids[-1]), projected[0, L - 2], L - 2, cache, 0, gamma=4, step=step)
    assert proposal.tokens.tolist() == by_hand.tolist() and proposal.draft_probs is None and proposal.forward_passes == 4


def test_a_chain_stops_where_the_product_of_top1_probabilities_falls_below_stop_below(target):
    """The chain drafts token k+1 only while c_1 * ... * c_k >= stop_below (c_j: the head's top-1 probability at
    draft j); what it drafts is a prefix of the full greedy chain. Thresholds between the products of a chain
    computed by hand give every length from 1 to gamma; one a hair above a product drafts one token fewer."""
    head = random_head(target.model, seed=4)
    with torch.no_grad():
        head.rows.mul_(5.0)  # sharper logits: top-1 probabilities spread over (0, 1) instead of ~1/V_d (argmax unchanged)
    ids = torch.randint(4, 512, (9,), generator=torch.Generator().manual_seed(2))
    feats = prompt_features(target.model, ids)
    L, gamma = ids.numel(), 5
    with torch.no_grad():
        projected = head.project_target(feats[None, :, None])
    step, cache = eagle.drafting_step(head), head.new_cache(1, 20)
    logits, out = step(ids[None, 1:], projected[:, : L - 1], torch.arange(L - 1)[None], cache, torch.tensor([0]))  # rows 0..L-2
    logits, out, chain, products, product = logits[0, -1], out[0, -1], [], [], 1.0
    for offset in range(gamma):  # the full greedy chain by hand, with its running products
        product *= float(torch.softmax(logits, -1).max())
        chain.append(int(head.d2t[logits.argmax()]))
        products.append(product)
        logits, out = step(torch.tensor([[chain[-1]]]), out.view(1, 1, -1), torch.tensor([[L - 1 + offset]]), cache, torch.tensor([0]))
        logits, out = logits[0, -1], out[0, -1]
    assert sum(products[k - 1] > products[k] * 1.01 for k in range(1, gamma)) >= 3  # the sharpened head spreads its confidences

    def drafted(stop_below: float) -> list[int]:
        drafter = EagleDrafter(head, target, stop_below=stop_below)
        drafter.begin(ids, GREEDY, None, 20)
        drafter.observe_features(0, feats[:-1])
        return drafter.propose(ids, gamma).tokens.tolist()

    assert drafted(0.0) == chain
    for k in range(1, gamma):  # products[k - 1] >= threshold > products[k]: k + 1 tokens
        if products[k - 1] > products[k] * 1.01:  # well apart (the drafter multiplies in float32)
            assert drafted((products[k - 1] * products[k]) ** 0.5) == chain[: k + 1]
            assert drafted(min(products[k - 1] * 1.0001, 0.999)) == chain[:k]
    with pytest.raises(ValueError, match="stop_below"):
        EagleDrafter(head, target, stop_below=1.0).begin(ids, GREEDY, None, 20)


def test_a_recurring_ngram_drafts_its_continuation_with_one_hot_q_and_no_head_step(target):
    """Prompt lookup first (eagle_drafter.LOOKUP_MIN_N, LOOKUP_MIN_N_SAMPLED when sampling): greedy, [.. a b c d a b]
    drafts "c d a b" (q one-hot: draft_probs None) without a head step; sampling, a recurring bigram alone drafts the
    head's chain and a recurring trigram its continuation; a context whose last bigram is new drafts the head's
    chain; lookup_min_n 0 is the head alone. sample_batch drafts what propose drafts and pads a short lookup with -1."""
    head = random_head(target.model, seed=4)
    params = SamplingParams(temperature=1.0)
    bigram = torch.tensor([1, 11, 12, 13, 14, 11, 12])  # (11, 12) recurs, (14, 11, 12) does not
    trigram = torch.tensor([1, 10, 11, 12, 13, 14, 10, 11, 12])  # (10, 11, 12) recurs

    def propose(context, lookup_min_n, sampling=params):
        drafter = EagleDrafter(head, target, stop_below=0.0, lookup_min_n=lookup_min_n)
        drafter.begin(context, sampling, torch.Generator().manual_seed(0), 16)
        drafter.observe_features(0, prompt_features(target.model, context)[: context.numel() - 1])
        return drafter.propose(context, 4)

    looked_up = propose(bigram, 2, GREEDY)
    assert looked_up.tokens.tolist() == [13, 14, 11, 12] and looked_up.draft_probs is None and looked_up.forward_passes == 0
    sampled = propose(bigram, 2)  # a bigram is not enough when sampling: the head drafts
    assert sampled.forward_passes == 4 and sampled.draft_probs is not None
    looked_up = propose(trigram, 2)
    assert looked_up.tokens.tolist() == [13, 14, 10, 11] and looked_up.draft_probs is None and looked_up.forward_passes == 0
    alone = propose(trigram, 0)
    assert alone.forward_passes == 4 and alone.draft_probs.values.shape == (4, head.d2t.numel())  # q on d2t's columns
    assert alone.draft_probs.support is head.d2t and alone.draft_probs.to_dense(512).shape == (4, 512)
    fresh = propose(bigram[:5], 2)  # last bigram (13, 14) never seen before
    assert fresh.forward_passes == 4 and fresh.draft_probs is not None
    tokens, q = EagleDrafter(head, target).sample_batch(torch.stack([trigram, trigram]), 6, params, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [[13, 14, 10, 11, 12, -1]] * 2
    assert q.shape == (2, 6, 512) and float(q[:, :5].sum()) == 10.0 and float(q[:, 5:].abs().sum()) == 0.0
    assert float(q[0, torch.arange(5), tokens[0, :5]].sum()) == 5.0
    tokens, q = EagleDrafter(head, target).sample_batch(torch.stack([bigram, bigram]), 3, params, torch.Generator().manual_seed(0))
    assert (tokens >= 0).all() and torch.allclose(q.sum(-1), torch.ones(2, 3))  # sampled, a bigram: the head's chains
    with pytest.raises(ValueError, match="lookup_min_n=4"):
        EagleDrafter(head, target, lookup_min_n=4).begin(bigram, params, None, 16)


def test_rejected_drafts_need_no_undo(target):
    """After a proposal whose drafts were rejected, the next one (the new states observed) equals a fresh drafter's."""
    head = random_head(target.model, seed=5)
    ids = torch.randint(4, 512, (14,), generator=torch.Generator().manual_seed(3))
    feats = prompt_features(target.model, ids)
    used = EagleDrafter(head, target, stop_below=0.0)
    used.begin(ids[:8], GREEDY, None, 24)
    used.observe_features(0, feats[:7])
    used.propose(ids[:8], 5)  # drafts at rows 7..10, then "rejected": the output went on as ids[8:11]
    used.observe_features(7, feats[7:10])  # the verification's states: the last committed token + 2 accepted
    fresh = EagleDrafter(head, target, stop_below=0.0)
    fresh.begin(ids[:11], GREEDY, None, 24)
    fresh.observe_features(0, feats[:10])
    assert used.propose(ids[:11], 4).tokens.tolist() == fresh.propose(ids[:11], 4).tokens.tolist()
    with pytest.raises(ValueError, match="without gaps"):
        used.observe_features(12, feats[12:13])


@pytest.mark.parametrize("sample_temperature", [1.0, 0.6])
def test_sampled_q_is_the_heads_processed_softmax_on_the_target_vocabulary(target, sample_temperature):
    head = random_head(target.model, seed=6)
    head.config = dataclasses.replace(head.config, sample_temperature=sample_temperature)
    params = SamplingParams(temperature=0.8, top_k=20)
    ids = torch.randint(4, 512, (7,), generator=torch.Generator().manual_seed(4))
    feats = prompt_features(target.model, ids)
    drafter = EagleDrafter(head, target, stop_below=0.0)
    drafter.begin(ids, params, torch.Generator().manual_seed(0), 16)
    drafter.observe_features(0, feats[:-1])
    proposal = drafter.propose(ids, 3)
    assert isinstance(proposal.draft_probs, SparseProbs) and proposal.draft_probs.support is head.d2t
    q = proposal.draft_probs.to_dense(512)  # [G, V_t]
    assert q.shape == (3, 512)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    outside = torch.ones(512, dtype=torch.bool)
    outside[head.d2t] = False
    assert float(q[:, outside].abs().max()) == 0.0  # zero outside the draft vocabulary: the residual covers it
    assert all(float(q[i, token]) > 0 for i, token in enumerate(proposal.tokens.tolist()))
    with torch.no_grad():  # the first draft's q by hand: the head's logits at row L-2, processed with the params
        projected = head.project_target(feats[None, :-1, None])
        logits, _ = eagle.drafting_step(head)(ids[None, 1:], projected, torch.arange(6)[None], head.new_cache(1, 8), torch.tensor([0]))
    expected = torch.zeros(512)
    expected[head.d2t] = logits_to_probs(logits[0, -1] / sample_temperature, params)  # the calibration, then the request's params
    torch.testing.assert_close(q[0], expected)


def test_calibration_undoes_a_flattened_heads_temperature_and_writes_it_to_the_heads_config(target, tmp_path):
    """Halving a head's rows halves its logits: q at temperature t is then the unhalved head's q at 2t, so its table
    must be the unhalved one's at twice the temperatures and its choice half the unhalved choice. No q on d2t can
    overlap p by more than p's mass on d2t, and the temperature must matter (a flat table would choose anything)."""
    from specgate.drafting.eagle_train import calibrate, write_calibration

    model = target.model
    windows = torch.randint(4, 512, (3, 12), generator=torch.Generator().manual_seed(11))  # [N, T]
    with torch.no_grad():
        logits = model.forward(windows, torch.arange(12)[None].expand(3, 12), model.new_cache(3, 12), torch.arange(3))  # [N, T, V]
    mass = float(torch.softmax(logits[:, 1:11].float(), -1)[..., draft_map(512)].sum(-1).mean())  # p after x_{j+1} on d2t
    head = echo_head(model)
    plain = calibrate(head, model, windows, 2, (0.5, 1.0, 2.0, 4.0))
    head.rows.mul_(0.5)
    result = calibrate(head, model, windows, 2, (0.25, 0.5, 1.0, 2.0))
    assert result["rates"] == plain["rates"] and result["chosen"] == plain["chosen"] / 2
    rates = [rate for row in plain["rates"] for rate in row]
    assert max(rates) <= mass + 1e-4 and max(rates) - min(rates) > 0.05, (rates, mass)
    assert plain["acceptance_length"][plain["temperatures"].index(plain["chosen"])] == max(plain["acceptance_length"])
    out = eagle.save_head(echo_head(model), tmp_path / "head", {"target": "tiny-gemma3"})
    weights = (out / eagle.HEAD_WEIGHTS_FILE).read_bytes()
    write_calibration(out, result, "three random windows")
    loaded = eagle.load_head(out, target)
    info = json.loads((out / eagle.HEAD_CONFIG_FILE).read_text())
    assert loaded.config.sample_temperature == result["chosen"] and info["metadata"]["target"] == "tiny-gemma3"
    assert info["metadata"]["calibration"]["chosen"] == result["chosen"] and info["metadata"]["calibration"]["data"] == "three random windows"
    assert (out / eagle.HEAD_WEIGHTS_FILE).read_bytes() == weights  # only the config changes


def test_a_prompt_of_one_token_drafts_nothing_until_a_state_is_known(target):
    drafter = EagleDrafter(echo_head(target.model), target)
    drafter.begin(torch.tensor([1]), GREEDY, None, 8)
    assert drafter.propose(torch.tensor([1]), 3).num_tokens == 0
    with pytest.raises(RuntimeError, match="observe_features"):
        drafter.propose(torch.tensor([1, 5, 6]), 3)  # the states of positions 0..1 were never passed


def test_hidden_states_without_logits_equal_those_with_them(target):
    """forward(logits=False, return_hidden=True) (prefill features) is forward(return_hidden=True)'s state, ragged."""
    model = target.model
    ids = torch.randint(4, 512, (2, 5))
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]])
    with torch.inference_mode():
        alone = model.forward(ids, positions, model.new_cache(2, 5), torch.arange(2), logits=False, return_hidden=True)
        _, with_logits = model.forward(ids, positions, model.new_cache(2, 5), torch.arange(2), return_hidden=True)
    torch.testing.assert_close(alone[positions >= 0], with_logits[positions >= 0])
    assert alone.shape == (2, 5, 64)


# --- exactness: generate, the scheduler, serve ----------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_generate_with_the_head_alone_equals_target_only(target, echo_dir, gamma):
    generator = torch.Generator().manual_seed(0)
    drafter = make_drafter(f"eagle:{echo_dir}", target)
    drafter.lookup_min_n = 0  # the head alone: its rejections below are the echo head's
    draftable = set(drafter.head.d2t.tolist())
    drafted = accepted = 0
    for length in (4, 9, 14):
        prompt = [1] + torch.randint(4, 512, (length,), generator=generator).tolist()
        baseline = generate(prompt, target, NoDrafter(), 0, GREEDY, max_new_tokens=20)
        result = generate(prompt, target, drafter, gamma, GREEDY, max_new_tokens=20)
        assert result.tokens == baseline.tokens and result.text == baseline.text
        assert result.stats.drafter == f"eagle:{echo_dir.name}" and result.stats.lossless
        drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
        assert_true_states(target.model, drafter.state, prompt + result.tokens)
        assert len(set(result.tokens)) == 1  # a tiny random model repeats one token (what the echo head relies on)
        if result.tokens[0] in draftable:  # only the first step fails (it echoes the prompt); then every draft holds,
            assert result.stats.rejections == 1, result.stats.to_dict()  # which needs the right state at each position
        else:
            assert result.stats.accepted_tokens == 0
    assert 0 < accepted < drafted  # drafts both accepted and rejected: the verification path is exercised


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_generate_with_lookup_and_the_head_equals_target_only(target, echo_dir, gamma):
    """The default drafter: lookups where the context repeats (the tiny model's output repeats one token, so a
    lookup takes over once a bigram recurs), the head elsewhere. Tokens equal target-only; lookup steps spend
    no head step, and the head's states stay the target's through them (the head drafts again after them)."""
    generator = torch.Generator().manual_seed(0)
    drafter = make_drafter(f"eagle:{echo_dir}", target)
    kinds, accepted = count_draft_kinds(drafter), 0
    for length in (4, 9, 14):
        prompt = [1] + torch.randint(4, 512, (length,), generator=generator).tolist()
        prompt += prompt[1:3] + [7]  # a recurring bigram whose continuation (the prompt's third token) is no repeat
        baseline = generate(prompt, target, NoDrafter(), 0, GREEDY, max_new_tokens=20)
        result = generate(prompt, target, drafter, gamma, GREEDY, max_new_tokens=20)
        assert result.tokens == baseline.tokens and result.text == baseline.text
        assert_true_states(target.model, drafter.state, prompt + result.tokens)
        accepted += result.stats.accepted_tokens
    assert accepted > 0 and kinds["head"] > 0 and kinds["lookup"] > 0, kinds


@pytest.mark.parametrize("lookup_min_n", [0, 2])
def test_scheduler_greedy_ragged_batch_with_the_head_equals_target_only(target, echo_dir, lookup_min_n):
    """Requests of different lengths joining at different steps, fewer slots than requests, prompts prefilled in
    chunks of 8 tokens (the states arrive chunk by chunk), a gamma that changes with the batch: every request's
    tokens equal target-only greedy decoding, and several rows drafted in one batched head step. The head alone
    (lookup_min_n 0), and as served by default: lookups where a row's context repeats (these prompts repeat a
    pattern), the head in the same step for rows without a match."""
    head = eagle.load_head(echo_dir, target)
    prompts = make_prompts(5, seed=1)
    prompts[1] = prompts[1][:7]  # one prompt without a recurring bigram: the head drafts its first steps
    max_tokens = [20, 28, 14, 24, 18]
    policy = TablePolicy([(1, 1, 4), (2, 2, 2), (3, 3, 3)])
    scheduler = Scheduler(target, draft=head, policy=policy, num_slots=3, max_seq_len=64, prefill_chunk_tokens=8)
    scheduler.model_drafter.lookup_min_n = lookup_min_n  # read as each request is admitted (new_state)
    scheduler.trace = []
    kinds = count_draft_kinds(scheduler.model_drafter)
    requests = [Request(p, GREEDY, max_tokens=m, seed=i) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    step = scheduler.step

    def step_and_check() -> bool:  # after every step, each decoding request's head holds the target's true states
        busy = step()
        for request in scheduler.running:
            state = scheduler._state[request.request_id]
            if state.prefilled >= request.prompt_len - 1 and request.tokens:
                assert_true_states(target.model, state.head, request.prompt_ids.tolist() + request.tokens)
        return busy

    scheduler.step = step_and_check
    run_staggered(scheduler, requests, join_after_steps=[0, 0, 1, 2, 3])
    for request, prompt, budget in zip(requests, prompts, max_tokens):
        assert request.finish_reason in ("length", "stop")
        assert request.tokens == reference_tokens(target, prompt, budget), request.request_id
    drafted = sum(r.stats.drafted_tokens for r in requests)
    accepted = sum(r.stats.accepted_tokens for r in requests)
    assert 0 < accepted < drafted and scheduler.draft_kind == "eagle"
    assert any(sum(1 for d in step["rows_drafts"] if d) >= 2 for step in scheduler.trace), "no step drafted for several rows at once"
    assert len(scheduler.free_slots) == 3 and not scheduler.running
    assert kinds["head"] > 0 and (kinds["lookup"] > 0) == (lookup_min_n > 0), kinds


def test_scheduler_sampled_batch_with_the_head_matches_generate_with_the_same_seed(target, echo_dir):
    """Per-request head states, generators and params in a mixed batch: each request draws what it draws alone."""
    head = eagle.load_head(echo_dir, target)
    params = [SamplingParams(temperature=0.8), GREEDY, SamplingParams(temperature=1.0, top_k=20)]
    prompts = make_prompts(3, seed=4)
    scheduler = Scheduler(target, draft=head, policy=FixedPolicy(3), num_slots=3, max_seq_len=64)
    requests = [Request(p, sp, max_tokens=12, seed=50 + i) for i, (p, sp) in enumerate(zip(prompts, params))]
    run_staggered(scheduler, requests, join_after_steps=[0, 1, 3])
    for request, prompt in zip(requests, prompts):
        alone = generate(prompt, target, EagleDrafter(head, target), 3, request.params, seed=request.seed, max_new_tokens=12)
        assert request.tokens == alone.tokens, request.request_id
    assert sum(r.stats.accepted_tokens for r in requests) > 0


def test_eagle_sampling_is_lossless_on_a_tiny_gemma(target, echo_dir):
    """The lossless harness (chi-square at fixed prefixes, Bonferroni, at significance 0.01) on the default drafter,
    at prefixes where it drafts a lookup ([<s> a b d c a b d]: "c a b"; sampling matches from 3 tokens) and where
    the head drafts with its q (no recurring n-gram); its three negative controls (a wrong q, two lossy verifiers)
    must be caught."""
    params = dict(temperature=1.0, top_k=20)
    lookups = uncertain_prefixes(target, SamplingParams(**params), match=3)
    heads = [[1] + torch.randperm(500, generator=torch.Generator().manual_seed(seed))[:5].add(4).tolist() for seed in (0, 1)]
    drafter = make_drafter(f"eagle:{echo_dir}", target)
    assert all(drafter._lookup(torch.tensor(p), 3, SamplingParams(**params)) for p in lookups)
    assert not any(drafter._lookup(torch.tensor(p), 3, SamplingParams(**params)) for p in heads)
    report = run_model_check(target, f"eagle:{echo_dir}", gamma=3, num_samples=10_000, seed=0, significance=0.01,
                             prefixes=lookups + heads, **params)
    failed = [c for c in report["cases"] if c["verdict"] != "pass"]
    missed = [(c["name"], c["min_p_value"]) for c in report["negative_controls"] if c["verdict"] != "fail"]
    assert report["verdict"] == "pass", (failed, missed)
    assert len(report["cases"]) == 16 and len(report["negative_controls"]) == 3 and report["draft"].startswith("eagle:")


@pytest.mark.parametrize("spec", ["eagle:DIR", "default"])
def test_serve_with_the_head_calibrates_its_step_and_answers_exactly(target, echo_dir, tiny_model_dir, monkeypatch, spec):
    """`specgate serve --draft eagle:DIR --policy adaptive`, and `--draft default` where the registry names a head
    (as it does for gemma-3-270m): the head's step is priced (HeadCostProxy), and a greedy completion equals
    target-only generation."""
    from specgate.drafting import registry
    from specgate.serving.server import ServerConfig, start_server

    target_dir = tiny_model_dir("gemma3")
    monkeypatch.setitem(registry.DEFAULT_DRAFTS, Path(target_dir).name, f"eagle:{echo_dir}")
    draft = f"eagle:{echo_dir}" if spec == "eagle:DIR" else spec
    handle = start_server(ServerConfig(target=str(target_dir), draft=draft, port=0, policy="adaptive",
                                       gamma=3, max_num_seqs=2, max_seq_len=64, dtype="float32"))
    try:
        scheduler = handle.engine.scheduler
        assert scheduler.draft_kind == "eagle" and scheduler.policy.cost_model.draft_ms
        body = json.dumps({"model": handle.engine.model_name, "prompt": "hello hello world", "max_tokens": 12, "temperature": 0}).encode()
        request = urllib.request.Request(f"{handle.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            text = json.loads(response.read())["choices"][0]["text"]
    finally:
        handle.stop()
    assert text == generate("hello hello world", target, NoDrafter(), 0, GREEDY, max_new_tokens=12).text


def test_the_cost_proxy_times_a_head_step(target):
    from specgate.serving.policy import calibrate_cost_model

    cost = calibrate_cost_model(target.model, HeadCostProxy(echo_head(target.model)), gamma_max=2, batch_sizes=(1, 2), context_len=8, repeats=1)
    assert set(cost.draft_ms) == {1, 2} and all(ms > 0 for ms in cost.draft_ms.values())


def test_head_state_refeeds_rows_whose_states_change():
    state = HeadState(torch.zeros(8, 4))
    state.observe(0, torch.ones(5, 4))
    state.fed = 4
    state.observe(3, torch.full((2, 4), 2.0))  # states rewritten from 3: rows from 3 on must be fed again
    assert (state.known, state.fed) == (5, 3) and float(state.features[4, 0]) == 2.0


@pytest.mark.skipif(not native.available(), reason="the native head path needs specgate's C kernels")
def test_the_native_head_step_computes_what_the_torch_step_computes(target):
    """NativeHead (C kernels; Q8_0 weights and int8 activations where the CPU has VNNI) against EagleHead.step on a
    ragged batch with padding: logits and output features close, the K/V it writes close, pads left zero. Negative
    control: a head with other weights is far outside the same tolerance."""
    head = random_head(target.model, seed=3)
    ids = torch.tensor([[5, 9, 11, 2], [7, 3, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1]])
    feature = torch.randn(2, 4, head.config.hidden_size, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([1, 0])
    reference_cache, native_cache = head.new_cache(2, 8), head.new_cache(2, 8)
    expected, expected_out = head.step(ids, feature, positions, reference_cache, slots)
    fast = eagle.NativeHead(head)
    got, got_out = fast.step(ids, feature, positions, native_cache, slots)
    tolerance = 0.05 if fast.quantized else 1e-4  # Q8_0 weights, int8 activations: ~1% of a logit's scale
    real = positions >= 0
    scale = float(expected[real].abs().max())
    assert torch.allclose(got[real], expected[real], atol=tolerance * scale, rtol=0)
    assert torch.allclose(got_out[real], expected_out[real], atol=tolerance * float(expected_out[real].abs().max()), rtol=0)
    assert (got[~real] == 0).all() and (got_out[~real] == 0).all()
    keys = reference_cache.keys[0][:, :, :8]  # [S, H_kv, L, D] (not the padding sink at L)
    assert torch.allclose(native_cache.keys[0][:, :, :8], keys, atol=tolerance * float(keys.abs().max()), rtol=0)
    other, _ = eagle.NativeHead(random_head(target.model, seed=4)).step(ids, feature, positions, head.new_cache(2, 8), slots)
    assert not torch.allclose(other[real], expected[real], atol=tolerance * scale, rtol=0)


def test_draft_eagle_names_the_head_shipped_for_the_target(target, echo_dir, monkeypatch):
    from specgate.drafting import registry

    with pytest.raises(ValueError, match=r"no EAGLE head ships for target .*--draft eagle:DIR"):
        make_drafter("eagle", target)
    monkeypatch.setitem(registry.EAGLE_HEADS, target.name, echo_dir)
    drafter = make_drafter("eagle", target)
    assert isinstance(drafter, EagleDrafter) and drafter.head.config.draft_vocab_size == DRAFT_VOCAB
    assert registry.resolve_eagle("ngram", target.name) == "ngram"
