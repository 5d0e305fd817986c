"""JSON helpers shared by the command line and the reports."""

from __future__ import annotations

import math
from typing import Any


def jsonable(value: Any) -> Any:
    """value with NaN and inf as None, dict keys as str, tuples as lists and numpy / torch scalars as Python ones,
    so json.dumps writes valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return jsonable(value.item())
    return value
