"""Continuous batching is exact: every request of a ragged, staggered batch equals its single-request output.

Greedy: each request's tokens equal target-only greedy decoding (engine.generate with no drafter), with
requests of different prompt lengths joining at different steps, fewer slots than requests (so some wait),
and a gamma that changes with the batch size (table policy). Sampling with the n-gram drafter: a request's
output in a batch equals engine.generate's output for the same seed and gamma (same per-request draws).
"""

import pytest
import torch

from specgate.drafting import NgramDrafter, NoDrafter
from specgate.drafting.model_drafter import ModelDrafter
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams
from specgate.serving import FixedPolicy, QueueFullError, Request, RequestTooLongError, Scheduler, TablePolicy
from specgate.serving.metrics import ServingMetrics

GREEDY = SamplingParams(temperature=0.0)
VARYING_GAMMA = TablePolicy([(1, 1, 4), (2, 2, 1), (3, 3, 3)])  # gamma changes as requests join and leave


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")))


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama", seed=1)))


def make_prompts(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts of different lengths; each repeats a short pattern so the n-gram drafter finds matches."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        pattern = torch.randint(4, 512, (3 + i,), generator=generator)
        prompts.append(torch.cat([torch.tensor([1]), pattern.repeat(2 + i % 3)]))
    return prompts


def reference_tokens(target, prompt: torch.Tensor, max_tokens: int) -> list[int]:
    return generate(prompt, target, NoDrafter(), 0, GREEDY, max_new_tokens=max_tokens).tokens


def run_staggered(scheduler: Scheduler, requests: list[Request], join_after_steps: list[int]) -> None:
    """Submit request i once the scheduler has run join_after_steps[i] steps, then run to completion."""
    pending = sorted(zip(join_after_steps, range(len(requests))))
    while pending or scheduler.has_work:
        while pending and pending[0][0] <= scheduler.steps:
            scheduler.submit(requests[pending.pop(0)[1]])
        if not scheduler.step() and pending:  # idle before the next join: jump ahead
            scheduler.steps = pending[0][0]


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_greedy_batch_equals_single_request_target_only(tiny_target, tiny_draft, draft):
    prompts = make_prompts(5)
    max_tokens = [12, 20, 7, 16, 10]
    scheduler = Scheduler(
        tiny_target, draft=tiny_draft if draft == "model" else "ngram", policy=VARYING_GAMMA, num_slots=3, max_seq_len=64
    )
    requests = [Request(p, GREEDY, max_tokens=m, seed=i) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    run_staggered(scheduler, requests, join_after_steps=[0, 0, 2, 3, 5])
    for request, prompt, budget in zip(requests, prompts, max_tokens):
        assert request.finish_reason in ("length", "stop")
        assert request.tokens == reference_tokens(tiny_target, prompt, budget), request.request_id
    drafted = sum(r.stats.drafted_tokens for r in requests)
    accepted = sum(r.stats.accepted_tokens for r in requests)
    assert drafted > 0 and 0 <= accepted <= drafted
    assert len({g for r in requests for g in r.stats.gammas}) >= 2, "the gamma must vary across steps"
    assert scheduler.free_slots and len(scheduler.free_slots) == 3 and not scheduler.running


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_sampled_batch_matches_single_request_with_same_seed(tiny_target, tiny_draft, draft):
    """Per-request generators and params: in a mixed batch (greedy, temperature, top-k rows verified in one
    call), each request draws exactly what it draws alone through engine.generate with the same seed."""
    params = [SamplingParams(temperature=0.8), GREEDY, SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.8)]
    prompts = make_prompts(4, seed=3)
    scheduler = Scheduler(
        tiny_target, draft=tiny_draft if draft == "model" else "ngram", policy=FixedPolicy(3), num_slots=4, max_seq_len=64
    )
    requests = [Request(p, sp, max_tokens=14, seed=100 + i) for i, (p, sp) in enumerate(zip(prompts, params))]
    run_staggered(scheduler, requests, join_after_steps=[0, 1, 1, 4])

    def alone(prompt, sp, seed):
        drafter = ModelDrafter(tiny_draft, tiny_target) if draft == "model" else NgramDrafter()
        return generate(prompt, tiny_target, drafter, 3, sp, seed=seed, max_new_tokens=14).tokens

    for request, prompt in zip(requests, prompts):
        assert request.tokens == alone(prompt, request.params, request.seed), request.request_id
    assert sum(r.stats.drafted_tokens for r in requests) > 0
    # a different seed changes the output (the comparison above can fail)
    assert alone(prompts[0], params[0], 999) != requests[0].tokens


def test_admission_limits_and_cancel(tiny_target):
    metrics = ServingMetrics("tiny", num_slots=1)
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=1, max_seq_len=32, max_waiting=1, metrics=metrics)
    prompt = make_prompts(1)[0]  # 7 tokens
    with pytest.raises(RequestTooLongError, match="max_seq_len=32"):
        scheduler.submit(Request(prompt, GREEDY, max_tokens=30))
    first = scheduler.submit(Request(prompt, GREEDY, max_tokens=20, ignore_eos=True))
    second = scheduler.submit(Request(prompt, GREEDY, max_tokens=5, ignore_eos=True))
    with pytest.raises(QueueFullError, match="max-waiting 1"):
        scheduler.submit(Request(prompt, GREEDY, max_tokens=5))
    scheduler.step()
    assert first.slot == 0 and second.slot == -1 and len(scheduler.waiting) == 1
    scheduler.cancel(first.request_id)
    scheduler.step()  # drops the cancelled request, frees its slot, admits the waiting one
    assert first.finish_reason == "cancelled" and len(first.tokens) < 20
    assert second.slot == 0
    scheduler.run_until_idle()
    assert second.finish_reason == "length" and len(second.tokens) == 5
    text = metrics.render().decode()
    assert 'specgate:num_requests_rejected_total{model_name="tiny"} 1.0' in text
    assert 'finished_reason="cancelled"' in text and 'specgate:kv_slots_in_use{model_name="tiny"} 0.0' in text


@pytest.mark.slow
def test_gemma_greedy_batch_equals_target_only(gemma):
    prompts = [
        gemma.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt")["input_ids"][0],
        gemma.tokenizer("Copy: the quick brown fox. Copy: the quick", return_tensors="pt")["input_ids"][0],
    ]
    scheduler = Scheduler(gemma, draft="ngram", policy=FixedPolicy(3), num_slots=2, max_seq_len=64)
    requests = [Request(p, GREEDY, max_tokens=16) for p in prompts]
    run_staggered(scheduler, requests, join_after_steps=[0, 2])
    for request, prompt in zip(requests, prompts):
        assert request.tokens == reference_tokens(gemma, prompt, 16)
    assert sum(r.stats.drafted_tokens for r in requests) > 0


def test_acceptance_estimate_tracks_hits_and_misses_and_goes_stale(tiny_target):
    from specgate.serving.scheduler import ACCEPTANCE_PRIOR

    scheduler = Scheduler(tiny_target, draft="none", policy=FixedPolicy(4), num_slots=1, max_seq_len=32)
    request = Request(make_prompts(1)[0], GREEDY, max_tokens=8)
    step = {"num_drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": [0] * 4}
    assert request.acceptance is None
    for _ in range(5):
        scheduler._record(request, 4, 4, 4, step)  # every draft accepted
    high = request.acceptance
    assert ACCEPTANCE_PRIOR < high < 1.0
    for _ in range(15):
        scheduler._record(request, 4, 4, 0, step)  # first draft rejected each time: the hits fade out
    low = request.acceptance
    assert 0.0 < low < ACCEPTANCE_PRIOR
    for _ in range(60):
        scheduler._record(request, 0, 0, 0, step)  # no drafts: the evidence ages back towards the prior
    assert low < request.acceptance and abs(request.acceptance - ACCEPTANCE_PRIOR) < 0.05
    assert step["draft_tokens"] == 80 and step["accepted"] == 20 and step["accepted_per_position"] == [5, 5, 5, 5]


def test_lossy_mode_is_labelled_in_the_metrics(tiny_target):
    from specgate.sampling import SyntheticAcceptanceLossy

    metrics = ServingMetrics("tiny", num_slots=2)
    scheduler = Scheduler(
        tiny_target, draft="ngram", policy=FixedPolicy(3), num_slots=2, max_seq_len=64, metrics=metrics,
        lossy=SyntheticAcceptanceLossy([1.0]),  # accept every draft whatever the target thinks
    )
    requests = [scheduler.submit(Request(p, GREEDY, max_tokens=20, ignore_eos=True)) for p in make_prompts(2)]
    scheduler.run_until_idle()
    drafted = sum(r.stats.drafted_tokens for r in requests)
    assert drafted > 0 and sum(r.stats.accepted_tokens for r in requests) == drafted
    text = metrics.render().decode()
    assert f'specgate:spec_decode_num_draft_tokens_total{{lossless="false",model_name="tiny"}} {float(drafted)}' in text
    assert 'specgate:spec_decode_num_draft_tokens_total{lossless="true",model_name="tiny"} 0.0' in text
    with pytest.raises(ValueError, match="not a lossy mode"):
        Scheduler(tiny_target, lossy="typical")


def test_ngram_shadow_drafts_keep_the_estimate_learning_with_speculation_off(tiny_target):
    """Policy off, n-gram drafter: each step's would-be first draft is scored against the emitted token."""
    from specgate.serving import OffPolicy
    from specgate.serving.scheduler import ACCEPTANCE_EMA_DECAY, ACCEPTANCE_PRIOR, PRIOR_WEIGHT

    prompt = torch.cat([torch.tensor([1]), torch.tensor([40, 41, 42, 43]).repeat(4)])
    scheduler = Scheduler(tiny_target, draft="ngram", policy=OffPolicy(), num_slots=1, max_seq_len=64)
    request = scheduler.submit(Request(prompt, GREEDY, max_tokens=24, ignore_eos=True))
    scheduler.run_until_idle()
    assert request.stats.drafted_tokens == 0 and len(request.tokens) == 24
    accepted = tested = 0.0
    hits = 0
    for k in range(24):  # steps emit one token each; the last step (budget 1) still gets a shadow
        proposal = NgramDrafter().propose(torch.cat([prompt, torch.tensor(request.tokens[:k], dtype=torch.int64)]), 1).tokens
        if proposal.numel():
            hit = float(int(proposal[0]) == request.tokens[k])
            hits += int(hit)
            accepted, tested = ACCEPTANCE_EMA_DECAY * accepted + hit, ACCEPTANCE_EMA_DECAY * tested + 1.0
    assert tested > 0
    assert request.acceptance == pytest.approx((accepted + PRIOR_WEIGHT * ACCEPTANCE_PRIOR) / (tested + PRIOR_WEIGHT))
