"""The vectorised rejection sampler against the loop reference, edge cases, input errors and greedy verification."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specgate.sampling import (
    EntropyGatedLossy,
    SamplingParams,
    SparseProbs,
    SyntheticAcceptanceLossy,
    TypicalAcceptanceLossy,
    greedy_verify,
    logits_to_probs,
    rejection_sample,
    rejection_sample_logits,
    verify,
)
from specgate.models import native
from specgate.sampling.reference import reference_greedy_verify, reference_inverse_cdf, reference_rejection_sample
from specgate.sampling.verifier import block_entries, block_sums, inverse_cdf_sample, row_columns


def random_probs(gen, *shape, zero_fraction=0.3):
    """Peaked-ish distributions with some exact zeros (never an all-zero row)."""
    x = torch.rand(*shape, generator=gen) ** 3 * (torch.rand(*shape, generator=gen) >= zero_fraction)
    x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


def generators(seed, batch):
    return [torch.Generator().manual_seed(seed * 100 + b) for b in range(batch)]


def random_batch(gen, batch, gamma, vocab, *, token_only=False):
    target_probs = random_probs(gen, batch, gamma + 1, vocab)
    draft_probs = None if token_only else random_probs(gen, batch, gamma, vocab)
    num_draft_tokens = torch.randint(0, gamma + 1, (batch,), generator=gen)
    num_draft_tokens[: min(batch, 3)] = torch.tensor([0, min(1, gamma), gamma])[: min(batch, 3)]  # 0, 1, G
    draft_tokens = torch.randint(0, vocab, (batch, gamma), generator=gen)
    if draft_probs is not None:  # drafts really drawn from q, as in exact use
        draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, gamma)
    draft_tokens[torch.arange(gamma)[None, :] >= num_draft_tokens[:, None]] = -1  # padding is ignored
    return draft_tokens, num_draft_tokens, draft_probs, target_probs


def assert_same(a, b):
    assert torch.equal(a.output_tokens, b.output_tokens), (a.output_tokens, b.output_tokens)
    assert torch.equal(a.num_accepted, b.num_accepted)


@pytest.mark.parametrize("token_only", [False, True])
def test_vectorised_equals_reference_draw_for_draw(token_only):
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        batch = int(torch.randint(3, 9, (), generator=gen))
        gamma = int(torch.randint(1, 6, (), generator=gen))
        vocab = 1100 if trial % 10 == 0 else int(torch.randint(2, 60, (), generator=gen))  # multi-block CDF too
        inputs = random_batch(gen, batch, gamma, vocab, token_only=token_only)
        fast = rejection_sample(*inputs, generators(trial, batch))
        slow = reference_rejection_sample(*inputs, generators(trial, batch))
        assert_same(fast, slow)


def test_reference_agreement_includes_p_equal_q_and_high_acceptance():
    gen = torch.Generator().manual_seed(2)
    for trial in range(20):
        draft_tokens, num_draft_tokens, draft_probs, target_probs = random_batch(gen, 6, 4, 12)
        target_probs[:, :4] = draft_probs  # p == q: every draft accepted, residual all zero
        fast = rejection_sample(draft_tokens, num_draft_tokens, draft_probs, target_probs, generators(trial, 6))
        slow = reference_rejection_sample(draft_tokens, num_draft_tokens, draft_probs, target_probs, generators(trial, 6))
        assert_same(fast, slow)
        assert torch.equal(fast.num_accepted, num_draft_tokens)


def test_seeded_determinism_and_different_seeds_differ():
    gen = torch.Generator().manual_seed(3)
    inputs = random_batch(gen, 32, 4, 30)
    a = rejection_sample(*inputs, generators(7, 32))
    b = rejection_sample(*inputs, generators(7, 32))
    c = rejection_sample(*inputs, generators(8, 32))
    assert_same(a, b)
    assert not torch.equal(a.output_tokens, c.output_tokens)
    one = rejection_sample(*inputs, torch.Generator().manual_seed(5))
    two = rejection_sample(*inputs, torch.Generator().manual_seed(5))
    assert_same(one, two)


def test_each_row_consumes_exactly_n_plus_one_draws_from_its_generator():
    gen = torch.Generator().manual_seed(4)
    inputs = random_batch(gen, 5, 3, 10)
    num_draft_tokens = inputs[1]
    gens = generators(9, 5)
    rejection_sample(*inputs, gens)
    for b, g in enumerate(gens):
        fresh = torch.Generator().manual_seed(9 * 100 + b)
        torch.rand(int(num_draft_tokens[b]) + 1, dtype=torch.float64, generator=fresh)
        assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=fresh))


def test_row_outcome_does_not_depend_on_other_rows():
    gen = torch.Generator().manual_seed(5)
    inputs = random_batch(gen, 8, 3, 20)
    full = rejection_sample(*inputs, generators(11, 8))
    row = 5
    alone = rejection_sample(*(x[row : row + 1] for x in inputs), [generators(11, 8)[row]])
    assert torch.equal(full.output_tokens[row : row + 1], alone.output_tokens)


def test_output_layout_and_bonus_token():
    vocab, gamma = 6, 3
    target_probs = torch.zeros(1, gamma + 1, vocab)
    target_probs[0, :gamma, 2] = 1.0  # every draft (token 2) has p = 1: accepted
    target_probs[0, gamma, 5] = 1.0  # the bonus position puts all mass on 5
    draft_probs = torch.full((1, gamma, vocab), 1.0 / vocab)
    draft_tokens = torch.tensor([[2, 2, 2]])
    out = rejection_sample(draft_tokens, torch.tensor([3]), draft_probs, target_probs)
    assert out.output_tokens.tolist() == [[2, 2, 2, 5]]
    assert out.num_accepted.tolist() == [3] and out.num_emitted.tolist() == [4]
    assert out.lossless and out.mode == "exact"
    out = rejection_sample(draft_tokens, torch.tensor([1]), draft_probs, target_probs)  # bonus at n_b = 1
    assert out.output_tokens.tolist() == [[2, 2, -1, -1]] and out.num_accepted.tolist() == [1]


def test_zero_drafts_is_plain_target_sampling():
    vocab = 5
    target_probs = torch.zeros(3, 3, vocab)
    target_probs[:, 0, 4] = 1.0
    target_probs[:, 1:, 0] = 1.0
    out = rejection_sample(torch.full((3, 2), -1), torch.zeros(3, dtype=torch.int64), None, target_probs)
    assert out.output_tokens.tolist() == [[4, -1, -1]] * 3
    assert out.num_accepted.tolist() == [0, 0, 0]


RESIDUAL_SIGNIFICANCE = 1e-6  # chance that a correct sampler's count falls outside the interval (two-sided)


def test_rejection_emits_from_residual_and_stops():
    """p = [0.75, 0.25, 0], q = [0, 0, 1] at position 0: the draft 2 has p = 0, always rejected; residual = p. Over
    n rows the count of token 0 is Binomial(n, 0.75): it must lie in the central 1 - 1e-6 interval. Negative
    controls: the same interval excludes a uniform residual (0.5) and p read the wrong way round (0.25)."""
    from scipy.stats import binom

    n = 4000
    target_probs = torch.tensor([[[0.75, 0.25, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]]).repeat(n, 1, 1)
    draft_probs = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]]).repeat(n, 1, 1)
    draft_tokens = torch.full((n, 2), 2)
    out = rejection_sample(draft_tokens, torch.full((n,), 2), draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert (out.num_accepted == 0).all()
    assert set(out.output_tokens[:, 0].tolist()) == {0, 1}
    assert (out.output_tokens[:, 1:] == -1).all()
    low, high = binom.interval(1 - RESIDUAL_SIGNIFICANCE, n, 0.75)  # about 3000 +- 134
    zeros = int((out.output_tokens[:, 0] == 0).sum())
    assert low <= zeros <= high, (zeros, low, high)
    assert all(not low <= n * wrong <= high for wrong in (0.5, 0.25))  # the interval can tell the wrong residuals apart


def test_vocab_boundary_tokens():
    vocab = 700  # two CDF blocks: ids 0 and V-1 sit at the edges of the first and the (padded) last block
    for token in (0, vocab - 1):
        target_probs = torch.zeros(50, 2, vocab)
        target_probs[:, :, token] = 1.0
        draft_probs = torch.zeros(50, 1, vocab)
        draft_probs[:, :, token] = 1.0
        out = rejection_sample(torch.full((50, 1), token), torch.ones(50, dtype=torch.int64), draft_probs, target_probs)
        assert (out.output_tokens == token).all()
        # rejected draft at the other edge: the residual's only mass is `token`
        other = vocab - 1 - token
        draft_probs = torch.zeros(50, 1, vocab)
        draft_probs[:, :, other] = 1.0
        out = rejection_sample(torch.full((50, 1), other), torch.ones(50, dtype=torch.int64), draft_probs, target_probs)
        assert out.output_tokens[:, 0].eq(token).all() and out.output_tokens[:, 1].eq(-1).all()


def test_q_zero_at_draft_and_p_equal_q_give_no_nan():
    vocab = 4
    target_probs = torch.tensor([[[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]]])
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    out = rejection_sample(torch.tensor([[3]]), torch.tensor([1]), draft_probs, target_probs)  # q(3) = 0, p(3) > 0
    assert out.num_accepted.tolist() == [1]  # accepted with probability 1, no division by zero
    target_probs = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]])
    out = rejection_sample(torch.tensor([[2]]), torch.tensor([1]), draft_probs, target_probs)  # p(2) = q(2) = 0
    assert out.output_tokens.tolist() == [[3, -1]]
    same = torch.tensor([[[0.2, 0.3, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    out = rejection_sample(torch.tensor([[2]]), torch.tensor([1]), same[:, :1], same)  # p == q: residual empty
    assert out.num_accepted.tolist() == [1] and (out.output_tokens >= 0).all()


def test_inverse_cdf_sampler_never_emits_zero_mass_and_matches_reference():
    gen = torch.Generator().manual_seed(6)
    vocab = 1300  # three blocks, the last one padded
    dist = random_probs(gen, 64, vocab, zero_fraction=0.9)
    dist[:, -200:] = 0.0
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    uniforms[:4] = torch.tensor([0.0, 1.0 - 2**-53, 0.5, 1e-300], dtype=torch.float64)
    rows = torch.arange(64)
    totals = block_sums(lambda a, b: row_columns(dist, rows, a, b), vocab)
    tokens = inverse_cdf_sample(totals, lambda blocks: block_entries(dist, rows, blocks), uniforms, vocab)
    assert (dist[rows, tokens] > 0).all()
    expected = [reference_inverse_cdf(dist[r].tolist(), float(uniforms[r])) for r in range(64)]
    assert tokens.tolist() == expected


def test_inverse_cdf_matches_plain_float64_inverse_cdf_away_from_boundaries():
    gen = torch.Generator().manual_seed(7)
    vocab = 2000
    dist = random_probs(gen, 200, vocab)
    uniforms = torch.rand(200, dtype=torch.float64, generator=gen)
    rows = torch.arange(200)
    totals = block_sums(lambda a, b: row_columns(dist, rows, a, b), vocab)
    tokens = inverse_cdf_sample(totals, lambda blocks: block_entries(dist, rows, blocks), uniforms, vocab)
    cdf = dist.double().cumsum(-1)
    plain = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
    gap = (cdf - (uniforms * cdf[:, -1])[:, None]).abs().min(-1).values
    far = gap > 1e-6  # float32 block sums only move boundaries by ~1e-7
    assert far.sum() > 150
    assert torch.equal(tokens[far], plain[far])


def _valid_inputs():
    gen = torch.Generator().manual_seed(8)
    return random_batch(gen, 4, 3, 10)


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d.update(target_probs=d["target_probs"][:, :3]), r"target_probs has shape \[4, 3, 10\]"),
        (lambda d: d.update(draft_probs=d["draft_probs"][:, :, :9]), r"draft_probs has shape \[4, 3, 9\]"),
        (lambda d: d.update(num_draft_tokens=torch.tensor([0, 1, 4, 2])), r"num_draft_tokens contains 4; .* 0\.\.3"),
        (lambda d: d.update(num_draft_tokens=torch.tensor([0, -1, 1, 2])), r"contains -1"),
        (lambda d: d.update(num_draft_tokens=torch.tensor([0, 1, 2])), r"num_draft_tokens has shape \[3\]"),
        (lambda d: d["draft_tokens"].__setitem__((2, 0), 10), r"token id 10; .*\[0, 10\)"),
        (lambda d: d["draft_tokens"].__setitem__((2, 0), -5), r"token id -5"),
        (lambda d: d["target_probs"].__setitem__((1, 0, 3), float("nan")), r"target_probs\[1, 0\] contains NaN"),
        (lambda d: d["draft_probs"].__setitem__((2, 1, 0), -0.5), r"draft_probs\[2, 1\] contains a negative"),
        (lambda d: d["target_probs"].__setitem__((3, 0), d["target_probs"][3, 0] * 0.9), r"sums to 0\.9.*within 0\.001"),
        (lambda d: d.update(draft_tokens=d["draft_tokens"].float()), r"integer tensors"),
    ],
)
def test_malformed_input_raises_clear_error(mutate, fragment):
    draft_tokens, num_draft_tokens, draft_probs, target_probs = _valid_inputs()
    num_draft_tokens = torch.tensor([0, 1, 3, 2])
    draft_tokens = draft_tokens.clamp(min=0)
    args = dict(draft_tokens=draft_tokens, num_draft_tokens=num_draft_tokens, draft_probs=draft_probs, target_probs=target_probs)
    mutate(args)
    with pytest.raises(ValueError, match=fragment):
        rejection_sample(**args)


def test_unused_padding_rows_are_not_validated():
    draft_tokens, _, draft_probs, target_probs = _valid_inputs()
    num_draft_tokens = torch.tensor([0, 1, 3, 2])
    target_probs[0, 1:] = 0.0  # row 0 verifies no drafts: only target position 0 is used
    draft_probs[0] = float("nan")
    out = rejection_sample(draft_tokens.clamp(min=0), num_draft_tokens, draft_probs, target_probs)
    assert out.num_accepted[0] == 0


def test_generators_list_must_match_batch():
    inputs = _valid_inputs()
    with pytest.raises(ValueError, match="generators has 2 entries but the batch has B=4"):
        rejection_sample(*inputs, generators(0, 2))


def test_greedy_verify_equals_target_argmax_chain():
    gen = torch.Generator().manual_seed(9)
    batch, gamma, vocab = 12, 4, 40
    target_logits = torch.randn(batch, gamma + 1, vocab, generator=gen)
    argmax = target_logits.argmax(-1)
    num_draft_tokens = torch.randint(0, gamma + 1, (batch,), generator=gen)
    draft_tokens = argmax[:, :gamma].clone()
    wrong = torch.rand(batch, gamma, generator=gen) < 0.3  # some drafts differ from the argmax
    draft_tokens[wrong] = (draft_tokens[wrong] + 1) % vocab
    out = greedy_verify(draft_tokens, num_draft_tokens, target_logits)
    assert_same(out, reference_greedy_verify(draft_tokens, num_draft_tokens, target_logits))
    for b in range(batch):
        emitted = out.output_tokens[b, : out.num_accepted[b] + 1]
        assert torch.equal(emitted, argmax[b, : out.num_accepted[b] + 1])  # the target-only greedy chain
        k = int(out.num_accepted[b])
        assert k == num_draft_tokens[b] or draft_tokens[b, k] != argmax[b, k]
    via_verify = verify(draft_tokens, num_draft_tokens, None, target_logits, SamplingParams(temperature=0.0))
    assert_same(out, via_verify)
    one_hot = logits_to_probs(target_logits, SamplingParams(temperature=0.0))  # the rejection sampler agrees
    assert_same(out, rejection_sample(draft_tokens, num_draft_tokens, None, one_hot))
    # the scheduler hands over the argmax of its finiteness pass: the same output; a wrong one is refused
    assert_same(out, greedy_verify(draft_tokens, num_draft_tokens, target_logits, target_argmax=argmax))
    shifted = greedy_verify(draft_tokens, num_draft_tokens, target_logits, target_argmax=(argmax + 1) % vocab)
    assert not torch.equal(shifted.output_tokens, out.output_tokens)  # negative control: the argmax given is used
    with pytest.raises(ValueError, match=r"target_argmax has shape \[12, 4\]"):
        greedy_verify(draft_tokens, num_draft_tokens, target_logits, target_argmax=argmax[:, :gamma])


def test_verify_processes_logits_then_samples():
    gen = torch.Generator().manual_seed(10)
    draft_tokens, num_draft_tokens, _, _ = random_batch(gen, 6, 3, 20, token_only=True)
    target_logits = torch.randn(6, 4, 20, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=5)
    out = verify(draft_tokens, num_draft_tokens, None, target_logits, params, generators(3, 6))
    target_probs = logits_to_probs(target_logits, params)
    expected = rejection_sample(draft_tokens, num_draft_tokens, None, target_probs, generators(3, 6))
    assert_same(out, expected)
    allowed = torch.topk(target_logits, 5, dim=-1).indices  # [B, G+1, 5]
    for b in range(6):
        k = int(out.num_accepted[b])
        assert int(out.output_tokens[b, k]) in allowed[b, k].tolist()  # top-k applied to the emitted token


@pytest.mark.parametrize(
    "mode",
    [TypicalAcceptanceLossy(), SyntheticAcceptanceLossy(rates=(0.5, 0.9)), EntropyGatedLossy(entropy_threshold=0.1, top_k=3)],
)
def test_lossy_modes_are_labelled_and_keep_the_layout(mode):
    gen = torch.Generator().manual_seed(11)
    inputs = random_batch(gen, 10, 3, 15)
    out = mode.verify(*inputs, generators(1, 10))
    assert out.lossless is False and "lossy" in out.mode and "lossy" in type(mode).__name__.lower()
    emitted = out.num_accepted + 1
    assert ((out.output_tokens >= 0).sum(-1) == emitted).all()
    assert (out.num_accepted <= inputs[1]).all()
    logits = inputs[3].clamp(min=1e-9).log()
    via_verify = verify(inputs[0], inputs[1], inputs[2], logits, SamplingParams(), generators(1, 10), lossy=mode)
    assert via_verify.lossless is False


def one_draft_rows(p, token, n, q_token=None):
    """n rows of one draft `token` at a position whose target distribution is p (the bonus position too), q the
    one-hot of q_token (default: the draft itself): inputs for LossyMode.verify."""
    vocab = len(p)
    target_probs = torch.tensor([p, p], dtype=torch.float32).expand(n, 2, vocab).contiguous()  # [n, 2, V]
    draft_probs = torch.zeros(n, 1, vocab)  # [n, 1, V]
    draft_probs[:, 0, token if q_token is None else q_token] = 1.0
    return torch.full((n, 1), token), torch.ones(n, dtype=torch.int64), draft_probs, target_probs


def entropy(p):
    return -sum(x * math.log(x) for x in p if x > 0)


# (eps, delta, p, draft token, accepted?) with the threshold min(eps, delta exp(-H(p))) worked out by hand
TYPICAL_CASES = [
    # H = 0.596 nats, 0.3 exp(-H) = 0.165 > eps: the threshold is eps = 0.09
    (0.09, 0.3, [0.82, 0.091, 0.089, 0.0], 0, True),
    (0.09, 0.3, [0.82, 0.091, 0.089, 0.0], 1, True),  # 0.091 > 0.09
    (0.09, 0.3, [0.82, 0.091, 0.089, 0.0], 2, False),  # 0.089 < 0.09
    (0.09, 0.3, [0.82, 0.091, 0.089, 0.0], 3, False),  # p = 0
    # uniform over 20: H = ln 20, 0.3 / 20 = 0.015 < eps: a token of 0.05 (< eps) is accepted
    (0.09, 0.3, [0.05] * 20, 7, True),
    # eps 1 leaves the entropy term: H([0.5, 0.3, 0.2]) = 1.0297, exp(-H) = 0.3571
    (1.0, 0.7, [0.5, 0.3, 0.2], 1, True),  # threshold 0.250 < 0.3
    (1.0, 0.7, [0.5, 0.3, 0.2], 2, False),  # 0.2 < 0.250
    (1.0, 0.9, [0.5, 0.3, 0.2], 1, False),  # threshold 0.321 > 0.3
    (1.0, 0.9, [0.5, 0.3, 0.2], 0, True),
]


@pytest.mark.parametrize("eps, delta, p, token, accepted", TYPICAL_CASES)
def test_typical_acceptance_accepts_exactly_above_its_threshold(eps, delta, p, token, accepted):
    """Typical acceptance is a deterministic threshold on p(x): every row (200 rows, different uniforms) decides the
    same, and q plays no part (q is the one-hot of the draft, so the exact test would reject a p(x) < 1 draft at
    random)."""
    threshold = min(eps, delta * math.exp(-entropy(p)))
    assert (p[token] > threshold) is accepted and abs(p[token] - threshold) > 1e-3  # the table is right and not a tie
    out = TypicalAcceptanceLossy(eps=eps, delta=delta).verify(*one_draft_rows(p, token, 200), torch.Generator().manual_seed(3))
    assert out.num_accepted.tolist() == [int(accepted)] * 200


def test_typical_acceptance_stops_at_its_first_rejection_and_samples_from_p():
    """Four positions decided accept, accept, reject, accept: 2 accepted, the fourth never counts. The token at the
    rejection is drawn from p (Medusa), not from the residual (p - q)+: with q the one-hot of the rejected draft 2,
    the residual could never emit 2, p emits it with probability 0.089 (count within its 1 - 1e-6 binomial
    interval)."""
    from scipy.stats import binom

    n = 4000
    rows = [[0.82, 0.091, 0.089, 0.0]] * 4  # [G + 1, V]: the threshold is 0.09 at every position
    target_probs = torch.tensor(rows + [[0.25] * 4]).expand(n, 5, 4).contiguous()  # [n, G + 1, V]
    draft_tokens = torch.tensor([[0, 1, 2, 0]]).expand(n, 4).contiguous()  # [n, G]
    draft_probs = torch.nn.functional.one_hot(draft_tokens, 4).float()  # [n, G, V]
    out = TypicalAcceptanceLossy().verify(draft_tokens, torch.full((n,), 4), draft_probs, target_probs, torch.Generator().manual_seed(4))
    assert out.num_accepted.tolist() == [2] * n
    assert (out.output_tokens[:, :2] == torch.tensor([0, 1])).all() and (out.output_tokens[:, 3:] == -1).all()
    emitted = out.output_tokens[:, 2]
    assert set(emitted.tolist()) <= {0, 1, 2}  # p's support
    low, high = binom.interval(1 - RESIDUAL_SIGNIFICANCE, n, 0.089)
    assert low <= int((emitted == 2).sum()) <= high


def test_entropy_gated_passes_high_entropy_top_k_drafts_and_tests_the_rest_exactly():
    """EntropyGatedLossy(entropy_threshold=1.0, top_k=3), q the one-hot of the draft (the exact test accepts with
    probability p(x)). Above the threshold a top-3 draft is accepted in every row; a draft outside the top 3, and
    any draft below the threshold, is accepted at the exact rate p(x), within its 1 - 1e-6 binomial interval; a
    p = 0 draft never is. At an exact rejection the token comes from the residual (p - q)+, which excludes the
    draft."""
    from scipy.stats import binom

    n, mode = 4000, EntropyGatedLossy(entropy_threshold=1.0, top_k=3)
    high = [0.2, 0.18, 0.16, 0.14, 0.12, 0.1, 0.1, 0.0]  # H = 1.91 nats > 1; top 3: tokens 0, 1, 2
    low = [0.9, 0.06, 0.04, 0.0]  # H = 0.39 nats < 1
    assert entropy(high) > 1.0 > entropy(low)
    for p, token, rate in [(high, 0, 1.0), (high, 2, 1.0), (high, 3, 0.14), (high, 6, 0.1), (high, 7, 0.0),
                           (low, 1, 0.06), (low, 3, 0.0)]:
        out = mode.verify(*one_draft_rows(p, token, n), torch.Generator().manual_seed(token))
        accepted = int(out.num_accepted.sum())
        if rate in (0.0, 1.0):
            assert accepted == rate * n, (p, token)
        else:
            lo, hi = binom.interval(1 - RESIDUAL_SIGNIFICANCE, n, rate)
            assert lo <= accepted <= hi and accepted < 0.5 * n, (p, token, accepted)
        rejected = out.num_accepted == 0
        assert (out.output_tokens[rejected, 0] != token).all()  # from (p - q)+, which has no mass at the draft
    # the negative control of the gate: the same top-3 draft at low entropy is tested exactly (0.06 is in low's top 3)
    out = mode.verify(*one_draft_rows(low, 1, n), torch.Generator().manual_seed(9))
    assert int(out.num_accepted.sum()) < 0.1 * n


def test_synthetic_acceptance_rate_from_mean_acceptance_length():
    mode = SyntheticAcceptanceLossy.from_mean_acceptance_length(3.0, 4)
    a = mode.rates[0]
    assert math.isclose((1 - a**5) / (1 - a), 3.0, rel_tol=1e-9)
    batch, gamma, vocab = 20_000, 4, 5
    target_probs = torch.full((batch, gamma + 1, vocab), 0.2)
    out = mode.verify(torch.zeros(batch, gamma, dtype=torch.int64), torch.full((batch,), gamma), None, target_probs,
                      torch.Generator().manual_seed(0))
    assert abs(float(out.num_emitted.double().mean()) - 3.0) < 0.05  # the target mean acceptance length
    with pytest.raises(ValueError, match="mean_acceptance_length=6"):
        SyntheticAcceptanceLossy.from_mean_acceptance_length(6, 4)


def test_lossy_mode_parameters_are_validated():
    with pytest.raises(ValueError, match="eps=0"):
        TypicalAcceptanceLossy(eps=0.0)
    with pytest.raises(ValueError, match="rates="):
        SyntheticAcceptanceLossy(rates=(1.2,))
    with pytest.raises(ValueError, match="top_k=0"):
        EntropyGatedLossy(top_k=0)
    with pytest.raises(ValueError, match="not a lossy mode"):
        verify(*_valid_inputs()[:2], None, torch.zeros(4, 4, 10), SamplingParams(), lossy="typical")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 6),
    gamma=st.integers(0, 5),
    vocab=st.integers(1, 30),
    seed=st.integers(0, 2**16),
    token_only=st.booleans(),
    zero_fraction=st.floats(0.0, 0.95),
)
def test_fuzz_shapes_and_probabilities(batch, gamma, vocab, seed, token_only, zero_fraction):
    gen = torch.Generator().manual_seed(seed)
    target_probs = random_probs(gen, batch, gamma + 1, vocab, zero_fraction=zero_fraction)
    draft_probs = None if token_only else random_probs(gen, batch, gamma, vocab, zero_fraction=zero_fraction)
    num_draft_tokens = torch.randint(0, gamma + 1, (batch,), generator=gen)
    draft_tokens = torch.randint(0, vocab, (batch, gamma), generator=gen)
    inputs = (draft_tokens, num_draft_tokens, draft_probs, target_probs)
    out = rejection_sample(*inputs, generators(seed, batch))
    assert_same(out, reference_rejection_sample(*inputs, generators(seed, batch)))
    assert out.output_tokens.shape == (batch, gamma + 1)
    for b in range(batch):
        k = int(out.num_accepted[b])
        assert 0 <= k <= int(num_draft_tokens[b])
        assert torch.equal(out.output_tokens[b, :k], draft_tokens[b, :k])
        assert (out.output_tokens[b, k + 1 :] == -1).all()
        final = int(out.output_tokens[b, k])
        assert 0 <= final < vocab and target_probs[b, k, final] > 0  # never a zero-probability token


@pytest.mark.parametrize("token_only", [False, True])
def test_logits_path_equals_probability_path(token_only):
    """verify() with temperature-only params skips the [B, G+1, V] softmax; same draws, same tokens."""
    gen = torch.Generator().manual_seed(12)
    for trial in range(40):
        batch, gamma = 8, int(torch.randint(1, 6, (), generator=gen))
        vocab = 1500 if trial % 8 == 0 else int(torch.randint(2, 80, (), generator=gen))
        temperature = [1.0, 0.7, 1.6][trial % 3]
        target_logits = 3 * torch.randn(batch, gamma + 1, vocab, generator=gen)
        target_logits[torch.rand(target_logits.shape, generator=gen) < 0.2] = float("-inf")
        target_logits[..., 0] = 0.0  # at least one finite logit per row
        params = SamplingParams(temperature=temperature)
        draft_probs = logits_to_probs(target_logits[:, :gamma] + torch.randn(batch, gamma, vocab, generator=gen), params)
        draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, gamma)
        num_draft_tokens = torch.randint(0, gamma + 1, (batch,), generator=gen)
        q = None if token_only else draft_probs
        fast = verify(draft_tokens, num_draft_tokens, q, target_logits, params, generators(trial, batch))
        probs = logits_to_probs(target_logits, params)
        assert_same(fast, rejection_sample(draft_tokens, num_draft_tokens, q, probs, generators(trial, batch)))


def test_logits_path_rejects_bad_logits():
    logits = torch.zeros(2, 3, 5)
    logits[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"target_logits\[1, 0\] has maximum nan"):
        verify(torch.zeros(2, 2, dtype=torch.int64), torch.tensor([2, 1]), None, logits, SamplingParams())


def test_logits_path_with_no_draft_positions():
    gen = torch.Generator().manual_seed(13)
    target_logits = torch.randn(5, 1, 30, generator=gen)
    empty = torch.zeros(5, 0, dtype=torch.int64)
    params = SamplingParams(temperature=0.9)
    out = verify(empty, torch.zeros(5, dtype=torch.int64), torch.zeros(5, 0, 30), target_logits, params, generators(4, 5))
    probs = logits_to_probs(target_logits, params)
    assert_same(out, rejection_sample(empty, torch.zeros(5, dtype=torch.int64), None, probs, generators(4, 5)))
    assert out.output_tokens.shape == (5, 1) and (out.num_accepted == 0).all()


def random_logits_batch(gen, batch, gamma, vocab, *, q_kind):
    """Target logits (some -inf), drafts drawn from q, and q as None / dense / SparseProbs (columns shuffled, a few
    listed twice with split mass, plus columns q gives no mass)."""
    target_logits = 3 * torch.randn(batch, gamma + 1, vocab, generator=gen)
    target_logits[torch.rand(target_logits.shape, generator=gen) < 0.2] = float("-inf")
    target_logits[..., 0] = 0.0
    dense = random_probs(gen, batch, gamma, vocab)
    draft_tokens = torch.multinomial(dense.view(-1, vocab), 1, generator=gen).view(batch, gamma)
    num_draft_tokens = torch.randint(0, gamma + 1, (batch,), generator=gen)
    if q_kind == "none":
        return target_logits, draft_tokens, num_draft_tokens, None, None
    if q_kind == "dense":
        return target_logits, draft_tokens, num_draft_tokens, dense, dense
    order = torch.randperm(vocab, generator=gen)
    twice = order[: vocab // 3 + 1]
    values = torch.cat([dense[..., order], dense[..., twice]], dim=-1)
    values[..., : twice.numel()] *= 0.25
    values[..., vocab:] *= 0.75
    return target_logits, draft_tokens, num_draft_tokens, SparseProbs(values, torch.cat([order, twice])), dense


@pytest.mark.skipif(not native.available(), reason="the C verifier needs specgate's C kernels")
@pytest.mark.parametrize("q_kind", ["none", "dense", "sparse"])
def test_c_logits_path_equals_torch_logits_path_draw_for_draw(q_kind):
    """The C kernel (native.verify_rows) against the torch logits path on the same uniforms: ragged batches, -inf
    logits, temperatures, vocabularies across block boundaries; a SparseProbs q reads as its dense form."""
    gen = torch.Generator().manual_seed(21)
    for trial in range(30):
        batch, gamma = int(torch.randint(1, 9, (), generator=gen)), int(torch.randint(0, 6, (), generator=gen))
        vocab = [3, 511, 513, 1500, 40][trial % 5]
        temperature = [1.0, 0.6, 1.7][trial % 3]
        logits, drafts, counts, q, _ = random_logits_batch(gen, batch, gamma, vocab, q_kind=q_kind)
        fast = rejection_sample_logits(drafts, counts, q, logits, temperature, generators(trial, batch))
        slow = rejection_sample_logits(drafts, counts, q, logits, temperature, generators(trial, batch), kernel=False)
        assert_same(fast, slow)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=7)])
def test_sparse_q_verifies_as_its_dense_form(params):
    """verify() with q as a SparseProbs emits what it emits with the dense q (the C path reads it as it is, top-k
    makes it dense first)."""
    gen = torch.Generator().manual_seed(22)
    for trial in range(10):
        logits, drafts, counts, sparse, _ = random_logits_batch(gen, 6, 4, 600, q_kind="sparse")
        dense = sparse.to_dense(600)
        assert torch.allclose(dense.sum(-1), torch.ones(6, 4))
        assert_same(verify(drafts, counts, sparse, logits, params, generators(trial, 6)),
                    verify(drafts, counts, dense, logits, params, generators(trial, 6)))


@pytest.mark.parametrize("mutate, fragment", [
    (lambda q: SparseProbs(q.values, q.support[:-1]), r"support has shape \[\d+\]; expected int64"),
    (lambda q: SparseProbs(q.values, q.support.clone().fill_(600)), "support contains token id 600"),
    (lambda q: SparseProbs(q.values[:, :2], q.support), r"values has shape \[6, 2, \d+\]; expected \[B, G, K\] = \[6, 4, K\]"),
    (lambda q: SparseProbs(q.values * 2, q.support), r"values\[\d, \d\] sums to 2"),
])
def test_bad_sparse_q_raises_a_clear_error(mutate, fragment):
    gen = torch.Generator().manual_seed(23)
    logits, drafts, _, sparse, _ = random_logits_batch(gen, 6, 4, 600, q_kind="sparse")
    counts = torch.full((6,), 4)
    with pytest.raises(ValueError, match=fragment):
        verify(drafts, counts, mutate(sparse), logits, SamplingParams(temperature=1.0))
