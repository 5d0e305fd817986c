"""Speculation policies: how many draft tokens (gamma) each running request gets at each scheduler step.

- `off`, `fixed`, `table` (simple.py): no model; gamma 0, one gamma, or one gamma per batch-size range.
- `adaptive` (adaptive.py): the per-request gammas of most expected goodput under a cost model (cost_model.py)
  calibrated on the running machine (calibration.py) and corrected live.
The interface is base.py's SpeculationPolicy; every tuning constant is named and explained in constants.py.
"""

from __future__ import annotations

from specgate.serving.policy.adaptive import AdaptivePolicy, Plan
from specgate.serving.policy.base import Acceptance, SpeculationPolicy, check_gamma
from specgate.serving.policy.calibration import calibrate_cost_model, calibration_tokens
from specgate.serving.policy.constants import (
    CALIBRATION_BATCH_SIZES,
    DEFAULT_CELL_DECAY,
    DEFAULT_CELL_PRIOR,
    DEFAULT_CELL_STALE,
    DEFAULT_FIXED_GAMMA,
    DEFAULT_GAMMA_MAX,
    DEFAULT_LIVE_RATE,
    DEFAULT_MARGIN,
    DEFAULT_PRIOR_ALPHA,
    DEFAULT_PROBE_BONUS,
    DEFAULT_PROBE_EVERY,
    DEFAULT_PROBE_MARGIN,
    MAX_STEP_ERROR,
    POLICY_NAMES,
    TOKEN_DECAY,
    TOKEN_FACTOR_RANGE,
    TOKEN_PRIOR,
)
from specgate.serving.policy.cost_model import CostModel, monotone
from specgate.serving.policy.simple import FixedPolicy, OffPolicy, TablePolicy


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


__all__ = [
    "Acceptance", "AdaptivePolicy", "CALIBRATION_BATCH_SIZES", "CostModel", "DEFAULT_CELL_DECAY", "DEFAULT_CELL_PRIOR",
    "DEFAULT_CELL_STALE", "DEFAULT_FIXED_GAMMA", "DEFAULT_GAMMA_MAX", "DEFAULT_LIVE_RATE", "DEFAULT_MARGIN",
    "DEFAULT_PRIOR_ALPHA", "DEFAULT_PROBE_BONUS", "DEFAULT_PROBE_EVERY", "DEFAULT_PROBE_MARGIN", "FixedPolicy",
    "MAX_STEP_ERROR", "OffPolicy", "POLICY_NAMES", "Plan", "SpeculationPolicy", "TOKEN_DECAY", "TOKEN_FACTOR_RANGE",
    "TOKEN_PRIOR", "TablePolicy", "calibrate_cost_model", "calibration_tokens", "check_gamma", "make_policy", "monotone",
]
