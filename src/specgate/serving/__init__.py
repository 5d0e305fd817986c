"""specgate.serving: continuous-batching speculative decoding, speculation policies, metrics, an OpenAI-compatible server.

    scheduler = Scheduler(target, draft="ngram", policy=FixedPolicy(4), num_slots=8, max_seq_len=512)
    scheduler.submit(Request(prompt_ids, SamplingParams(temperature=0.0), max_tokens=32))
    scheduler.run_until_idle()          # or scheduler.start() to run the loop in a background thread
"""

from specgate.serving.policy import (
    AdaptivePolicy,
    CostModel,
    FixedPolicy,
    OffPolicy,
    SpeculationPolicy,
    TablePolicy,
    calibrate_cost_model,
    make_policy,
)
from specgate.serving.scheduler import QueueFullError, Request, RequestStats, RequestTooLongError, Scheduler

__all__ = [
    "AdaptivePolicy",
    "CostModel",
    "FixedPolicy",
    "OffPolicy",
    "QueueFullError",
    "Request",
    "RequestStats",
    "RequestTooLongError",
    "Scheduler",
    "SpeculationPolicy",
    "TablePolicy",
    "calibrate_cost_model",
    "make_policy",
]
