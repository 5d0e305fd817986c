"""Continuous (iteration-level) batching with speculative decoding over specgate's runtime.

Requests join a bounded waiting queue, are admitted when one of `num_slots` KV-cache rows is free, prefilled,
then decoded step by step while other requests join and leave between steps. One step:

  1. admit: move waiting requests into free slots; prefill their prompts (minus the last token) in one
     ragged target forward (and nothing else: the draft cache catches up lazily in step 3).
  2. policy: one gamma per running request (0 = no drafts), capped by the request's remaining budget - 1.
  3. draft: the n-gram drafter per request, or ONE batched draft-model pass (the draft CausalLM keeps its own
     cache with the same slot per request; it re-feeds from the first position whose token changed).
  4. score: ONE batched ragged target forward; row b feeds its last committed token + its drafts at its own
     absolute positions (-1 pads shorter rows).
  5. verify: one `greedy_verify` (every row greedy) or one `rejection_sample` / `verify` call for the whole
     batch, with one torch.Generator per request (seeded from the request's seed, like engine.generate).
  6. commit: EOS, stop strings (engine's OutputText semantics) and max_tokens end a request; its slot is freed
     at once, so a waiting request can take it at the next step.

Preemption: none is ever needed. Admission reserves a slot's full length, prompt + max_tokens positions
(every position a request can write, drafts included, is below that), so a running request can never run out
of KV memory; the price is that max_seq_len bounds prompt + max_tokens (longer requests are refused with a
ValueError naming the limit). The preemption counter in the metrics therefore stays 0.

Admission control: `submit` raises QueueFullError (HTTP 429) when running + waiting requests already reach
num_slots + max_waiting, and RequestTooLongError (HTTP 400) when prompt + max_tokens > max_seq_len.

Threading: one thread owns the models (`run_forever`, or a caller driving `step()` by hand). `submit` and
`cancel` may be called from any thread; a cancelled request is finished (finish_reason "cancelled") and its
slot freed at the start of the next step. Request events go to the request's `sink` callback, called on the
model thread: ("text", delta) as text becomes final, then ("done", request).

Known limits: prefill is not chunked (admitting a long prompt delays the running requests' next step by its
prefill); a step's cost is set by its longest row (drafts are padded to the longest, which is why the
adaptive policy shares one gamma per step); `lossy` (a specgate.sampling.lossy mode) replaces exact
verification for cost studies and is labelled lossless="false" in the metrics.
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
from specgate.sampling import SamplingParams, greedy_verify, logits_to_probs, rejection_sample, verify
from specgate.serving.policy import SpeculationPolicy

# Per-request acceptance estimate (alpha, the chance one draft is accepted), read by the adaptive policy:
# EMAs of accepted and tested drafts (testing stops at the first rejection, so alpha_hat = accepted / tested),
# blended with a prior of PRIOR_WEIGHT pseudo-drafts at ACCEPTANCE_PRIOR. Steps without drafts age the
# evidence (STALE_DECAY), so a request written off after a few misses drifts back to the prior and is tried
# again: without this, an estimate of 0 would stop drafting for good and could never be corrected. Lookup
# (n-gram) drafts are free, so with them a step without drafts still yields evidence ("shadow" drafts).
ACCEPTANCE_EMA_DECAY = 0.8
ACCEPTANCE_PRIOR = 0.5
PRIOR_WEIGHT = 1.0
STALE_DECAY = 0.9


class QueueFullError(RuntimeError):
    """The waiting queue is full (HTTP 429): retry later or raise --max-waiting."""


class RequestTooLongError(ValueError):
    """prompt + max_tokens does not fit in a KV slot (HTTP 400)."""


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """One independent generator per random stream of a request (verifier = 0, drafter = 1), as engine.generate."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + stream) % (2**63))


@dataclass
class RequestStats:
    """Per-request counters and latencies (seconds, from time.perf_counter)."""

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
    # live state (owned by the model thread)
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    acceptance: float | None = None  # estimate of alpha (see ACCEPTANCE_EMA_DECAY); None before any draft
    _tested_ema: float = 0.0
    _accepted_ema: float = 0.0

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
            next_rows, next_tokens = [], []
            for row in rows:
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
    under lossless="false" in the metrics), or None (exact).
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
    ) -> None:
        from specgate.serving.policy import OffPolicy

        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1 (--max-num-seqs: requests decoded at once)")
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} must be >= 0 (--max-waiting: requests queued for a slot)")
        limit = int(target.model.max_position_embeddings)
        if not 2 <= max_seq_len <= limit:
            raise ValueError(f"max_seq_len={max_seq_len} is out of range 2..{limit} (the target's context): lower --max-seq-len")
        self.target = target
        self.policy = policy or OffPolicy()
        self.num_slots, self.max_seq_len, self.max_waiting = num_slots, max_seq_len, max_waiting
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
        self.thread: threading.Thread | None = None
        self.steps = 0
        self.last_error: BaseException | None = None

    # ------------------------------------------------------------------ requests (any thread)
    def validate(self, request: Request) -> None:
        """Raise RequestTooLongError / ValueError for a request this scheduler can never run."""
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens} is invalid: it must be >= 1")
        if request.prompt_len < 1:
            raise ValueError("the prompt is empty (0 tokens): give at least one token")
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
            if len(self.running) + len(self.waiting) >= self.num_slots + self.max_waiting:
                if self.metrics is not None:
                    self.metrics.on_rejected()
                raise QueueFullError(
                    f"the server is full ({len(self.running)} running, {len(self.waiting)} waiting, "
                    f"--max-num-seqs {self.num_slots}, --max-waiting {self.max_waiting}): retry later"
                )
            request.request_id = request.request_id or f"req-{next(self._ids)}"
            request.stats.arrival_s = time.perf_counter()
            self.waiting.append(request)
            self._update_gauges()
            self.lock.notify_all()
        return request

    def cancel(self, request_id: str) -> None:
        """Ask for a request to be dropped (any thread); its slot is freed at the start of the next step."""
        with self.lock:
            self._cancelled.add(request_id)
            self.lock.notify_all()

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
                    self._finish(request, "error")

    def step(self) -> bool:
        """One scheduler iteration. Returns False when there was nothing to do."""
        with torch.inference_mode():
            self._drop_cancelled()
            self._admit()
            if not self.running:
                return False
            self._decode_step()
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
        admitted = []
        with self.lock:
            while self.waiting and self.free_slots:
                request = self.waiting.popleft()
                request.slot = self.free_slots.pop()
                admitted.append(request)
                self.running.append(request)
            self._update_gauges()
        if not admitted:
            return
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
                "context": context, "length": request.prompt_len, "ngram": ngram,
                "verify_gen": seeded_generator(request.seed, 0), "draft_gen": seeded_generator(request.seed, 1),
                "text": OutputText(self.target.tokenizer, list(request.stop), self._text_sink(request)),
            }
        # prefill every new prompt minus its last token (fed by the first decode step with its drafts)
        prefill = [r for r in admitted if r.prompt_len > 1]
        if prefill:
            width = max(r.prompt_len - 1 for r in prefill)
            ids = torch.zeros(len(prefill), width, dtype=torch.int64)  # [B, T]
            positions = torch.full((len(prefill), width), -1, dtype=torch.int64)  # [B, T]
            for row, request in enumerate(prefill):
                n = request.prompt_len - 1
                ids[row, :n] = request.prompt_ids[:n]
                positions[row, :n] = torch.arange(n)
            slots = torch.tensor([r.slot for r in prefill], dtype=torch.int64)  # [B]
            self.target.model.forward(ids, positions, self.cache, slots, last_only=True)

    def _text_sink(self, request: Request) -> Callable[[str], None]:
        def on_text(delta: str) -> None:
            request.text += delta
            if request.sink is not None:
                request.sink(("text", delta))

        return on_text

    def _drafts(self, gammas: list[int]) -> list[tuple[list[int], list[Tensor | None]]]:
        states = [self._state[r.request_id] for r in self.running]
        contexts = [s["context"][: s["length"]] for s in states]
        if self.draft_kind == "ngram":
            out = []
            for state, context, gamma in zip(states, contexts, gammas):
                tokens = state["ngram"].propose(context, gamma).tokens.tolist() if gamma > 0 else []
                out.append((tokens, [None] * len(tokens)))
            return out
        if self.model_drafter is not None:
            generators = [s["draft_gen"] for s in states]
            return self.model_drafter.propose(self.running, contexts, gammas, generators)
        return [([], []) for _ in self.running]

    def _decode_step(self) -> None:
        running = self.running
        states = [self._state[r.request_id] for r in running]
        # 2. policy: per-request gamma, never past the remaining budget
        gammas = self.policy.choose([r.acceptance for r in running])
        gammas = [max(0, min(int(g), r.max_tokens - len(r.tokens) - 1)) for g, r in zip(gammas, running)]
        # 3. drafts (and, for lookup drafters, a free one-token "shadow" proposal where gamma is 0)
        drafts = self._drafts(gammas)
        shadows = self._shadow_proposals(gammas)
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
        target_logits = self.target.model.forward(ids, positions, self.cache, slots)  # [B, G+1, V]
        # 5. one batched verification with per-request generators
        result = self._verify(running, states, drafts, draft_tokens, torch.tensor(num_drafts), target_logits)
        # 6. commit
        now = time.perf_counter()
        step_stats = {"num_drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": [0] * width}
        for row, request in enumerate(list(running)):
            accepted = int(result.num_accepted[row])
            emitted = result.output_tokens[row, : accepted + 1].tolist()
            self._record(request, gammas[row], num_drafts[row], accepted, step_stats)
            if shadows[row] is not None:
                self._record_shadow(request, shadows[row], emitted[0], target_logits[row, 0])
            self._commit(request, states[row], emitted, now)
        if self.metrics is not None:
            self.metrics.on_step(step_stats, lossless=bool(result.lossless))
        self._update_gauges()

    def _verify(self, running, states, drafts, draft_tokens: Tensor, num_drafts: Tensor, target_logits: Tensor):
        params = [r.params for r in running]
        generators = [s["verify_gen"] for s in states]
        if all(p.greedy for p in params) and self.lossy is None:
            return greedy_verify(draft_tokens, num_drafts, target_logits)
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

    def _shadow_proposals(self, gammas: list[int]) -> list[int | None]:
        """For the n-gram drafter, the token it would draft first for rows the policy gave gamma 0 (else None).

        Lookup drafts cost nothing, so the acceptance estimate can keep learning while speculation is off: the
        step's own target logits tell whether that draft would have been accepted (see _record_shadow).
        """
        if self.draft_kind != "ngram":
            return [None] * len(gammas)
        out: list[int | None] = []
        for request, gamma in zip(self.running, gammas):
            state = self._state[request.request_id]
            proposal = state["ngram"].propose(state["context"][: state["length"]], 1).tokens if gamma == 0 else None
            out.append(int(proposal[0]) if proposal is not None and proposal.numel() else None)
        return out

    def _record_shadow(self, request: Request, draft: int, emitted: int, target_logits: Tensor) -> None:
        """Evidence from a draft that was not verified: accepted iff it equals the greedy token; when sampling,
        its acceptance probability p(draft) (q is one-hot), the expected value of the real accept test."""
        if request.params.greedy:
            accepted = float(draft == emitted)
        else:
            accepted = float(logits_to_probs(target_logits, request.params)[draft])  # target_logits [V]
        request._accepted_ema = ACCEPTANCE_EMA_DECAY * request._accepted_ema + accepted
        request._tested_ema = ACCEPTANCE_EMA_DECAY * request._tested_ema + 1.0
        request.acceptance = self._blend(request)

    def _record(self, request: Request, gamma: int, drafted: int, accepted: int, step_stats: dict) -> None:
        stats = request.stats
        stats.steps += 1
        stats.gammas.append(gamma)
        if drafted == 0:
            if request.acceptance is not None and self.draft_kind != "ngram":  # n-gram rows learn from shadows
                request._accepted_ema *= STALE_DECAY
                request._tested_ema *= STALE_DECAY
                request.acceptance = self._blend(request)
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
        tested = accepted + int(accepted < drafted)
        request._accepted_ema = ACCEPTANCE_EMA_DECAY * request._accepted_ema + accepted
        request._tested_ema = ACCEPTANCE_EMA_DECAY * request._tested_ema + tested
        request.acceptance = self._blend(request)

    @staticmethod
    def _blend(request: Request) -> float:
        """The acceptance estimate: EMA evidence plus PRIOR_WEIGHT pseudo-drafts at ACCEPTANCE_PRIOR."""
        return (request._accepted_ema + PRIOR_WEIGHT * ACCEPTANCE_PRIOR) / (request._tested_ema + PRIOR_WEIGHT)

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
        if state is not None and reason != "cancelled":
            state["text"].finish()
        request.finish_reason = reason
        request.stats.finish_s = time.perf_counter()
        with self.lock:
            if request in self.running:
                self.running.remove(request)
                self.free_slots.append(request.slot)
            self._update_gauges()
        if self.metrics is not None:
            self.metrics.on_finish(request)
        if request.sink is not None:
            request.sink(("done", request))
