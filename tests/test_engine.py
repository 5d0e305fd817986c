"""engine.generate on tiny random models: greedy exactness, EOS and stop strings inside accepted drafts,
stats consistency, seeds, bad inputs, the synthetic (lossy) drafter, and the real-model lossless check."""

import json
import math

import pytest
import torch
from test_drafting_model import make_draft_dir

from specgate.drafting import NgramDrafter, NoDrafter
from specgate.drafting.model_drafter import ModelDrafter
from specgate.drafting.synthetic import SyntheticDrafter
from specgate.engine import generate
from specgate.engine.lossless_real import run_model_check
from specgate.models import load_model
from specgate.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = {"repetitive": [1, 7, 8, 9, 7, 8, 9, 7, 8], "varied": [1, 30, 12, 45, 3, 27, 19, 40, 6, 33]}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request, tiny_model_dir):
    return load_model(str(tiny_model_dir(request.param)))


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    return load_model(str(make_draft_dir(target.path, tmp_path_factory.mktemp("draft"), layers=1, seed=3)))


@pytest.fixture(scope="module")
def twin(target):
    """The target's own weights as a draft: in greedy every draft is accepted (EOS / stop inside accepted drafts)."""
    return load_model(str(target.path))


@pytest.fixture(scope="module")
def greedy_baselines(target):
    return {name: generate(p, target, NoDrafter(), 0, GREEDY, max_new_tokens=32) for name, p in PROMPTS.items()}


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_speculative_equals_target_only(target, draft, greedy_baselines, prompt, gamma):
    baseline = greedy_baselines[prompt]
    for drafter in (NgramDrafter(), ModelDrafter(draft, target)):
        result = generate(PROMPTS[prompt], target, drafter, gamma, GREEDY, max_new_tokens=32)
        assert result.tokens == baseline.tokens, drafter.name
        assert result.text == baseline.text


def test_greedy_with_an_identical_draft_accepts_everything(target, twin):
    result = generate(PROMPTS["varied"], target, ModelDrafter(twin, target), 4, GREEDY, max_new_tokens=30)
    baseline = generate(PROMPTS["varied"], target, NoDrafter(), 0, GREEDY, max_new_tokens=30)
    assert result.tokens == baseline.tokens
    assert result.stats.acceptance_rate == 1.0 and result.stats.measured_alpha == 1.0
    assert result.stats.iterations == 6  # 5 tokens per step


def test_eos_inside_accepted_drafts_ends_the_output(target, twin):
    baseline = generate(PROMPTS["varied"], target, NoDrafter(), 0, GREEDY, max_new_tokens=30, eos_ids=set())
    # declare a token of the greedy output, first seen at index k, to be EOS; with gamma 8 and every draft
    # accepted each step emits 9 tokens, so k % 9 != 8 puts it inside a step's accepted drafts
    k = max(i for i, t in enumerate(baseline.tokens[:20]) if i % 9 != 8 and baseline.tokens.index(t) == i)
    eos = baseline.tokens[k]
    result = generate(PROMPTS["varied"], target, ModelDrafter(twin, target), 8, GREEDY, max_new_tokens=30, eos_ids={eos})
    assert result.tokens == baseline.tokens[: k + 1]  # EOS included, nothing after it
    assert result.stats.finish_reason == "stop"  # OpenAI's reason for an EOS token, as for a stop string
    # the step that hit EOS had accepted drafts past it: they were produced and not emitted
    assert result.stats.accepted_tokens + result.stats.iterations > len(result.tokens)


def _stop_candidate(tokens: list[int], decode) -> tuple[str, int]:
    """A 2-character stop string from the greedy text and the index of the token that completes it."""
    full = decode(tokens)
    for k in range(19, -1, -1):  # prefer a late stop string (several steps before it), not in the last step
        before, upto = decode(tokens[:k]), decode(tokens[: k + 1])
        stop = upto[len(before) : len(before) + 2]
        if len(stop) < 2 or not upto.startswith(before):
            continue
        first = next(i for i in range(len(tokens)) if stop in decode(tokens[: i + 1]))
        if first % 9 != 8 and full.find(stop) >= 0:
            return stop, first
    raise AssertionError("no usable stop string in the greedy output")


def test_stop_string_inside_accepted_drafts_ends_the_output(target, twin):
    baseline = generate(PROMPTS["varied"], target, NoDrafter(), 0, GREEDY, max_new_tokens=30, eos_ids=set())
    decode = lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    stop, last = _stop_candidate(baseline.tokens, decode)
    full = decode(baseline.tokens)
    result = generate(PROMPTS["varied"], target, ModelDrafter(twin, target), 8, GREEDY, max_new_tokens=30, stop=[stop], eos_ids=set())
    assert result.text == full[: full.find(stop)] and stop not in result.text
    assert result.stats.finish_reason == "stop"
    assert result.tokens == baseline.tokens[: last + 1]  # up to the token that completes the stop string
    assert result.stats.accepted_tokens + result.stats.iterations > len(result.tokens)


def test_streamed_text_equals_the_final_text(target, draft):
    pieces = []
    result = generate(PROMPTS["varied"], target, ModelDrafter(draft, target), 4, SamplingParams(), seed=1, max_new_tokens=20, on_text=pieces.append)
    assert "".join(pieces) == result.text


def test_stats_add_up_and_seeds_reproduce(target, draft):
    params = SamplingParams(temperature=0.8, top_k=20)
    # seed 1: a run with accepted and rejected drafts on both families (random tiny models agree on few tokens)
    runs = [generate(PROMPTS["varied"], target, ModelDrafter(draft, target), 4, params, seed=s, max_new_tokens=40) for s in (1, 1, 2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens != runs[2].tokens
    stats = runs[0].stats
    assert stats.target_forward_passes == stats.iterations + stats.prefill_passes and stats.prefill_passes == 1
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:]))
    assert stats.draft_forward_passes == stats.drafted_tokens  # one draft pass per drafted token
    assert sum(stats.steps_by_draft_length) == stats.iterations
    assert sum(k * n for k, n in enumerate(stats.steps_by_draft_length)) == stats.drafted_tokens
    assert math.isclose(stats.acceptance_length, (stats.accepted_tokens + stats.iterations) / stats.iterations)
    assert math.isclose(stats.acceptance_rate, stats.accepted_tokens / stats.drafted_tokens)
    assert stats.new_tokens == len(runs[0].tokens) == 40 <= stats.accepted_tokens + stats.iterations
    # alpha: accepted over tested drafts (testing stops at a rejection); c: ms per draft over ms per target step
    alpha, gamma, c = stats.measured_alpha, stats.gamma, stats.measured_c
    assert gamma == 4 and 0 < stats.rejections <= stats.iterations
    assert math.isclose(alpha, stats.accepted_tokens / (stats.accepted_tokens + stats.rejections)) and 0 < alpha < 1
    assert math.isclose(c, (stats.draft_ms_total / stats.drafted_tokens) / (stats.verify_ms_total / stats.iterations)) and c > 0
    # Leviathan's closed form, written out here: E[T] = (1 - a^(g+1)) / (1 - a), S = E[T] / (g c + 1)
    expected_tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    assert math.isclose(stats.predicted_speedup, expected_tokens / (gamma * c + 1), rel_tol=1e-12)
    assert stats.lossless and stats.wall_s > 0 and stats.tokens_per_s > 0
    json.dumps(runs[0].to_dict())  # JSON-ready


def test_baseline_counts_one_token_per_target_pass(target):
    result = generate(PROMPTS["varied"], target, NoDrafter(), 0, SamplingParams(), seed=0, max_new_tokens=12)
    stats = result.stats
    assert stats.iterations == 12 and stats.target_forward_passes == 13 and stats.drafted_tokens == 0
    assert stats.acceptance_length == 1.0 and stats.acceptance_rate is None and stats.predicted_speedup is None


def test_synthetic_drafter_is_labelled_lossy(target):
    drafter = SyntheticDrafter(rates=(1.0,))
    result = generate(PROMPTS["varied"], target, drafter, 4, GREEDY, max_new_tokens=20)
    assert not result.stats.lossless and "lossy" in result.stats.drafter
    assert result.stats.acceptance_rate == 1.0  # every draft accepted regardless of p
    al = generate(PROMPTS["varied"], target, SyntheticDrafter(mean_acceptance_length=3.0, gamma=4), 4, SamplingParams(), max_new_tokens=200)
    assert 2.0 < al.stats.acceptance_length < 4.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(gamma=-1), "gamma=-1"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=10**7), "max_new_tokens=10000000 runs past"),
        (dict(prompt=[1] * 10**6), "shorten the prompt"),
        (dict(stop=[""]), "empty string"),
    ],
)
def test_bad_inputs_name_the_parameter(target, kwargs, message):
    args = dict(prompt="hello", gamma=2, max_new_tokens=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(args.pop("prompt"), target, NgramDrafter(), args.pop("gamma"), GREEDY, **args)


def uncertain_prefixes(target, params, count: int = 2, match: int = 2) -> list[list[int]]:
    """Prefixes [<s> a b c a b] (match 2; 3: [<s> a b d c a b d]): a lookup proposes c, which the target gives
    0.1..0.7 of its mass.

    A lossy verifier can only show its bias where the target is unsure about a plausible draft; a prefix
    the target is certain about would let even a wrong sampler pass.
    """
    from specgate.sampling import logits_to_probs

    generator, found = torch.Generator().manual_seed(0), []
    vocab = int(target.model.vocab_size)
    while len(found) < count:
        *m, c = (torch.randint(4, vocab, (match + 1,), generator=generator)).tolist()
        prefix = [1, *m, c, *m]
        with torch.inference_mode():
            cache = target.model.new_cache(1, len(prefix))
            logits = target.model.forward(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, torch.zeros(1, dtype=torch.int64), last_only=True)
        if 0.1 < float(logits_to_probs(logits[0], params)[c]) < 0.7:
            found.append(prefix)
    return found


@pytest.mark.parametrize("draft_kind", ["ngram", "model"])
def test_sampling_is_lossless_on_tiny_models(tiny_model_dir, tmp_path_factory, draft_kind):
    """Chi-square at fixed prefixes (Bonferroni over all cases); every negative control must be caught.

    The model draft is a one-layer copy of the target: correlated with it, not equal.
    """
    target_dir = tiny_model_dir("llama")
    target = load_model(str(target_dir))
    params = dict(temperature=1.0, top_k=20)
    prefixes = uncertain_prefixes(target, SamplingParams(**params))
    draft = "ngram"
    if draft_kind == "model":
        draft = str(make_draft_dir(target_dir, tmp_path_factory.mktemp("check_draft"), layers=1, copy_target=True))
    num_samples = 20_000 if draft_kind == "ngram" else 10_000  # the model draft samples every row: costlier
    report = run_model_check(
        target, draft, gamma=3, num_samples=num_samples, seed=0, significance=0.01, progress=False, prefixes=prefixes, **params
    )
    failed = [c for c in report["cases"] if c["verdict"] != "pass"]
    missed = [(c["name"], c["min_p_value"]) for c in report["negative_controls"] if c["verdict"] != "fail"]
    assert report["verdict"] == "pass", (failed, missed)
    assert len(report["cases"]) == 8 and len(report["negative_controls"]) == 3


def test_a_batch_of_sparse_and_one_hot_q_keeps_its_columns():
    """decode's q for a ragged batch: rows whose q is a SparseProbs on one shared support stay sparse (values on the
    support's columns, plus one column per draft of the rows without a q, one-hot there), and read densely they are
    what each row proposed; rows of another form make the batch dense."""
    from specgate.drafting.base import DraftProposal
    from specgate.engine.decode import _draft_probs
    from specgate.sampling import SparseProbs

    support = torch.tensor([5, 2, 9, 7])
    q_a = torch.softmax(torch.randn(3, 4), -1)  # [G_a, K]
    q_c = torch.softmax(torch.randn(1, 4), -1)
    proposals = [
        DraftProposal(tokens=torch.tensor([2, 9, 5]), draft_probs=SparseProbs(q_a, support)),
        DraftProposal(tokens=torch.tensor([2, 3]), draft_probs=None),  # a lookup's drafts: q one-hot
        DraftProposal(tokens=torch.tensor([7]), draft_probs=SparseProbs(q_c, support)),
        DraftProposal(tokens=torch.empty(0, dtype=torch.int64), draft_probs=None),
    ]
    batch = _draft_probs(proposals, 3, 12)
    assert isinstance(batch, SparseProbs) and batch.values.shape == (4, 3, 6)
    dense = batch.to_dense(12)  # [B, G, V]
    expected = torch.zeros(4, 3, 12)
    expected[0, :, support] = q_a
    expected[1, 0, 2] = expected[1, 1, 3] = 1.0
    expected[2, :1, support] = q_c
    torch.testing.assert_close(dense, expected)
    alone = _draft_probs(proposals[:1], 3, 12)
    assert isinstance(alone, SparseProbs) and alone.support is support and alone.values.shape == (1, 3, 4)
    mixed = proposals[:2] + [DraftProposal(tokens=torch.tensor([4]), draft_probs=torch.full((1, 12), 1 / 12))]
    dense_mixed = _draft_probs(mixed, 3, 12)
    assert isinstance(dense_mixed, torch.Tensor) and dense_mixed.shape == (3, 3, 12)
    torch.testing.assert_close(dense_mixed[:2], expected[:2])
