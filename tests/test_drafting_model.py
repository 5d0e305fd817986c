"""The model drafter: tokenizer / vocabulary checks, the subset-vocabulary id map, q, and its KV cache."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specgate.drafting.model_drafter import VOCAB_MAP_FILE, ModelDrafter
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams


def make_draft_dir(
    target_dir: Path, out_dir: Path, *, layers: int = 1, seed: int = 1, keep_ids: list[int] | None = None, copy_target: bool = False
) -> Path:
    """A draft sharing target_dir's tokenizer, with `layers` layers.

    Weights: fresh random ones (seed), or with copy_target the target's own for every tensor the draft shares
    (embeddings, the first `layers` layers, the head: a cheap draft correlated with the target). keep_ids:
    build a subset-vocabulary draft whose output i is target token keep_ids[i] (embedding and LM head rows
    sliced from the target's) and store the d2t map next to it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(seed)
    if keep_ids is not None:
        config.vocab_size = len(keep_ids)
    model = AutoModelForCausalLM.from_config(config)
    if copy_target or keep_ids is not None:
        source = AutoModelForCausalLM.from_pretrained(target_dir)
        own = model.state_dict()
        model.load_state_dict({k: v for k, v in source.state_dict().items() if k in own and v.shape == own[k].shape}, strict=False)
        if keep_ids is not None:
            keep = torch.tensor(keep_ids)
            with torch.no_grad():
                model.get_input_embeddings().weight.copy_(source.get_input_embeddings().weight[keep])
                if not config.tie_word_embeddings:
                    model.get_output_embeddings().weight.copy_(source.get_output_embeddings().weight[keep])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for path in Path(target_dir).iterdir():  # the tokenizer files: identical to the target's
        if path.is_file() and "token" in path.name or path.name == "special_tokens_map.json":
            shutil.copy(path, out_dir / path.name)
    if keep_ids is not None:
        save_file({"d2t": torch.tensor(keep_ids, dtype=torch.int64)}, str(out_dir / VOCAB_MAP_FILE))
    return out_dir


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")))


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_dir, tmp_path_factory):
    return load_model(str(make_draft_dir(tiny_model_dir("llama"), tmp_path_factory.mktemp("draft"))))


SUBSET_PROMPT = [1, 9, 13, 9, 13, 21, 9]


@pytest.fixture(scope="module")
def subset_ids(tiny_target):
    """Half the vocabulary at random, plus the special tokens and the target's greedy output (FR-Spec keeps the
    frequent tokens), so the sliced draft can agree with the target."""
    from specgate.drafting import NoDrafter

    vocab = int(tiny_target.model.vocab_size)
    generator = torch.Generator().manual_seed(0)
    rest = torch.randperm(vocab - 8, generator=generator)[: vocab // 2] + 8
    frequent = generate(SUBSET_PROMPT, tiny_target, NoDrafter(), 0, SamplingParams(temperature=0.0), max_new_tokens=24).tokens
    return sorted(set(range(8)) | set(rest.tolist()) | set(frequent))


@pytest.fixture(scope="module")
def subset_draft(tiny_model_dir, tmp_path_factory, subset_ids):
    """The target's own layers with the vocabulary sliced to subset_ids (embedding and head rows) + its d2t map."""
    out = tmp_path_factory.mktemp("subset_draft")
    return load_model(str(make_draft_dir(tiny_model_dir("llama"), out, layers=2, keep_ids=subset_ids)))


def test_a_different_tokenizer_is_refused(tiny_model_dir, tiny_target):
    other = load_model(str(tiny_model_dir("llama", tokenizer="other")))
    with pytest.raises(ValueError, match="different tokenizer"):
        ModelDrafter(other, tiny_target)


def test_q_is_the_processed_draft_distribution_on_the_target_vocabulary(tiny_target, tiny_draft):
    params = SamplingParams(temperature=0.7, top_k=5)
    drafter = ModelDrafter(tiny_draft, tiny_target)
    prompt = torch.tensor([1, 5, 9, 13, 17])
    drafter.begin(prompt, params, torch.Generator().manual_seed(0), 32)
    proposal = drafter.propose(prompt, 3)
    assert proposal.tokens.shape == (3,) and proposal.draft_probs.shape == (3, tiny_target.model.vocab_size)
    assert proposal.forward_passes == 3
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(3))
    assert ((proposal.draft_probs > 0).sum(-1) <= 5).all()  # top-k applied to q as to p
    # each q is the draft's next-token distribution after the prompt and the drafts before it, computed here
    # independently of specgate's runtime and sampling code: the checkpoint's plain transformers forward, the
    # temperature divided out by hand, the 5 largest logits kept, softmax
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_draft.path, torch_dtype=torch.float32).eval()
    for i in range(3):
        context = torch.cat([prompt, proposal.tokens[:i]])
        with torch.no_grad():
            logits = reference(context[None]).logits[0, -1].double() / 0.7  # [V]
        kept = logits >= logits.topk(5).values[-1]
        expected = torch.where(kept, logits, torch.tensor(float("-inf"), dtype=torch.float64)).softmax(-1)
        torch.testing.assert_close(proposal.draft_probs[i].double(), expected, atol=1e-5, rtol=1e-4)
        assert proposal.draft_probs[i, proposal.tokens[i]] > 0  # the draft was sampled from its q


def test_cache_reuse_after_rejection_matches_a_fresh_drafter(tiny_target, tiny_draft):
    """Rejected drafts stay in the cache at their positions; the next proposal must not depend on them."""
    params = SamplingParams(temperature=0.0)
    reused = ModelDrafter(tiny_draft, tiny_target)
    prompt = torch.tensor([1, 5, 9, 13, 17])
    reused.begin(prompt, params, None, 64)
    first = reused.propose(prompt, 4).tokens
    reused.feedback(1)
    context = torch.cat([prompt, first[:1], torch.tensor([(int(first[1]) + 1) % 50])])  # 1 accepted, then a correction
    fresh = ModelDrafter(tiny_draft, tiny_target)
    fresh.begin(prompt, params, None, 64)
    assert reused.propose(context, 4).tokens.tolist() == fresh.propose(context, 4).tokens.tolist()


def test_subset_vocabulary_q_is_scattered_into_the_target_vocabulary(tiny_target, subset_draft, subset_ids):
    drafter = ModelDrafter(subset_draft, tiny_target)
    assert drafter.d2t.tolist() == subset_ids
    prompt = torch.tensor([1, 9, 13, 9, 13])
    drafter.begin(prompt, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), 32)
    proposal = drafter.propose(prompt, 4)
    outside = torch.ones(tiny_target.model.vocab_size, dtype=torch.bool)
    outside[subset_ids] = False
    assert proposal.draft_probs[:, outside].abs().max() == 0
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(4))
    assert set(proposal.tokens.tolist()) <= set(subset_ids)


@pytest.mark.parametrize("gamma", [1, 4])
def test_subset_vocabulary_draft_is_exact_in_greedy(tiny_target, subset_draft, gamma):
    from specgate.drafting import NoDrafter

    params = SamplingParams(temperature=0.0)
    prompt = SUBSET_PROMPT
    baseline = generate(prompt, tiny_target, NoDrafter(), 0, params, max_new_tokens=24)
    speculative = generate(prompt, tiny_target, ModelDrafter(subset_draft, tiny_target), gamma, params, max_new_tokens=24)
    assert speculative.tokens == baseline.tokens
    assert speculative.stats.accepted_tokens > 0  # the sliced draft agrees with the target where it can


@pytest.mark.parametrize(
    "d2t, message",
    [
        ("wrong_length", "entries but the draft has"),
        ("out_of_range", "outside the target vocabulary"),
        ("duplicate", "one-to-one"),
        ("float", "1-D integer tensor"),
        ("missing_key", "has no tensor 'd2t'"),
    ],
)
def test_bad_vocabulary_maps_are_refused(tiny_target, subset_draft, subset_ids, tmp_path, d2t, message):
    bad_dir = tmp_path / "bad"
    shutil.copytree(subset_draft.path, bad_dir)
    ids = torch.tensor(subset_ids, dtype=torch.int64)
    tensors = {
        "wrong_length": {"d2t": ids[:-1]},
        "out_of_range": {"d2t": torch.cat([ids[:-1], torch.tensor([tiny_target.model.vocab_size])])},
        "duplicate": {"d2t": torch.cat([ids[:-1], ids[:1]])},
        "float": {"d2t": ids.float()},
        "missing_key": {"t2d": ids},
    }[d2t]
    save_file(tensors, str(bad_dir / VOCAB_MAP_FILE))
    with pytest.raises(ValueError, match=message):
        ModelDrafter(load_model(str(bad_dir)), tiny_target)


def test_the_draft_sampler_draws_from_q_and_never_a_token_q_cuts():
    """sample_draft_ids (inverse CDF, one uniform a row): 200,000 draws of a 12-token top-k q pass Pearson's
    chi-square at 0.001, never a token top-k cut; the negative control (the same counts against q with two
    tokens' probabilities swapped) must be rejected."""
    from scipy.stats import chisquare

    from specgate.drafting.model_drafter import sample_draft_ids

    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(5)) * 1.5
    params = SamplingParams(temperature=0.9, top_k=8)
    generator = torch.Generator().manual_seed(6)
    draws, q = [], None
    for _ in range(20):
        ids, q = sample_draft_ids(logits.expand(10_000, 12), params, generator)
        draws.append(ids)
    counts = torch.bincount(torch.cat(draws), minlength=12).double()
    q = q[0].double() / q[0].double().sum()  # float32 rows sum to 1 within rounding; scipy wants the totals equal
    assert float(counts[q == 0].sum()) == 0.0  # a token top-k cut is never drawn
    kept = q > 0
    expected = q[kept] * counts.sum()
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3
    order = torch.argsort(q[kept], descending=True)
    swapped = q[kept].clone()
    swapped[order[0]], swapped[order[3]] = q[kept][order[3]], q[kept][order[0]]
    assert chisquare(counts[kept].numpy(), (swapped * counts.sum()).numpy()).pvalue < 1e-6
    assert sample_draft_ids(logits, SamplingParams(temperature=0.0), None)[1] is None  # greedy: argmax, q one-hot
