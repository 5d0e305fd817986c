"""The runtime's default dtype on this machine, and the CPU feature it depends on.

bf16 weights halve the bytes a decode step reads, but only CPUs with bf16 dot-product instructions
(x86 avx512_bf16 or amx_bf16) multiply bf16 matrices at full speed; elsewhere PyTorch's bf16 GEMM runs as one
matrix-vector product per row (measured on an AVX2-only AMD EPYC: 16 rows cost 15x one row), so float32 is the
default there. The library's load_model keeps float32 as its default (the exactness tests compare float32
logits with transformers); the CLI's `--dtype auto` uses default_dtype().
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where the file does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True if the CPU has bf16 dot-product instructions (avx512_bf16 or amx_bf16)."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def default_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 where the CPU multiplies bf16 natively (avx512_bf16 / amx_bf16), else float32."""
    return torch.bfloat16 if native_bf16(flags) else torch.float32


def resolve_dtype(name: str) -> torch.dtype:
    """A --dtype value ("auto", "float32" or "bfloat16") -> torch dtype; "auto" = default_dtype()."""
    if name == "auto":
        return default_dtype()
    if name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {name!r} is not supported: use one of {', '.join(DTYPE_CHOICES)} (auto = {default_dtype_name()} on this CPU)")
    return getattr(torch, name)


def default_dtype_name() -> str:
    return str(default_dtype()).removeprefix("torch.")
