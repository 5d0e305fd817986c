"""Speculation policies: how many draft tokens (gamma) each running request gets at each scheduler step.

    policy.choose(acceptance) -> list[int]      # acceptance: per running request, its live alpha estimate

- `off`: gamma 0 for everyone (plain target decoding through the same loop).
- `fixed`: the same gamma every step, whatever the load.
- `table`: vLLM-style per-batch-size table [(lo, hi, gamma), ...]; a batch size outside every range gets 0.
- `adaptive`: a cost model calibrated on the running machine (target step time as a function of batch size
  and tokens verified per row, draft step time per draft token as a function of batch size) and each
  request's live acceptance estimate; each step it picks the gamma in 0..gamma_max that maximises expected
  goodput = sum_i E[T](alpha_i, gamma) / predicted step time (Leviathan's E[T], specgate.theory).

The adaptive policy picks ONE gamma per step, shared by every running request: the batched target pass is
padded to the longest row (T = max gamma + 1 for every row) and the batched draft pass runs max gamma
sequential draft forwards, so the step's cost is set by the largest gamma; giving every row that gamma adds
expected tokens at no extra modelled cost. Requests without an estimate yet use `prior_alpha`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specgate.theory import expected_tokens

POLICY_NAMES = ("adaptive", "fixed", "table", "off")
CALIBRATION_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_GAMMA_MAX = 8


def _check_gamma(gamma: int, name: str = "gamma") -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 0 <= gamma <= 64:
        raise ValueError(f"{name}={gamma!r} is out of range: use an integer in 0..64 (0 = no drafting)")
    return gamma


class SpeculationPolicy(ABC):
    """Chooses per-request gamma for one step. `acceptance[i]` is request i's alpha estimate (or None)."""

    name = "policy"

    @abstractmethod
    def choose(self, acceptance: Sequence[float | None]) -> list[int]:
        """One gamma (>= 0) per running request."""

    def describe(self) -> dict:
        return {"policy": self.name}


class OffPolicy(SpeculationPolicy):
    name = "off"

    def choose(self, acceptance: Sequence[float | None]) -> list[int]:
        return [0] * len(acceptance)


class FixedPolicy(SpeculationPolicy):
    name = "fixed"

    def __init__(self, gamma: int) -> None:
        self.gamma = _check_gamma(gamma)

    def choose(self, acceptance: Sequence[float | None]) -> list[int]:
        return [self.gamma] * len(acceptance)

    def describe(self) -> dict:
        return {"policy": self.name, "gamma": self.gamma}


class TablePolicy(SpeculationPolicy):
    """vLLM's num_speculative_tokens_per_batch_size: [(lo, hi, gamma), ...], ranges inclusive, first match wins."""

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
            rows.append((lo, hi, _check_gamma(gamma)))
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

    def choose(self, acceptance: Sequence[float | None]) -> list[int]:
        return [self.gamma_for(len(acceptance))] * len(acceptance)

    def describe(self) -> dict:
        return {"policy": self.name, "table": [list(row) for row in self.table]}


@dataclass
class CostModel:
    """Predicted step times in ms, interpolated from measurements.

    target_ms[(batch, tokens_per_row)]: one target forward of `batch` rows of `tokens_per_row` tokens each;
    draft_ms[batch]: one draft forward of `batch` rows of one token (a step with gamma drafts costs gamma of
    them; empty for lookup drafters, whose cost is negligible). Between measured points the time is linear in
    tokens per row and piecewise linear in batch size (extrapolated from the last segment beyond the grid).
    """

    target_ms: dict[tuple[int, int], float]
    draft_ms: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.target_ms:
            raise ValueError("target_ms is empty: the cost model needs at least one measured (batch, tokens) time")
        self.batches = sorted({b for b, _ in self.target_ms})
        self.tokens = sorted({t for _, t in self.target_ms})
        missing = [(b, t) for b in self.batches for t in self.tokens if (b, t) not in self.target_ms]
        if missing:
            raise ValueError(f"target_ms misses grid points {missing}: measure every (batch, tokens) pair")

    @staticmethod
    def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
        if len(xs) == 1:
            return float(ys[0]) * (x / xs[0] if xs[0] else 1.0)  # one point: proportional
        if x <= xs[0]:
            i = 0
        elif x >= xs[-1]:
            i = len(xs) - 2
        else:
            i = int(np.searchsorted(xs, x)) - 1
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return float(max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-6))

    def target_step_ms(self, batch: int, tokens_per_row: int) -> float:
        by_batch = [self._interp(tokens_per_row, self.tokens, [self.target_ms[(b, t)] for t in self.tokens]) for b in self.batches]
        return self._interp(batch, self.batches, by_batch)

    def draft_step_ms(self, batch: int) -> float:
        if not self.draft_ms:
            return 0.0
        batches = sorted(self.draft_ms)
        return self._interp(batch, batches, [self.draft_ms[b] for b in batches])

    def step_ms(self, batch: int, gamma: int) -> float:
        """A whole step: gamma sequential draft forwards, then one target forward of gamma + 1 tokens per row."""
        return gamma * self.draft_step_ms(batch) + self.target_step_ms(batch, gamma + 1)

    def to_dict(self) -> dict:
        return {
            "target_ms": [[b, t, round(ms, 3)] for (b, t), ms in sorted(self.target_ms.items())],
            "draft_ms": [[b, round(ms, 3)] for b, ms in sorted(self.draft_ms.items())],
        }


class AdaptivePolicy(SpeculationPolicy):
    """Maximise expected goodput (emitted tokens per ms) over one shared gamma in 0..gamma_max each step."""

    name = "adaptive"

    def __init__(self, cost_model: CostModel, gamma_max: int = DEFAULT_GAMMA_MAX, prior_alpha: float = 0.5) -> None:
        self.cost_model = cost_model
        self.gamma_max = _check_gamma(gamma_max, "gamma_max")
        if not 0.0 <= prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha={prior_alpha} is out of range [0, 1]")
        self.prior_alpha = prior_alpha

    def goodput(self, acceptance: Sequence[float | None], gamma: int) -> float:
        """Expected emitted tokens per ms of one step with `gamma` drafts for every request."""
        alphas = [self.prior_alpha if a is None else min(max(a, 0.0), 1.0) for a in acceptance]
        tokens = len(alphas) if gamma == 0 else sum(expected_tokens(a, gamma) for a in alphas)
        return tokens / self.cost_model.step_ms(len(alphas), gamma)

    def choose(self, acceptance: Sequence[float | None]) -> list[int]:
        if not acceptance:
            return []
        best = max(range(self.gamma_max + 1), key=lambda g: (self.goodput(acceptance, g), -g))
        return [best] * len(acceptance)

    def describe(self) -> dict:
        return {"policy": self.name, "gamma_max": self.gamma_max, "prior_alpha": self.prior_alpha, "cost_model": self.cost_model.to_dict()}


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() in ms over `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def calibrate_cost_model(
    target_model,
    draft_model=None,
    *,
    gamma_max: int = DEFAULT_GAMMA_MAX,
    batch_sizes: Sequence[int] = CALIBRATION_BATCH_SIZES,
    context_len: int = 64,
    repeats: int = 3,
) -> CostModel:
    """Measure target forwards (batch x {1, gamma_max + 1} tokens per row) and draft forwards (batch x 1 token).

    target_model / draft_model: specgate CausalLM (draft None for lookup drafters). Runs on a scratch cache of
    max(batch_sizes) slots whose first context_len positions are filled, so attention reads a realistic context.
    Each point is the median of `repeats` runs after a warm-up; the grid is then made monotone (see monotone).
    Calibrate on a quiet machine: the policy is only as good as these numbers.
    """
    import torch

    _check_gamma(gamma_max, "gamma_max")
    tokens_grid = sorted({1, gamma_max + 1})
    max_batch = max(batch_sizes)
    seq_len = context_len + gamma_max + 1
    target_ms: dict[tuple[int, int], float] = {}
    draft_ms: dict[int, float] = {}
    with torch.inference_mode():
        models = [("target", target_model)] + ([("draft", draft_model)] if draft_model is not None else [])
        for role, model in models:
            cache = model.new_cache(max_batch, seq_len)
            slots = torch.arange(max_batch, dtype=torch.int64)  # [B]
            ids = torch.ones(max_batch, context_len, dtype=torch.int64)  # [B, L]
            model.forward(ids, torch.arange(context_len)[None].expand(max_batch, -1), cache, slots, last_only=True)
            for batch in batch_sizes:
                for tokens in tokens_grid if role == "target" else [1]:
                    step_ids = torch.ones(batch, tokens, dtype=torch.int64)  # [B, T]
                    positions = torch.arange(context_len, context_len + tokens)[None].expand(batch, -1)  # [B, T]
                    ms = time_ms(lambda: model.forward(step_ids, positions, cache, slots[:batch]), repeats)
                    if role == "target":
                        target_ms[(batch, tokens)] = ms
                    else:
                        draft_ms[batch] = ms
    return monotone(CostModel(target_ms=target_ms, draft_ms=draft_ms))


def monotone(cost: CostModel) -> CostModel:
    """Noise guard: a step never gets cheaper with more rows or more tokens (running maxima over the grid).

    Timing noise (another process on the cores) can make a larger batch measure faster than a smaller one;
    left in, the goodput argmax would chase the noise.
    """
    target_ms = dict(cost.target_ms)
    for i, batch in enumerate(cost.batches):
        for j, tokens in enumerate(cost.tokens):
            below = [target_ms[(cost.batches[i - 1], tokens)]] if i else []
            below += [target_ms[(batch, cost.tokens[j - 1])]] if j else []
            target_ms[(batch, tokens)] = max([target_ms[(batch, tokens)], *below])
    draft_ms, running = {}, 0.0
    for batch in sorted(cost.draft_ms):
        running = max(running, cost.draft_ms[batch])
        draft_ms[batch] = running
    return CostModel(target_ms=target_ms, draft_ms=draft_ms)


def make_policy(name: str, *, gamma: int = 4, table: str | None = None, cost_model: CostModel | None = None) -> SpeculationPolicy:
    """Build a policy by name: 'off', 'fixed' (gamma), 'table' (table text), 'adaptive' (cost model, gamma_max=gamma)."""
    if name == "off":
        return OffPolicy()
    if name == "fixed":
        return FixedPolicy(gamma)
    if name == "table":
        if not table:
            raise ValueError("--policy table needs --gamma-table, e.g. '1-4:4,5-8:2,9-64:0'")
        return TablePolicy.parse(table)
    if name == "adaptive":
        if cost_model is None:
            raise ValueError("the adaptive policy needs a cost model: calibrate one with calibrate_cost_model()")
        return AdaptivePolicy(cost_model, gamma_max=gamma)
    raise ValueError(f"--policy {name!r} is unknown: use one of {', '.join(POLICY_NAMES)}")
