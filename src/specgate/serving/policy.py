"""Speculation policies: how many draft tokens (gamma) each running request gets at each scheduler step.

    policy.choose(acceptance, caps) -> list[int]
        acceptance[i]: request i's live estimate: None (unknown), one alpha, or conditional rates per draft
                       position [a_1, a_2, ...] (specgate.serving.acceptance); caps[i]: the most drafts request i
                       can take this step (its remaining budget - 1; for lookup drafters, the drafts available).

- `off`: gamma 0 for everyone (plain target decoding through the same loop).
- `fixed`: the same gamma every step, whatever the load.
- `table`: vLLM-style per-batch-size table [(lo, hi, gamma), ...]; a batch size outside every range gets 0.
- `adaptive`: a cost model calibrated on the running machine (target step time as a function of batch size
  and tokens per row, draft step time as a function of the rows drafting) and each request's live acceptance
  profile; each step it chooses the VECTOR of gammas (0 included) that maximises expected goodput =
  sum_i E[T_i](gamma_i) / predicted step time, E[T](gamma) = 1 + sum_{k<=gamma} prod_{j<=k} a_j.

Joint choice. The batched target pass is padded to its widest row, W = max gamma_i + 1 tokens per row (its
price depends on the batch and on W), and the draft model's k-th sequential pass runs over the rows with
gamma_i >= k. So the adaptive policy searches, for every width W in 1..gamma_max and every k, the plan "the k
requests with the most expected extra tokens at min(cap_i, W) drafts get that many, the others 0", plus
"everyone 0", and keeps the best (ties go to fewer drafts). With free lookup drafts a request drafts whenever
the width is paid for anyway; with a draft model, a request whose drafts are rarely accepted is dropped when its
rows in the draft passes cost more than its expected extra tokens are worth.

The price of a plan is its padded rectangle (batch x W tokens), although the C stack and the head run only a
step's real tokens (batch + sum gamma_i), and a step's time grows with them (run 20, batch 16, fixed gamma 2:
~6 ms per draft at the same width). The ablation `real_token_prices` prices a step at the calibration for its
real tokens per row times the live correction of its width (CostModel.target_step_ms(batch, W, real_tokens)),
and with lookup drafts searches one plan per width (every row drafts min(cap_i, W)). It replayed at or above the
padded price (bench/bench_replay.py with run 19's costs: concurrency 2 1.009 against 0.976 of the best fixed
gamma), but on the machine, in one sweep with both prices as lanes (bench/out/slices_ab23), it made 0.981, 0.980
and 1.001x the padded price's throughput at concurrency 2, 4 and 8: no gain, so the padded price stays the
default. `cut_rows` (with real_token_prices) also lets a width leave rows out on their estimates; a request's own
estimate says little (diag 17: rows estimated lowest at position 1, 0.63, were accepted at 0.83), and it
replayed worse (run 19's costs, concurrency 4 / 8: 0.976 / 0.992 against 1.012 / 1.021 without). The ablation
CostModel(real_cells=True) (with real_token_prices) learns the live correction per real-token count, interpolated
between the counts run: the padded cells mispriced widths rarely run (batch 8, run 28: width 3 at 1.25x the
measured mean), but on the machine it made the same throughput (A/B 29: 0.97-1.00x the padded price).

Robustness. The optimum is flat and the predictions carry noise (per-request acceptance estimates, step-time
jitter), so the width must not flip from step to step on estimate noise: the width that ran last (the
incumbent) runs again while its best plan stays within `margin` (3%) of the best predicted goodput; otherwise
the best plan runs and becomes the incumbent (AdaptivePolicy). This is hysteresis without a direction: an
earlier rule ("the narrowest plan within 4%") also stopped the flapping but, by construction, ran narrower than
the optimum whenever a narrower plan was within the margin; at concurrency 1, where the optimum is the widest
plan, that cost ~5% of throughput against fixed gamma 8 (docs/BENCHMARKS.md, Serving). The cost model is
calibrated at start and then corrected by every target step the scheduler runs (CostModel.observe), because
the calibration's timing conditions are not the serving ones (a busy machine at start, another thread,
contention that slows wide verify passes most), so a model that flatters a width is corrected by running it;
a model that over-prices a width would never run it, so one decision in 16 probes the other width with the best
optimistic goodput (a shape seen less gets more optimism), if that is within 10% of the best (AdaptivePolicy._probe).
The acceptance side is checked the same way: each step's committed tokens against the plan's expected ones give
one live factor on every plan's expected accepted drafts (AdaptivePolicy.token_factor).
"""

from __future__ import annotations

import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


POLICY_NAMES = ("adaptive", "fixed", "table", "off")
CALIBRATION_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_GAMMA_MAX = 8  # adaptive: the widest plan (at concurrency 1 the best fixed gamma here is 8)
DEFAULT_FIXED_GAMMA = 4  # fixed: gamma when none is given
DEFAULT_LIVE_RATE = 0.5  # weight of one measured step in a batch size's live factor (CostModel.observe)
DEFAULT_CELL_DECAY = 0.97  # a shape's deviation: the mean of its ~30 latest steps (CostModel.observe)
DEFAULT_CELL_PRIOR = 3.0  # pseudo-visits in a shape's deviation (a shape's first step moves its price a quarter of the way)
DEFAULT_CELL_STALE = 0.99  # a step at a batch size ages its other shapes' recent visits (the probes' count: halves in ~70 steps)
MAX_STEP_ERROR = 0.25  # the most one measured step moves a price, in log (a 4x burst on a shared core counts as 1.28x)
DEFAULT_MARGIN = 0.03  # adaptive: the incumbent width stays while within 3% of the best predicted goodput
DEFAULT_PROBE_EVERY = 16  # adaptive: one step in 16 runs the most promising other width (AdaptivePolicy._probe)
DEFAULT_PROBE_MARGIN = 0.10  # ... if its optimistic goodput is within 10% of the best plan's
DEFAULT_PROBE_BONUS = 0.25  # ... optimism exp(0.25 / sqrt(visits + 1)) for a shape seen `visits` times
TOKEN_DECAY = 0.99  # adaptive: the realized / predicted accepted drafts, over the ~100 latest steps (token_factor)
TOKEN_PRIOR = 4.0  # ... shrunk towards 1 by this many pseudo-steps
TOKEN_FACTOR_RANGE = (0.7, 1.4)  # ... and kept within this range
OBJECTIVES = ("throughput", "goodput")  # adaptive: what a step's plan maximises (AdaptivePolicy, "Objective")
RATE_DECAY = 0.98  # objective "throughput": the plans' predicted tokens per ms at a batch size over its ~50 latest steps
RATE_MIN_STEPS = 5.0  # ... taken once this many (decayed) steps are in; before, the step's best ratio (the goodput rule)
Acceptance = float | Sequence[float] | None  # one alpha, conditional rates per position, or unknown


def fold_rate(counts: dict[int, list[float]], batch: int, tokens: float, ms: float) -> None:
    """One step's tokens and ms into a batch size's decayed [steps, tokens, ms] sums (RATE_DECAY)."""
    sums = counts.setdefault(batch, [0.0, 0.0, 0.0])
    for i, value in enumerate((1.0, tokens, ms)):
        sums[i] = RATE_DECAY * sums[i] + value


def read_rate(counts: dict[int, list[float]], batch: int) -> float | None:
    """tokens / ms of a batch size's decayed sums once RATE_MIN_STEPS (decayed) steps are in; else None."""
    sums = counts.get(batch)
    if sums is None or sums[0] < RATE_MIN_STEPS or sums[2] <= 0.0:
        return None
    return sums[1] / sums[2]


def _check_gamma(gamma: int, name: str = "gamma") -> int:
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

    def observe_step(self, batch: int, width_tokens: int, target_ms: float, emitted: int | None = None, drafted: int | None = None) -> None:
        """A measured step (`batch` rows, padded to `width_tokens` tokens each; its draft passes excepted; the
        tokens it committed; the drafts it verified, None = every row at the full width); most policies ignore it."""

    def describe(self) -> dict:
        return {"policy": self.name}


class OffPolicy(SpeculationPolicy):
    name = "off"
    max_gamma = 0

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        return [0] * len(acceptance)


class FixedPolicy(SpeculationPolicy):
    name = "fixed"

    def __init__(self, gamma: int) -> None:
        self.gamma = _check_gamma(gamma)

    @property
    def max_gamma(self) -> int:
        return self.gamma

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
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

    @property
    def max_gamma(self) -> int:
        return max(gamma for _, _, gamma in self.table)

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        return [self.gamma_for(len(acceptance))] * len(acceptance)

    def describe(self) -> dict:
        return {"policy": self.name, "table": [list(row) for row in self.table]}


def _real_per_row(batch: int, tokens_per_row: float, real_tokens: int | None) -> float:
    """Real tokens per row of a step padded to tokens_per_row (None: every token real)."""
    return tokens_per_row if real_tokens is None else real_tokens / batch


@dataclass
class CostModel:
    """Predicted step times in ms: a calibrated grid, interpolated, corrected live by the steps actually run.

    A step padded to t tokens per row with fewer real tokens (a ragged verification) is priced at the calibration's
    time for its real tokens per row, times the correction of its padded shape (b, t) (target_step_ms): the C
    stack runs real tokens only, and what padding adds (its zeroed logits, their passes) is in the correction.

    target_ms[(batch, tokens_per_row)]: one target forward of `batch` rows of `tokens_per_row` tokens each (with
    the step's passes over its logits); draft_ms[batch]: one draft forward of `batch` rows of one token (a step's
    k-th draft pass runs over the rows drafting >= k tokens; empty for lookup drafters, whose cost is negligible).
    Between grid points the calibrated time is linear in tokens per row and piecewise linear in batch size
    (extrapolated from the last segment).

    real_cells (an ablation, with AdaptivePolicy.real_token_prices): the cells are keyed by a step's real tokens per
    row instead of its padded width, and a count not run is priced by linear interpolation between those run.

    Live correction (`observe`), in log space, two parts per exact batch size b:
    - a batch factor F_b, moved by `live_rate` (0.5) of each measured step's error at batch b: the machine's
      present speed at that load (a busy host, another thread, a slower VM than at calibration). It prices every
      width at b, visited or not, so a width the policy has not run lately moves with the ones it runs. It moves
      fast because this host's speed moves 20-40% within seconds, and what F_b does not take the running shape's
      deviation does: at 0.1, a slow stretch while one width ran priced that width up against the others (batch 8,
      width 2 ~16% above its steps' median, bench/out/slices_diag13), and the policy left it for a worse one;
      with a lagging factor, the relative prices the choice rests on drift with every change of host speed;
    - a cell deviation d[b, t] per exact (batch, tokens per row), moved by each of its steps' error with gain
      1 / (n + cell_prior), n its visits decayed by `cell_decay` per visit (cell_prior 3: a first visit moves it
      a quarter of the way, a shape run often is the mean of its ~30 latest steps; at 1, one slow first visit
      priced batch 8 x 3 tokens 1.19x above the others there, bench/out/slices_run12, and it was not run again);
      after each step the cells of batch b are re-centred
      (their visit-weighted mean moves into F_b), so d is what distinguishes a shape from the others at that
      batch. It learns the shape the calibration got wrong (measured while serving: 9-token steps at batch 1
      cost 1.3x 5-token steps, 1.1x in a calibration) from the steps of that exact shape, and only from them.
    prediction(b, t) = calibrated(b, t) * exp(F_b + d[b, t]). A batch size never run takes the factor of the
    nearest one that has; a shape never run at a batch, the deviation of the nearest shape run there. One step's
    error counts at most MAX_STEP_ERROR (0.25 in log): a burst of interference (4-10x on a shared core) must not
    price a shape out of use in one step, since a shape priced out is not run again to be corrected, except by a
    probe (AdaptivePolicy._probe), whose optimism for a shape grows back as the shape goes unrun: each step at
    batch b ages the other shapes' recent visits u by `cell_stale` (0.99; u counts as n does, and only sets the
    probes' optimism, so a stale price is retried without its next step counting for more). Exact
    cells, not grid points: an earlier version corrected the grid points around a step by their interpolation
    weights, so steps of 6 tokens moved the 9-token point, and at batch 1 it priced 9-token steps 18% above
    6-token ones while the forwards measured within 3%. live_rate 0 keeps the calibration as it is.
    """

    target_ms: dict[tuple[int, int], float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    live_rate: float = DEFAULT_LIVE_RATE
    cell_decay: float = DEFAULT_CELL_DECAY
    cell_prior: float = DEFAULT_CELL_PRIOR
    cell_stale: float = DEFAULT_CELL_STALE
    real_cells: bool = False

    def __post_init__(self) -> None:
        if not self.target_ms:
            raise ValueError("target_ms is empty: the cost model needs at least one measured (batch, tokens) time")
        if not 0.0 <= self.live_rate <= 1.0:
            raise ValueError(f"live_rate={self.live_rate} is out of range [0, 1] (0 = keep the calibration, no live correction)")
        if not 0.0 < self.cell_decay <= 1.0:
            raise ValueError(f"cell_decay={self.cell_decay} is out of range (0, 1] (1 = never forget a shape's deviation)")
        if not self.cell_prior > 0.0:
            raise ValueError(f"cell_prior={self.cell_prior} must be > 0 (pseudo-visits that shrink a shape's deviation to 0)")
        if not 0.0 < self.cell_stale <= 1.0:
            raise ValueError(f"cell_stale={self.cell_stale} is out of range (0, 1] (1 = a shape's visits never age while others run)")
        self.batches = sorted({b for b, _ in self.target_ms})
        self.tokens = sorted({t for _, t in self.target_ms})
        missing = [(b, t) for b in self.batches for t in self.tokens if (b, t) not in self.target_ms]
        if missing:
            raise ValueError(f"target_ms misses grid points {missing}: measure every (batch, tokens) pair")
        self.batch_factor: dict[int, float] = {}  # b -> F_b (log)
        self.cells: dict[int, dict[float, list[float]]] = {}  # b -> t -> [decayed visits n, deviation d (log), recent visits u]
        self._calibrated: dict[tuple[int, int], float] = {}  # memo of the interpolated calibration
        self.observations = 0  # measured steps folded in (cached predictions are stale when it changes)

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

    def calibrated_ms(self, batch: int, tokens_per_row: float) -> float:
        """The calibration's price of one target step, without the live correction."""
        key = (batch, tokens_per_row)
        if key not in self._calibrated:
            by_batch = [self._interp(tokens_per_row, self.tokens, [self.target_ms[(b, t)] for t in self.tokens]) for b in self.batches]
            self._calibrated[key] = self._interp(batch, self.batches, by_batch)
        return self._calibrated[key]

    def factor(self, batch: int) -> float:
        """F_b (log): the batch's own, else the nearest batch size's that has one (ties to the smaller), else 0."""
        if batch in self.batch_factor:
            return self.batch_factor[batch]
        if not self.batch_factor:
            return 0.0
        nearest = min(self.batch_factor, key=lambda b: (abs(np.log(b / batch)), b))
        return self.batch_factor[nearest]

    def _deviation(self, batch: int, tokens_per_row: float) -> float:
        """d[b, t]; for a shape not run yet, the deviation of the nearest one run at that batch (ties to the
        wider): a calibration's shape error is smooth in the tokens per row, so it carries to the next width.
        real_cells: t is real tokens per row, and between two counts run the deviation is interpolated."""
        cells = self.cells.get(batch)
        if not cells:
            return 0.0
        if tokens_per_row in cells:
            return cells[tokens_per_row][1]
        if self.real_cells:
            return float(self.deviations(batch, np.array([tokens_per_row]))[0])
        return cells[min(cells, key=lambda t: (abs(t - tokens_per_row), -t))][1]

    def deviations(self, batch: int, tokens_per_row: np.ndarray) -> np.ndarray:
        """real_cells: d[b, t] at many real tokens per row at once: linear between the counts run at that batch,
        the nearest one's beyond them (np.interp), 0 where none has run."""
        cells = self.cells.get(batch)
        if not cells:
            return np.zeros(len(tokens_per_row))
        keys = sorted(cells)
        return np.interp(tokens_per_row, keys, [cells[k][1] for k in keys])

    def visits(self, batch: int, tokens_per_row: float) -> float:
        """Recent visits u of this exact shape (0 if never run): its decayed count of measured steps, aged further
        by cell_stale at every step of another shape at the batch; the probes' optimism shrinks with it."""
        return self.cells.get(batch, {}).get(tokens_per_row, (0.0, 0.0, 0.0))[2]

    def correction(self, batch: int, tokens_per_row: float) -> float:
        """exp(F_b + d[b, t]): the live factor on the calibrated price of a step padded to t tokens per row."""
        return math.exp(self.factor(batch) + self._deviation(batch, tokens_per_row))

    def target_step_ms(self, batch: int, tokens_per_row: float, real_tokens: int | None = None) -> float:
        """One target step of `batch` rows padded to `tokens_per_row` tokens, `real_tokens` of them real (default
        all): the calibration at the real tokens per row (the C stack and the head run only those), times the live
        correction of the padded shape (what its logits passes and bookkeeping add, learnt from its steps), or,
        with real_cells, of its real tokens."""
        real = _real_per_row(batch, tokens_per_row, real_tokens)
        return self.calibrated_ms(batch, real) * self.correction(batch, real if self.real_cells else tokens_per_row)

    def live_correction(self, batch: int, tokens_per_row: float) -> float:
        """predicted / calibrated at this shape (1.0 = as calibrated)."""
        return self.target_step_ms(batch, tokens_per_row) / self.calibrated_ms(batch, tokens_per_row)

    def observe(self, batch: int, tokens_per_row: float, measured_ms: float, real_tokens: int | None = None) -> None:
        """One target step measured while serving (padded to tokens_per_row; real_tokens of its batch x
        tokens_per_row real, default all; predicted as target_step_ms does). Its error r (log measured / predicted)
        moves F_batch by live_rate * r and the (batch, tokens) cell's deviation by r / (visits + cell_prior); then the cells of this
        batch are re-centred (their visit-weighted mean deviation moves into F_batch), so that F_batch is the
        batch's common factor and a width not run lately is priced with it."""
        if self.live_rate == 0.0 or not measured_ms > 0.0 or not np.isfinite(measured_ms):
            return
        log_ratio = float(np.log(measured_ms / self.calibrated_ms(batch, _real_per_row(batch, tokens_per_row, real_tokens))))
        if self.real_cells:  # the cell of the step's real tokens per row
            tokens_per_row = _real_per_row(batch, tokens_per_row, real_tokens)
        factor, deviation = self.factor(batch), self._deviation(batch, tokens_per_row)
        residual = float(np.clip(log_ratio - factor - deviation, -MAX_STEP_ERROR, MAX_STEP_ERROR))
        cells = self.cells.setdefault(batch, {})
        for tokens, other in cells.items():  # the shapes not run age in the probes' eyes (their optimism grows back)
            if tokens != tokens_per_row:
                other[2] *= self.cell_stale
        cell = cells.setdefault(tokens_per_row, [0.0, deviation, 0.0])
        cell[0] = self.cell_decay * cell[0] + 1.0
        cell[2] = self.cell_decay * cell[2] + 1.0
        cell[1] += residual / (cell[0] + self.cell_prior)
        factor += self.live_rate * residual
        mean = sum(n * d for n, d, _ in cells.values()) / sum(n for n, _, _ in cells.values())
        for c in cells.values():
            c[1] -= mean
        self.batch_factor[batch] = factor + mean
        self.observations += 1

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
            "live_rate": self.live_rate, "cell_decay": self.cell_decay, "cell_prior": self.cell_prior, "cell_stale": self.cell_stale,
            "real_cells": self.real_cells, "observations": self.observations,
            # predicted / calibrated per batch size run and per shape run: [batch, factor] and [batch, tokens, visits, factor]
            "batch_factor": [[b, round(float(np.exp(f)), 3)] for b, f in sorted(self.batch_factor.items())],
            "live_correction": [
                [b, t, round(n, 1), round(self.live_correction(b, t), 3)]
                for b, cells in sorted(self.cells.items()) for t, (n, _, _) in sorted(cells.items())
            ],
        }


class AdaptivePolicy(SpeculationPolicy):
    """Maximise expected goodput (emitted tokens per ms) over per-request gammas in 0..gamma_max each step.

    See the module docstring for the search. prior_alpha: the flat acceptance used for a request with no
    estimate (the scheduler passes per-position profiles that already blend in the traffic's estimate).
    margin: the hysteresis. The width that ran last step (the incumbent) runs again while its best plan's
    predicted goodput is within `margin` (a fraction) of the best plan's; otherwise the best plan runs (exact ties
    to the narrower) and its width becomes the incumbent. Why: the predictions carry errors larger than the
    differences the argmax would act on (per-request acceptance estimates from a few steps, step-time jitter on
    a shared 2-core VM), and near the optimum the goodput curve is flat (Gemma at batch 16: gamma 3, 4 and 8
    within 4% of each other), so a plain argmax would flip the width from step to step. Holding the incumbent
    costs at most `margin` by the model's own account, and has no bias towards narrow or wide plans.

    Objective (an ablation, `objective="throughput"`; the default "goodput" is the per-step ratio above). A
    closed loop's throughput is a ratio of sums, total tokens / total time, and the plan that maximises it step by
    step is not the one with the best ratio in each step but the one with the most E[tokens] - rho * ms, rho the
    achievable rate (renewal reward, Dinkelbach): where a step's prospects beat rho, tokens bought below the best
    ratio still pay; where they fall short, the cheapest plan does. "throughput" takes rho = rate(batch), the
    predicted tokens per ms of its own recent plans. With the true match lengths the rule gains (bench_replay.py
    lane oracle-rate against the per-step ratio's oracle), but with the estimates it loses (lane adaptive-rate):
    it acts on which rows look hard now, which the per-request estimates cannot tell, and at batch 16 it locks
    into width 0, whose plans set the rate it is judged by (docs/BENCHMARKS.md, "Objective"). The margin there is
    in tokens: the incumbent stays while its score is within margin x the best plan's expected tokens of the best.
    """

    name = "adaptive"

    def __init__(
        self,
        cost_model: CostModel,
        gamma_max: int = DEFAULT_GAMMA_MAX,
        prior_alpha: float = 0.5,
        margin: float = DEFAULT_MARGIN,
        probe_every: int = DEFAULT_PROBE_EVERY,
        probe_margin: float = DEFAULT_PROBE_MARGIN,
        probe_bonus: float = DEFAULT_PROBE_BONUS,
        cut_rows: bool = False,
        real_token_prices: bool = False,
        objective: str = "goodput",
    ) -> None:
        self.cost_model = cost_model
        self.gamma_max = _check_gamma(gamma_max, "gamma_max")
        if not 0.0 <= prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha={prior_alpha} is out of range [0, 1]")
        if not 0.0 <= margin < 0.5:
            raise ValueError(f"margin={margin} is out of range [0, 0.5): the fraction of the best goodput treated as a tie (0 = strict argmax)")
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 0:
            raise ValueError(f"probe_every={probe_every!r} must be an integer >= 0 (decisions between probes of another width; 0 = never)")
        if not 0.0 <= probe_margin < 1.0:
            raise ValueError(f"probe_margin={probe_margin} is out of range [0, 1): how much worse than the best a probed width may be predicted")
        if not 0.0 <= probe_bonus <= 2.0:
            raise ValueError(f"probe_bonus={probe_bonus} is out of range [0, 2]: the log optimism given an unvisited shape when probing")
        self.prior_alpha = prior_alpha
        self.margin = margin
        self.probe_every, self.probe_margin, self.probe_bonus = probe_every, probe_margin, probe_bonus
        if cost_model.real_cells and not real_token_prices:
            raise ValueError("a cost model with real_cells=True learns prices by real tokens: use it with real_token_prices=True")
        self.real_token_prices = real_token_prices  # price a step at its real tokens, not its padded rectangle
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r} is unknown: use one of {', '.join(OBJECTIVES)} (see AdaptivePolicy)")
        self.objective = objective
        self.rate_counts: dict[int, list[float]] = {}  # batch -> decayed [steps, predicted tokens, predicted ms] of its plans (objective throughput)
        self.cut_rows = cut_rows  # free drafts too: search plans that leave rows out (an ablation, with real_token_prices)
        self.incumbent: int | None = None  # width (max gamma) of the plan that ran last; None before the first
        self.plans_made = 0
        self.probes = 0  # probe decisions made (AdaptivePolicy._probe)
        self.last_prediction: tuple | None = None  # the last plan's expected tokens, predicted ms, goodput per plan
        self._last_plan: tuple[int, int, float] | None = None  # (batch, width, raw expected accepted drafts)
        self._last_plans: tuple | None = None  # (batch, [(width, drafts)], correction, calibrated) of the last decision
        self.token_counts = [0.0, 0.0, 0.0]  # decayed sums over the plans run: steps, realized, raw predicted accepted drafts
        self._calibrated: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # batch -> (calibrated ms by drafts [B*G+1], draft_ms [B+1])
        self._corrections: dict[int, np.ndarray] = {}  # batch -> live correction by width [G+1]
        self._costs_at = cost_model.observations

    @property
    def max_gamma(self) -> int:
        return self.gamma_max

    def rates(self, acceptance: Sequence[Acceptance]) -> np.ndarray:
        """Conditional acceptance per request and draft position, clipped to [0, 1]: [B, gamma_max]."""
        rows = np.empty((len(acceptance), self.gamma_max))
        for i, estimate in enumerate(acceptance):
            if estimate is None or np.ndim(estimate) == 0:
                rows[i] = self.prior_alpha if estimate is None else float(estimate)
            else:
                profile = np.asarray(estimate, dtype=float)[: self.gamma_max]
                rows[i, : profile.size] = profile
                rows[i, profile.size :] = profile[-1] if profile.size else self.prior_alpha
        return np.clip(rows, 0.0, 1.0)

    def costs(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prices of one batch size's plans: a target step of width w with d drafts in all costs
        calibrated[d] * correction[w] (CostModel.target_step_ms), and the s-th draft pass over r rows draft_ms[r].
        correction [G+1] is recomputed when the live correction moves; calibrated [B*G+1] and draft_ms [B+1] once."""
        if batch not in self._calibrated:
            calibrated = [self.cost_model.calibrated_ms(batch, 1 + d / batch) for d in range(batch * self.gamma_max + 1)]
            draft_ms = [0.0] + [self.cost_model.draft_step_ms(b) for b in range(1, batch + 1)]
            self._calibrated[batch] = (np.array(calibrated), np.array(draft_ms))  # [B*G+1], [B+1]
        if self._costs_at != self.cost_model.observations:  # the live correction moved: price again
            self._corrections, self._costs_at = {}, self.cost_model.observations
        if batch not in self._corrections:
            cost = self.cost_model
            if cost.real_cells:  # by the plan's drafts d: the cell of (batch + d) / batch real tokens per row, interpolated
                real = (batch + np.arange(batch * self.gamma_max + 1)) / batch
                self._corrections[batch] = np.exp(cost.factor(batch) + cost.deviations(batch, real))  # [B*G+1]
            else:
                self._corrections[batch] = np.array([cost.correction(batch, w + 1) for w in range(self.gamma_max + 1)])  # [G+1]
        return self._corrections[batch], *self._calibrated[batch]

    def candidates(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[tuple[float, np.ndarray]]:
        """The best plan of every width (k requests drafting, see the module docstring), "everyone 0" first:
        [(expected goodput in tokens per ms, gammas [B]), ...] in increasing width."""
        return [(p[0], p[1]) for p in self._candidates(acceptance, caps, self.rate(len(acceptance)))]

    def _candidates(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None, rate: float | None = None) -> list[tuple]:
        """candidates(), each plan with its width, its drafts, its expected tokens and its price: (goodput, gammas [B],
        max gamma, sum of gammas, tokens, ms). rate: the objective's tokens per ms (None: the goodput rule), which
        picks a width's best prefix of rows where rows may be cut (a draft model, cut_rows)."""
        batch = len(acceptance)
        limit = np.full(batch, self.gamma_max) if caps is None else np.clip(np.asarray(caps, dtype=int), 0, self.gamma_max)  # [B]
        correction, calibrated, draft_ms = self.costs(batch)
        plans = [(batch / float(calibrated[0] * correction[0]), np.zeros(batch, dtype=int), 0, 0, float(batch), float(calibrated[0] * correction[0]))]
        top = min(self.gamma_max, int(limit.max()))
        if top == 0:
            return plans
        gain = np.zeros((batch, top + 1))  # [B, W+1]: expected accepted drafts with g drafts
        gain[:, 1:] = np.cumsum(np.cumprod(self.rates(acceptance)[:, :top], axis=1), axis=1)
        # every width at once: one set of numpy calls per step, not one per width (the policy runs every step);
        # plain fancy indexing, not take_along_axis: at batch 1 this runs in ~0.1 ms of a ~15-40 ms step
        widths = np.arange(1, top + 1)  # [W]
        plan_rows = np.arange(top)[:, None]  # [W, 1]
        gammas = np.minimum(limit[None], widths[:, None])  # [W, B]
        value = gain[np.arange(batch)[None], gammas]  # [W, B] expected extra tokens
        order = np.argsort(-value, axis=1, kind="stable")  # [W, B] most valuable first
        ranked = gammas[plan_rows, order]  # [W, B]
        # prefix k (rows order[:k] draft): the widest row, the drafts, the price, the expected tokens
        widest = np.maximum.accumulate(ranked, axis=1)  # [W, B] the plan's width
        drafts = np.cumsum(ranked, axis=1)  # [W, B]
        cost_ms = calibrated[drafts if self.real_token_prices else batch * widest] * correction[drafts if self.cost_model.real_cells else widest]  # [W, B]
        if draft_ms.any():  # a draft model: the s-th draft pass runs over the rows drafting >= s (lookups: free)
            drafting = np.cumsum(ranked[:, :, None] >= widths[None, None], axis=1)  # [W, B, S]
            cost_ms = cost_ms + draft_ms[drafting].sum(axis=2)  # (draft_ms[0] = 0: passes past a row's gamma)
        tokens = batch + self.token_factor() * np.cumsum(value[plan_rows, order], axis=1)  # [W, B]
        goodput = tokens / cost_ms  # [W, B]
        if draft_ms.any() or self.cut_rows:
            best = np.argmax(goodput if rate is None else tokens - rate * cost_ms, axis=1)  # [W] the best prefix per width (first of ties)
        else:  # free drafts: every row drafts what the width allows (see the module docstring: no per-row cuts)
            best = np.full(top, batch - 1)
        chosen = np.zeros_like(gammas)
        chosen[plan_rows, order] = np.where(np.arange(batch)[None] <= best[:, None], ranked, 0)
        at = (np.arange(top), best)
        plans.extend(zip(goodput[at].tolist(), chosen, widest[at].tolist(), drafts[at].tolist(), tokens[at].tolist(), cost_ms[at].tolist()))
        return plans

    def plan(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> tuple[list[int], float]:
        """The chosen gamma per request and its expected goodput (tokens per ms): the incumbent width's plan while
        it is within `margin` of the best, else the best (exact ties to fewer drafts); see the class docstring."""
        if not acceptance:
            return [], 0.0
        batch = len(acceptance)
        rate = self.rate(batch)
        plans = self._candidates(acceptance, caps, rate)
        if rate is None:  # the goodput rule: the best ratio; the incumbent while within margin of it
            score, slack = (lambda p: p[0]), (lambda best: best[0] * self.margin)
        else:  # throughput: tokens - rate * ms; the incumbent while it loses under margin of the best plan's tokens
            score, slack = (lambda p: p[4] - rate * p[5]), (lambda best: best[4] * self.margin)
        best = max(plans, key=lambda p: (score(p), -p[2], -p[3]))
        held = [p for p in plans if p[2] == self.incumbent]
        kept = max(held, key=score) if held else None
        if kept is not None and score(kept) >= score(best) - slack(best) * (1 + 1e-9):
            goodput, gammas = kept[:2]
        else:
            goodput, gammas = best[:2]
        self.incumbent = int(gammas.max())
        self.plans_made += 1
        if self.probe_every and self.plans_made % self.probe_every == 0:
            probe = self._probe(plans, max(p[0] for p in plans), batch)
            if probe is not None:  # this step only: the incumbent stays
                goodput, gammas = probe
        correction, calibrated, draft_ms = self.costs(batch)
        width = int(gammas.max())
        predicted_ms = self._target_ms(batch, width, int(gammas.sum()), correction, calibrated)
        if width and draft_ms.any():
            predicted_ms += float(draft_ms[(gammas[None] >= np.arange(1, width + 1)[:, None]).sum(axis=1)].sum())
        expected = goodput * predicted_ms  # rows + token_factor * the estimates' accepted drafts
        if self.objective == "throughput":
            fold_rate(self.rate_counts, batch, expected, predicted_ms)
        self.last_prediction = (expected, predicted_ms, [float(f"{p[0]:.5g}") for p in plans])
        # priced only if asked (plans_priced: benchmarks' traces), at this decision's prices (costs() replaces, never
        # mutates, its arrays when the live correction moves)
        self._last_plans = (batch, [(p[2], p[3]) for p in plans], correction, calibrated)
        self._last_plan = (len(acceptance), width, (expected - len(acceptance)) / self.token_factor())
        return gammas.tolist(), float(goodput)

    def _target_ms(self, batch: int, width: int, drafts: int, correction: np.ndarray, calibrated: np.ndarray) -> float:
        """The target step's price of a plan of this width and drafts, as _candidates prices it (padded, or at its
        real tokens; the correction of its width, or with real_cells of its real tokens)."""
        at = drafts if self.real_token_prices else batch * width
        return float(calibrated[at] * correction[drafts if self.cost_model.real_cells else width])

    def plans_priced(self) -> list[list[float]] | None:
        """The last decision's plans, each [width, drafts, target ms] (for offline counterfactuals of a trace:
        bench/bench_counterfactual.py); None before any."""
        if self._last_plans is None:
            return None
        batch, plans, correction, calibrated = self._last_plans
        return [[width, drafts, round(self._target_ms(batch, width, drafts, correction, calibrated), 2)] for width, drafts in plans]

    def _probe(self, plans: list[tuple[float, np.ndarray, int, int]], best_goodput: float, batch: int) -> tuple[float, np.ndarray] | None:
        """The plan of another width than the incumbent with the best optimistic goodput, if that is within
        probe_margin of the best predicted goodput; else None.

        Why: the live cost correction learns a shape only from the steps that run it, and the policy runs only the
        shapes it prices best, so a width the model over-prices would never be run again and never be corrected.
        Measured (bench/out/slices_run9, concurrency 8): the calibration priced batch 8 x 5 tokens at 192 ms and
        the shapes below it 15-53% under what serving then measured, so the corrected model priced it ~250 ms
        while it ran in 187 (fixed gamma 4's steps), and the policy never ran width 4, the best, two widths from its
        incumbent. Optimism in the face of uncertainty (UCB): a width's goodput is scaled by exp(probe_bonus /
        sqrt(n + 1)), n the recent visits of its (batch, tokens) shape (an unvisited shape 1.28x, after 3 visits
        1.13x, after 30 1.05x); one decision in probe_every (16) runs the best width by that score. A probe costs
        at most what the plan's predicted goodput lacks (< 1 - (1 - probe_margin) / exp(probe_bonus), 30%), one
        step in 16 (< 2%), and less as the shapes near the optimum are learnt. n is the shape's recent visits
        (CostModel.visits), which age while other shapes run, so a shape priced out by a burst of interference
        gets its optimism back and is retried (run 11, concurrency 8: width 2, the best, ran 1 step in 495 after
        a few slow visits priced it 1.1x above the others at its batch)."""
        self.probes += 1
        cost = self.cost_model
        scored = []
        for goodput, gammas, width, drafts, _, _ in plans:
            if width != self.incumbent:
                shape = (batch + drafts) / batch if cost.real_cells else width + 1  # the cell its price comes from
                bonus = self.probe_bonus / np.sqrt(cost.visits(batch, shape) + 1.0)
                scored.append((goodput * float(np.exp(bonus)), goodput, gammas))
        if not scored:
            return None
        optimistic, goodput, gammas = max(scored, key=lambda p: p[0])
        if optimistic >= best_goodput * (1 - self.probe_margin):
            return goodput, gammas
        return None

    def goodput(self, acceptance: Sequence[Acceptance], gammas: Sequence[int] | int) -> float:
        """Expected emitted tokens per ms of one step with these gammas (one int = the same for every request)."""
        batch = len(acceptance)
        gammas = [gammas] * batch if isinstance(gammas, int) else list(gammas)
        gain = np.cumsum(np.cumprod(self.rates(acceptance), axis=1), axis=1)  # [B, G]
        tokens = batch + sum(float(gain[i, g - 1]) for i, g in enumerate(gammas) if g > 0)
        rows_per_pass = [sum(g >= s for g in gammas) for s in range(1, max(gammas, default=0) + 1)]
        drafts_ms = sum(self.cost_model.draft_step_ms(rows) for rows in rows_per_pass)
        return tokens / (drafts_ms + self.cost_model.target_step_ms(batch, max(gammas, default=0) + 1, batch + sum(gammas)))

    def choose(self, acceptance: Sequence[Acceptance], caps: Sequence[int] | None = None) -> list[int]:
        return self.plan(acceptance, caps)[0]

    def token_factor(self) -> float:
        """Realized / predicted accepted drafts of the plans that ran (1 before any): the live check on the
        acceptance estimates, as CostModel.observe is on the prices. A request's estimate comes from its few latest
        proposals, and the scheduler's lookup evidence resolves a proposal at its first rejection but, when it is
        right, only once it is fully covered, so recent evidence leans to rejections. Measured
        (bench/out/slices_run12, concurrency 4): the plans run emitted 3.6-5.3% more than predicted at widths 1-2,
        8.6% at width 8. One factor for all widths, as the live cost correction has one per batch: a factor per
        width would correct only the widths run, so the incumbent alone would be priced by it. The ratio of
        decayed sums over the ~100 latest steps, shrunk to 1 by TOKEN_PRIOR pseudo-steps, within
        TOKEN_FACTOR_RANGE; it scales every plan's expected accepted drafts."""
        steps, realized, predicted = self.token_counts
        if predicted <= 0.0:
            return 1.0
        ratio = (steps * realized / predicted + TOKEN_PRIOR) / (steps + TOKEN_PRIOR)
        return min(max(float(ratio), TOKEN_FACTOR_RANGE[0]), TOKEN_FACTOR_RANGE[1])  # (np.clip on a scalar: ~6 us)

    def rate(self, batch: int) -> float | None:
        """Objective throughput: the predicted tokens per ms of the plans this policy chose at this batch size
        (decayed sums over its ~50 latest decisions there, RATE_DECAY; in the model's own units, so a bias of the
        estimates or prices common to all plans does not move the choice), once RATE_MIN_STEPS are in; else None
        (the goodput rule)."""
        return read_rate(self.rate_counts, batch) if self.objective == "throughput" else None

    def observe_step(self, batch: int, width_tokens: int, target_ms: float, emitted: int | None = None, drafted: int | None = None) -> None:
        self.cost_model.observe(batch, width_tokens, target_ms, batch + drafted if self.real_token_prices and drafted is not None else None)
        plan, self._last_plan = self._last_plan, None
        if emitted is None or plan is None or plan[:2] != (batch, width_tokens - 1) or width_tokens <= 1:
            return  # no prediction for this step (another caller, rows dropped), or nothing drafted
        for i, value in enumerate((1.0, float(emitted - batch), plan[2])):
            self.token_counts[i] = TOKEN_DECAY * self.token_counts[i] + value

    def describe(self) -> dict:
        return {
            "policy": self.name, "gamma_max": self.gamma_max, "prior_alpha": self.prior_alpha, "margin": self.margin,
            "probe_every": self.probe_every, "probe_margin": self.probe_margin, "probe_bonus": self.probe_bonus, "probes": self.probes,
            "real_token_prices": self.real_token_prices, "cut_rows": self.cut_rows, "objective": self.objective,
            "token_factor": round(self.token_factor(), 3),
            "rates": [[b, round(self.rate(b), 4)] for b in sorted(self.rate_counts) if self.rate(b) is not None],
            "cost_model": self.cost_model.to_dict(),
        }


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() in ms over `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def calibration_tokens(gamma_max: int) -> list[int]:
    """Tokens per row to measure: every count 1..min(gamma_max + 1, 9), then 2^k + 1 up to gamma_max + 1
    (gamma_max 8 -> 1..9; 16 -> 1..9, 17).

    Every count, not a few to interpolate between, because the cost is a staircase in rows = batch x tokens, not
    a line: the C products take 6 rows per pass over a weight block (AVX-512; 3 on AVX2), and past 64 rows a
    layer's product goes to oneDNN. Measured here (bf16, Ice Lake, bench/out/slices_run8): at batch 2, 3 tokens
    per row (6 rows, one pass) 39 ms a step, 5 tokens (10 rows, two passes) 59 ms, and the calibration of
    1, 2, 3, 5, 9 priced 4 tokens (8 rows, two passes) halfway between; the adaptive policy found width 3 worse
    than priced, never ran width 4, and stayed at width 2, 0.90x of fixed gamma 4.
    """
    dense = set(range(1, min(gamma_max + 1, 9) + 1))
    return sorted(dense | {2**k + 1 for k in range(3, 7) if 2**k + 1 <= gamma_max + 1} | {gamma_max + 1})


def calibrate_cost_model(
    target_model,
    draft_model=None,
    *,
    gamma_max: int = DEFAULT_GAMMA_MAX,
    batch_sizes: Sequence[int] = CALIBRATION_BATCH_SIZES,
    context_len: int = 64,
    repeats: int = 5,
) -> CostModel:
    """Measure target forwards (batch x calibration_tokens(gamma_max) per row) and draft forwards (batch x 1).

    target_model / draft_model: specgate CausalLM (draft None for lookup drafters). Runs on a scratch cache of
    max(batch_sizes) slots whose first context_len positions are filled, so attention reads a realistic context.
    The grid is swept `repeats` times after a warm-up sweep, interleaved, and each point keeps its fastest sample:
    interference only ever adds time, and on a shared 2-core machine it is large (an oversubscribed multi-token
    GEMM measured 4-10x its quiet time), so a burst must not land on every sample of one point. The grid is then
    made monotone (see monotone). Calibrate on a quiet machine: the policy is only as good as these numbers.
    """
    import torch

    from specgate.models import native
    from specgate.models.transformer import LogitsBuffer

    _check_gamma(gamma_max, "gamma_max")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1 (calibration sweeps per point)")
    tokens_grid = calibration_tokens(gamma_max)
    max_batch = max(batch_sizes)
    seq_len = context_len + gamma_max + 1
    points = [("target", b, t) for b in batch_sizes for t in tokens_grid]
    points += [("draft", b, 1) for b in batch_sizes] if draft_model is not None else []
    samples: dict[tuple[str, int, int], list[float]] = {point: [] for point in points}
    with torch.inference_mode():
        caches = {}
        buffers = {}  # logits buffers kept across the sweep, as the scheduler keeps one across steps
        for role, model in [("target", target_model)] + ([("draft", draft_model)] if draft_model is not None else []):
            cache = caches[role] = model.new_cache(max_batch, seq_len)
            buffers[role] = LogitsBuffer(model.vocab_size)
            buffers[role].view(max_batch, max(tokens_grid))  # allocated at its largest before any timing
            ids = torch.ones(max_batch, context_len, dtype=torch.int64)  # [B, L]
            model.forward(ids, torch.arange(context_len)[None].expand(max_batch, -1), cache, torch.arange(max_batch), logits=False)
        for sweep in range(repeats + 1):  # sweep 0 warms up
            # each sweep in another (seeded) order: the pass right after a wide one measured ~1.4x slow (caches,
            # threads), and a fixed order, or a rotation of it, would put the same point there every sweep
            order = list(points)
            random.Random(sweep).shuffle(order)
            for role, batch, tokens in order:
                model = target_model if role == "target" else draft_model
                step_ids = torch.ones(batch, tokens, dtype=torch.int64)  # [B, T]
                positions = torch.arange(context_len, context_len + tokens)[None].expand(batch, -1)  # [B, T]
                start = time.perf_counter()
                out = buffers[role].view(batch, tokens)  # warm memory, as serving's
                logits = model.forward(step_ids, positions, caches[role], torch.arange(batch), out=out)  # [B, T, V]
                if role == "target":  # the step's passes over the logits scale with B x T too: NaN check, greedy verify
                    native.max_argmax(logits)  # as the scheduler does (its check and greedy_verify's argmax)
                if sweep:
                    samples[(role, batch, tokens)].append((time.perf_counter() - start) * 1e3)
    target_ms = {(b, t): min(times) for (role, b, t), times in samples.items() if role == "target"}
    draft_ms = {b: min(times) for (role, b, _), times in samples.items() if role == "draft"}
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
    return CostModel(
        target_ms=target_ms, draft_ms=draft_ms, live_rate=cost.live_rate, cell_decay=cost.cell_decay, cell_prior=cost.cell_prior,
        cell_stale=cost.cell_stale, real_cells=cost.real_cells,
    )


def make_policy(name: str, *, gamma: int = DEFAULT_FIXED_GAMMA, table: str | None = None, cost_model: CostModel | None = None) -> SpeculationPolicy:
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
