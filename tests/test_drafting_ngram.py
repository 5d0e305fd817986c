"""The n-gram (prompt lookup) drafter against a brute-force scan of the context."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.drafting.ngram import NgramDrafter


def brute_force(tokens: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    """Longest n in max_n..min_n whose suffix occurs earlier with a successor; the most recent such occurrence."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # occurrence tokens[end-n:end], successor tokens[end]
            if tokens[end - n : end] == suffix:
                return tokens[end : end + gamma]
    return []


def test_copies_the_continuation_of_the_longest_match():
    drafter = NgramDrafter(min_n=1, max_n=3)
    drafter.begin(torch.tensor([1]), None, None, 64)
    context = torch.tensor([5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7])  # suffix 5 6 7 occurred at the start
    proposal = drafter.propose(context, 3)
    assert proposal.tokens.tolist() == [8, 9, 1]
    assert proposal.draft_probs is None and proposal.tokens.dtype == torch.int64


def test_no_match_and_gamma_zero_propose_nothing():
    drafter = NgramDrafter(min_n=2, max_n=3)
    drafter.begin(torch.tensor([1]), None, None, 64)
    assert drafter.propose(torch.tensor([1, 2, 3, 4]), 4).num_tokens == 0
    assert drafter.propose(torch.tensor([1, 2, 3, 4, 1, 2]), 0).num_tokens == 0


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    split=st.integers(1, 60),
    gamma=st.integers(1, 6),
    sizes=st.sampled_from([(1, 1), (1, 3), (2, 4), (3, 3)]),
)
def test_matches_brute_force_as_the_context_grows(tokens, split, gamma, sizes):
    min_n, max_n = sizes
    drafter = NgramDrafter(min_n=min_n, max_n=max_n)
    drafter.begin(torch.tensor(tokens[:1]), None, None, 128)
    split = min(split, len(tokens))
    for length in (split, len(tokens)):  # incremental index update must agree with a fresh scan
        got = drafter.propose(torch.tensor(tokens[:length]), gamma).tokens.tolist()
        assert got == brute_force(tokens[:length], gamma, min_n, max_n)


def test_a_new_request_resets_the_index():
    drafter = NgramDrafter()
    drafter.begin(torch.tensor([1]), None, None, 64)
    drafter.propose(torch.tensor([3, 4, 5, 3, 4]), 2)
    drafter.begin(torch.tensor([9]), None, None, 64)
    assert drafter.propose(torch.tensor([9, 8]), 2).num_tokens == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n=3, max_n=2"):
        NgramDrafter(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="min_n=0"):
        NgramDrafter(min_n=0, max_n=2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 3), st.integers(1, 3))
def test_a_stricter_floor_for_one_call_matches_a_drafter_built_with_it(tokens, min_n, floor):
    """propose(..., min_n=floor) (the EAGLE drafter's floor for sampled requests) drafts what a drafter with
    min_n = max(min_n, floor) drafts, and the brute-force scan agrees."""
    context = torch.tensor(tokens)
    drafter = NgramDrafter(min_n=min_n, max_n=3)
    drafter.begin(context, None, None, 64)
    strict = max(min_n, floor)
    expected = brute_force(tokens, 4, strict, 3)
    assert drafter.propose(context, 4, min_n=floor).tokens.tolist() == expected
    assert drafter.propose(context, 4).tokens.tolist() == brute_force(tokens, 4, min_n, 3)
