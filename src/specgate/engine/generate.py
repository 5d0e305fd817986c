"""Single-request speculative generation: the draft -> score -> verify -> commit -> feedback loop.

Prefill writes the prompt minus its last token into the target's KV cache. Each iteration then runs the decode
core (specgate.engine.decode, shared with the serving scheduler) on a batch of one: the last committed token
plus G' drafts (G' <= gamma) in ONE target forward at absolute positions, so a rejected draft needs no undo.
Each iteration emits num_accepted + 1 tokens, which makes the baseline (gamma = 0: no drafts, one token per
target pass, sampled by the same verifier) and every method count tokens the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal, Drafter
from specgate.engine.decode import DRAFT_STREAM, VERIFY_STREAM, DecodeState, decode_step, eos_token_ids, seeded_generator
from specgate.engine.stats import GenerationStats
from specgate.models.transformer import LogitsBuffer
from specgate.text import OutputText


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
    stats.finish_reason: "stop" (EOS or a stop string) or "length" (max_new_tokens).
    """
    model, tokenizer = target.model, target.tokenizer
    prompt_ids = encode_prompt(prompt, tokenizer)  # [L]
    prompt_len = int(prompt_ids.numel())
    validate_request(prompt_len, int(model.max_position_embeddings), int(gamma), int(max_new_tokens))
    max_seq_len = prompt_len + max_new_tokens + gamma + 1
    context = torch.empty(max_seq_len, dtype=torch.int64)  # [S] prompt + committed tokens (+ scratch)
    context[:prompt_len] = prompt_ids
    state = DecodeState(
        context=context, length=prompt_len, tokens=[], max_new_tokens=int(max_new_tokens), params=params,
        eos_ids=eos_token_ids(target) if eos_ids is None else set(eos_ids), text=OutputText(tokenizer, stop, on_text),
        verify_generator=seeded_generator(seed, VERIFY_STREAM),
    )
    stats = GenerationStats(drafter=drafter.name, gamma=int(gamma), lossless=bool(drafter.lossless), prompt_tokens=prompt_len)

    with torch.inference_mode():
        cache = model.new_cache(1, max_seq_len)
        drafter.begin(prompt_ids, params, seeded_generator(seed, DRAFT_STREAM), max_seq_len)
        start = time.perf_counter()
        _prefill(model, cache, prompt_ids, stats, drafter)
        stats.prefill_ms = (time.perf_counter() - start) * 1e3
        target_pass = _TargetPass(model, cache, torch.zeros(1, dtype=torch.int64), LogitsBuffer(model.vocab_size))
        while True:
            finish, num_accepted = _step(state, stats, drafter, int(gamma), target_pass)
            stats.new_tokens = len(state.tokens)
            stats.wall_s = time.perf_counter() - start
            if on_step is not None:
                on_step(stats)
            if finish is not None:
                stats.finish_reason = finish
                break
            drafter.feedback(num_accepted)  # 5. feedback: the drafter learns how many of its drafts survived

    state.text.finish()
    return GenerationResult(tokens=state.tokens, text=state.text.text, stats=stats)


def _prefill(model: Any, cache: Any, prompt_ids: Tensor, stats: GenerationStats, drafter: Drafter) -> None:
    """Write the prompt but its last token into the cache (the first step feeds that one with its drafts); a
    drafter that reads the target's features gets their final-norm states (positions 0..L-2)."""
    prompt_len = int(prompt_ids.numel())
    if prompt_len > 1:
        positions = torch.arange(prompt_len - 1, dtype=torch.int64)[None]  # [1, L-1]
        wants = drafter.wants_features
        hidden = model.forward(prompt_ids[None, :-1], positions, cache, torch.zeros(1, dtype=torch.int64), logits=False, return_hidden=wants)
        if wants:
            drafter.observe_features(0, hidden[0].float())  # [L-1, H]
        stats.prefill_passes = 1
        stats.target_forward_passes = 1


@dataclass
class _TargetPass:
    """What the target's scoring pass needs: the model, its one-slot cache, and a logits block kept across steps."""

    model: Any
    cache: Any
    slots: Tensor  # [1] the request's cache row
    logits_buffer: LogitsBuffer


def _step(state: DecodeState, stats: GenerationStats, drafter: Drafter, gamma: int, target: _TargetPass) -> tuple[str | None, int]:
    """One iteration: 1. draft, 2-3. score and verify (the decode core), 4. commit. Returns (finish reason, accepted)."""
    draft_start = time.perf_counter()
    step_gamma = min(gamma, state.max_new_tokens - len(state.tokens) - 1)  # drafts past the budget are never emitted
    if step_gamma > 0:
        proposal = drafter.propose(state.context[: state.length], step_gamma)
    else:
        proposal = DraftProposal(tokens=torch.empty(0, dtype=torch.int64), draft_probs=None)
    stats.draft_forward_passes += proposal.forward_passes
    verify_start = time.perf_counter()
    result = decode_step(
        target.model, target.cache, target.slots, [state], [proposal], lossy=drafter.lossy, logits_buffer=target.logits_buffer,
        return_features=drafter.wants_features,
    )
    if result.failed:
        raise ValueError(
            f"the target model produced non-finite logits (NaN or inf) at position {state.length - 1}: "
            "check the model's weights and dtype (float32 rules out bf16 overflow)"
        )
    num_accepted = result.num_accepted[0]
    if result.features is not None:  # the states after the last committed token and the accepted drafts
        drafter.observe_features(state.length - 1, result.features[0, : num_accepted + 1].float())
    stats.lossless = stats.lossless and result.lossless
    verify_ms = (time.perf_counter() - verify_start) * 1e3
    stats.record_step(proposal.num_tokens, num_accepted, (verify_start - draft_start) * 1e3, verify_ms)
    return state.commit(result.emitted[0]), num_accepted
