"""Helpers shared by the command modules: JSON output, clean one-line errors."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, NoReturn

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit status 2."""


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` on stderr and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(code)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


def print_json(obj: dict[str, Any]) -> None:
    """Print one JSON object on stdout (NaN and inf become null so the output stays valid JSON)."""
    sys.stdout.write(json.dumps(_jsonable(obj), indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()
