"""The policies that need no model: `off` (gamma 0 for everyone: plain target decoding through the same loop),
`fixed` (the same gamma every step, whatever the load) and `table` (vLLM-style per-batch-size table)."""

from __future__ import annotations

from collections.abc import Sequence

from specgate.serving.policy.base import Acceptance, SpeculationPolicy, check_gamma


class OffPolicy(SpeculationPolicy):
    name = "off"
    max_gamma = 0

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        return [0] * len(acceptance)


class FixedPolicy(SpeculationPolicy):
    name = "fixed"

    def __init__(self, gamma: int) -> None:
        self.gamma = check_gamma(gamma)

    @property
    def max_gamma(self) -> int:
        return self.gamma

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        return [self.gamma] * len(acceptance)

    def describe(self) -> dict:
        return {"policy": self.name, "gamma": self.gamma}


class TablePolicy(SpeculationPolicy):
    """vLLM's num_speculative_tokens_per_batch_size: [(lo, hi, gamma), ...], ranges inclusive, first match wins;
    a batch size outside every range gets 0."""

    name = "table"

    def __init__(self, table: Sequence[tuple[int, int, int]]) -> None:
        if not table:
            raise ValueError("table=[] is empty: give at least one (lo, hi, gamma) range, e.g. [(1, 4, 4), (5, 16, 0)]")
        rows = []
        for entry in table:
            if len(entry) != 3:
                raise ValueError(f"table entry {entry!r} must be (lo, hi, gamma)")
            lo, hi, gamma = (int(v) for v in entry)
            if not 1 <= lo <= hi:
                raise ValueError(f"table range {lo}-{hi} is invalid: need 1 <= lo <= hi (batch sizes)")
            rows.append((lo, hi, check_gamma(gamma)))
        self.table = rows

    @staticmethod
    def parse(text: str) -> "TablePolicy":
        """'1-4:4,5-8:2,9-16:0' -> TablePolicy([(1, 4, 4), (5, 8, 2), (9, 16, 0)])."""
        rows = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            try:
                span, gamma = part.split(":")
                lo, _, hi = span.partition("-")
                rows.append((int(lo), int(hi or lo), int(gamma)))
            except ValueError:
                raise ValueError(
                    f"--gamma-table entry {part!r} is not LO-HI:GAMMA: write e.g. '1-4:4,5-8:2,9-64:0'"
                ) from None
        return TablePolicy(rows)

    def gamma_for(self, batch_size: int) -> int:
        for lo, hi, gamma in self.table:
            if lo <= batch_size <= hi:
                return gamma
        return 0

    @property
    def max_gamma(self) -> int:
        return max(gamma for _, _, gamma in self.table)

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        return [self.gamma_for(len(acceptance))] * len(acceptance)

    def describe(self) -> dict:
        return {"policy": self.name, "table": [list(row) for row in self.table]}
