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
from specgate.serving.acceptance import AcceptanceStats
from specgate.serving import FixedPolicy, QueueFullError, Request, RequestTooLongError, Scheduler, TablePolicy
from specgate.serving.scheduler import LookupProposal, StepStats
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
    from specgate.serving.acceptance import FLAT_PRIOR

    scheduler = Scheduler(tiny_target, draft="none", policy=FixedPolicy(4), num_slots=1, max_seq_len=32)
    request = Request(make_prompts(1)[0], GREEDY, max_tokens=8)
    step = StepStats(accepted_per_position=[0] * 4)
    assert request.acceptance is None
    for _ in range(5):
        scheduler._record(request, 4, 4, 4, step)  # every draft accepted
    high = request.acceptance
    assert FLAT_PRIOR < high < 1.0
    for _ in range(15):
        scheduler._record(request, 4, 4, 0, step)  # first draft rejected each time: the hits fade out
    low = request.acceptance
    assert 0.0 < low < 0.2
    traffic_rate = float(scheduler.traffic_acceptance.profile(FLAT_PRIOR)[0])
    assert low < traffic_rate < FLAT_PRIOR  # the traffic estimate remembers the hits for longer
    for _ in range(60):
        scheduler._record(request, 0, 0, 0, step)  # no drafts: the evidence ages back towards the traffic prior
    assert low < request.acceptance and abs(request.acceptance - traffic_rate) < 0.02
    assert step.draft_tokens == 80 and step.accepted == 20 and step.accepted_per_position == [5, 5, 5, 5]


def test_request_estimates_are_shrunk_towards_the_traffic_by_the_prior_weight(tiny_target):
    """The policy is given each request's profile blended with request_prior_weight pseudo-tests of the traffic's
    (acceptance.REQUEST_PRIOR_WEIGHT by default, the weight that scored best in run 41): with 8, a request's
    estimate lies nearer the traffic's than with 1. Negative control: the profiles a weight-1 scheduler hands the
    policy are not the weight-8 blend of the same counts."""
    import numpy as np

    from specgate.serving.acceptance import FLAT_PRIOR, REQUEST_PRIOR_WEIGHT

    assert REQUEST_PRIOR_WEIGHT == 8.0
    gaps = {}
    for weight in (None, 1.0):
        holder = {}
        seen = {"match": 0, "other_weight_match": 0, "gap": []}

        class Recording(FixedPolicy):
            def choose(self, acceptance, caps=None):
                scheduler = holder["scheduler"]
                prior = scheduler.traffic_acceptance.profile(FLAT_PRIOR)
                other = 1.0 if weight is None else REQUEST_PRIOR_WEIGHT
                for request, given in zip(scheduler.running, acceptance):
                    if not request.acceptance_stats.observed:
                        continue
                    seen["match"] += np.allclose(given, request.acceptance_stats.profile(prior, scheduler.request_prior_weight))
                    seen["other_weight_match"] += np.allclose(given, request.acceptance_stats.profile(prior, other))
                    seen["gap"].append(abs(float(given[0]) - float(prior[0])))
                return super().choose(acceptance, caps)

        kwargs = {} if weight is None else {"request_prior_weight": weight}
        scheduler = holder["scheduler"] = Scheduler(tiny_target, draft="ngram", policy=Recording(3), num_slots=3, max_seq_len=96, **kwargs)
        assert scheduler.request_prior_weight == (REQUEST_PRIOR_WEIGHT if weight is None else weight)
        for prompt in make_prompts(3):
            scheduler.submit(Request(prompt, GREEDY, max_tokens=40, ignore_eos=True))
        scheduler.run_until_idle()
        assert seen["match"] > 20 and seen["other_weight_match"] == 0
        gaps[weight] = float(np.mean(seen["gap"]))
    assert gaps[None] < gaps[1.0]  # shrunk towards the traffic
    for bad in (0, -1.0, True, "8"):
        with pytest.raises(ValueError, match="request_prior_weight=.*must be a number > 0"):
            Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(3), num_slots=1, max_seq_len=32, request_prior_weight=bad)


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


def test_ngram_proposals_keep_the_estimate_learning_with_speculation_off(tiny_target):
    """Policy off, n-gram drafter: each step's lookup proposal (one token: the policy's max gamma is 0) is scored
    against the token the request actually produced."""
    from specgate.serving import OffPolicy
    from specgate.serving.acceptance import FLAT_PRIOR, PRIOR_WEIGHT, REQUEST_DECAY, REQUEST_PRIOR_WEIGHT, TRAFFIC_DECAY

    prompt = torch.cat([torch.tensor([1]), torch.tensor([40, 41, 42, 43]).repeat(4)])
    scheduler = Scheduler(tiny_target, draft="ngram", policy=OffPolicy(), num_slots=1, max_seq_len=64)
    request = scheduler.submit(Request(prompt, GREEDY, max_tokens=24, ignore_eos=True))
    scheduler.run_until_idle()
    assert request.stats.drafted_tokens == 0 and len(request.tokens) == 24
    accepted = tested = traffic_accepted = traffic_tested = 0.0
    for k in range(24):  # steps emit one token each; the last step (budget 1) still proposes one token
        proposal = NgramDrafter().propose(torch.cat([prompt, torch.tensor(request.tokens[:k], dtype=torch.int64)]), 1).tokens
        if proposal.numel():
            hit = float(int(proposal[0]) == request.tokens[k])
            accepted, tested = REQUEST_DECAY * accepted + hit, REQUEST_DECAY * tested + 1.0
            traffic_accepted, traffic_tested = TRAFFIC_DECAY * traffic_accepted + hit, TRAFFIC_DECAY * traffic_tested + 1.0
    assert tested > 0
    traffic_rate = (traffic_accepted + PRIOR_WEIGHT * FLAT_PRIOR) / (traffic_tested + PRIOR_WEIGHT)
    assert request.acceptance == pytest.approx((accepted + REQUEST_PRIOR_WEIGHT * traffic_rate) / (tested + REQUEST_PRIOR_WEIGHT))


def test_chunked_prefill_bounds_each_step_and_keeps_the_others_decoding(tiny_target):
    """Two long prompts join a running request; with a budget of 8 prompt tokens per step (pads included) each
    step's prefill stays within it, the running request emits at every step meanwhile, and all outputs are exact."""
    budget = 8
    short = make_prompts(1)[0]
    long_prompts = [torch.cat([torch.tensor([1]), torch.arange(20, 20 + n)]) for n in (45, 30)]
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=3, max_seq_len=96, prefill_chunk_tokens=budget)
    runner = scheduler.submit(Request(short, GREEDY, max_tokens=40, ignore_eos=True))
    scheduler.step()
    longs = [scheduler.submit(Request(p, GREEDY, max_tokens=6, ignore_eos=True)) for p in long_prompts]
    prefill_steps = 0
    while any(not r.tokens for r in longs):
        before = len(runner.tokens)
        scheduler.step()
        assert 0 < scheduler.last_prefill_tokens <= budget
        assert len(runner.tokens) > before, "the running request must not stall while prompts prefill"
        prefill_steps += 1
    assert prefill_steps >= (45 + 30) // budget  # the prompts really were spread over many steps
    scheduler.run_until_idle()
    for request in [runner, *longs]:
        assert request.tokens == reference_tokens(tiny_target, request.prompt_ids, request.max_tokens)
    with pytest.raises(ValueError, match="prefill_chunk_tokens=0"):
        Scheduler(tiny_target, prefill_chunk_tokens=0)


def test_adaptive_policy_in_the_loop_gives_per_request_gammas_and_stays_exact(tiny_target):
    """The scheduler hands the policy each request's per-position profile and its cap (n-gram drafts actually
    available, remaining budget); within one step requests get different gammas, and outputs stay exact."""
    from specgate.serving import AdaptivePolicy, CostModel

    flat = CostModel({(1, 1): 10.0, (1, 9): 10.5, (4, 1): 10.0, (4, 9): 10.5})  # width almost free: draft what you can
    policy = AdaptivePolicy(flat, gamma_max=8)
    chosen: list[list[int]] = []
    original = policy.choose
    policy.choose = lambda acceptance, caps=None: chosen.append(list(caps)) or original(acceptance, caps)  # record caps
    prompts = make_prompts(3) + [torch.arange(100, 140)]  # the last never repeats: few n-gram matches
    scheduler = Scheduler(tiny_target, draft="ngram", policy=policy, num_slots=4, max_seq_len=96)
    requests = [scheduler.submit(Request(p, GREEDY, max_tokens=18, ignore_eos=True)) for p in prompts]
    scheduler.run_until_idle()
    for request, prompt in zip(requests, prompts):
        assert request.tokens == reference_tokens(tiny_target, prompt, 18)
    assert any(len(set(caps)) > 1 for caps in chosen), "caps differ per request (drafts available, budgets)"
    steps = min(len(r.stats.gammas) for r in requests)
    assert any(len({r.stats.gammas[s] for r in requests}) > 1 for s in range(steps)), "one step, several gammas"


def test_lookup_proposals_are_scored_beyond_the_verified_drafts(tiny_target):
    """Each n-gram proposal (up to the policy's max gamma, not just the drafts verified) is scored against the
    output once known: positions the policy did not verify still get evidence, so long drafts can be learned.
    Each position counts as soon as the output decides it, once: a proposal still matching is not held back
    until it resolves (which would put its failures in the estimate before the successes made with them)."""
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=1, max_seq_len=32)
    request = Request(make_prompts(1)[0], GREEDY, max_tokens=20)
    pending = [LookupProposal(0, [5, 6, 7, 8, 9]), LookupProposal(2, [7, 9, 9])]
    stats = request.acceptance_stats  # decay 0.8 at each proposal's first counted position
    request.tokens = [5, 6, 7]  # first: 3 positions accepted, still pending; second: 1 accepted, pending
    pending = scheduler._score_proposals(request, pending, final=False)
    assert pending == [LookupProposal(0, [5, 6, 7, 8, 9], 3), LookupProposal(2, [7, 9, 9], 1)]
    assert stats.accepted[:5].tolist() == pytest.approx([1.8, 0.8, 0.8, 0.0, 0.0])
    assert stats.tested[:5].tolist() == pytest.approx([1.8, 0.8, 0.8, 0.0, 0.0])
    request.tokens = [5, 6, 7, 8, 1, 2]  # first: 4 accepted, 5th rejected; second: 9 != 8 rejected at position 2
    pending = scheduler._score_proposals(request, pending, final=False)
    assert pending == []
    # each position once, weighted as of when it was decided (positions 4-5 after the second proposal's decay)
    assert stats.accepted[:5].tolist() == pytest.approx([1.8, 0.8, 0.8, 1.0, 0.0])
    assert stats.tested[:5].tolist() == pytest.approx([1.8, 1.8, 0.8, 1.0, 1.0])
    request.tokens += [3]  # the request ends with the proposal partly known: score what is known
    pending = scheduler._score_proposals(request, [LookupProposal(6, [3, 4, 5])], final=True)
    assert pending == [] and stats.tested[0] == pytest.approx(1.8 * 0.8 + 1)
    assert stats.tested[1] == pytest.approx(1.8 * 0.8)  # position 2 undecided: untested


def test_position_by_position_scoring_removes_the_resolution_lag_bias():
    """Lookup proposals that hold resolve later than those that fail. Simulated: every step a request makes a
    proposal of 8 whose first draft holds with probability 0.9 (then the rest hold); the output advances 2 tokens
    a step. Counting whole proposals at resolution over the first 12 steps of each request (the evidence a short
    request's estimate rests on) puts position 1 well under 0.9; counting each position when decided does not."""
    import random

    def estimate(by_position: bool) -> float:
        rng, values = random.Random(0), []
        for _ in range(400):
            stats, pending, length, output = AcceptanceStats(), [], 0, []
            for step in range(12):
                start = len(output)
                holds = rng.random() < 0.9
                pending.append([start, holds, 0])
                output.extend([1, 1])
                length += 2
                keep = []
                for item in pending:
                    at, ok, counted = item
                    known = length - at
                    matched = min(known, 8) if ok else 0
                    decided = min(matched + 1, known, 8)
                    resolved = not ok or known >= 8
                    if by_position:
                        stats.observe_positions(counted, decided, matched)
                    elif resolved:
                        stats.observe(min(known, 8), matched)
                    if not resolved:
                        keep.append([at, ok, decided])
                pending = keep
                values.append(stats.profile(0.9)[0])
        return sum(values) / len(values)

    assert abs(estimate(by_position=True) - 0.9) < 0.01
    assert estimate(by_position=False) < 0.88  # negative control: the lag bias, without the fix


def test_trace_records_every_decode_step(tiny_target):
    """scheduler.trace (for benchmarks): one record per decode step; the tokens it counts are exactly the tokens
    the requests got, the batch never exceeds the slots, the width never exceeds the policy's gamma."""
    scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(3), num_slots=2, max_seq_len=96)
    scheduler.trace = []
    requests = [scheduler.submit(Request(p, GREEDY, max_tokens=12 + i, ignore_eos=True)) for i, p in enumerate(make_prompts(3))]
    scheduler.run_until_idle()
    trace = scheduler.trace
    assert sum(t["emitted"] for t in trace) == sum(len(r.tokens) for r in requests) == 12 + 13 + 14
    assert {t["batch"] for t in trace} <= {1, 2} and max(t["batch"] for t in trace) == 2
    assert all(0 <= t["width"] <= 3 and t["drafted"] <= 3 * t["batch"] for t in trace) and any(t["width"] > 0 for t in trace)
    assert all(t["step_ms"] >= t["forward_ms"] > 0 and t["draft_ms"] == 0.0 for t in trace)
    assert [t["end_s"] for t in trace] == sorted(t["end_s"] for t in trace)
    assert all(sum(t["rows_emitted"]) == t["emitted"] and len(t["rows_emitted"]) == len(t["rows_before"]) == t["batch"] for t in trace)
    firsts = [b for t in trace for b in t["rows_before"] if b == 0]
    assert len(firsts) == len(requests)  # each request's first decode step, and only that, had no tokens before it
    assert all(t["predicted_tokens"] is None and t["predicted_goodputs"] is None for t in trace)  # fixed: no model
    assert all(t["predicted_plans"] is None for t in trace)
    # per row: the request, its lookups cap, its drafts (<= cap and the gamma)
    assert {i for t in trace for i in t["rows_id"]} == {r.request_id for r in requests}
    assert all(len(t["rows_id"]) == len(t["rows_caps"]) == len(t["rows_drafts"]) == t["batch"] for t in trace)
    assert all(d <= min(c, 3) for t in trace for d, c in zip(t["rows_drafts"], t["rows_caps"])) and any(max(t["rows_drafts"]) for t in trace)
    assert all(sum(t["rows_drafts"]) == t["drafted"] for t in trace)


def test_adaptive_cost_model_learns_from_every_decode_step(tiny_target):
    """The scheduler reports each decode step's measured target time to the policy: the adaptive cost model folds
    in one observation per step and its grid moves away from a deliberately wrong calibration (1000 s a step)."""
    from specgate.serving import AdaptivePolicy, CostModel

    wrong = CostModel({(b, t): 1e6 for b in (1, 4) for t in (1, 9)})
    scheduler = Scheduler(tiny_target, draft="ngram", policy=AdaptivePolicy(wrong, gamma_max=8), num_slots=2, max_seq_len=96)
    scheduler.trace = []
    for prompt in make_prompts(2):
        scheduler.submit(Request(prompt, GREEDY, max_tokens=10, ignore_eos=True))
    scheduler.run_until_idle()
    assert wrong.observations == len(scheduler.trace) > 0
    assert all(wrong.live_correction(1, t) < 1.0 for t in range(1, 10)) and wrong.batch_factor[1] < 0.0
    # each step records the plan's prediction: expected tokens >= the rows, goodput = tokens / ms, one per width
    first = scheduler.trace[0]
    assert first["batch"] <= first["predicted_tokens"] <= first["batch"] * 9
    assert first["predicted_ms"] > 0 and len(first["predicted_goodputs"]) >= first["width"] + 1
    assert first["predicted_tokens"] / first["predicted_ms"] == pytest.approx(first["predicted_goodputs"][first["width"]], rel=1e-3)
    # and every plan's [width, drafts, target ms]: the plan that ran is priced at the step's predicted ms
    for step in scheduler.trace:
        plans = step["predicted_plans"]
        assert len(plans) == len(step["predicted_goodputs"]) and [p[0] for p in plans] == sorted({p[0] for p in plans})
        ran = [p for p in plans if p[0] == step["width"]]
        assert len(ran) == 1 and ran[0][1] == step["drafted"]
        assert ran[0][2] == pytest.approx(step["predicted_ms"], rel=1e-3, abs=0.01)


def test_lookup_tokens_sets_the_proposal_length_whatever_the_policy_drafts(tiny_target, monkeypatch):
    """lookup_tokens: n-gram proposals of that length are made and scored with a narrower policy (fixed gamma 2
    verifies 2 drafts of them), so the estimates get evidence past position 2 (up to each first miss); without it (negative control) a
    gamma-2 policy's proposals stop at 2 and positions 3.. have none. The output is the same either way (exact),
    and a bad value is refused with its name."""
    prompt = torch.cat([torch.tensor([1]), torch.tensor([40, 41, 42, 43, 44, 45]).repeat(5)])
    asked: list[int] = []
    propose = NgramDrafter.propose
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, context, k: asked.append(k) or propose(self, context, k))
    runs, lengths = {}, {}
    for lookup in (None, 8):
        asked.clear()
        scheduler = Scheduler(tiny_target, draft="ngram", policy=FixedPolicy(2), num_slots=1, max_seq_len=96, lookup_tokens=lookup)
        request = scheduler.submit(Request(prompt, GREEDY, max_tokens=30, ignore_eos=True))
        scheduler.run_until_idle()
        runs[lookup], lengths[lookup] = (request, scheduler.traffic_acceptance), max(asked)
        assert max(request.stats.gammas) <= 2
    assert runs[None][0].tokens == runs[8][0].tokens == reference_tokens(tiny_target, prompt, 30)
    assert runs[None][1].tested[2:].sum() == 0.0, "gamma 2's own proposals: no evidence past position 2"
    assert lengths == {None: 2, 8: 8}
    assert runs[8][1].tested[2:].sum() > 0.0 and runs[8][1].tested[8:].sum() == 0.0  # decided up to each first miss
    for bad in (0, 65, 2.5, True):
        with pytest.raises(ValueError, match=f"lookup_tokens={bad!r}"):
            Scheduler(tiny_target, draft="ngram", lookup_tokens=bad)
