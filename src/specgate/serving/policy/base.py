"""The speculation-policy interface: how many draft tokens (gamma) each running request gets at one scheduler step.

    policy.choose(acceptance, caps) -> list[int]
        acceptance[i]: request i's live estimate: None (unknown), one alpha, or conditional rates per draft
                       position [a_1, a_2, ...] (specgate.serving.acceptance); caps[i]: the most drafts request i
                       can take this step (its remaining budget - 1; for lookup drafters, the drafts available).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

Acceptance = float | Sequence[float] | None  # one alpha, conditional rates per position, or unknown


def check_gamma(gamma: int, name: str = "gamma") -> int:
    """gamma itself if it is an int in 0..64; else a ValueError naming it and the range."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 0 <= gamma <= 64:
        raise ValueError(f"{name}={gamma!r} is out of range: use an integer in 0..64 (0 = no drafting)")
    return gamma


class SpeculationPolicy(ABC):
    """Chooses per-request gamma for one step. `acceptance[i]` is request i's alpha estimate (or None)."""

    name = "policy"

    @property
    @abstractmethod
    def max_gamma(self) -> int:
        """The largest gamma this policy can ever choose (the scheduler proposes lookup drafts up to it)."""

    @abstractmethod
    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        """One gamma (>= 0) per running request; the scheduler clips each to caps[i] anyway."""

    def observe_step(self, batch: int, width_tokens: int, target_ms: float, emitted: int | None = None) -> None:
        """A measured step (`batch` rows, padded to `width_tokens` tokens each; its target forward in ms, draft
        passes excepted; the tokens it committed, None when unknown); most policies ignore it."""

    def describe(self) -> dict:
        return {"policy": self.name}
