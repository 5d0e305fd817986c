"""C kernels for the decode and verification steps of the runtime (float32 arithmetic, float32 or bf16 weights):
few-row matrix products, RMSNorm, one attention layer's work between its products (q/k norms, RoPE, the KV-cache
write, causal attention), the whole decoder stack in one call, and the verifier's argmax.

Why: a decode step here is ~0.5-1 GB of weights read by matrix-vector products plus ~1,000 small torch ops.
- Products (`skinny`): for one row oneDNN streams a weight at about the machine's bandwidth, but for 2-9 rows
  oneDNN costs 1.8-2.7x that and MKL 4-7x: their small-M GEMM does not keep the weight's rows in cache across
  the rows of x. Verifying gamma drafted tokens is exactly such a product. This kernel loads 4 rows of W and
  multiplies them by up to 3 rows of x at a time (12 AVX2 FMA accumulators; with AVX-512, 6 rows of x in 24 zmm
  accumulators), so W is read from memory once whatever R is, prefetching two blocks ahead. A bf16 weight is
  widened to float32 in registers (exact), so bf16 weights cost half the bytes and the same arithmetic.
  Gemma-3-270M's head at 1 / 5 / 9 rows on the AMD VM: 26 / 42 / 35 ms against oneDNN's 24 / 87 / 56; its 72
  layer products of a step: 16.7 / 20.3 / 22.0 ms against 20.2 / 39.2 / 38.8 (docs/BENCHMARKS.md, Performance).
- Between the products (`attn_prep`, `attend`, `residual_norm`, `rms_norm`): ~25 torch ops per layer (norms,
  rotate-half RoPE, index_put into the cache, SDPA with a boolean mask, residual adds) become 3-4 C calls that
  work on each row directly.
- The whole stack (`decode_layers`, DecodeStack): every layer's products, attention, norms and MLP activation in
  one C call and one OpenMP parallel region per forward, so the ~10 Python-level calls per layer, their checks,
  allocations and thread wake-ups go (on Gemma-3-270M ~4-6 ms of a ~31 ms bf16 step before it).
- The verifier's argmax and the scheduler's finiteness pass (`argmax`, `amax`, both from one pass: `max_argmax`):
  torch's run on one core at ~3 GB/s over a 262,144-logit row; one multi-threaded AVX2 pass gives the same
  results ~4x faster.

Every output element is computed by the same sequence of operations whichever R, row block or thread computes
it: a token's result does not depend on what else is in the call (batch-invariant), so a verification pass gives
each position the same logits as 1-token steps. The AVX-512 or AVX2 variant of a product is chosen by the CPU
and K alone, never by R.

The source is compiled with the system C compiler on first use (about a second) into
~/.cache/specgate/native/<hash>/ and loaded with ctypes (which drops the GIL during the call). Its OpenMP loops
are linked to torch's own libgomp (same soname, already loaded by torch, rpath to torch/lib), so they run on the
same OpenMP thread pool as torch's and oneDNN's kernels: a separate pool (Python worker threads were the first
version) fought oneDNN's spinning OpenMP threads for the cores and made whole steps slower. Where there is no C
compiler, no AVX2/FMA, or the build fails, `available()` is False and the runtime uses oneDNN and torch ops;
`SPECGATE_NATIVE=0` turns the kernels off, `SPECGATE_AVX512=0` keeps the products on AVX2.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specgate.models.cpu import cpu_flags
from specgate.models.quant import BLOCKS, REPACKED_KIND, QuantPart, QuantWeight

SKINNY_MAX_ROWS = 20  # a float32 LM head (>= HEAD_ELEMENTS): faster than oneDNN at every row count up to 20 (83 vs 102 ms)
LAYER_MAX_ROWS = 64  # a float32 layer weight: faster than oneDNN up to 64 rows (Gemma-3-270M's gate/up: 2.9 vs 3.3 ms)
# bf16 weights: the alternative past the limit is a chunked upcast to float32 before each GEMM, on every layer. Up
# to 160 rows covers every verification shape of a 16-request batch at gamma <= 8 (16 x 9 = 144 rows) and keeps
# them batch-invariant; at 64 such a forward doubled for 25% more rows (bench/bench_rows.py, docs/BENCHMARKS.md,
# Performance, "Wide verification forwards").
BF16_LAYER_MAX_ROWS = 160
BF16_HEAD_MAX_ROWS = 160
# quantized weights (GGUF blocks): every verification shape of a 16-request batch at gamma <= 8, as for bf16; past
# it (a prefill) a product dequantizes its weight in chunks and multiplies in float32 (transformer.linear)
QUANT_MAX_ROWS = 160
HEAD_ELEMENTS = 1 << 24  # weights of >= 16M elements are LM heads here
ATTENTION_THREAD_WORK = 1 << 18  # multiply-adds (rows x heads x D x keys) from which attend uses every thread
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # what the products read; x and the output are float32
NORM_MAX_ELEMENTS = 1 << 16  # rms_norm on the calling thread up to 64K elements (e.g. 20 rows of 640 x 4 heads)



CSRC = Path(__file__).parent / "csrc"  # the C sources, package data (pyproject.toml)
SOURCES = ("kernels.c", "quant.c", "verify.c")
HEADERS = ("specgate.h",)
WARNING_FLAGS = ["-Wall", "-Wextra"]
STRICT_ENV = "SPECGATE_NATIVE_STRICT"  # "1": a missing compiler, a failed build or load raises NativeBuildError


class NativeBuildError(RuntimeError):
    """The C kernels could not be built or loaded, or their ctypes mirrors do not match the C structs."""


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECGATE_CACHE", Path.home() / ".cache" / "specgate")) / "native"


def _fail(message: str) -> None:
    """A build or load problem: NativeBuildError under SPECGATE_NATIVE_STRICT=1, else a RuntimeWarning (the runtime
    then runs on oneDNN and torch ops: correct, several times slower)."""
    message += (f"\nspecgate runs without its C kernels (slower). Fix the cause above, or set SPECGATE_NATIVE=0 to "
                f"silence this; {STRICT_ENV}=1 makes it an error.")
    if os.environ.get(STRICT_ENV, "0") == "1":
        raise NativeBuildError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def compile_flags(torch_lib: Path) -> list[str]:
    """The compiler flags of the kernel library (warnings on; OpenMP linked to torch's own libgomp)."""
    return ["-O3", "-mavx2", "-mfma", "-mf16c", *WARNING_FLAGS, "-fopenmp", "-fPIC", "-shared", f"-I{CSRC}",
            f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]


def _build() -> Path | None:
    """Compile csrc/*.c into a shared library, cached under the hash of sources, flags and compiler; None (with a
    warning that shows the compiler's output and the fix) where that fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        _fail(f"no C compiler found (CC={os.environ.get('CC', 'cc')!r}, gcc): install one (e.g. apt-get install gcc)")
        return None
    torch_lib = Path(torch.__file__).parent / "lib"  # torch's own libgomp: one OpenMP runtime and thread pool
    flags = compile_flags(torch_lib)
    texts = [(CSRC / name).read_text() for name in (*HEADERS, *SOURCES)]
    digest = hashlib.sha256(("\0".join(texts) + " ".join(flags) + compiler).encode()).hexdigest()[:16]
    target = _cache_dir() / digest / "libspecgate_kernels.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            built = Path(work) / target.name
            command = [compiler, *flags, *(str(CSRC / name) for name in SOURCES), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                _fail(f"compiling specgate's C kernels failed (exit {result.returncode}):\n$ {' '.join(command)}\n"
                      f"{result.stderr.strip()}")
                return None
            if result.stderr.strip():  # built, but the compiler had something to say: show it once (the build is cached)
                warnings.warn(f"specgate's C kernels compiled with warnings:\n{result.stderr.strip()}", RuntimeWarning, stacklevel=3)
            os.replace(built, target)  # atomic: a concurrent build by another process is harmless
    except (OSError, subprocess.SubprocessError) as error:
        _fail(f"compiling specgate's C kernels failed: {error}")
        return None
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECGATE_NATIVE", "1") == "0":
        return None
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        if os.environ.get(STRICT_ENV, "0") == "1":
            raise NativeBuildError(f"{STRICT_ENV}=1 but this CPU lacks AVX2, FMA or F16C: the C kernels need all three")
        return None
    path = _build()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        _fail(f"loading specgate's C kernels from {path} failed: {error}")
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {
        "skinny": ([ptr] * 4 + [i64] * 3 + [i32] * 3, None),
        "weight_product": ([ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32], None),
        "dequantize_rows": ([ptr, i32, i64, ptr, i64, ptr, i32], None),
        "int8_activations": ([ptr, i64, i64, ptr], None),
        "repack": ([ptr, i32, i64, i64, ptr, i32], None),
        "kind_row_bytes": ([i32, i64], i64),
        "rms_norm": ([ptr] * 3 + [i64] * 2 + [ctypes.c_float], None),
        "read_sum": ([ptr, i64, i32, i64], ctypes.c_double),
        "residual_norm": ([ptr] * 5 + [i64] * 2 + [ctypes.c_float], None),
        "attn_prep": ([ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, i64, ptr, ptr, i64], None),
        "attend": ([ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, i32, i32], None),
        "argmax_rows": ([ptr, i64, i64, ptr, ptr, i32], None),
        "verify_rows": ([ptr, i64, i64, i64, ptr, ctypes.c_double, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i32], None),
        "decode_layers": ([ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i32], None),
        "specgate_struct_layout": ([ctypes.c_char_p, ptr, i64], i64),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    for mirror in (_Weight, _Layer, _Config):
        check_layout(library, mirror)  # a mismatch is a bug in this file: raise, never run on a wrong layout
    return library


def struct_layout(library: ctypes.CDLL, name: str) -> list[int]:
    """[sizeof, offset of each field...] of the C struct `name` as the compiled library lays it out."""
    values = (ctypes.c_int64 * 64)()
    count = library.specgate_struct_layout(name.encode(), values, len(values))
    if count < 0:
        raise NativeBuildError(f"the C library does not describe a struct named {name!r} (specgate_struct_layout)")
    return list(values[:count])


def check_layout(library: ctypes.CDLL, mirror: type[ctypes.Structure], name: str | None = None) -> None:
    """Raise NativeBuildError unless the ctypes class `mirror` lays out its fields as the C struct `name` (default:
    the class name without its leading underscore) does: same size, same offset for each field in order."""
    name = name or mirror.__name__.lstrip("_")
    expected = struct_layout(library, name)
    actual = [ctypes.sizeof(mirror)] + [getattr(mirror, field).offset for field, _ in mirror._fields_]
    if actual != expected:
        raise NativeBuildError(
            f"the ctypes mirror {mirror.__name__} does not match the C struct {name}: [sizeof, offsets] {actual} vs "
            f"{expected} in the library: update the _fields_ in specgate/models/native.py to csrc/specgate.h"
        )


def _require(fallback: str) -> ctypes.CDLL:
    """The loaded library, or ValueError naming why it is missing and what to use instead."""
    library = _library()
    if library is None:
        raise ValueError(f"the native kernel is not available here (no C compiler, no AVX2/FMA, or SPECGATE_NATIVE=0): use {fallback}")
    return library


@functools.lru_cache(maxsize=1)
def wide_vectors() -> bool:
    """True where the products use their AVX-512 variant (the CPU has avx512f and avx512bw; SPECGATE_AVX512=0
    keeps AVX2). For weights with K % 16 == 0."""
    return os.environ.get("SPECGATE_AVX512", "1") != "0" and {"avx512f", "avx512bw"} <= cpu_flags()


@functools.lru_cache(maxsize=1)
def int8_activations() -> bool:
    """True where products over quantized weights round x to int8 per 32-block and take integer dot products
    (csrc/quant.c, llama.cpp's method: the CPU has AVX-512 VNNI; SPECGATE_VNNI=0 or SPECGATE_AVX512=0 keeps float32
    activations). Decided by the CPU alone, so a row's result never depends on the other rows of a call."""
    return wide_vectors() and os.environ.get("SPECGATE_VNNI", "1") != "0" and {"avx512_vnni", "avx512vl"} <= cpu_flags()


def round_activations(x: Tensor) -> Tensor:
    """x [R, K] float32 contiguous as the int8 kernels see it: each 32-block rounded to int8 with its scale
    (q * dx, exact in float32). A prefill's rows through the dequantized float32 product see the same activations
    as decode rows, so the KV cache does not depend on how a prompt was chunked beyond float32 rounding."""
    rows, k = x.shape
    out = torch.empty(rows, (k + 63) // 64 * 64, dtype=torch.float32)  # [R, K rounded up to 64]
    _require("round_activations()").int8_activations(x.data_ptr(), rows, k, out.data_ptr())
    return out[:, :k]


def attention_wide() -> bool:
    """True where attention runs its AVX-512 variant (csrc/kernels.c attend_head16: fewer instructions, which pay in a
    prefill's chunks whose keys are in cache; decode steps read the cache from memory and gain little): the CPU has
    AVX-512; SPECGATE_ATTN_AVX512=0 or SPECGATE_AVX512=0 keeps AVX2. Decided by the CPU alone, never by the rows of a
    call (bench/bench_prefill.py --compare attention measures it)."""
    return wide_vectors() and os.environ.get("SPECGATE_ATTN_AVX512", "1") != "0"


WIDE_ATTN = 4  # specgate.h: the stack's Config.wide bit for the AVX-512 attention


def stack_flags() -> int:
    """DecodeStack's Config.wide: quant_flags() plus WIDE_ATTN where attention_wide()."""
    return quant_flags() | (WIDE_ATTN if attention_wide() else 0)


def quant_flags() -> int:
    """The C products' `wide` argument for quantized weights: 1 AVX-512, 2 int8 activations (specgate.h WIDE_*)."""
    return int(wide_vectors()) | (2 if int8_activations() else 0)


def available() -> bool:
    """True where the kernel is built and loaded (x86-64 with AVX2 and FMA, a C compiler, SPECGATE_NATIVE != 0)."""
    return _library() is not None


def max_rows(weight: Tensor) -> int:
    """The most rows of x skinny_linear serves for this weight: SKINNY_MAX_ROWS for a float32 LM head,
    BF16_HEAD_MAX_ROWS for a bf16 one, layer_max_rows(dtype) for a layer's weight (beyond them oneDNN's blocked
    GEMM, or the chunked bf16 upcast, is faster: a prefill); QUANT_MAX_ROWS for a QuantWeight."""
    if isinstance(weight, QuantWeight):
        return QUANT_MAX_ROWS
    if weight.numel() >= HEAD_ELEMENTS:
        return BF16_HEAD_MAX_ROWS if weight.dtype == torch.bfloat16 else SKINNY_MAX_ROWS
    return layer_max_rows(weight.dtype)


def layer_max_rows(weight_dtype: torch.dtype, quantized: bool = False) -> int:
    """The most rows a forward runs through the C paths (the stack, or the per-layer kernels) with weights of this
    dtype: QUANT_MAX_ROWS for quantized weights, BF16_LAYER_MAX_ROWS for bf16, LAYER_MAX_ROWS otherwise."""
    if quantized:
        return QUANT_MAX_ROWS
    return BF16_LAYER_MAX_ROWS if weight_dtype == torch.bfloat16 else LAYER_MAX_ROWS


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether skinny_linear serves this product: float32 x and a float32 or bfloat16 weight on the CPU, 1..
    max_rows(weight) rows of x, a contiguous weight with K a multiple of 8, and the kernel available."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if isinstance(weight, QuantWeight):
        return x.dtype == torch.float32 and x.device.type == "cpu" and 1 <= rows <= QUANT_MAX_ROWS and available()
    return (
        x.dtype == torch.float32
        and weight.dtype in WEIGHT_DTYPES
        and x.device.type == weight.device.type == "cpu"
        and weight.dim() == 2
        and 1 <= rows <= max_rows(weight)
        and weight.shape[1] % 8 == 0
        and weight.is_contiguous()
        and available()
    )


def skinny_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [R, K] float32 @ weight [N, K]^T (float32, or bfloat16 widened in registers) -> [R, N] float32, W's rows
    split over torch's OpenMP threads."""
    library = _require("linear()")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [R, K] and [N, K]")
    if x.dtype != torch.float32 or weight.dtype not in WEIGHT_DTYPES or weight.shape[1] % 8 or not weight.is_contiguous():
        raise ValueError(
            f"skinny_linear needs float32 x, a float32 or bfloat16 contiguous weight and K % 8 == 0 (got {x.dtype}, "
            f"{weight.dtype}, K={weight.shape[1]}, contiguous={weight.is_contiguous()})"
        )
    return skinny_product(x.contiguous(), weight, library)


def skinny_product(x: Tensor, weight: Tensor, library: ctypes.CDLL | None = None, out: Tensor | None = None,
                   out_rows: Tensor | None = None) -> Tensor:
    """skinny_linear without its checks, for a caller that made them (transformer.linear after applies(): a decode
    step's ~70 products are not validated twice). x [R, K] contiguous float32. With out (contiguous float32
    [M, N]) and out_rows (int64 [R], distinct, in 0..M-1) row r of the product is written to out[out_rows[r]] and
    out is returned: a ragged batch's real tokens scored straight into their padded places."""
    library = library or _library()
    rows, k = x.shape
    if out is None:
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)  # [R, N]
    if isinstance(weight, QuantWeight):  # the GGUF's blocks decoded in registers (csrc/quant.c); same conventions
        library.weight_product(x.data_ptr(), ctypes.byref(weight_struct(weight)), out.data_ptr(),
                               out_rows.data_ptr() if out_rows is not None else None, rows, k, weight.shape[0],
                               quant_flags(), torch.get_num_threads())
        return out
    # one call (ctypes drops the GIL) whose OpenMP loop runs on torch's own OpenMP threads; the AVX-512 variant
    # serves where the CPU has it and K % 16 == 0: decided by the CPU and K alone, never by R (batch invariance)
    library.skinny(x.data_ptr(), weight.data_ptr(), out.data_ptr(), out_rows.data_ptr() if out_rows is not None else None,
                   rows, k, weight.shape[0], int(weight.dtype == torch.bfloat16), int(wide_vectors()), torch.get_num_threads())
    return out


def for_kernels(weight: QuantWeight) -> QuantWeight:
    """The weight as the products read it fastest here: where int8 activations are on, parts with rows % 4 == 0 and
    K % 128 == 0 rearranged (exactly) into one sequential stream per 4 rows (csrc/quant.c): Q8_0 / Q5_0 / Q4_K
    block-transposed so one integer lane sums a whole 32-group, Q6_K in pairs of groups. Q8_0 and Q5_0 keep their
    size, Q4_K and Q6_K grow 1.33x / 1.22x (float32 scales). Otherwise unchanged."""
    if not (available() and int8_activations()) or weight.in_features % 128:
        return weight
    parts, k = [], weight.in_features
    for part in weight.parts:
        if part.rows % 4 == 0 and part.kind in REPACKED_KIND:
            packed_kind = REPACKED_KIND[part.kind]
            packed = torch.empty(part.rows, k // BLOCKS[packed_kind][0] * BLOCKS[packed_kind][1], dtype=torch.uint8)
            _library().repack(part.data.data_ptr(), part.kind, part.rows, k, packed.data_ptr(), torch.get_num_threads())
            part = QuantPart(packed_kind, packed)
        parts.append(part)
    return QuantWeight(tuple(parts), weight.in_features)


def dequantize_rows(weight: QuantWeight, rows: Tensor | None = None, part: int = 0) -> Tensor:
    """Rows `rows` (int64 [R]; None: all) of one part of a QuantWeight as float32 [R, K], dequantized in C exactly
    as ggml does (an embedding lookup; the float32 chunks of a prefill's product)."""
    library = _require("QuantWeight.dequantize()")
    data = weight.parts[part].data
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= data.shape[0]):
            raise ValueError(f"row ids must be in 0..{data.shape[0] - 1} (got {int(rows.min())}..{int(rows.max())})")
    count = data.shape[0] if rows is None else rows.numel()
    out = torch.empty(count, weight.in_features, dtype=torch.float32)  # [R, K]
    library.dequantize_rows(data.data_ptr(), weight.parts[part].kind, weight.in_features,
                            rows.data_ptr() if rows is not None else None, count, out.data_ptr(), torch.get_num_threads())
    return out


def norm_applies(x: Tensor, scale: Tensor) -> bool:
    """Whether rms_norm serves this call: float32 CPU tensors, a contiguous scale [D] with D % 8 == 0, x [..., D]
    with at most NORM_MAX_ELEMENTS elements (decode and verification rows; a prefill is left to torch, which
    spreads it over threads), and the kernel available."""
    return (
        x.dim() >= 1
        and 0 < x.numel() <= NORM_MAX_ELEMENTS
        and x.dtype == scale.dtype == torch.float32
        and x.device.type == scale.device.type == "cpu"
        and scale.dim() == 1
        and scale.shape[0] == x.shape[-1]
        and scale.shape[0] % 8 == 0
        and scale.is_contiguous()
        and available()
    )


def rms_norm(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """x [..., D] / sqrt(mean(x^2, -1) + eps) * scale [D] -> float32 [..., D], like F.rms_norm(x, (D,), scale, eps)
    in one call instead of ~8 small torch ops (a Gemma-3-270M decode step has 109 norms)."""
    library = _require("F.rms_norm")
    if x.dtype != torch.float32 or scale.dtype != torch.float32 or scale.dim() != 1 or x.shape[-1] != scale.shape[0]:
        raise ValueError(f"rms_norm needs float32 x [..., D] and scale [D] (got {x.dtype} {tuple(x.shape)}, {scale.dtype} {tuple(scale.shape)})")
    if scale.shape[0] % 8:
        raise ValueError(f"rms_norm needs D % 8 == 0 (got D={scale.shape[0]})")
    x = x.contiguous()
    scale = scale.contiguous()
    out = torch.empty_like(x)  # [..., D]
    library.rms_norm(x.data_ptr(), scale.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def residual_norm(x: Tensor, a: Tensor, scale: Tensor, next_scale: Tensor | None, eps: float) -> Tensor | None:
    """Gemma's residual step in one call: x += rms_norm(a) * scale, IN PLACE on x (contiguous float32 [..., D]),
    and, with next_scale, returns rms_norm(x) * next_scale (the next sub-layer's input norm); else None."""
    library = _require("x + F.rms_norm(a, ...)")
    if not (x.is_contiguous() and x.dtype == torch.float32 and a.shape == x.shape):
        raise ValueError(f"residual_norm needs a contiguous float32 x and a of the same shape (got {tuple(x.shape)}, {tuple(a.shape)})")
    for norm_scale in (scale,) if next_scale is None else (scale, next_scale):
        if norm_scale.dtype != torch.float32 or not norm_scale.is_contiguous() or norm_scale.shape != (x.shape[-1],) or x.shape[-1] % 8:
            raise ValueError(
                f"residual_norm needs contiguous float32 scales [D] with D % 8 == 0 (got {tuple(norm_scale.shape)}, D={x.shape[-1]})"
            )
    a = a.contiguous()
    out = torch.empty_like(x) if next_scale is not None else None
    library.residual_norm(
        x.data_ptr(), a.data_ptr(), scale.data_ptr(), next_scale.data_ptr() if next_scale is not None else None,
        out.data_ptr() if out is not None else None, x.numel() // x.shape[-1], x.shape[-1], eps,
    )
    return out


def attention_applies(rows: int, head_dim: int, keys: Tensor, limit: int) -> bool:
    """Whether attn_prep / attend serve this forward: 1..limit rows (layer_max_rows of the weights' dtype: decode
    and verification; a longer prefill keeps torch's flash attention), head_dim a multiple of 16 up to 1024, a
    contiguous float32 CPU cache."""
    return (
        1 <= rows <= limit
        and head_dim % 16 == 0
        and head_dim <= 1024
        and keys.dtype == torch.float32
        and keys.device.type == "cpu"
        and keys.is_contiguous()
        and available()
    )


def attention(
    qkv: Tensor,
    positions: Tensor,
    slots: Tensor,
    inv_freq: Tensor,
    q_scale: Tensor | None,
    k_scale: Tensor | None,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    keys: Tensor,
    values: Tensor,
    window: int | None,
    scale: float,
    kv_length: int,
) -> Tensor:
    """One attention layer's work between its two products, in two C calls.

    qkv [R, (H_q + 2 H_kv) D] contiguous float32, the fused q/k/v product (modified in place: normed, rotated);
    positions [R] int64 (-1 = padding), slots [R] int64 (each row's cache slot); inv_freq [D/2] float32;
    q_scale, k_scale [D] (Gemma's q/k norms, 1 + w) or None; keys, values [S, H_kv, L + 1, D] (one layer of the
    KVCache); kv_length: the highest position + 1 (sizes the work). Writes each non-pad row's k, v at (slot,
    position), then attends causally (and within `window` positions on a sliding layer). Returns [R, H_q D]
    float32 (zeros for padding rows)."""
    library = _require("the torch attention path")
    rows, width = qkv.shape
    head_dim = keys.shape[-1]
    if head_dim % 16 or head_dim > 1024:
        raise ValueError(f"head_dim={head_dim} is not served: the C attention path needs head_dim % 16 == 0 and <= 1024")
    if width != (num_heads + 2 * num_kv_heads) * head_dim or not qkv.is_contiguous() or qkv.dtype != torch.float32:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be contiguous float32 [R, (H_q + 2 H_kv) D] = [R, {(num_heads + 2 * num_kv_heads) * head_dim}]")
    if positions.shape != (rows,) or slots.shape != (rows,) or positions.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError(f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be int64 [R] = [{rows}]")
    positions, slots = positions.contiguous(), slots.contiguous()
    length = keys.shape[2]  # L + 1
    library.attn_prep(
        qkv.data_ptr(), width, rows, positions.data_ptr(), slots.data_ptr(), inv_freq.data_ptr(),
        q_scale.data_ptr() if q_scale is not None else None, k_scale.data_ptr() if k_scale is not None else None,
        eps, num_heads, num_kv_heads, head_dim, keys.data_ptr(), values.data_ptr(), length,
    )
    out = torch.empty(rows, num_heads * head_dim, dtype=torch.float32)  # [R, H_q D]
    # one thread for a 1-token step (Gemma-3-270M: ~0.13 M multiply-adds, ~30 us), all from a few rows on
    work = rows * num_heads * head_dim * min(kv_length, window or kv_length)
    threads = torch.get_num_threads() if work >= ATTENTION_THREAD_WORK else 1
    scratch = torch.empty(threads, length, dtype=torch.float32)  # [threads, L + 1] scores
    library.attend(
        qkv.data_ptr(), width, rows, positions.data_ptr(), slots.data_ptr(), keys.data_ptr(), values.data_ptr(),
        length, num_heads, num_kv_heads, head_dim, window or 0, scale, out.data_ptr(), scratch.data_ptr(), threads,
        int(attention_wide()),
    )
    return out


def read_sum(x: Tensor, prefetch_floats: int = 0) -> float:
    """The sum of a contiguous float32 tensor whose size is a multiple of 64, read with AVX2 on torch's OpenMP
    threads (with prefetch_floats > 0, each chunk also prefetches that far ahead): bench/bench_perf.py's
    bandwidth probe (a plain streaming read; torch's own sum is slower here)."""
    library = _require("torch.sum")
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() % 64:
        raise ValueError(f"read_sum needs a contiguous float32 tensor of a multiple of 64 elements (got {x.dtype}, {x.numel()})")
    if prefetch_floats < 0:
        raise ValueError(f"prefetch_floats={prefetch_floats} must be >= 0 (0 = no software prefetch)")
    return library.read_sum(x.data_ptr(), x.numel(), torch.get_num_threads(), prefetch_floats)


# --- the whole decoder stack of a decode / verification forward in one call ---------------------------------------


class _Weight(ctypes.Structure):  # mirrors the C struct Weight (csrc/specgate.h)
    _fields_ = [("data", ctypes.c_void_p * 4), ("rows", ctypes.c_int64 * 4), ("kind", ctypes.c_int32 * 4),
                ("parts", ctypes.c_int32)]


class _Layer(ctypes.Structure):  # mirrors the C struct Layer (field order and types)
    _fields_ = [(name, _Weight if name[0] == "w" else ctypes.c_void_p) for name in (
        "wqkv", "bqkv", "wo", "bo", "wgu", "bgu", "wd", "bd", "norm_in", "norm_attn", "norm_pre_ff", "norm_post_ff",
        "q_norm", "k_norm", "inv_freq")] + [("window", ctypes.c_int64), ("scale", ctypes.c_float)]


class _Config(ctypes.Structure):  # mirrors the C struct Config
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float)] + [(name, ctypes.c_int32) for name in ("gemma", "act", "wide")]


KIND_F32, KIND_BF16 = 0, 1  # csrc/specgate.h; quantized kinds keep ggml's numbers (quant.BLOCKS)


def weight_struct(weight: "Tensor | QuantWeight") -> _Weight:
    """The C Weight of a float32 / bf16 tensor [N, K] (one part) or a QuantWeight (its parts). The caller keeps
    the tensors alive while the struct is used."""
    if isinstance(weight, QuantWeight):
        parts = [(part.data.data_ptr(), part.rows, part.kind) for part in weight.parts]
    else:
        parts = [(weight.data_ptr(), weight.shape[0], KIND_BF16 if weight.dtype == torch.bfloat16 else KIND_F32)]
    struct = _Weight()
    for index, (pointer, rows, kind) in enumerate(parts):
        struct.data[index], struct.rows[index], struct.kind[index] = pointer, rows, kind
    struct.parts = len(parts)
    return struct


STACK_ACTIVATIONS = {"silu": 0, "tanh_gelu": 1}  # what decode_layers computes between gate/up and down


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as decode_layers reads it: weights [N, K] (all float32 or all bf16, contiguous), biases
    and norm scales float32 [N] / [D] or None. Gemma: norm_attn is the norm of the attention output and
    norm_pre_ff / norm_post_ff the MLP's; Llama-style: norm_attn is the pre-MLP norm and the other two are None.
    q_norm / k_norm: per-head scales [head_dim] (Gemma) or None; window: sliding window or None; scale: multiplies
    q . k."""

    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None
    norm_in: Tensor
    norm_attn: Tensor
    norm_pre_ff: Tensor | None
    norm_post_ff: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    inv_freq: Tensor
    window: int | None
    scale: float


class DecodeStack:
    """Every layer of a decoder as ONE C call per forward (decode_layers), for decode and verification rows.

    The per-op path makes ~10 C calls per layer from Python (three products, attn_prep, attend, residual_norm, the
    activation in torch), each with argument checks, allocations and an OpenMP wake-up: on Gemma-3-270M ~6 ms of
    a ~31 ms bf16 step. Here the layers run in one OpenMP parallel region with barriers between the pieces; the
    same operations in the same order, so the rows are batch-invariant exactly as on the per-op path. The object
    holds the tensors it points at (weights, norm scales): CausalLM rebuilds it when they change (see
    CausalLM.native_stack)."""

    def __init__(self, layers: list[StackLayer], *, heads: int, kv_heads: int, head_dim: int, eps: float,
                 gemma: bool, activation: str) -> None:
        library = _require("the per-layer path")
        if not layers:
            raise ValueError("layers=[] is empty: a decoder stack needs at least one layer")
        if activation not in STACK_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not computed in C: use one of {', '.join(STACK_ACTIVATIONS)}")
        first = layers[0]
        hidden, intermediate = first.qkv.shape[1], first.down.shape[1]
        quantized = isinstance(first.qkv, QuantWeight)
        weight_dtype = "quantized" if quantized else first.qkv.dtype
        if (not quantized and weight_dtype not in WEIGHT_DTYPES) or hidden % 8 or intermediate % 8 or head_dim % 16 or head_dim > 1024:
            raise ValueError(
                f"decode_layers needs float32, bf16 or quantized weights, hidden and intermediate % 8 == 0 and head_dim "
                f"% 16 == 0 (<= 1024); got {weight_dtype}, hidden={hidden}, intermediate={intermediate}, head_dim={head_dim}"
            )
        shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                  "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        self._keep: list[Tensor | QuantWeight] = []
        array = (_Layer * len(layers))()
        for index, layer in enumerate(layers):
            for name, shape in shapes.items():
                weight = getattr(layer, name)
                dtype = "quantized" if isinstance(weight, QuantWeight) else weight.dtype
                if tuple(weight.shape) != shape or dtype != weight_dtype or (dtype != "quantized" and not weight.is_contiguous()):
                    raise ValueError(f"layer {index} {name}: {tuple(weight.shape)} {dtype} must be a contiguous {shape} {weight_dtype}")
            fields = {}
            for field, _ in _Layer._fields_[:-2]:
                tensor = getattr(layer, {"wqkv": "qkv", "bqkv": "qkv_bias", "wo": "o", "bo": "o_bias", "wgu": "gate_up",
                                         "bgu": "gate_up_bias", "wd": "down", "bd": "down_bias"}.get(field, field))
                if tensor is not None and field[0] != "w" and (tensor.dtype != torch.float32 or not tensor.is_contiguous()):
                    raise ValueError(f"layer {index} {field}: must be a contiguous float32 tensor (got {tensor.dtype})")
                if tensor is not None:
                    self._keep.append(tensor)
                if field[0] == "w":
                    fields[field] = weight_struct(tensor)
                else:
                    fields[field] = tensor.data_ptr() if tensor is not None else None
            array[index] = _Layer(**fields, window=layer.window or 0, scale=layer.scale)
        self.layers = array
        self.config = _Config(hidden, heads, kv_heads, head_dim, intermediate, eps, int(gemma),
                              STACK_ACTIVATIONS[activation], stack_flags())
        self.width = 2 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 3 * intermediate  # WORK floats per row
        self._library = library

    def run(self, x: Tensor, positions: Tensor, slots: Tensor, keys: list[Tensor], values: list[Tensor]) -> None:
        """x [R, hidden] contiguous float32, updated in place through every layer; positions, slots [R] int64
        contiguous (-1: padding); keys / values: the cache's per-layer [S, kv_heads, L1, head_dim] float32."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or tuple(x.shape) != (rows, self.config.hidden):
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be contiguous float32 [R, {self.config.hidden}]")
        if len(keys) != len(self.layers) or len(values) != len(self.layers):
            raise ValueError(f"the cache has {len(keys)} layers, the stack {len(self.layers)}")
        length = keys[0].shape[2]  # L1
        work = torch.empty(rows * self.width, dtype=torch.float32)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * length, dtype=torch.float32)  # [threads, L1] attention scores
        key_ptrs = (ctypes.c_void_p * len(keys))(*(k.data_ptr() for k in keys))
        value_ptrs = (ctypes.c_void_p * len(values))(*(v.data_ptr() for v in values))
        self._library.decode_layers(
            x.data_ptr(), rows, positions.data_ptr(), slots.data_ptr(), ctypes.byref(self.layers), len(self.layers),
            ctypes.byref(self.config), key_ptrs, value_ptrs, length, work.data_ptr(), scratch.data_ptr(), threads,
        )


def _argmax_applies(x: Tensor) -> bool:
    return (available() and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and x.dim() > 0
            and 0 < x.shape[-1] < 2**31 and x.numel() > 0)


def argmax(x: Tensor) -> Tensor:
    """torch.argmax(x, -1) for a contiguous float32 CPU tensor [..., V] (V < 2^31), in one multi-threaded AVX2 pass
    (the same indices: the first maximum, and the first NaN where there is one). torch's own argmax reads a
    262,144-logit row at ~3 GB/s on one core, ~0.36 ms: a verification of 16 requests x 5 positions spent ~20 ms
    of its step there (5.8 ms here). Falls back to torch.argmax for anything else."""
    if not _argmax_applies(x):
        return x.argmax(-1)
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    _library().argmax_rows(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr(), None, torch.get_num_threads())
    return out


def amax(x: Tensor) -> Tensor:
    """torch.amax(x, -1) (NaN where a row has a NaN, +inf where it has +inf: what a finiteness check needs) in the
    same one pass as argmax; torch.amax elsewhere."""
    return max_argmax(x)[0]


def max_argmax(x: Tensor) -> tuple[Tensor, Tensor]:
    """(torch.amax(x, -1), torch.argmax(x, -1)) from ONE pass over x: the scheduler's finiteness check and the
    greedy verification read the same [B, G+1, V] logits (16 requests x 1 token of Gemma's 262,144: 17 MB a
    pass), so reading them once saves a pass per step. torch's two reductions elsewhere."""
    if not _argmax_applies(x):
        return x.amax(-1), x.argmax(-1)
    index = torch.empty(x.shape[:-1], dtype=torch.int64)
    out = torch.empty(x.shape[:-1], dtype=torch.float32)
    _library().argmax_rows(x.data_ptr(), out.numel(), x.shape[-1], index.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out, index


VERIFY_BLOCK = 512  # csrc/verify.c's tokens per block of the inverse CDF (verifier.BLOCK_SIZE)


def verify_applies(logits: Tensor) -> bool:
    """True where verify_rows runs: the C kernels built and logits a contiguous float32 CPU tensor [B, G+1, V]."""
    return _argmax_applies(logits) and logits.dim() == 3 and logits.shape[1] >= 1


def verify_rows(
    logits: Tensor, row_max: Tensor, temperature: float, draft_tokens: Tensor, num_draft_tokens: Tensor,
    draft_values: Tensor | None, support: Tensor | None, accept_uniforms: Tensor, sample_uniforms: Tensor,
) -> tuple[Tensor, Tensor]:
    """The exact temperature-only verification of a ragged batch in C (csrc/verify.c), one thread per row.

    logits `# [B, G+1, V]` float32 (verify_applies), row_max `# [B, G+1]` their maxima, draft_tokens `# [B, G]`
    (valid ids, 0 past each row's count), num_draft_tokens `# [B]`, draft_values `# [B, G, K]` (q on support's
    columns; support None: K = V, dense) or None (q one-hot at each draft), support `# [K]` int64 or None,
    accept_uniforms `# [B, G]` and sample_uniforms `# [B]` float64 -> (num_accepted `# [B]`, final token `# [B]`).
    No checks beyond shapes: the verifier validates its inputs before calling this."""
    batch, positions, vocab = logits.shape
    gamma = positions - 1
    row_max = row_max.float().contiguous()
    drafts = draft_tokens.long().contiguous()
    counts = num_draft_tokens.long().contiguous()
    accept_uniforms, sample_uniforms = accept_uniforms.double().contiguous(), sample_uniforms.double().contiguous()
    columns = vocab
    if draft_values is not None:
        draft_values = draft_values.float().contiguous()
        columns = draft_values.shape[-1]
        if tuple(draft_values.shape) != (batch, gamma, columns) or (support is None and columns != vocab):
            raise ValueError(f"draft_values has shape {list(draft_values.shape)}; expected [B, G, K] = [{batch}, {gamma}, K] "
                             f"with K = V = {vocab} when support is None")
    if support is not None:
        support = support.long().contiguous()
    threads = max(1, min(torch.get_num_threads(), batch))
    scratch = torch.empty(threads, vocab)  # [threads, V] one exp row per thread
    totals = torch.empty(threads, -(-vocab // VERIFY_BLOCK), dtype=torch.float64)  # [threads, blocks]
    accepted = torch.empty(batch, dtype=torch.int64)
    tokens = torch.empty(batch, dtype=torch.int64)

    def pointer(t: Tensor | None) -> int | None:
        return None if t is None or t.numel() == 0 else t.data_ptr()

    _library().verify_rows(
        logits.data_ptr(), batch, positions, vocab, row_max.data_ptr(), float(temperature), pointer(drafts),
        counts.data_ptr(), pointer(draft_values), pointer(support), columns, pointer(accept_uniforms),
        sample_uniforms.data_ptr(), accepted.data_ptr(), tokens.data_ptr(), scratch.data_ptr(), totals.data_ptr(), threads,
    )
    return accepted, tokens
