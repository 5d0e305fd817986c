"""bench/bench_multidraft.py's method (specgate.bench.multidraft): the Monte Carlo of recursive rejection sampling
without replacement against exact enumeration (with a negative control that must fail: with-replacement values),
the p / q pairing on a tiny Gemma-3 with the echo head, and the table's verdict."""

from __future__ import annotations

import dataclasses
import math

import torch
from test_eagle_drafting import echo_head

from specgate.bench.multidraft import greedy_top_k, multidraft_table, on_draft_columns, recursive_rejection, root_distributions
from specgate.models import load_model

SIGMAS = 5.0  # a check fails beyond 5 standard errors: a false alarm about once in 1.7 million runs


def exact_acceptance(p: torch.Tensor, q: torch.Tensor, replace: bool) -> list[float]:
    """P(accepted within 1 and 2 drafts) for one row p, q `# [V]`, by enumerating both draws (loops, not the code
    under test). replace: the second draft comes from q again and the residual alone moves (a different sampler)."""
    first = float(torch.minimum(p, q).sum())
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum()
    second = 0.0
    for x1 in range(q.numel()):
        if q[x1] == 0:
            continue
        rejected = 1.0 - min(1.0, float(p[x1] / q[x1]))
        proposal = q.clone()
        if not replace:
            proposal[x1] = 0.0
            proposal = proposal / proposal.sum()
        second += float(q[x1]) * rejected * float(torch.minimum(residual, proposal).sum())
    return [first, first + second]


def test_recursive_rejection_matches_enumeration_and_not_the_with_replacement_sampler():
    p = torch.tensor([0.05, 0.40, 0.30, 0.20, 0.05])
    q = torch.tensor([0.85, 0.05, 0.05, 0.03, 0.02])  # peaked: without replacement's second draft differs a lot
    rows, trials = 400, 25
    estimate = recursive_rejection(p.repeat(rows, 1), q.repeat(rows, 1), 2, trials, torch.Generator().manual_seed(0))
    exact, other = exact_acceptance(p, q, replace=False), exact_acceptance(p, q, replace=True)
    samples = rows * trials
    for j in range(2):
        error = math.sqrt(exact[j] * (1 - exact[j]) / samples)
        assert abs(estimate[j] - exact[j]) < SIGMAS * error, (j, estimate, exact)
    # negative control: the same test against the with-replacement sampler's value must fail
    assert abs(estimate[1] - other[1]) > SIGMAS * math.sqrt(other[1] * (1 - other[1]) / samples), (estimate, other)
    same = recursive_rejection(p[None], p[None], 2, 50, torch.Generator().manual_seed(1))
    assert same == [1.0, 1.0]  # q = p: the first draft is always accepted


def test_on_draft_columns_keeps_the_rest_of_the_mass_in_one_bucket():
    p = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1)
    d2t = torch.tensor([7, 2, 5])
    squeezed = on_draft_columns(p, d2t)
    assert squeezed.shape == (3, 4)
    assert torch.equal(squeezed[:, :3], p[:, d2t])
    assert torch.allclose(squeezed.sum(-1), torch.ones(3))


def test_root_distributions_pair_each_first_draft_with_the_next_target_distribution(tiny_model_dir):
    target = load_model(str(tiny_model_dir("gemma3")))
    vocab = target.model.vocab_size
    d2t = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))  # every id draftable
    head = echo_head(target.model, d2t)  # drafts what the state it reads predicts: the token of position j + 1
    texts = ["the quick brown fox jumps over the lazy dog", "a b c d e f g h"]
    p, q, top = root_distributions(target, head, texts, temperature=1.0)
    lengths = [len(target.tokenizer(text)["input_ids"]) for text in texts]
    assert p.shape == q.shape == (sum(n - 2 for n in lengths), vocab + 1)
    assert torch.allclose(p.sum(-1), torch.ones(p.shape[0]), atol=1e-4) and torch.all(q[:, -1] == 0)
    assert torch.equal(top, p[:, :-1].argmax(-1))
    # row n's p is the target after x_{j+1}; the echo head read h_j, so its top draft is the target's argmax one row
    # earlier (within a text): pairing q with p at the same position j would break this
    start = 0
    for n in lengths:
        rows = range(start + 1, start + n - 2)
        assert all(int(q[r, :-1].argmax()) == int(top[r - 1]) for r in rows)
        start += n - 2
    assert greedy_top_k(q, top, 2)[1] >= greedy_top_k(q, top, 2)[0]
    head.config = dataclasses.replace(head.config, sample_temperature=0.5)  # q as the drafter draws it: softmax(z / 0.5) ∝ q^2
    _, sharpened, _ = root_distributions(target, head, texts, temperature=1.0)
    torch.testing.assert_close(sharpened, q**2 / (q**2).sum(-1, keepdim=True), atol=1e-5, rtol=1e-4)


def test_the_table_says_a_draft_clears_the_cost_only_past_a_verified_tokens_forward_cost():
    lines = multidraft_table({"code": {"greedy": [0.40, 0.55], "T=1": [0.44, 0.50]}}, [1.0, 1.05, 1.20])
    assert "costs the forward 0.100 one-token passes" in lines[0]  # (1.20 - 1) / 2
    assert lines[3].startswith("| code | greedy | 0.400 | 0.550 | 0.150 | yes |")
    assert lines[4].startswith("| code | T=1 | 0.440 | 0.500 | 0.060 | no |")
