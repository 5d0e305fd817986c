"""Single-request speculative generation: the draft -> score -> verify -> commit -> feedback loop.

Prefill writes the prompt minus its last token into the target's KV cache. Each iteration then feeds the last
committed token plus G' drafts (G' <= gamma) in ONE target forward, at absolute positions, so a rejected
draft needs no undo: the next step writes over its cache entries. Each iteration emits num_accepted + 1
tokens, which makes the baseline (gamma = 0: no drafts, one token per target pass, sampled by the same
verifier) and every method count tokens the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal, Drafter
from specgate.engine.stats import GenerationStats


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids, prompt excluded (an EOS that ended the output is included)
    text: str  # decoded output, special tokens skipped, cut before a stop string
    stats: GenerationStats

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "text": self.text, "stats": self.stats.to_dict()}


def encode_prompt(prompt: str | Sequence[int] | Tensor, tokenizer: Any) -> Tensor:
    """Prompt text (tokenised with the tokenizer's special tokens, e.g. BOS, as HF generate does) or ids -> [L] int64."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give a non-empty --prompt text or a non-empty --prompt-file")
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    else:
        ids = torch.as_tensor(list(prompt) if not isinstance(prompt, Tensor) else prompt, dtype=torch.int64).flatten()
    if ids.numel() == 0:
        raise ValueError("prompt is empty (0 tokens): give at least one token")
    return ids.to(torch.int64)


def eos_token_ids(target: Any) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS and the model config's eos_token_id (int or list)."""
    ids: set[int] = set()
    if getattr(target.tokenizer, "eos_token_id", None) is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    config_eos = getattr(getattr(target.model, "config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, (list, tuple)):
        ids.update(int(i) for i in config_eos)
    return ids


def validate_request(prompt_len: int, max_context: int, gamma: int, max_new_tokens: int) -> None:
    """Raise ValueError naming the bad parameter, its value, the allowed range and the fix."""
    if gamma < 0:
        raise ValueError(f"gamma={gamma} is invalid: the number of draft tokens per step must be >= 0 (0 = no drafting)")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: it must be >= 1")
    if prompt_len >= max_context:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, but the model's context is {max_context} positions: "
            f"shorten the prompt to at most {max_context - 1} tokens"
        )
    if prompt_len + max_new_tokens > max_context:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} runs past the model's context ({max_context} positions, prompt "
            f"{prompt_len} tokens): use max_new_tokens <= {max_context - prompt_len}"
        )


class OutputText:
    """Decodes the output as it grows, finds stop strings, and releases text that can no longer change.

    A stop string may span tokens, so after each step the whole output is decoded and searched from a little
    before the previous end. On a match the output is cut to the shortest token prefix whose text contains the
    stop string; the text ends just before it (OpenAI / vLLM semantics). Streamed text holds back the last
    characters that could still begin a stop string, and a trailing incomplete UTF-8 character.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] | None, on_text: Callable[[str], None] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or [])]
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop={self.stop!r} contains an empty string: each stop string needs >= 1 character")
        self.hold_chars = max((len(s) for s in self.stop), default=1) - 1
        self.on_text = on_text
        self.text = ""
        self.streamed = 0
        self._searched = 0

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _find_stop(self, text: str, start: int) -> int:
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def update(self, tokens: list[int], num_new: int) -> int | None:
        """tokens: the whole output so far, the last num_new just appended. Returns the cut length on a stop hit."""
        text = self.decode(tokens)
        start = max(0, self._searched - self.hold_chars)
        if self.stop and self._find_stop(text, start) >= 0:
            for keep in range(len(tokens) - num_new + 1, len(tokens) + 1):
                prefix_text = self.decode(tokens[:keep])
                hit = self._find_stop(prefix_text, start)
                if hit >= 0:
                    self.text = prefix_text[:hit]
                    self._stream(final=True)
                    return keep
        self.text = text
        self._searched = len(text)
        self._stream(final=False)
        return None

    def _stream(self, final: bool) -> None:
        if self.on_text is None:
            return
        end = len(self.text)
        if not final:
            end -= self.hold_chars
            while end > self.streamed and self.text[end - 1] == "\ufffd":
                end -= 1
        if end > self.streamed:
            self.on_text(self.text[self.streamed : end])
            self.streamed = end

    def finish(self) -> None:
        self._stream(final=True)


def _seeded(seed: int, stream: int) -> torch.Generator:
    """An independent generator per random stream of a request (verifier = 0, drafter = 1)."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + stream) % (2**63))


def generate(
    prompt: str | Sequence[int] | Tensor,
    target: Any,
    drafter: Drafter,
    gamma: int,
    params: Any,
    seed: int = 0,
    max_new_tokens: int = 64,
    stop: Sequence[str] | None = None,
    *,
    on_text: Callable[[str], None] | None = None,
    on_step: Callable[[GenerationStats], None] | None = None,
    eos_ids: set[int] | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens after `prompt` with speculative decoding; exact unless drafter.lossless is False.

    target: a specgate.models.LoadedModel. drafter: any specgate.drafting Drafter (NoDrafter with gamma 0 is
    target-only decoding). params: specgate.sampling.SamplingParams (temperature 0 = greedy). seed: the request's
    seed; the same seed gives the same output. stop: strings that end the output (not included in the text).
    on_text(delta) receives text as it becomes final; on_step(stats) is called after every iteration.
    eos_ids: the ids that end generation (default: the tokenizer's and the model config's EOS).
    """
    from specgate.sampling import verify

    model, tokenizer = target.model, target.tokenizer
    prompt_ids = encode_prompt(prompt, tokenizer)  # [L]
    prompt_len = int(prompt_ids.numel())
    validate_request(prompt_len, int(model.max_position_embeddings), int(gamma), int(max_new_tokens))
    eos_ids = eos_token_ids(target) if eos_ids is None else set(eos_ids)
    output_text = OutputText(tokenizer, stop, on_text)

    max_seq_len = prompt_len + max_new_tokens + gamma + 1
    stats = GenerationStats(drafter=drafter.name, gamma=int(gamma), lossless=bool(drafter.lossless), prompt_tokens=prompt_len)
    generator = _seeded(seed, 0)
    slots = torch.zeros(1, dtype=torch.int64)  # [B=1] this request's cache row
    context = torch.empty(max_seq_len, dtype=torch.int64)  # [S] prompt + committed tokens (+ scratch)
    context[:prompt_len] = prompt_ids
    length = prompt_len
    tokens: list[int] = []

    with torch.inference_mode():
        cache = model.new_cache(1, max_seq_len)
        drafter.begin(prompt_ids, params, _seeded(seed, 1), max_seq_len)
        start = time.perf_counter()
        if prompt_len > 1:  # the last prompt token is fed by the first iteration, together with its drafts
            positions = torch.arange(prompt_len - 1, dtype=torch.int64)[None]  # [1, L-1]
            model.forward(prompt_ids[None, :-1], positions, cache, slots, logits=False)  # fills the cache only
            stats.prefill_passes = 1
            stats.target_forward_passes = 1
        stats.prefill_ms = (time.perf_counter() - start) * 1e3

        while True:
            budget = max_new_tokens - len(tokens)
            # 1. draft up to gamma tokens (no more than the remaining budget can use)
            draft_start = time.perf_counter()
            step_gamma = min(gamma, budget - 1)
            if step_gamma > 0:
                proposal = drafter.propose(context[:length], step_gamma)
            else:
                proposal = DraftProposal(tokens=torch.empty(0, dtype=torch.int64), draft_probs=None)
            num_drafted = proposal.num_tokens
            stats.draft_forward_passes += proposal.forward_passes
            verify_start = time.perf_counter()

            # 2. score the last committed token and the drafts in ONE target forward
            input_ids = torch.cat([context[length - 1 : length], proposal.tokens])[None]  # [1, G'+1]
            positions = torch.arange(length - 1, length + num_drafted, dtype=torch.int64)[None]  # [1, G'+1]
            target_logits = model.forward(input_ids, positions, cache, slots)  # [1, G'+1, V]

            # 3. verify: accept a prefix of the drafts, then one corrected or bonus token
            draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[None]  # [1, G', V]
            result = verify(
                proposal.tokens[None],  # [1, G']
                torch.tensor([num_drafted], dtype=torch.int64),  # [1]
                draft_probs,
                target_logits,
                params,
                generators=[generator],
                lossy=drafter.lossy,
            )
            num_accepted = int(result.num_accepted[0])
            emitted = result.output_tokens[0, : num_accepted + 1].tolist()
            stats.lossless = stats.lossless and bool(result.lossless)
            verify_end = time.perf_counter()
            stats.record_step(num_drafted, num_accepted, (verify_start - draft_start) * 1e3, (verify_end - verify_start) * 1e3)

            # 4. commit: cut at EOS, the token budget, or a stop string; nothing past them is emitted
            finish = None
            for i, token in enumerate(emitted):
                if token in eos_ids:
                    emitted, finish = emitted[: i + 1], "eos"
                    break
            if len(emitted) >= budget:
                emitted, finish = emitted[:budget], finish or "length"
            tokens.extend(emitted)
            context[length : length + len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
            length += len(emitted)
            cut = output_text.update(tokens, len(emitted))
            if cut is not None:
                del tokens[cut:]
                finish = "stop"
            stats.new_tokens = len(tokens)
            stats.wall_s = time.perf_counter() - start
            if on_step is not None:
                on_step(stats)
            if finish is not None:
                stats.finish_reason = finish
                break

            # 5. feedback: the drafter learns how many of its tokens survived
            drafter.feedback(num_accepted)

    output_text.finish()
    return GenerationResult(tokens=tokens, text=output_text.text, stats=stats)
