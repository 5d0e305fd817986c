"""One request generated and timed, in specgate's engine or in transformers' generate(), as one record shape.

A run is {"tokens": new token ids, "wall_s", "call_s", "cpu_s", "stats"}: wall_s is the engine's own clock (prefill
to last token, specgate.engine stats) for specgate and the time around generate() for transformers; call_s is the
time around the call for both (tokenisation outside it where the prompt is ids); cpu_s is the process CPU time of
the call; stats is the engine's GenerationStats (None for transformers).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from specgate.engine import generate
from specgate.sampling import SamplingParams


def own_run(target: Any, drafter: Any, gamma: int, prompt: str | list[int], max_new_tokens: int,
            temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """specgate.engine.generate of one prompt (text or ids) with this drafter and gamma."""
    cpu_start, start = time.process_time(), time.perf_counter()
    result = generate(prompt, target, drafter, gamma, SamplingParams(temperature=temperature), seed=seed, max_new_tokens=max_new_tokens)
    call_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    return {"tokens": result.tokens, "wall_s": result.stats.wall_s, "call_s": call_s, "cpu_s": cpu_s, "stats": result.stats}


def hf_run(model: Any, prompt_ids: torch.Tensor, max_new_tokens: int, lookup: int | None = None, assistant: Any = None,
           exact_length: bool = False) -> dict[str, Any]:
    """transformers' greedy generate() of prompt_ids [1, L] (attention mask all ones); lookup: prompt lookup with
    that many tokens; assistant: assisted generation with that model; exact_length: min_new_tokens =
    max_new_tokens (no early stop at EOS)."""
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if exact_length:
        kwargs["min_new_tokens"] = max_new_tokens
    cpu_start, start = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), **kwargs)
    call_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    return {"tokens": out[0, prompt_ids.shape[1] :].tolist(), "wall_s": call_s, "call_s": call_s, "cpu_s": cpu_s, "stats": None}


def prompt_ids(tokenizer: Any, prompt: str) -> torch.Tensor:
    """The tokenizer's ids of prompt as [1, L] (special tokens as the tokenizer adds them)."""
    return torch.tensor([tokenizer(prompt)["input_ids"]])


def tokens_per_s(run: dict[str, Any]) -> float:
    return len(run["tokens"]) / run["wall_s"]
