"""Counters and derived figures of one speculative generation (the lesson's call-count table and more).

Definitions (counted the same way for the baseline, gamma = 0, and every method):
- iterations: draft -> verify steps after prefill; each emits num_accepted + 1 tokens (fewer only when EOS, a
  stop string or max_new_tokens cuts the last step).
- target_forward_passes = iterations + prefill_passes (prefill_passes is 1, or 0 for a one-token prompt).
- acceptance_rate AR = accepted / drafted (vLLM's definition).
- acceptance_length AL = (accepted + iterations) / iterations: tokens produced per target step.
- accepted_per_position[i]: how many steps accepted the draft at position i (marginal counts, vLLM-style;
  divide by iterations for the per-position rate).
- steps_by_draft_length[k]: how many steps drafted exactly k tokens (a lookup drafter often drafts fewer than
  gamma; Spec-Bench records the same per step), so the analytical model can be applied to the lengths that ran.
- measured_alpha: Leviathan's alpha (the probability that one draft is accepted, i.i.d. model). Every tested
  draft is one Bernoulli(alpha) trial and testing stops at the first rejection, so the maximum-likelihood
  estimate is accepted / (accepted + rejections). AR underestimates alpha because drafts after a rejection are
  never tested (under the model AR = alpha (1 - alpha^gamma) / ((1 - alpha) gamma)); with full acceptance
  alpha_hat = 1.
- measured_c: draft cost per drafted token divided by the cost of one target step (Leviathan's c, which is
  the time of one draft-model call over one target-model call), c = (draft_ms_total / drafted_tokens) /
  (verify_ms_total / iterations). verify_ms covers the target forward of G+1 tokens plus the verifier.
- predicted_speedup: specgate.theory.speedup(measured_alpha, gamma, measured_c), the analytical speedup the
  measured alpha and c imply (Leviathan et al., S = (1 - a^(g+1)) / ((1 - a)(g c + 1))). The model assumes
  gamma drafts every step: for a drafter that often proposes fewer (n-gram lookup without a match) it
  overstates the speedup; compare acceptance_length with the closed form's E[T] to see by how much.
- wall_s: seconds from the start of prefill to the last token (loading excluded); tokens_per_s = tokens / wall_s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    drafter: str = "none"
    gamma: int = 0
    lossless: bool = True
    iterations: int = 0
    prefill_passes: int = 0
    draft_forward_passes: int = 0
    target_forward_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    steps_by_draft_length: list[int] = field(default_factory=list)
    new_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = "length"  # OpenAI's: "stop" (EOS or a stop string) or "length" (max_new_tokens)
    prefill_ms: float = 0.0
    draft_ms_total: float = 0.0
    verify_ms_total: float = 0.0
    wall_s: float = 0.0

    def record_step(self, num_drafted: int, num_accepted: int, draft_ms: float, verify_ms: float) -> None:
        """Count one draft -> verify step."""
        self.iterations += 1
        self.target_forward_passes += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.rejections += int(num_accepted < num_drafted)
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        if len(self.steps_by_draft_length) <= num_drafted:
            self.steps_by_draft_length.extend([0] * (num_drafted + 1 - len(self.steps_by_draft_length)))
        self.steps_by_draft_length[num_drafted] += 1
        self.draft_ms_total += draft_ms
        self.verify_ms_total += verify_ms

    # ---- derived figures (None where undefined, e.g. AR with no drafts) ----
    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        return (self.accepted_tokens + self.iterations) / self.iterations if self.iterations else None

    @property
    def measured_alpha(self) -> float | None:
        tested = self.accepted_tokens + self.rejections
        return self.accepted_tokens / tested if tested else None

    @property
    def draft_ms_per_step(self) -> float | None:
        return self.draft_ms_total / self.iterations if self.iterations else None

    @property
    def verify_ms_per_step(self) -> float | None:
        return self.verify_ms_total / self.iterations if self.iterations else None

    @property
    def measured_c(self) -> float | None:
        if not self.drafted_tokens or not self.iterations or self.verify_ms_total <= 0:
            return None
        return (self.draft_ms_total / self.drafted_tokens) / (self.verify_ms_total / self.iterations)

    @property
    def predicted_speedup(self) -> float | None:
        """Leviathan's speedup from the measured alpha and c (None for the baseline or without drafts)."""
        alpha, c = self.measured_alpha, self.measured_c
        if self.gamma <= 0 or alpha is None or c is None:
            return None
        try:
            from specgate.theory import speedup  # lazy: the analytical model lives in its own module
        except ImportError:
            return None
        return float(speedup(alpha, self.gamma, c))

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in (
            "acceptance_rate",
            "acceptance_length",
            "measured_alpha",
            "measured_c",
            "predicted_speedup",
            "draft_ms_per_step",
            "verify_ms_per_step",
            "tokens_per_s",
        ):
            value = getattr(self, name)
            out[name] = None if value is None or (isinstance(value, float) and not math.isfinite(value)) else value
        return out
