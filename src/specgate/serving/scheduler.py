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
  3. draft: the n-gram drafter per request, or ONE batched draft-model pass per draft position (the draft CausalLM
     keeps its own cache with the same slot per request; it re-feeds from the first position whose token changed),
     or ONE batched EAGLE head step per draft position (drafting.eagle_drafter: the head's cache has the same slot
     per request; each request's HeadState holds the target's final-norm states, which the prefill and the
     verification pass return for it, return_hidden, only when the drafter is an EAGLE head).
  4. score and 5. verify: the decode core shared with engine.generate (specgate.engine.decode.decode_step):
     ONE batched ragged target forward, row b feeding its last committed token + its drafts at its own absolute
     positions (-1 pads shorter rows), then one verification call for the batch with one torch.Generator per
     request (seeded from the request's seed, like engine.generate). A row whose logits are not finite (NaN/inf)
     fails its request alone (finish_reason "error", Request.error says why); the other rows go on.
  6. commit (DecodeState.append / cut_at_stop, as engine.generate): EOS, stop strings (specgate.text.OutputText)
     and max_tokens end a request; its slot is freed at once, so a waiting request can take it at the next step. The step's time, its draft passes excepted,
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

from specgate.drafting.base import DraftProposal
from specgate.drafting.batched import BatchedModelDrafter
from specgate.drafting.eagle import EagleHead
from specgate.drafting.eagle_drafter import EagleProposer, HeadState
from specgate.drafting.ngram import NgramDrafter
from specgate.engine.decode import DRAFT_STREAM, VERIFY_STREAM, DecodeState, decode_step, eos_token_ids, seeded_generator
from specgate.models.transformer import LogitsBuffer
from specgate.sampling import SamplingParams
from specgate.text import OutputText
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
# own tests spread the estimates far wider than the rows' acceptance (acceptance.REQUEST_PRIOR_WEIGHT).
DEFAULT_PREFILL_CHUNK_TOKENS = 512


class QueueFullError(RuntimeError):
    """The waiting queue is full (HTTP 429): retry later or raise --max-waiting."""


class RequestTooLongError(ValueError):
    """prompt + max_tokens does not fit in a KV slot (HTTP 400)."""


class ServerDrainingError(RuntimeError):
    """The scheduler is draining (shutting down) and accepts no new request (HTTP 503)."""


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


@dataclass(slots=True)
class LookupProposal:
    """An n-gram proposal awaiting scoring against the output (Scheduler._score_proposals)."""

    start: int  # index in Request.tokens of the token its first draft stands for
    tokens: list[int]
    counted: int = 0  # leading positions already counted as evidence


@dataclass(slots=True, kw_only=True, eq=False)
class RequestState(DecodeState):
    """A running request's state on the model thread: the decode core's DecodeState plus what batching adds."""

    draft_generator: torch.Generator  # the draft model's sampling stream (the n-gram drafter draws nothing)
    ngram: NgramDrafter | None  # the request's lookup index (n-gram drafts), else None
    head: HeadState | None = None  # the EAGLE head's state (the target's final-norm states by position), else None
    prefilled: int = 0  # prompt tokens in the target's cache; the request decodes once it reaches prompt_len - 1
    proposals: list[LookupProposal] = field(default_factory=list)  # n-gram proposals not yet fully scored


@dataclass(slots=True)
class StepStats:
    """One decode step's speculation counters over its rows with >= 1 draft (the metrics' on_step record)."""

    num_drafts: int = 0  # rows with >= 1 draft token
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # rows that accepted the draft at position i


class Scheduler:
    """Continuous-batching speculative decoding over one target (and optionally one draft) model.

    target: specgate.models.LoadedModel. draft: "none", "ngram", a LoadedModel (draft model sharing the
    target's tokenizer) or an EagleHead attached to the target (specgate.drafting.eagle.load_head). policy: a
    SpeculationPolicy. num_slots: KV rows = the most requests decoded at once.
    max_seq_len: positions per slot (prompt + max_tokens must fit). max_waiting: requests allowed to wait for
    a slot beyond the running ones. metrics: an object with the specgate.serving.metrics.ServingMetrics hooks,
    or None. lossy: a specgate.sampling.lossy mode replacing exact verification (LOSSY; its steps are counted
    under lossless="false" in the metrics), or None (exact). prefill_chunk_tokens: most prompt tokens
    prefilled per step, over all admitted requests (>= 1). lookup_tokens: with n-gram drafts, the length of
    every lookup proposal (scored against the output for the acceptance estimates, whatever the policy drafts of
    it); None: the policy's max gamma (>= 1). A benchmark that swaps policies on one scheduler sets it to the
    adaptive policy's gamma_max, so that a narrower policy's steps do not leave the deep positions' estimates
    without evidence for the adaptive one. request_prior_weight: pseudo-tests of the
    traffic's profile in each request's estimate (acceptance.REQUEST_PRIOR_WEIGHT: a request's few own tests are
    shrunk towards the traffic's, the weight whose estimates scored the next drafts best). clock: a function giving
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
        self.step_delay_s = 0.0  # a sleep after every step: a server made slower by a known amount, for tests only
        self.eos_ids = eos_token_ids(target)
        self.cache = target.model.new_cache(num_slots, max_seq_len)
        if isinstance(draft, str) and draft in ("none", "ngram"):
            self.draft_kind, self.model_drafter = draft, None
        elif isinstance(draft, str):
            raise ValueError(f"draft={draft!r}: pass 'none', 'ngram', a loaded draft model (specgate.models.load_model) or an EagleHead (eagle.load_head)")
        elif isinstance(draft, EagleHead):
            self.draft_kind = "eagle"
            self.model_drafter = EagleProposer(draft, target.model.vocab_size, num_slots, max_seq_len)
        else:
            self.draft_kind = "model"
            self.model_drafter = BatchedModelDrafter(draft, target, num_slots, max_seq_len)
        self.draft_name = self.model_drafter.name if self.model_drafter else self.draft_kind
        self.wants_features = self.draft_kind == "eagle"  # the target's passes return final-norm states for the head
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self._cancelled: set[str] = set()
        self._ids = itertools.count()
        self._state: dict[str, RequestState] = {}  # request_id -> its state on the model thread
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
                if self.step() and self.step_delay_s > 0:
                    time.sleep(self.step_delay_s)  # a documented slowdown for the gate's tests (serve --debug-step-delay-ms)
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
            decoding = [r for r in self.running if self._state[r.request_id].prefilled >= r.prompt_len - 1]
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
            self._state[request.request_id] = RequestState(
                context=context, length=request.prompt_len, tokens=request.tokens, max_new_tokens=request.max_tokens,
                params=request.params, eos_ids=frozenset() if request.ignore_eos else self.eos_ids,
                text=OutputText(self.target.tokenizer, list(request.stop), self._text_sink(request)),
                verify_generator=seeded_generator(request.seed, VERIFY_STREAM),
                draft_generator=seeded_generator(request.seed, DRAFT_STREAM), ngram=ngram,
                head=self.model_drafter.new_state() if self.wants_features else None,
            )

    def _prefill(self) -> None:
        """Feed the next prompt chunks (all but each prompt's last token) in one ragged forward of at most
        prefill_chunk_tokens tokens, pads included: the first unfinished prompt (FIFO) sets the width, later ones
        join with chunks no wider while rows x width stays within the budget."""
        rows: list[tuple[Request, int, int]] = []  # (request, first position, tokens)
        width = 0
        for request in self.running:
            done = self._state[request.request_id].prefilled
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
        # the cache only, no LM head; the final-norm states too when the EAGLE head reads them
        hidden = self.target.model.forward(ids, positions, self.cache, slots, logits=False, return_hidden=self.wants_features)
        for row, (request, first, count) in enumerate(rows):
            state = self._state[request.request_id]
            state.prefilled = first + count
            if state.head is not None:
                state.head.observe(first, hidden[row, :count].float())

    def _text_sink(self, request: Request) -> Callable[[str], None]:
        def on_text(delta: str) -> None:
            request.text += delta
            if request.sink is not None:
                request.sink(("text", delta))

        return on_text

    def _lookups(self, running: list[Request], states: list[RequestState], budgets: list[int]) -> list[list[int]] | None:
        """n-gram drafter: every row's proposal up to lookup_tokens, default the policy's max gamma (>= 1 to keep
        learning); else None."""
        if self.draft_kind != "ngram":
            return None
        longest = self.policy.max_gamma if self.lookup_tokens is None else self.lookup_tokens
        return [
            state.ngram.propose(state.context[: state.length], max(1, min(longest, budget))).tokens.tolist()
            for state, budget in zip(states, budgets)
        ]

    def _choose_gammas(self, running: list[Request], states: list[RequestState]) -> tuple[list[int], list[int], list[list[int]] | None]:
        """Step 2: the policy's gamma per row, capped by its remaining budget - 1 and (lookups) by the drafts
        available. Returns (gammas, caps, the rows' lookup proposals or None)."""
        budgets = [r.max_tokens - len(r.tokens) - 1 for r in running]  # drafts past it could never be emitted
        lookups = self._lookups(running, states, budgets)
        caps = budgets if lookups is None else [min(len(tokens), b) for tokens, b in zip(lookups, budgets)]
        prior = self.traffic_acceptance.profile(FLAT_PRIOR)  # [K]
        gammas = self.policy.choose([r.acceptance_stats.profile(prior, self.request_prior_weight) for r in running], caps)
        return [max(0, min(int(g), cap)) for g, cap in zip(gammas, caps)], caps, lookups

    def _drafts(self, running: list[Request], states: list[RequestState], gammas: list[int], lookups: list[list[int]] | None) -> list[DraftProposal]:
        """Step 3: each row's drafts: a prefix of its lookup proposal, or the batched draft model's, or none."""
        if lookups is not None:  # a shorter n-gram proposal is a prefix of a longer one
            return [DraftProposal(tokens=torch.tensor(tokens[:gamma], dtype=torch.int64), draft_probs=None) for tokens, gamma in zip(lookups, gammas)]
        if self.model_drafter is not None:
            contexts = [s.context[: s.length] for s in states]
            slots, params, generators = [r.slot for r in running], [s.params for s in states], [s.draft_generator for s in states]
            if self.wants_features:
                return self.model_drafter.propose(slots, [s.head for s in states], contexts, gammas, params, generators)
            return self.model_drafter.propose(slots, contexts, gammas, params, generators)
        return [DraftProposal(tokens=torch.empty(0, dtype=torch.int64), draft_probs=None) for _ in running]

    def _decode_step(self, running: list[Request]) -> None:
        step_start = time.perf_counter()
        states = [self._state[r.request_id] for r in running]
        # 2. policy: per-request gamma, capped by the remaining budget and (lookups) by the drafts available
        gammas, caps, lookups = self._choose_gammas(running, states)
        # 3. drafts; every lookup proposal is kept to be scored against the output (see the module comment)
        draft_start = time.perf_counter()
        proposals = self._drafts(running, states, gammas, lookups)
        draft_s = time.perf_counter() - draft_start if self.model_drafter is not None else 0.0
        for request, state, lookup in zip(running, states, lookups or []):
            if lookup:
                state.proposals.append(LookupProposal(len(request.tokens), lookup))
        num_drafts = [proposal.num_tokens for proposal in proposals]
        batch, width = len(running), max(num_drafts)
        # 4-5. the decode core: one ragged target forward, one verification for the batch
        slots = torch.tensor([r.slot for r in running], dtype=torch.int64)  # [B]
        result = decode_step(self.target.model, self.cache, slots, states, proposals, lossy=self.lossy, logits_buffer=self._logits,
                             return_features=self.wants_features)
        # (the logits block is kept across steps: a fresh 80 MB one, 16 requests x 5 positions x Gemma's 262,144, page-faults ~19 ms)
        self._fail_non_finite([running[i] for i in result.failed], [states[i] for i in result.failed])
        if not result.kept:
            return
        running, states = [running[i] for i in result.kept], [states[i] for i in result.kept]
        gammas, caps, num_drafts = ([values[i] for i in result.kept] for values in (gammas, caps, num_drafts))
        # 6. commit
        now = self.clock()
        step_stats = StepStats(accepted_per_position=[0] * width)
        rows_emitted, rows_before = [], []  # per row: tokens committed now, tokens it had before (0: its first)
        for row, request in enumerate(running):
            if states[row].head is not None:  # the states after the last committed token and the accepted drafts
                states[row].head.observe(states[row].length - 1, result.features[row, : result.num_accepted[row] + 1].float())
            self._record(request, gammas[row], num_drafts[row], result.num_accepted[row], step_stats)
            rows_before.append(len(request.tokens))
            self._commit(request, states[row], result.emitted[row], now)
            rows_emitted.append(len(request.tokens) - rows_before[-1])
        committed = sum(rows_emitted)
        if self.metrics is not None:
            self.metrics.on_step(step_stats, lossless=result.lossless)
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
                "forward_ms": 1e3 * result.forward_s, "draft_ms": 1e3 * draft_s, "prefill_tokens": self.last_prefill_tokens,
                # what the policy was given and ran, per row (for offline counterfactuals of the policy)
                "rows_id": [r.request_id for r in running], "rows_caps": caps, "rows_drafts": num_drafts,
                "predicted_plans": self.policy.plans_priced() if hasattr(self.policy, "plans_priced") else None,
            })

    def _fail_non_finite(self, requests: list[Request], states: list[RequestState]) -> None:
        """Finish with "error" every request whose scored rows held NaN/inf logits (decode_step's failed rows)."""
        for request, state in zip(requests, states):
            request.error = (
                f"the target model produced non-finite logits (NaN or inf) for this request at position "
                f"{state.length - 1}; the request was stopped, other requests are unaffected"
            )
            self._finish(request, "error")

    def _score_proposals(self, request: Request, proposals: list[LookupProposal], final: bool) -> list[LookupProposal]:
        """Score the pending lookup proposals against the output so far; the ones still pending. Each position
        counts as soon as the output decides it (AcceptanceStats.observe_positions); a proposal leaves at its
        first mismatch, once fully covered, or when the request ends.

        Position by position, not once resolved: a proposal that fails resolves at its mismatch, one that holds
        only once the output covers it (up to 8 tokens, 2-4 steps later), so counting whole proposals at
        resolution put the recent failures in a request's estimate before the successes made with them, and the
        estimates ran 3-4 points low (docs/BENCHMARKS.md, changelog)."""
        pending = []
        for proposal in proposals:
            known = request.tokens[proposal.start : proposal.start + len(proposal.tokens)]
            matched = next((k for k, (a, b) in enumerate(zip(known, proposal.tokens)) if a != b), len(known))
            decided = min(matched + 1, len(known))  # positions 1..matched accepted, matched + 1 rejected if known
            request.acceptance_stats.observe_positions(proposal.counted, decided, matched)
            self.traffic_acceptance.observe_positions(proposal.counted, decided, matched)
            if not (matched < len(known) or len(known) == len(proposal.tokens) or final):
                pending.append(LookupProposal(proposal.start, proposal.tokens, decided))
        request.acceptance = request.acceptance_stats.first_rate(self.traffic_acceptance.first_rate(FLAT_PRIOR), self.request_prior_weight)
        return pending

    def _record(self, request: Request, gamma: int, drafted: int, accepted: int, step_stats: StepStats) -> None:
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
            step_stats.accepted_per_position[position] += 1
        step_stats.num_drafts += 1
        step_stats.draft_tokens += drafted
        step_stats.accepted += accepted
        if self.draft_kind != "ngram":  # n-gram rows learn from their whole proposal in _score_proposals
            request.acceptance_stats.observe(drafted, accepted)
            self.traffic_acceptance.observe(drafted, accepted)
            request.acceptance = request.acceptance_stats.first_rate(self.traffic_acceptance.first_rate(FLAT_PRIOR), self.request_prior_weight)

    def _commit(self, request: Request, state: RequestState, emitted: list[int], now: float) -> None:
        """Step 6 for one row: DecodeState.commit's two halves, with the lookup proposals scored in between
        (against the output as the target produced it, before a stop string cuts it) and the token times."""
        before = len(request.tokens)
        finish = state.append(emitted)
        if state.proposals:
            state.proposals = self._score_proposals(request, state.proposals, final=finish is not None)
        self._time_tokens(request.stats, now)
        if state.cut_at_stop(len(request.tokens) - before):
            finish = "stop"
        if finish is not None:
            self._finish(request, finish)

    def _time_tokens(self, stats: RequestStats, now: float) -> None:
        """A token-emitting step at `now`: the request's first token, or one more inter-token latency."""
        if stats.first_token_s is None:
            stats.first_token_s = now
            if self.metrics is not None:
                self.metrics.on_first_token(now - stats.arrival_s)
        else:
            stats.itl_s.append(now - stats.last_emit_s)
            if self.metrics is not None:
                self.metrics.on_inter_token(now - stats.last_emit_s)
        stats.last_emit_s = now

    def _finish(self, request: Request, reason: str) -> None:
        """End a request (model thread): flush its text, free its slot, tell its sink."""
        state = self._state.pop(request.request_id, None)
        if state is not None and reason != "cancelled":  # the text so far is final (timeouts and errors too)
            state.text.finish()
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
