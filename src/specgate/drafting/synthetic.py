"""The synthetic drafter, for cost studies only: LOSSY (its output does not follow the target's distribution).

It proposes gamma copies of the last committed token at no model cost (c ~ 0) and hands the verifier
specgate.sampling.lossy.SyntheticAcceptanceLossy, which accepts draft i with a fixed rate whatever p and q say
(as vLLM's and llama.cpp's synthetic acceptance for benchmarking). That isolates the engine's cost per step at
a chosen acceptance profile. Every stats object of a run with it reads lossless = False.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal, Drafter


class SyntheticDrafter(Drafter):
    """Fixed per-position acceptance rates, or one rate chosen to give a target mean acceptance length."""

    lossless = False

    def __init__(self, rates: tuple[float, ...] | None = None, mean_acceptance_length: float | None = None, gamma: int | None = None) -> None:
        from specgate.sampling.lossy import SyntheticAcceptanceLossy

        if (rates is None) == (mean_acceptance_length is None):
            raise ValueError("synthetic drafter: give exactly one of rates (e.g. 0.9,0.8) or mean_acceptance_length (e.g. AL=3)")
        if mean_acceptance_length is not None:
            if gamma is None or gamma < 1:
                raise ValueError(f"synthetic drafter with AL={mean_acceptance_length} needs gamma >= 1, got gamma={gamma}")
            self.lossy = SyntheticAcceptanceLossy.from_mean_acceptance_length(mean_acceptance_length, gamma)
            self.name = f"synthetic_lossy(AL={mean_acceptance_length:g})"
        else:
            self.lossy = SyntheticAcceptanceLossy(rates=tuple(rates))
            self.name = "synthetic_lossy(rates=" + ",".join(f"{r:g}" for r in self.lossy.rates) + ")"

    @classmethod
    def from_spec(cls, spec: str, gamma: int | None = None) -> SyntheticDrafter:
        """'synthetic:0.9,0.8,0.7' (per-position rates) or 'synthetic:AL=3' (mean acceptance length)."""
        _, _, body = spec.partition(":")
        body = body.strip()
        fix = "use --draft synthetic:0.9,0.8 (per-position acceptance rates) or --draft synthetic:AL=3 (tokens per step)"
        try:
            if body.upper().startswith("AL="):
                return cls(mean_acceptance_length=float(body[3:]), gamma=gamma)
            return cls(rates=tuple(float(r) for r in body.split(",")))
        except ValueError as exc:
            if "synthetic" in str(exc) or "rate" in str(exc) or "mean_acceptance_length" in str(exc):
                raise
            raise ValueError(f"--draft {spec!r} is not a synthetic drafter spec: {fix}") from exc

    def propose(self, context_ids: Tensor, gamma: int) -> DraftProposal:
        return DraftProposal(tokens=context_ids[-1:].repeat(gamma).to(torch.int64), draft_probs=None)
