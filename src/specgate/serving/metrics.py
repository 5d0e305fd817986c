"""Prometheus metrics of the serving engine, with vLLM's names and meanings under the `specgate:` prefix.

Counters (exported with `_total`), per scheduler step, over the requests that had >= 1 draft token:
- specgate:spec_decode_num_drafts: draft sequences verified (one per request per step with drafts);
- specgate:spec_decode_num_draft_tokens: draft tokens verified;
- specgate:spec_decode_num_accepted_tokens: draft tokens accepted;
- specgate:spec_decode_num_accepted_tokens_per_pos{position="i"}: steps that accepted the draft at position i.
  AR = accepted / draft_tokens; mean AL = 1 + accepted / drafts; per-position rate = per_pos / drafts.
Every spec-decode counter carries a `lossless` label ("true", or "false" where a lossy verifier ran).
Histograms (seconds): time_to_first_token, inter_token_latency (between token-emitting steps of a request; one
step may emit several tokens), e2e_request_latency. Gauges: num_requests_running, num_requests_waiting,
kv_slots_in_use (of kv_slots_total). Counters: num_preemptions (always 0: admission reserves a whole slot, see
specgate.serving.scheduler), num_requests_rejected (429s), request_success{finished_reason}, prompt_tokens,
generation_tokens.

Each ServingMetrics owns its CollectorRegistry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from specgate.serving.scheduler import StepStats

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

__all__ = ["CONTENT_TYPE_LATEST", "ServingMetrics"]


class ServingMetrics:
    """The hooks the Scheduler calls, backed by prometheus_client metrics in a private registry."""

    def __init__(self, model_name: str, num_slots: int) -> None:
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        spec_labels = ["model_name", "lossless"]
        self.num_drafts = Counter("specgate:spec_decode_num_drafts", "Draft sequences verified.", spec_labels, registry=registry)
        self.num_draft_tokens = Counter("specgate:spec_decode_num_draft_tokens", "Draft tokens verified.", spec_labels, registry=registry)
        self.num_accepted_tokens = Counter(
            "specgate:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec_labels, registry=registry
        )
        self.accepted_per_pos = Counter(
            "specgate:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position (marginal counts).",
            [*spec_labels, "position"],
            registry=registry,
        )
        self.ttft = Histogram(
            "specgate:time_to_first_token_seconds", "Time to first token.", ["model_name"], buckets=LATENCY_BUCKETS_S, registry=registry
        )
        self.itl = Histogram(
            "specgate:inter_token_latency_seconds",
            "Time between successive token-emitting steps of a request.",
            ["model_name"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.e2e = Histogram(
            "specgate:e2e_request_latency_seconds", "Request latency, arrival to finish.", ["model_name"], buckets=LATENCY_BUCKETS_S, registry=registry
        )
        self.running = Gauge("specgate:num_requests_running", "Requests being decoded.", ["model_name"], registry=registry)
        self.waiting = Gauge("specgate:num_requests_waiting", "Requests waiting for a KV slot.", ["model_name"], registry=registry)
        self.slots_in_use = Gauge("specgate:kv_slots_in_use", "KV cache slots held by requests.", ["model_name"], registry=registry)
        self.slots_total = Gauge("specgate:kv_slots_total", "KV cache slots in the pool.", ["model_name"], registry=registry)
        self.preemptions = Counter("specgate:num_preemptions", "Preempted requests (none by design).", ["model_name"], registry=registry)
        self.rejected = Counter("specgate:num_requests_rejected", "Requests refused with 429.", ["model_name"], registry=registry)
        self.success = Counter("specgate:request_success", "Finished requests.", ["model_name", "finished_reason"], registry=registry)
        self.prompt_tokens = Counter("specgate:prompt_tokens", "Prompt tokens of finished requests.", ["model_name"], registry=registry)
        self.generation_tokens = Counter("specgate:generation_tokens", "Generated tokens.", ["model_name"], registry=registry)
        self.slots_total.labels(model_name).set(num_slots)
        self.preemptions.labels(model_name)  # exported as 0 from the start
        self.rejected.labels(model_name)
        for lossless in ("true",):
            for counter in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
                counter.labels(model_name, lossless)

    # ---- hooks called by the Scheduler (model thread) or submit (any thread)
    def on_step(self, step: StepStats, lossless: bool) -> None:
        label = "true" if lossless else "false"
        if step.num_drafts:
            self.num_drafts.labels(self.model_name, label).inc(step.num_drafts)
            self.num_draft_tokens.labels(self.model_name, label).inc(step.draft_tokens)
            self.num_accepted_tokens.labels(self.model_name, label).inc(step.accepted)
        for position, count in enumerate(step.accepted_per_position):
            if count:
                self.accepted_per_pos.labels(self.model_name, label, str(position)).inc(count)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def on_finish(self, request: Any) -> None:
        self.success.labels(self.model_name, request.finish_reason).inc()
        self.prompt_tokens.labels(self.model_name).inc(request.prompt_len)
        self.generation_tokens.labels(self.model_name).inc(len(request.tokens))
        if request.stats.e2e_s is not None and request.finish_reason != "cancelled":
            self.e2e.labels(self.model_name).observe(request.stats.e2e_s)

    def on_rejected(self) -> None:
        self.rejected.labels(self.model_name).inc()

    def set_load(self, running: int, waiting: int, slots_in_use: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)
        self.slots_in_use.labels(self.model_name).set(slots_in_use)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
