"""Logits processing: temperature, top-k and top-p, applied the same way to the target and the draft.

Speculative sampling is lossless with respect to the distributions it is given. When the engine samples
with temperature / top-k / top-p, it must therefore hand the verifier the *processed* target distribution
p' = process(p) and the *processed* draft distribution q' = process(q) (the draft token must really have
been drawn from q'). The guarantee is then: the emitted tokens have exactly the law of sampling from p'
autoregressively, i.e. of plain target-only sampling with the same SamplingParams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from logits.

    temperature: >= 0; 0.0 means greedy (argmax), 1.0 leaves the logits unchanged.
    top_k: >= 0; keep the k most likely tokens (ties at the k-th value are kept too); 0 turns it off.
    top_p: in (0, 1]; keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 turns it off.
    Temperature is applied first, then top-k, then top-p (on the already top-k-filtered distribution).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature={self.temperature} is out of range: use a finite value >= 0 (0.0 for greedy)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is out of range: use an integer >= 0 (0 turns top-k off)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1] (1.0 turns top-p off)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} is out of range: use a value in (0, 1] (1.0 turns top-p off)")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Turn logits `# [..., V]` into float32 probabilities `# [..., V]` after temperature, top-k and top-p.

    Greedy params give the one-hot of the argmax (first index on ties), so greedy verification is the same
    rejection sampler with one-hot distributions. Apply this identically to target and draft logits.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected [..., V] with V >= 1")
    logits = logits.float()
    vocab_size = logits.shape[-1]
    if params.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < vocab_size:
        kth_value = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest prefix of tokens (by descending probability) whose mass reaches top_p; renormalise."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., V] mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p  # the most likely token always has mass_before 0 and is kept
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)
