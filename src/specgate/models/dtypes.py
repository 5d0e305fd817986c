"""The runtime's default dtype on this machine, and the CPU features it depends on.

bf16 weights halve the bytes a decode step reads, and a CPU decode step is a stream of weight reads. The runtime
keeps a bf16 model's matrices in bf16 and computes in float32 (CausalLM.compute_dtype): its native kernel widens
each weight exactly in registers (specgate.models.native, AVX2 + FMA), so a CPU without bf16 instructions runs
bf16 weights at the speed of their bytes too (Gemma-3-270M on the 2-core Ice Lake VM: a batch-1 step of 27 ms
against 48 ms in float32). So bfloat16 is the default wherever that kernel runs or the CPU multiplies bf16
natively (avx512_bf16 / amx_bf16), and float32 elsewhere (without the kernel a bf16 product would be upcast
chunk by chunk: slower than float32). The library's load_model keeps float32 as its default (the exactness tests
compare float32 logits with transformers); the CLI's `--dtype auto` uses default_dtype().
"""

from __future__ import annotations

import torch

from specgate.models.cpu import cpu_flags

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
WEIGHT_CHOICES = (*DTYPE_CHOICES, "gguf", "int8")  # --dtype of a target: also a GGUF's own blocks, or Q8_0 on load
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True if the CPU has bf16 dot-product instructions (avx512_bf16 or amx_bf16)."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def default_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 where bf16 weights run at the speed of their bytes: the CPU has bf16 dot products (avx512_bf16 /
    amx_bf16), or AVX2 + FMA for specgate's native kernel; else float32. For this machine (flags None) the
    kernel must also have been built (a C compiler, SPECGATE_NATIVE != 0); for given flags, a compiler is assumed."""
    if flags is None:
        from specgate.models import native  # lazy: building the kernel is not needed to import dtypes

        return torch.bfloat16 if native_bf16() or native.available() else torch.float32
    return torch.bfloat16 if native_bf16(flags) or {"avx2", "fma"} <= flags else torch.float32


def resolve_dtype(name: str) -> torch.dtype:
    """A --dtype value ("auto", "float32" or "bfloat16") -> torch dtype; "auto" = default_dtype()."""
    if name == "auto":
        return default_dtype()
    if name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {name!r} is not supported: use one of {', '.join(DTYPE_CHOICES)} (auto = {default_dtype_name()} on this CPU)")
    return getattr(torch, name)


def default_dtype_name() -> str:
    return str(default_dtype()).removeprefix("torch.")


def resolve_weights(name: str, target: str) -> "torch.dtype | str":
    """A target's --dtype -> what load_model takes: a torch dtype, "gguf" (a .gguf's own quantized blocks) or
    "int8" (Q8_0 on load). "auto" picks "gguf" for a .gguf target (the embedded default is one) where the native
    kernels run: its weights as shipped are the fewest bytes a step can read, and their products equal the float32
    products of the de-quantised weights bit for bit; otherwise default_dtype()."""
    if name not in WEIGHT_CHOICES:
        raise ValueError(f"--dtype {name!r} is not supported: use one of {', '.join(WEIGHT_CHOICES)} (auto = "
                         f"{weights_name(resolve_weights('auto', target))} for {target!r} on this CPU)")
    if name in ("gguf", "int8"):
        return name
    if name != "auto":
        return getattr(torch, name)
    from specgate.models import native

    is_gguf = target == "gemma-3-270m" or str(target).endswith(".gguf")
    return "gguf" if is_gguf and native.available() else default_dtype()


def draft_dtype(weights: "torch.dtype | str") -> torch.dtype:
    """The torch dtype a draft model is loaded in beside a target loaded with `weights` (quantized: default_dtype())."""
    return default_dtype() if isinstance(weights, str) else weights


def weights_name(weights: "torch.dtype | str") -> str:
    return weights if isinstance(weights, str) else str(weights).removeprefix("torch.")
