"""Helpers shared by the command modules: JSON output, clean one-line errors."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

from rich.console import Console

from specgate.errors import UserError  # noqa: F401 (the command modules raise common.UserError)
from specgate.jsonutil import jsonable

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` on stderr and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(code)


def print_json(obj: dict[str, Any]) -> None:
    """Print one JSON object on stdout (NaN and inf become null so the output stays valid JSON)."""
    sys.stdout.write(json.dumps(jsonable(obj), indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()
