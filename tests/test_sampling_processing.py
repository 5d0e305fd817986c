"""Temperature, top-k and top-p processing, and SamplingParams validation."""

import pytest
import torch

from specgate.sampling import SamplingParams, logits_to_probs


def test_default_params_are_plain_softmax():
    logits = torch.randn(3, 7)
    assert torch.allclose(logits_to_probs(logits, SamplingParams()), torch.softmax(logits, -1))


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))
    assert probs.dtype == torch.float32


def test_greedy_is_one_hot_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert SamplingParams(temperature=0.0).greedy
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_top_k_keeps_k_most_likely():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    probs = logits_to_probs(logits, SamplingParams(top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, False, False, True]
    expected = torch.softmax(torch.tensor([3.0, 2.5]), -1)
    assert torch.allclose(probs[0, [1, 4]], expected)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs_in = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs_in.log()
    probs = logits_to_probs(logits, SamplingParams(top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert (probs[0] > 0).tolist() == [True, False, True, False]
    assert torch.allclose(probs[0, [0, 2]], torch.tensor([0.625, 0.375]))
    probs = logits_to_probs(logits, SamplingParams(top_p=0.81))  # needs the third token too
    assert (probs[0] > 0).tolist() == [True, False, True, True]
    probs = logits_to_probs(logits, SamplingParams(top_p=0.1))  # the top token is always kept
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_processing_is_identical_for_identical_logits_and_batched():
    logits = torch.randn(2, 3, 50)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9)
    batched = logits_to_probs(logits, params)
    single = logits_to_probs(logits[1, 2], params)
    assert torch.allclose(batched[1, 2], single)
    assert torch.allclose(batched.sum(-1), torch.ones(2, 3))
    assert ((batched > 0).sum(-1) <= 10).all()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(temperature=-0.1), "temperature=-0.1"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
    ],
)
def test_bad_params_name_the_parameter(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        SamplingParams(**kwargs)
