"""Continuous (iteration-level) batching with speculative decoding over specgate's runtime.

Requests join a bounded waiting queue, are admitted when one of `num_slots` KV-cache rows is free, prefilled,
then decoded step by step while other requests join and leave between steps. One step:

  0. expire and drop: requests past their timeout_s finish "timeout"; cancelled ones finish "cancelled".
  1. admit: move waiting requests into free slots; prefill prompts (minus the last token) in ragged target
     forwards of at most `prefill_chunk_tokens` tokens per step (chunked prefill: a long prompt is spread over
     several steps, so it delays the running requests' step by one bounded chunk, not its whole prompt). A
     request decodes from the step in which its prefill completes. The draft cache catches up lazily in step 3.
  2. policy: one gamma per decoding request (0 = no drafts), capped by its remaining budget - 1 and, for the
     n-gram drafter, by the drafts it can actually propose (proposed first: lookups are free).
  3. draft: the n-gram drafter per request, or ONE batched draft-model pass (the draft CausalLM keeps its own
     cache with the same slot per request; it re-feeds from the first position whose token changed).
  4. score: ONE batched ragged target forward; row b feeds its last committed token + its drafts at its own
     absolute positions (-1 pads shorter rows). A row whose logits are not finite (NaN/inf) fails its request
     alone (finish_reason "error", Request.error says why); the other rows go on in the same step.
  5. verify: one `greedy_verify` (every row greedy) or one `rejection_sample` / `verify` call for the whole
     batch, with one torch.Generator per request (seeded from the request's seed, like engine.generate).
  6. commit: EOS, stop strings (engine's OutputText semantics) and max_tokens end a request; its slot is freed
     at once, so a waiting request can take it at the next step. The step's time, its draft passes excepted,
     goes to policy.observe_step (the adaptive cost model corrects itself live with what a step really costs,
     lookups, verification and commit included).

Preemption: none is ever needed. Admission reserves a slot's full length, prompt + max_tokens positions
(every position a request can write, drafts included, is below that), so a running request can never run out
of KV memory; the price is that max_seq_len bounds prompt + max_tokens (longer requests are refused with a
ValueError naming the limit). The preemption counter in the metrics therefore stays 0.

Admission control: `submit` raises QueueFullError (HTTP 429) when running + waiting requests already reach
num_slots + max_waiting, RequestTooLongError (HTTP 400) when prompt + max_tokens > max_seq_len, and
ServerDrainingError (HTTP 503) after `drain()`: draining stops new submissions while the running and the
already-waiting requests finish.

finish_reason: "stop" (EOS or a stop string), "length" (max_tokens), "cancelled" (cancel()), "timeout" (past
Request.timeout_s seconds from arrival; checked at the start of each step), "error" (non-finite logits in the
request's rows, or an exception in a step, which fails every running request; Request.error says which).

Threading: one thread owns the models (`run_forever`, or a caller driving `step()` by hand). `submit` and
`cancel` may be called from any thread; a cancelled request is finished (finish_reason "cancelled") and its
slot freed at the start of the next step. Request events go to the request's `sink` callback, called on the
model thread: ("text", delta) as text becomes final, then ("done", request).

Known limits: a step's target cost is set by its longest row (drafts are padded to the longest; the adaptive
policy prices that when it chooses the per-request gammas); prefill chunks run as their own forward before the
decode forward (not fused into it); `lossy` (a specgate.sampling.lossy mode) replaces exact verification for
cost studies and is labelled lossless="false" in the metrics.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specgate.drafting.ngram import NgramDrafter
from specgate.engine.generate import OutputText, eos_token_ids
from specgate.models import native
from specgate.models.transformer import LogitsBuffer
from specgate.sampling import SamplingParams, greedy_verify, logits_to_probs, rejection_sample, verify
from specgate.serving.acceptance import FLAT_PRIOR, MAX_POSITIONS, REQUEST_PRIOR_WEIGHT, TRAFFIC_DECAY, AcceptanceStats
from specgate.serving.policy import SpeculationPolicy

# Acceptance estimates (specgate.serving.acceptance): per request and per draft position, blended with the
# traffic's estimate. Draft-model rows learn from their verified drafts; steps without drafts age the evidence
# (AcceptanceStats.age), so a request written off after a few misses drifts back to the prior and is tried again.
# Lookup (n-gram) rows learn from the WHOLE proposal (up to the policy's max gamma), scored afterwards against the
# tokens the request actually produced: draft k "would have been accepted" iff drafts 1..k equal the output
# (exact for greedy; for sampling, with q one-hot, P(output = draft) = p(draft) = P(accept), so the indicator is
# unbiased). Without this, positions beyond the chosen gamma are never tested, their estimate stays at the prior,
# and the policy never tries longer drafts (measured at concurrency 2: stuck at gamma 2 on copy-span prompts).
# A request's estimate counts request_prior_weight pseudo-tests of the traffic's profile: with one, its handful of
# own tests spread the estimates far wider than the rows' acceptance (run 41, docs/BENCHMARKS.md).
DEFAULT_PREFILL_CHUNK_TOKENS = 512


class QueueFullError(RuntimeError):
    """The waiting queue is full (HTTP 429): retry later or raise --max-waiting."""


class RequestTooLongError(ValueError):
    """prompt + max_tokens does not fit in a KV slot (HTTP 400)."""


class ServerDrainingError(RuntimeError):
    """The scheduler is draining (shutting down) and accepts no new request (HTTP 503)."""


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """One independent generator per random stream of a request (verifier = 0, drafter = 1), as engine.generate."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + stream) % (2**63))


@dataclass
class RequestStats:
    """Per-request counters and latencies (seconds, on the scheduler's clock: time.perf_counter by default)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0  # steps in which the request had >= 1 draft token (vLLM's num_drafts)
    steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    last_emit_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # time between successive token-emitting steps
    gammas: list[int] = field(default_factory=list)  # gamma the policy gave this request at each step

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens, "num_drafts": self.num_drafts,
            "steps": self.steps, "accepted_per_position": list(self.accepted_per_position), "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s, "itl_s": list(self.itl_s),
        }


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    """One generation request and its live state. Build with Scheduler.make_request or directly."""

    prompt_ids: Tensor  # [L] int64
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    seed: int = 0
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    sink: Callable[[tuple], None] | None = None
    request_id: str = ""
    timeout_s: float | None = None  # seconds from arrival; past it the request finishes with "timeout"
    # live state (owned by the model thread)
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # why, when finish_reason is "error"
    stats: RequestStats = field(default_factory=RequestStats)
    acceptance: float | None = None  # estimated chance its first draft is accepted; None before any evidence
    acceptance_stats: AcceptanceStats = field(default_factory=AcceptanceStats)  # per-position evidence

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class BatchedModelDrafter:
    """Draft tokens for many requests at once with a draft CausalLM; one cache slot per scheduler slot.

    Reuses specgate.drafting.ModelDrafter for the tokenizer check and the draft<->target vocabulary maps;
    q is each row's draft logits processed with that request's SamplingParams (None for greedy rows: one-hot).
    """

    def __init__(self, draft: Any, target: Any, num_slots: int, max_seq_len: int) -> None:
        from specgate.drafting.model_drafter import ModelDrafter

        self.maps = ModelDrafter(draft, target)
        self.name = self.maps.name
        self.model = draft.model
        self.cache = self.model.new_cache(num_slots, max_seq_len)
        self.cached_tokens = torch.full((num_slots, max_seq_len), -1, dtype=torch.int64)  # [S, L] target id per position

    def begin(self, slot: int) -> None:
        self.cached_tokens[slot] = -1

    def _feed(self, slots: list[int], chunks: list[Tensor], starts: list[int]) -> Tensor:
        """Feed each row's target-id chunk [T_b] at positions start_b..; logits of each row's last token [B, V_d']."""
        width = max(int(c.numel()) for c in chunks)
        ids = torch.zeros(len(chunks), width, dtype=torch.int64)  # [B, T]
        positions = torch.full((len(chunks), width), -1, dtype=torch.int64)  # [B, T]
        for row, (chunk, start, slot) in enumerate(zip(chunks, starts, slots)):
            n = int(chunk.numel())
            ids[row, :n] = self.maps.t2d[chunk]
            positions[row, :n] = torch.arange(start, start + n)
            self.cached_tokens[slot, start : start + n] = chunk
        logits = self.model.forward(ids, positions, self.cache, torch.tensor(slots, dtype=torch.int64), last_only=True)
        return logits[:, : self.maps.num_outputs].float()  # [B, V_d']

    def _sample(self, logits: Tensor, request: Request, generator: torch.Generator) -> tuple[int, Tensor | None]:
        """One draft token (target id) from logits [V_d'] and its q over the target vocabulary (None if greedy)."""
        if request.params.greedy:
            return int(self.maps.d2t[int(torch.argmax(logits))]), None
        probs = logits_to_probs(logits, request.params)  # [V_d']
        draft_id = int(torch.multinomial(probs, 1, generator=generator))
        if self.maps.identity_map:
            return draft_id, probs
        draft_probs = torch.zeros(self.maps.target_vocab_size, dtype=probs.dtype)  # [V_t]
        draft_probs[self.maps.d2t] = probs
        return int(self.maps.d2t[draft_id]), draft_probs

    def propose(self, requests: list[Request], contexts: list[Tensor], gammas: list[int], generators: list[torch.Generator]) -> list[tuple[list[int], list[Tensor | None]]]:
        """Draft gammas[i] tokens after contexts[i] [L_i] for each request; rows with gamma 0 get nothing."""
        out: list[tuple[list[int], list[Tensor | None]]] = [([], []) for _ in requests]
        active = [i for i, g in enumerate(gammas) if g > 0]
        if not active:
            return out
        chunks, starts = [], []
        for i in active:
            context, slot = contexts[i], requests[i].slot
            length = int(context.numel())
            differs = (self.cached_tokens[slot, :length] != context).nonzero()
            valid = min(int(differs[0]) if differs.numel() else length, length - 1)  # always feed >= 1 token
            chunks.append(context[valid:])
            starts.append(valid)
        logits = self._feed([requests[i].slot for i in active], chunks, starts)  # [B, V_d']
        rows = list(range(len(active)))
        for step in range(max(gammas[i] for i in active)):
            finite = torch.isfinite(logits).all(dim=-1)  # [B]: a row with NaN/inf draft logits stops drafting
            next_rows, next_tokens = [], []
            for row in (r for r in rows if finite[r]):
                i = active[row]
                token, q = self._sample(logits[row], requests[i], generators[i])
                out[i][0].append(token)
                out[i][1].append(q)
                if step + 1 < gammas[i]:
                    next_rows.append(row)
                    next_tokens.append(token)
            if not next_rows:
                break
            slots = [requests[active[r]].slot for r in next_rows]
            positions = [int(contexts[active[r]].numel()) + step for r in next_rows]
            chunk_list = [torch.tensor([t], dtype=torch.int64) for t in next_tokens]
            new_logits = self._feed(slots, chunk_list, positions)  # [B', V_d']
            logits = torch.zeros(len(active), new_logits.shape[1])
            logits[next_rows] = new_logits
            rows = next_rows
        return out


class Scheduler:
    """Continuous-batching speculative decoding over one target (and optionally one draft) model.

    target: specgate.models.LoadedModel. draft: "none", "ngram", or a LoadedModel (draft model sharing the
    target's tokenizer). policy: a SpeculationPolicy. num_slots: KV rows = the most requests decoded at once.
    max_seq_len: positions per slot (prompt + max_tokens must fit). max_waiting: requests allowed to wait for
    a slot beyond the running ones. metrics: an object with the specgate.serving.metrics.ServingMetrics hooks,
    or None. lossy: a specgate.sampling.lossy mode replacing exact verification (LOSSY; its steps are counted
    under lossless="false" in the metrics), or None (exact). prefill_chunk_tokens: most prompt tokens
    prefilled per step, over all admitted requests (>= 1). lookup_tokens: with n-gram drafts, the length of
    every lookup proposal (scored against the output for the acceptance estimates, whatever the policy drafts of
    it); None: the policy's max gamma (>= 1). A benchmark that swaps policies on one scheduler sets it to the
    adaptive policy's gamma_max, so that a narrower policy's steps do not leave the deep positions' estimates
    without evidence for the adaptive one (bench/bench_slices.py). request_prior_weight: pseudo-tests of the
    traffic's profile in each request's estimate (acceptance.REQUEST_PRIOR_WEIGHT: a request's few own tests are
    shrunk towards the traffic's, the weight that scored the next drafts best in run 41). clock: a function giving
    seconds, for the request times (arrival, timeouts, first token, inter-token latencies, finish; trace
    "end_s"); default time.perf_counter. Tests pass a fake one so that timeouts depend on steps, not on the host's
    speed. The step costs the policy learns from are always measured with time.perf_counter.
    """

    def __init__(
        self,
        target: Any,
        draft: Any = "none",
        policy: SpeculationPolicy | None = None,
        *,
        num_slots: int = 8,
        max_seq_len: int = 512,
        max_waiting: int = 64,
        metrics: Any = None,
        lossy: Any = None,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        lookup_tokens: int | None = None,
        request_prior_weight: float = REQUEST_PRIOR_WEIGHT,
        clock: Callable[[], float] | None = None,
    ) -> None:
        from specgate.serving.policy import OffPolicy

        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1 (--max-num-seqs: requests decoded at once)")
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} must be >= 0 (--max-waiting: requests queued for a slot)")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1 (prompt tokens prefilled per step)")
        if lookup_tokens is not None and (isinstance(lookup_tokens, bool) or not isinstance(lookup_tokens, int) or not 1 <= lookup_tokens <= MAX_POSITIONS):
            raise ValueError(f"lookup_tokens={lookup_tokens!r} must be None (the policy's max gamma) or an integer in 1..{MAX_POSITIONS} (n-gram proposal length)")
        if isinstance(request_prior_weight, bool) or not isinstance(request_prior_weight, (int, float)) or not request_prior_weight > 0:
            raise ValueError(f"request_prior_weight={request_prior_weight!r} must be a number > 0 (pseudo-tests of the traffic's acceptance in a request's estimate)")
        limit = int(target.model.max_position_embeddings)
        if not 2 <= max_seq_len <= limit:
            raise ValueError(f"max_seq_len={max_seq_len} is out of range 2..{limit} (the target's context): lower --max-seq-len")
        self.target = target
        self.policy = policy or OffPolicy()
        self.num_slots, self.max_seq_len, self.max_waiting = num_slots, max_seq_len, max_waiting
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.lookup_tokens = lookup_tokens
        self.request_prior_weight = float(request_prior_weight)
        self._logits = LogitsBuffer(target.model.vocab_size)  # the step's target logits, one block kept across steps
        self.metrics = metrics
        if lossy is not None and not callable(getattr(lossy, "verify", None)):
            raise ValueError(f"lossy={lossy!r} is not a lossy mode: pass an object from specgate.sampling.lossy or None")
        self.lossy = lossy
        self.eos_ids = eos_token_ids(target)
        self.cache = target.model.new_cache(num_slots, max_seq_len)
        if isinstance(draft, str) and draft in ("none", "ngram"):
            self.draft_kind, self.model_drafter = draft, None
        elif isinstance(draft, str):
            raise ValueError(f"draft={draft!r}: pass 'none', 'ngram' or a loaded draft model (specgate.models.load_model)")
        else:
            self.draft_kind = "model"
            self.model_drafter = BatchedModelDrafter(draft, target, num_slots, max_seq_len)
        self.draft_name = self.model_drafter.name if self.model_drafter else self.draft_kind
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self._cancelled: set[str] = set()
        self._ids = itertools.count()
        self._state: dict[str, dict[str, Any]] = {}  # request_id -> per-request objects (context, generators, ...)
        self._stop = False
        self.draining = False
        self.thread: threading.Thread | None = None
        self.steps = 0
        self.last_error: BaseException | None = None
        self.traffic_acceptance = AcceptanceStats(TRAFFIC_DECAY)  # every request's evidence: a new request's prior
        self.last_prefill_tokens = 0  # prompt tokens prefilled by the latest step (<= prefill_chunk_tokens)
        self.trace: list[dict] | None = None  # set to [] to record one dict per decode step (see _decode_step)
        self.clock = clock or time.perf_counter  # request times (see the class docstring); step costs stay on perf_counter

    # ------------------------------------------------------------------ requests (any thread)
    def validate(self, request: Request) -> None:
        """Raise RequestTooLongError / ValueError for a request this scheduler can never run."""
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens} is invalid: it must be >= 1")
        if request.prompt_len < 1:
            raise ValueError("the prompt is empty (0 tokens): give at least one token")
        if request.timeout_s is not None and not 0 < request.timeout_s < float("inf"):
            raise ValueError(f"timeout_s={request.timeout_s} is invalid: give seconds > 0, or None for no timeout")
        if request.prompt_len + request.max_tokens > self.max_seq_len:
            raise RequestTooLongError(
                f"the prompt ({request.prompt_len} tokens) + max_tokens ({request.max_tokens}) = "
                f"{request.prompt_len + request.max_tokens} exceeds the server's max_seq_len={self.max_seq_len}: "
                f"use max_tokens <= {max(self.max_seq_len - request.prompt_len, 0)} or a shorter prompt"
            )
        vocab = int(self.target.model.vocab_size)
        if int(request.prompt_ids.min()) < 0 or int(request.prompt_ids.max()) >= vocab:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1} (the model's vocabulary)")

    def submit(self, request: Request) -> Request:
        """Queue a request (any thread). Raises RequestTooLongError / ValueError or QueueFullError."""
        request.prompt_ids = torch.as_tensor(request.prompt_ids, dtype=torch.int64).flatten()
        self.validate(request)
        with self.lock:
            if self.draining:
                raise ServerDrainingError("the server is shutting down (draining) and accepts no new request: retry on another server")
            if len(self.running) + len(self.waiting) >= self.num_slots + self.max_waiting:
                if self.metrics is not None:
                    self.metrics.on_rejected()
                raise QueueFullError(
                    f"the server is full ({len(self.running)} running, {len(self.waiting)} waiting, "
                    f"--max-num-seqs {self.num_slots}, --max-waiting {self.max_waiting}): retry later"
                )
            request.request_id = request.request_id or f"req-{next(self._ids)}"
            request.stats.arrival_s = self.clock()
            self.waiting.append(request)
            self._update_gauges()
            self.lock.notify_all()
        return request

    def cancel(self, request_id: str) -> None:
        """Ask for a request to be dropped (any thread); its slot is freed at the start of the next step."""
        with self.lock:
            self._cancelled.add(request_id)
            self.lock.notify_all()

    def drain(self) -> None:
        """Stop accepting requests (any thread): later `submit` calls raise ServerDrainingError; the running and
        already-waiting requests run to completion. Use wait_idle to wait for them."""
        with self.lock:
            self.draining = True
            self.lock.notify_all()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no request is running or waiting (the loop must be running); False if timeout_s passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            while self.running or self.waiting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.lock.wait(0.05 if left is None else min(left, 0.05))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ the model thread
    def start(self) -> None:
        """Run the loop in a background thread (it owns the models)."""
        self._stop = False
        self.thread = threading.Thread(target=self.run_forever, name="specgate-scheduler", daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join(timeout_s)

    def run_forever(self) -> None:
        while True:
            with self.lock:
                while not self._stop and not (self.waiting or self.running or self._cancelled):
                    self.lock.wait(0.5)
                if self._stop:
                    return
            try:
                self.step()
            except Exception as exc:  # fail the running requests, keep serving the next ones
                self.last_error = exc
                for request in list(self.running):
                    request.error = f"the engine failed during a step: {exc!r}"
                    self._finish(request, "error")

    def step(self) -> bool:
        """One scheduler iteration. Returns False when there was nothing to do."""
        with torch.inference_mode():
            self._expire()
            self._drop_cancelled()
            self._admit()
            self._prefill()
            if not self.running:
                return False
            decoding = [r for r in self.running if self._state[r.request_id]["prefilled"] >= r.prompt_len - 1]
            if decoding:
                self._decode_step(decoding)
            self.steps += 1
            return True

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Drive step() until every submitted request has finished (synchronous use, tests)."""
        for _ in range(max_steps):
            if not self.step() and not self.has_work:
                return
        raise RuntimeError(f"requests still running after {max_steps} steps")

    # ------------------------------------------------------------------ internals
    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_load(len(self.running), len(self.waiting), self.num_slots - len(self.free_slots))

    def _expire(self) -> None:
        """Finish every waiting or running request past its timeout_s with finish_reason "timeout"."""
        now = self.clock()

        def late(request: Request) -> bool:
            return request.timeout_s is not None and now - request.stats.arrival_s > request.timeout_s

        with self.lock:
            expired = [r for r in self.waiting if late(r)]
            for request in expired:
                self.waiting.remove(request)
        for request in expired + [r for r in self.running if late(r)]:
            self._finish(request, "timeout")

    def _drop_cancelled(self) -> None:
        with self.lock:
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [r for r in self.waiting if r.request_id in cancelled]
            for request in dropped:
                self.waiting.remove(request)
        for request in dropped:
            self._finish(request, "cancelled")
        for request in [r for r in self.running if r.request_id in cancelled]:
            self._finish(request, "cancelled")

    def _admit(self) -> None:
        """Give waiting requests free slots (FIFO) and their per-request state; _prefill feeds their prompts."""
        admitted = []
        with self.lock:
            while self.waiting and self.free_slots:
                request = self.waiting.popleft()
                request.slot = self.free_slots.pop()
                admitted.append(request)
                self.running.append(request)
            self._update_gauges()
        for request in admitted:
            context = torch.zeros(self.max_seq_len, dtype=torch.int64)  # [S] prompt + committed tokens
            context[: request.prompt_len] = request.prompt_ids
            ngram = None
            if self.draft_kind == "ngram":
                ngram = NgramDrafter()
                ngram.begin(request.prompt_ids, request.params, None, self.max_seq_len)
            if self.model_drafter is not None:
                self.model_drafter.begin(request.slot)
            self._state[request.request_id] = {
                "context": context, "length": request.prompt_len, "ngram": ngram, "prefilled": 0, "proposals": [],
                "verify_gen": seeded_generator(request.seed, 0), "draft_gen": seeded_generator(request.seed, 1),
                "text": OutputText(self.target.tokenizer, list(request.stop), self._text_sink(request)),
            }

    def _prefill(self) -> None:
        """Feed the next prompt chunks (all but each prompt's last token) in one ragged forward of at most
        prefill_chunk_tokens tokens, pads included: the first unfinished prompt (FIFO) sets the width, later ones
        join with chunks no wider while rows x width stays within the budget."""
        rows: list[tuple[Request, int, int]] = []  # (request, first position, tokens)
        width = 0
        for request in self.running:
            done = self._state[request.request_id]["prefilled"]
            left = request.prompt_len - 1 - done
            if left <= 0:
                continue
            if rows and (len(rows) + 1) * width > self.prefill_chunk_tokens:
                break
            count = min(left, width if rows else self.prefill_chunk_tokens)
            rows.append((request, done, count))
            width = max(width, count)
        self.last_prefill_tokens = len(rows) * width
        if not rows:
            return
        ids = torch.zeros(len(rows), width, dtype=torch.int64)  # [B, T]
        positions = torch.full((len(rows), width), -1, dtype=torch.int64)  # [B, T]
        for row, (request, first, count) in enumerate(rows):
            ids[row, :count] = request.prompt_ids[first : first + count]
            positions[row, :count] = torch.arange(first, first + count)
        slots = torch.tensor([r.slot for r, _, _ in rows], dtype=torch.int64)  # [B]
        self.target.model.forward(ids, positions, self.cache, slots, logits=False)  # the cache only: no head pass
        for request, first, count in rows:
            self._state[request.request_id]["prefilled"] = first + count

    def _text_sink(self, request: Request) -> Callable[[str], None]:
        def on_text(delta: str) -> None:
            request.text += delta
            if request.sink is not None:
                request.sink(("text", delta))

        return on_text

    def _lookups(self, running: list[Request], states: list[dict], budgets: list[int]) -> list[list[int]] | None:
        """n-gram drafter: every row's proposal up to lookup_tokens, default the policy's max gamma (>= 1 to keep
        learning); else None."""
        if self.draft_kind != "ngram":
            return None
        longest = self.policy.max_gamma if self.lookup_tokens is None else self.lookup_tokens
        return [
            state["ngram"].propose(state["context"][: state["length"]], max(1, min(longest, budget))).tokens.tolist()
            for state, budget in zip(states, budgets)
        ]

    def _drafts(self, running: list[Request], states: list[dict], gammas: list[int], lookups: list[list[int]] | None) -> list[tuple[list[int], list[Tensor | None]]]:
        if lookups is not None:  # a shorter n-gram proposal is a prefix of a longer one
            return [(tokens[:gamma], [None] * gamma) for tokens, gamma in zip(lookups, gammas)]
        if self.model_drafter is not None:
            contexts = [s["context"][: s["length"]] for s in states]
            return self.model_drafter.propose(running, contexts, gammas, [s["draft_gen"] for s in states])
        return [([], []) for _ in running]

    def _decode_step(self, running: list[Request]) -> None:
        step_start = time.perf_counter()
        states = [self._state[r.request_id] for r in running]
        # 2. policy: per-request gamma, capped by the remaining budget and (lookups) by the drafts available
        budgets = [r.max_tokens - len(r.tokens) - 1 for r in running]  # drafts past it could never be emitted
        lookups = self._lookups(running, states, budgets)
        caps = budgets if lookups is None else [min(len(tokens), b) for tokens, b in zip(lookups, budgets)]
        prior = self.traffic_acceptance.profile(FLAT_PRIOR)  # [K]
        gammas = self.policy.choose([r.acceptance_stats.profile(prior, self.request_prior_weight) for r in running], caps)
        gammas = [max(0, min(int(g), cap)) for g, cap in zip(gammas, caps)]
        # 3. drafts; every lookup proposal is kept to be scored against the output (see the module comment)
        draft_start = time.perf_counter()
        drafts = self._drafts(running, states, gammas, lookups)
        draft_s = time.perf_counter() - draft_start if self.model_drafter is not None else 0.0
        for request, state, proposal in zip(running, states, lookups or []):
            if proposal:
                state["proposals"].append((len(request.tokens), proposal, 0))
        num_drafts = [len(tokens) for tokens, _ in drafts]
        width = max(num_drafts)
        # 4. one ragged target forward: last committed token + drafts, at each row's own positions
        batch = len(running)
        ids = torch.zeros(batch, width + 1, dtype=torch.int64)  # [B, G+1]
        positions = torch.full((batch, width + 1), -1, dtype=torch.int64)  # [B, G+1]
        draft_tokens = torch.zeros(batch, width, dtype=torch.int64)  # [B, G]
        for row, (state, (tokens, _)) in enumerate(zip(states, drafts)):
            length = state["length"]
            ids[row, 0] = state["context"][length - 1]
            ids[row, 1 : 1 + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            draft_tokens[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            positions[row, : 1 + len(tokens)] = torch.arange(length - 1, length + len(tokens))
        slots = torch.tensor([r.slot for r in running], dtype=torch.int64)  # [B]
        forward_start = time.perf_counter()
        target_logits = self.target.model.forward(ids, positions, self.cache, slots, out=self._logits.view(batch, width + 1))  # [B, G+1, V]; read by the verification below, never after
        # (a fresh 80 MB block per step, 16 requests x 5 positions x Gemma's 262,144, page-faults ~19 ms)
        forward_s = time.perf_counter() - forward_start
        peak, target_argmax = native.max_argmax(target_logits)  # [B, G+1] each: one pass for the check and greedy
        keep = self._fail_non_finite(running, peak, positions)
        if len(keep) < batch:
            if not keep:
                return
            index = torch.tensor(keep, dtype=torch.int64)
            running, states, drafts = [running[i] for i in keep], [states[i] for i in keep], [drafts[i] for i in keep]
            gammas, num_drafts = [gammas[i] for i in keep], [num_drafts[i] for i in keep]
            caps = [caps[i] for i in keep]
            draft_tokens, target_logits, target_argmax = draft_tokens[index], target_logits[index], target_argmax[index]
        # 5. one batched verification with per-request generators
        result = self._verify(running, states, drafts, draft_tokens, torch.tensor(num_drafts), target_logits, target_argmax)
        # 6. commit
        now = self.clock()
        step_stats = {"num_drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": [0] * width}
        committed = 0
        rows_emitted, rows_before = [], []  # per row: tokens committed now, tokens it had before (0: its first)
        for row, request in enumerate(running):
            accepted = int(result.num_accepted[row])
            emitted = result.output_tokens[row, : accepted + 1].tolist()
            self._record(request, gammas[row], num_drafts[row], accepted, step_stats)
            before = len(request.tokens)
            self._commit(request, states[row], emitted, now)
            rows_emitted.append(len(request.tokens) - before)
            rows_before.append(before)
            committed += rows_emitted[-1]
        if self.metrics is not None:
            self.metrics.on_step(step_stats, lossless=bool(result.lossless))
        # the adaptive cost model learns the whole step but its draft passes (priced on their own): the lookups,
        # the forward, the verification and the commit, which grow with the tokens a step scores and emits
        step_ms = 1e3 * (time.perf_counter() - step_start - draft_s)
        self.policy.observe_step(batch, width + 1, step_ms, committed if len(running) == batch else None)
        self._update_gauges()
        if self.trace is not None:  # one record per decode step, for benchmarks (times in ms)
            predicted = getattr(self.policy, "last_prediction", None)  # adaptive: the plan's (tokens, ms)
            self.trace.append({
                "predicted_tokens": None if predicted is None else predicted[0],
                "predicted_ms": None if predicted is None else predicted[1],
                "predicted_goodputs": None if predicted is None else predicted[2],
                "end_s": now, "batch": batch, "width": width, "drafted": sum(num_drafts),
                "emitted": committed, "rows_emitted": rows_emitted, "rows_before": rows_before,
                "step_ms": 1e3 * (time.perf_counter() - step_start),
                "forward_ms": 1e3 * forward_s, "draft_ms": 1e3 * draft_s, "prefill_tokens": self.last_prefill_tokens,
                # what the policy was given and ran, per row (for counterfactuals offline: bench/bench_counterfactual.py)
                "rows_id": [r.request_id for r in running], "rows_caps": caps, "rows_drafts": num_drafts,
                "predicted_plans": self.policy.plans_priced() if hasattr(self.policy, "plans_priced") else None,
            })

    def _fail_non_finite(self, running: list[Request], peak: Tensor, positions: Tensor) -> list[int]:
        """Finish with "error" every request whose scored rows hold NaN/inf logits; the rows to keep.

        peak `# [B, G+1]`: the logits' max over the vocabulary, NaN if any logit is NaN and +inf if any is +inf
        (native.max_argmax: one multi-threaded pass, no [B, T, V] mask); a -inf logit alone is a legal zero
        probability. Pad positions (-1) are not checked.
        """
        finite = (torch.isfinite(peak) | (positions < 0)).all(dim=1)  # [B]
        if bool(finite.all()):
            return list(range(len(running)))
        for row in (~finite).nonzero().flatten().tolist():
            request = running[row]
            request.error = (
                f"the target model produced non-finite logits (NaN or inf) for this request at position "
                f"{int(positions[row, 0])}; the request was stopped, other requests are unaffected"
            )
            self._finish(request, "error")
        return finite.nonzero().flatten().tolist()

    def _verify(self, running, states, drafts, draft_tokens: Tensor, num_drafts: Tensor, target_logits: Tensor, target_argmax: Tensor):
        params = [r.params for r in running]
        generators = [s["verify_gen"] for s in states]
        if all(p.greedy for p in params) and self.lossy is None:
            return greedy_verify(draft_tokens, num_drafts, target_logits, target_argmax=target_argmax)
        width = draft_tokens.shape[1]
        has_q = any(q is not None for _, qs in drafts for q in qs)
        draft_probs = None
        if has_q and width > 0:
            vocab = target_logits.shape[-1]
            draft_probs = torch.zeros(len(running), width, vocab)  # [B, G, V] (one-hot where a row has no q)
            for row, (tokens, qs) in enumerate(drafts):
                for i, (token, q) in enumerate(zip(tokens, qs)):
                    if q is None:
                        draft_probs[row, i, token] = 1.0
                    else:
                        draft_probs[row, i] = q
        if self.lossy is not None:  # labelled LOSSY verification: output.lossless is False
            target_probs = torch.stack([logits_to_probs(target_logits[row], p) for row, p in enumerate(params)])  # [B, G+1, V]
            return self.lossy.verify(draft_tokens, num_drafts, draft_probs, target_probs, generators)
        if all(p == params[0] for p in params):
            return verify(draft_tokens, num_drafts, draft_probs, target_logits, params[0], generators)
        target_probs = torch.stack([logits_to_probs(target_logits[row], p) for row, p in enumerate(params)])  # [B, G+1, V]
        return rejection_sample(draft_tokens, num_drafts, draft_probs, target_probs, generators)

    def _score_proposals(self, request: Request, state: dict, final: bool) -> None:
        """Score the pending lookup proposals (start index in request.tokens, tokens, positions counted) against
        the output so far. Each position counts as soon as the output decides it (AcceptanceStats.observe_positions);
        a proposal leaves at its first mismatch, once fully covered, or when the request ends.

        Position by position, not once resolved: a proposal that fails resolves at its mismatch, one that holds
        only once the output covers it (up to 8 tokens, 2-4 steps later), so counting whole proposals at
        resolution put the recent failures in a request's estimate before the successes made with them. Measured
        (bench/bench_acceptance.py, Gemma-3-270M, bench prompts, concurrency 4, adaptive, resolution counting):
        position 1 estimated 0.856 on average against 0.892 accepted, and where the policy chose width 1, width 3's
        accepted drafts predicted 1.67 per row against 1.86 (docs/BENCHMARKS.md, Serving, diag 17)."""
        pending = []
        for start, proposal, counted in state["proposals"]:
            known = request.tokens[start : start + len(proposal)]
            matched = next((k for k, (a, b) in enumerate(zip(known, proposal)) if a != b), len(known))
            decided = min(matched + 1, len(known))  # positions 1..matched accepted, matched + 1 rejected if known
            request.acceptance_stats.observe_positions(counted, decided, matched)
            self.traffic_acceptance.observe_positions(counted, decided, matched)
            if not (matched < len(known) or len(known) == len(proposal) or final):
                pending.append((start, proposal, decided))
        state["proposals"] = pending
        request.acceptance = request.acceptance_stats.first_rate(self.traffic_acceptance.first_rate(FLAT_PRIOR), self.request_prior_weight)

    def _record(self, request: Request, gamma: int, drafted: int, accepted: int, step_stats: dict) -> None:
        stats = request.stats
        stats.steps += 1
        stats.gammas.append(gamma)
        if drafted == 0:
            if request.acceptance_stats.observed and self.draft_kind != "ngram":  # n-gram rows: _score_proposals
                request.acceptance_stats.age()
                request.acceptance = request.acceptance_stats.first_rate(self.traffic_acceptance.first_rate(FLAT_PRIOR), self.request_prior_weight)
            return
        stats.num_drafts += 1
        stats.drafted_tokens += drafted
        stats.accepted_tokens += accepted
        if len(stats.accepted_per_position) < accepted:
            stats.accepted_per_position.extend([0] * (accepted - len(stats.accepted_per_position)))
        for position in range(accepted):
            stats.accepted_per_position[position] += 1
            step_stats["accepted_per_position"][position] += 1
        step_stats["num_drafts"] += 1
        step_stats["draft_tokens"] += drafted
        step_stats["accepted"] += accepted
        if self.draft_kind != "ngram":  # n-gram rows learn from their whole proposal in _score_proposals
            request.acceptance_stats.observe(drafted, accepted)
            self.traffic_acceptance.observe(drafted, accepted)
            request.acceptance = request.acceptance_stats.first_rate(self.traffic_acceptance.first_rate(FLAT_PRIOR), self.request_prior_weight)

    def _commit(self, request: Request, state: dict, emitted: list[int], now: float) -> None:
        finish = None
        if not request.ignore_eos:
            for i, token in enumerate(emitted):
                if token in self.eos_ids:
                    emitted, finish = emitted[: i + 1], "stop"
                    break
        budget = request.max_tokens - len(request.tokens)
        if len(emitted) >= budget:
            emitted, finish = emitted[:budget], finish or "length"
        request.tokens.extend(emitted)
        length = state["length"]
        state["context"][length : length + len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        state["length"] = length + len(emitted)
        if state["proposals"]:
            self._score_proposals(request, state, final=finish is not None)
        stats = request.stats
        if stats.first_token_s is None:
            stats.first_token_s = now
            if self.metrics is not None:
                self.metrics.on_first_token(now - stats.arrival_s)
        else:
            stats.itl_s.append(now - stats.last_emit_s)
            if self.metrics is not None:
                self.metrics.on_inter_token(now - stats.last_emit_s)
        stats.last_emit_s = now
        cut = state["text"].update(request.tokens, len(emitted))
        if cut is not None:
            del request.tokens[cut:]
            finish = "stop"
        if finish is not None:
            self._finish(request, finish)

    def _finish(self, request: Request, reason: str) -> None:
        """End a request (model thread): flush its text, free its slot, tell its sink."""
        state = self._state.pop(request.request_id, None)
        if state is not None and reason != "cancelled":  # the text so far is final (timeouts and errors too)
            state["text"].finish()
        request.finish_reason = reason
        request.stats.finish_s = self.clock()
        with self.lock:
            if request in self.running:
                self.running.remove(request)
                self.free_slots.append(request.slot)
            self._update_gauges()
        if self.metrics is not None:
            self.metrics.on_finish(request)
        if request.sink is not None:
            request.sink(("done", request))
