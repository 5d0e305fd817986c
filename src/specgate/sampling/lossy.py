"""Labelled lossy verification modes. Each is off unless passed explicitly (`verify(..., lossy=mode)`).

Their output does NOT follow the target distribution: every VerifierOutput they return has
`lossless=False` and `mode` set to the mode's name (which contains "lossy"), so metrics, reports and the
gate can exclude them from lossless claims. The statistical suite (`lossless_check`) runs each of them as a
negative control and must reject it.

All modes consume the same random draws as the exact sampler (n_b accept uniforms, then one sample uniform
per row; see verifier.py), whether or not they use them, so a seed produces aligned streams across modes.

* TypicalAcceptanceLossy (Medusa, Cai et al. 2024): accept x_i iff p_i(x_i) > min(eps, delta * exp(-H(p_i)))
  (H in nats); at the first rejection emit a token sampled from p_i (not a residual); if all are accepted,
  the bonus token from p_{n_b}. The draft distribution is not used.
* SyntheticAcceptanceLossy (vLLM / llama.cpp benchmarking aid): accept draft i with a fixed conditional
  probability rate_i, ignoring p and q; on rejection emit a token from p_i, else the bonus from p_{n_b}.
  `from_mean_acceptance_length(L, gamma)` picks one constant rate whose expected tokens per step
  (1 - a^(gamma+1)) / (1 - a) equals L.
* EntropyGatedLossy (in the spirit of FLy, "loosely" speculative decoding): where the target is uncertain
  (H(p_i) > entropy_threshold nats) a draft among the target's top_k tokens is accepted outright; elsewhere the
  exact test u * q(x) < p(x) applies. At the first rejection (always an exact-test rejection) the token is
  sampled from the normalised residual (p - q)+ as in the exact sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from specgate.sampling.verifier import (
    Generators,
    VerifierOutput,
    accepted_prefix_length,
    assemble_output,
    draw_uniforms,
    gather_token_probs,
    sample_final_tokens,
    validate_verifier_inputs,
)


def entropy_nats(probs: Tensor) -> Tensor:
    """Shannon entropy in nats of `# [..., V]` probabilities -> `# [...]` float64 (0 log 0 = 0)."""
    return -torch.special.xlogy(probs, probs).sum(-1).double()


class LossyMode:
    """Base class: `verify` runs the shared skeleton, subclasses decide acceptance and the emitted token."""

    name: ClassVar[str] = "lossy"
    lossless: ClassVar[bool] = False
    residual_on_reject: ClassVar[bool] = False  # True: emit from (p - q)+ at a rejection; False: emit from p

    def accept(
        self, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor, accept_uniforms: Tensor
    ) -> Tensor:
        """`# [B, G]` bool acceptance of each draft (before masking the ragged padding)."""
        raise TypeError(f"{type(self).__name__} must define accept(); use one of the modes in this module")

    def verify(
        self,
        draft_tokens: Tensor,
        num_draft_tokens: Tensor,
        draft_probs: Tensor | None,
        target_probs: Tensor,
        generators: Generators = None,
        *,
        validate: bool = True,
    ) -> VerifierOutput:
        """Same inputs and output layout as `rejection_sample`; output.lossless is False."""
        if validate:
            validate_verifier_inputs(draft_tokens, num_draft_tokens, draft_probs, target_probs)
        gamma = draft_tokens.shape[1]
        accept_u, sample_u = draw_uniforms(num_draft_tokens, gamma, generators)
        valid = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft_tokens[:, None]  # [B, G]
        safe_tokens = torch.where(valid, draft_tokens, 0).long()  # [B, G]
        accepted = self.accept(safe_tokens, draft_probs, target_probs, accept_u) & valid
        num_accepted = accepted_prefix_length(accepted)  # [B]
        rejected = num_accepted < num_draft_tokens
        use_residual = rejected if self.residual_on_reject else torch.zeros_like(rejected)
        final = sample_final_tokens(target_probs, draft_probs, safe_tokens, num_accepted, use_residual, sample_u)
        return assemble_output(draft_tokens, num_accepted, final, lossless=False, mode=self.name)


@dataclass(frozen=True)
class TypicalAcceptanceLossy(LossyMode):
    """Medusa's typical acceptance: accept x iff p(x) > min(eps, delta * exp(-H(p))). LOSSY.

    eps (posterior threshold) in (0, 1], delta (posterior alpha) >= 0; Medusa's defaults are 0.09 and 0.3.
    """

    eps: float = 0.09
    delta: float = 0.3
    name: ClassVar[str] = "typical_acceptance_lossy"

    def __post_init__(self) -> None:
        if not (0.0 < self.eps <= 1.0):
            raise ValueError(f"eps={self.eps} is out of range: use a probability threshold in (0, 1] (Medusa: 0.09)")
        if not (math.isfinite(self.delta) and self.delta >= 0.0):
            raise ValueError(f"delta={self.delta} is out of range: use a finite value >= 0 (Medusa: 0.3)")

    def accept(self, draft_tokens, draft_probs, target_probs, accept_uniforms):  # noqa: D102
        gamma = draft_tokens.shape[1]
        p_draft = gather_token_probs(target_probs[:, :gamma], draft_tokens)  # [B, G]
        threshold = torch.clamp(self.delta * torch.exp(-entropy_nats(target_probs[:, :gamma])), max=self.eps)
        return p_draft > threshold


@dataclass(frozen=True)
class SyntheticAcceptanceLossy(LossyMode):
    """Accept draft i with the fixed conditional probability rates[i] (the last rate repeats). LOSSY.

    For cost studies without a real draft; the decision ignores p and q. rates: each in [0, 1].
    """

    rates: Sequence[float] = (0.8,)
    name: ClassVar[str] = "synthetic_acceptance_lossy"

    def __post_init__(self) -> None:
        rates = tuple(float(r) for r in self.rates)
        if not rates or any(not (0.0 <= r <= 1.0) for r in rates):
            raise ValueError(
                f"rates={list(self.rates)} is invalid: give at least one per-position acceptance rate, each in [0, 1]"
            )
        object.__setattr__(self, "rates", rates)

    @classmethod
    def from_mean_acceptance_length(cls, mean_acceptance_length: float, gamma: int) -> SyntheticAcceptanceLossy:
        """The constant rate a with (1 - a^(gamma+1)) / (1 - a) = mean_acceptance_length (tokens per step)."""
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma={gamma!r} is out of range: use an integer >= 1")
        if not (1.0 <= mean_acceptance_length <= gamma + 1):
            raise ValueError(
                f"mean_acceptance_length={mean_acceptance_length} is out of range: with gamma={gamma} it must be in "
                f"[1, {gamma + 1}] (tokens emitted per verification step)"
            )

        def tokens_per_step(a: float) -> float:
            return sum(a**k for k in range(gamma + 1))

        low, high = 0.0, 1.0
        for _ in range(100):  # bisection: tokens_per_step is increasing in a
            mid = (low + high) / 2
            low, high = (mid, high) if tokens_per_step(mid) < mean_acceptance_length else (low, mid)
        return cls(rates=((low + high) / 2,))

    def accept(self, draft_tokens, draft_probs, target_probs, accept_uniforms):  # noqa: D102
        gamma = draft_tokens.shape[1]
        rates = [self.rates[min(i, len(self.rates) - 1)] for i in range(gamma)]
        return accept_uniforms < torch.tensor(rates, dtype=torch.float64, device=accept_uniforms.device)[None, :]


@dataclass(frozen=True)
class EntropyGatedLossy(LossyMode):
    """FLy-style loose verification: where H(p) > entropy_threshold nats, accept any top_k draft. LOSSY.

    entropy_threshold >= 0 (nats); top_k >= 1. Elsewhere the exact test applies; rejections use (p - q)+.
    """

    entropy_threshold: float = 1.0
    top_k: int = 5
    name: ClassVar[str] = "entropy_gated_lossy"
    residual_on_reject: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.entropy_threshold) and self.entropy_threshold >= 0.0):
            raise ValueError(f"entropy_threshold={self.entropy_threshold} is out of range: use a value >= 0 (nats)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k={self.top_k!r} is out of range: use an integer >= 1")

    def accept(self, draft_tokens, draft_probs, target_probs, accept_uniforms):  # noqa: D102
        gamma = draft_tokens.shape[1]
        target_draft = target_probs[:, :gamma]  # [B, G, V]
        p_draft = gather_token_probs(target_draft, draft_tokens)  # [B, G]
        if draft_probs is None:
            exact = accept_uniforms < p_draft
        else:
            exact = accept_uniforms * gather_token_probs(draft_probs, draft_tokens) < p_draft
        k = min(self.top_k, target_probs.shape[-1])
        kth_prob = torch.topk(target_draft, k, dim=-1).values[..., -1].double()  # [B, G]
        loose = (entropy_nats(target_draft) > self.entropy_threshold) & (p_draft >= kth_prob) & (p_draft > 0)
        return exact | loose


LOSSY_MODES = {
    "typical": TypicalAcceptanceLossy,
    "synthetic": SyntheticAcceptanceLossy,
    "entropy_gated": EntropyGatedLossy,
}
