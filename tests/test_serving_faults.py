"""Faults in the scheduler: one bad request fails alone, timeouts, drain, a failed step, and nothing leaks.

NaN/inf logits are injected by wrapping the real target model's forward so that one cache slot's rows come
back poisoned (fault injection around the real model; the scheduler under test is not mocked). After every
scenario the metrics must show no running or waiting request and no KV slot in use.
"""

import pytest
import torch

from specgate.drafting import NoDrafter
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams
from specgate.serving import FixedPolicy, Request, Scheduler
from specgate.serving.metrics import ServingMetrics
from specgate.serving.scheduler import ServerDrainingError

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")))


def prompts(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.cat([torch.tensor([1]), torch.randint(4, 512, (4 + i,), generator=generator).repeat(2)]) for i in range(count)]


def reference(target, prompt: torch.Tensor, max_tokens: int) -> list[int]:
    return generate(prompt, target, NoDrafter(), 0, GREEDY, max_new_tokens=max_tokens).tokens


def assert_idle(metrics: ServingMetrics, scheduler: Scheduler) -> None:
    text = metrics.render().decode()
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_slots_in_use"):
        assert f'specgate:{gauge}{{model_name="tiny"}} 0.0' in text, gauge
    assert not scheduler.running and not scheduler.waiting and len(scheduler.free_slots) == scheduler.num_slots
    assert not scheduler._state  # no per-request state left behind


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_logits_fail_only_that_request(tiny_target, monkeypatch, poison):
    metrics = ServingMetrics("tiny", num_slots=3)
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(3), num_slots=3, max_seq_len=64, metrics=metrics)
    requests = [scheduler.submit(Request(p, GREEDY, max_tokens=16, ignore_eos=True)) for p in prompts(3)]
    bad = requests[1]
    real_forward = tiny_target.model.forward

    def poisoned_forward(input_ids, positions, cache, slots, **kwargs):
        logits = real_forward(input_ids, positions, cache, slots, **kwargs)
        if not kwargs.get("last_only") and len(bad.tokens) >= 2:  # decode steps, once the request has output
            row = (slots == bad.slot).nonzero().flatten()
            logits[row, 0, 5] = poison  # one logit of one position is enough
        return logits

    monkeypatch.setattr(tiny_target.model, "forward", poisoned_forward)
    scheduler.run_until_idle()
    monkeypatch.undo()
    assert bad.finish_reason == "error" and "non-finite logits" in bad.error
    assert 2 <= len(bad.tokens) < 16
    assert bad.tokens == reference(tiny_target, bad.prompt_ids, 16)[: len(bad.tokens)]  # what it got is right
    for good in (requests[0], requests[2]):  # decoded in the same steps as the failed one, unharmed
        assert good.finish_reason == "length" and good.error is None
        assert good.tokens == reference(tiny_target, good.prompt_ids, 16)
    assert 'finished_reason="error"' in metrics.render().decode()
    assert_idle(metrics, scheduler)


class FakeClock:
    """The scheduler's clock: seconds pass only when the test moves `now` (timeouts do not race the host's speed)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timeouts_of_running_and_waiting_requests(tiny_target):
    metrics, clock = ServingMetrics("tiny", num_slots=1), FakeClock()
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=1, max_seq_len=64, metrics=metrics, clock=clock)
    with pytest.raises(ValueError, match="timeout_s=0"):
        scheduler.submit(Request(prompts(1)[0], GREEDY, max_tokens=4, timeout_s=0))
    running = scheduler.submit(Request(prompts(1)[0], GREEDY, max_tokens=40, ignore_eos=True, timeout_s=0.3))
    waiting = scheduler.submit(Request(prompts(2)[1], GREEDY, max_tokens=4, ignore_eos=True, timeout_s=0.2))
    patient = scheduler.submit(Request(prompts(3)[2], GREEDY, max_tokens=4, ignore_eos=True))
    scheduler.step()
    assert running.slot == 0 and len(running.tokens) >= 1
    clock.now = 0.2  # exactly the waiting request's timeout: not past it yet (control)
    scheduler.step()
    assert running.finish_reason is None and waiting.finish_reason is None and list(scheduler.waiting) == [waiting, patient]
    clock.now = 0.35  # past both timeouts
    scheduler.step()
    assert running.finish_reason == "timeout" and 1 <= len(running.tokens) < 40
    assert running.tokens == reference(tiny_target, running.prompt_ids, 40)[: len(running.tokens)]
    assert waiting.finish_reason == "timeout" and waiting.slot == -1 and waiting.tokens == []
    assert running.stats.e2e_s == pytest.approx(0.35) and waiting.stats.e2e_s == pytest.approx(0.35)  # on the scheduler's clock
    scheduler.run_until_idle()
    assert patient.finish_reason == "length" and len(patient.tokens) == 4  # the freed slot went to the next one
    assert 'specgate:request_success_total{finished_reason="timeout",model_name="tiny"} 2.0' in metrics.render().decode()
    assert_idle(metrics, scheduler)


def test_drain_refuses_new_requests_and_finishes_the_admitted_ones(tiny_target):
    metrics = ServingMetrics("tiny", num_slots=1)
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=1, max_seq_len=64, metrics=metrics)
    first = scheduler.submit(Request(prompts(1)[0], GREEDY, max_tokens=12, ignore_eos=True))
    second = scheduler.submit(Request(prompts(2)[1], GREEDY, max_tokens=6, ignore_eos=True))
    scheduler.start()
    try:
        assert not scheduler.draining
        scheduler.drain()
        assert scheduler.draining
        with pytest.raises(ServerDrainingError, match="draining"):
            scheduler.submit(Request(prompts(1)[0], GREEDY, max_tokens=4))
        assert scheduler.wait_idle(timeout_s=60)
    finally:
        scheduler.stop()
    assert first.finish_reason == second.finish_reason == "length"
    assert first.tokens == reference(tiny_target, first.prompt_ids, 12) and len(second.tokens) == 6
    assert isinstance(ServerDrainingError("x"), RuntimeError)
    assert_idle(metrics, scheduler)


def test_a_failed_step_fails_the_running_requests_and_the_loop_keeps_serving(tiny_target, monkeypatch):
    metrics = ServingMetrics("tiny", num_slots=2)
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=2, max_seq_len=64, metrics=metrics)
    real_forward = tiny_target.model.forward
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(tiny_target.model, "forward", failing_once)
    doomed = [scheduler.submit(Request(p, GREEDY, max_tokens=20, ignore_eos=True)) for p in prompts(2)]
    scheduler.start()
    try:
        assert scheduler.wait_idle(timeout_s=60)
        later = scheduler.submit(Request(prompts(1)[0], GREEDY, max_tokens=5, ignore_eos=True))
        assert scheduler.wait_idle(timeout_s=60)
    finally:
        scheduler.stop()
        monkeypatch.undo()
    for request in doomed:
        assert request.finish_reason == "error" and "injected device fault" in request.error
    assert later.finish_reason == "length" and later.tokens == reference(tiny_target, later.prompt_ids, 5)
    assert isinstance(scheduler.last_error, RuntimeError)
    assert_idle(metrics, scheduler)


def test_cancel_frees_the_slot_at_the_next_step_even_mid_prefill(tiny_target):
    metrics = ServingMetrics("tiny", num_slots=1)
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=1, max_seq_len=96, metrics=metrics, prefill_chunk_tokens=4)
    long_prompt = torch.cat([torch.tensor([1]), torch.arange(10, 50)])  # 41 tokens: 10 prefill steps of 4
    prefilling = scheduler.submit(Request(long_prompt, GREEDY, max_tokens=8))
    next_up = scheduler.submit(Request(prompts(1)[0], GREEDY, max_tokens=3, ignore_eos=True))
    scheduler.step()
    scheduler.step()
    assert prefilling.slot == 0 and prefilling.tokens == [] and scheduler.last_prefill_tokens == 4
    scheduler.cancel(prefilling.request_id)
    scheduler.step()  # drops it, frees slot 0 and admits the waiting request in the same step
    assert prefilling.finish_reason == "cancelled" and next_up.slot == 0
    scheduler.run_until_idle()
    assert next_up.tokens == reference(tiny_target, next_up.prompt_ids, 3)
    assert_idle(metrics, scheduler)
