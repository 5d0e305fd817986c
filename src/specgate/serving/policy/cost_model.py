"""The adaptive policy's cost model: predicted step times in ms, from a calibrated grid corrected live by the steps
the scheduler actually runs (CostModel), and the noise guard applied to a fresh calibration (monotone)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specgate.serving.policy.constants import (
    DEFAULT_CELL_DECAY,
    DEFAULT_CELL_PRIOR,
    DEFAULT_CELL_STALE,
    DEFAULT_LIVE_RATE,
    MAX_STEP_ERROR,
)


@dataclass
class CostModel:
    """Predicted step times in ms: a calibrated grid, interpolated, corrected live by the steps actually run.

    target_ms[(batch, tokens_per_row)]: one target forward of `batch` rows of `tokens_per_row` tokens each (with
    the step's passes over its logits); draft_ms[batch]: one draft forward of `batch` rows of one token (a step's
    k-th draft pass runs over the rows drafting >= k tokens; empty for lookup drafters, whose cost is negligible).
    Between grid points the calibrated time is linear in tokens per row and piecewise linear in batch size
    (extrapolated from the last segment). A step is priced at its padded rectangle (batch x widest row).

    Live correction (`observe`), in log space, two parts per exact batch size b:
    - a batch factor F_b, moved by `live_rate` of each measured step's error at batch b: the machine's present
      speed at that load (a busy host, another thread, a slower VM than at calibration). It prices every width at
      b, visited or not, so a width the policy has not run lately moves with the ones it runs (DEFAULT_LIVE_RATE
      says why it moves fast);
    - a cell deviation d[b, t] per exact (batch, tokens per row), moved by each of its steps' error with gain
      1 / (n + cell_prior), n its visits decayed by `cell_decay` per visit; after each step the cells of batch b are
      re-centred (their visit-weighted mean moves into F_b), so d is what distinguishes a shape from the others at
      that batch. It learns the shape the calibration got wrong (the calibration's timing conditions are not the
      serving ones) from the steps of that exact shape, and only from them.
    prediction(b, t) = calibrated(b, t) * exp(F_b + d[b, t]). A batch size never run takes the factor of the
    nearest one that has; a shape never run at a batch, the deviation of the nearest shape run there. One step's
    error counts at most MAX_STEP_ERROR: a shape priced out is not run again to be corrected, except by a probe
    (AdaptivePolicy._probe), whose optimism for a shape grows back as the shape goes unrun: each step at batch b
    ages the other shapes' recent visits u by `cell_stale` (u counts as n does, and only sets the probes' optimism,
    so a stale price is retried without its next step counting for more). Exact cells, not grid points: correcting
    the grid points around a step by their interpolation weights lets steps of one shape move the price of another
    (6-token steps moved the 9-token point), mispricing shapes whose forwards cost the same. live_rate 0 keeps the
    calibration as it is.
    """

    target_ms: dict[tuple[int, int], float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    live_rate: float = DEFAULT_LIVE_RATE
    cell_decay: float = DEFAULT_CELL_DECAY
    cell_prior: float = DEFAULT_CELL_PRIOR
    cell_stale: float = DEFAULT_CELL_STALE

    def __post_init__(self) -> None:
        self._check_settings()
        self.batches = sorted({b for b, _ in self.target_ms})
        self.tokens = sorted({t for _, t in self.target_ms})
        missing = [(b, t) for b in self.batches for t in self.tokens if (b, t) not in self.target_ms]
        if missing:
            raise ValueError(f"target_ms misses grid points {missing}: measure every (batch, tokens) pair")
        self.batch_factor: dict[int, float] = {}  # b -> F_b (log)
        self.cells: dict[int, dict[float, list[float]]] = {}  # b -> t -> [decayed visits n, deviation d (log), recent visits u]
        self._calibrated: dict[tuple[int, int], float] = {}  # memo of the interpolated calibration
        self.observations = 0  # measured steps folded in (cached predictions are stale when it changes)

    def _check_settings(self) -> None:
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
        wider): a calibration's shape error is smooth in the tokens per row, so it carries to the next width."""
        cells = self.cells.get(batch)
        if not cells:
            return 0.0
        if tokens_per_row in cells:
            return cells[tokens_per_row][1]
        return cells[min(cells, key=lambda t: (abs(t - tokens_per_row), -t))][1]

    def visits(self, batch: int, tokens_per_row: float) -> float:
        """Recent visits u of this exact shape (0 if never run): its decayed count of measured steps, aged further
        by cell_stale at every step of another shape at the batch; the probes' optimism shrinks with it."""
        return self.cells.get(batch, {}).get(tokens_per_row, (0.0, 0.0, 0.0))[2]

    def correction(self, batch: int, tokens_per_row: float) -> float:
        """exp(F_b + d[b, t]): the live factor on the calibrated price of a step padded to t tokens per row."""
        return math.exp(self.factor(batch) + self._deviation(batch, tokens_per_row))

    def target_step_ms(self, batch: int, tokens_per_row: float) -> float:
        """One target step of `batch` rows of `tokens_per_row` tokens: the calibration times the live correction."""
        return self.calibrated_ms(batch, tokens_per_row) * self.correction(batch, tokens_per_row)

    def live_correction(self, batch: int, tokens_per_row: float) -> float:
        """predicted / calibrated at this shape (1.0 = as calibrated)."""
        return self.target_step_ms(batch, tokens_per_row) / self.calibrated_ms(batch, tokens_per_row)

    def observe(self, batch: int, tokens_per_row: float, measured_ms: float) -> None:
        """One target step measured while serving (padded to tokens_per_row). Its error r (log measured /
        predicted) moves F_batch by live_rate * r and the (batch, tokens) cell's deviation by r / (visits +
        cell_prior); then the cells of this batch are re-centred (their visit-weighted mean deviation moves into
        F_batch), so that F_batch is the batch's common factor and a width not run lately is priced with it."""
        if self.live_rate == 0.0 or not measured_ms > 0.0 or not np.isfinite(measured_ms):
            return
        log_ratio = float(np.log(measured_ms / self.calibrated_ms(batch, tokens_per_row)))
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
            "observations": self.observations,
            # predicted / calibrated per batch size run and per shape run: [batch, factor] and [batch, tokens, visits, factor]
            "batch_factor": [[b, round(float(np.exp(f)), 3)] for b, f in sorted(self.batch_factor.items())],
            "live_correction": [
                [b, t, round(n, 1), round(self.live_correction(b, t), 3)]
                for b, cells in sorted(self.cells.items()) for t, (n, _, _) in sorted(cells.items())
            ],
        }


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
        cell_stale=cost.cell_stale,
    )
