"""A small C kernel for the LM head of decode and verification steps: out [R, N] = x [R, K] @ W [N, K]^T for few
rows (R <= SKINNY_MAX_ROWS), W read from memory once, split over the machine's cores.

Why: Gemma-3-270M's tied head (262,144 x 640 float32, 671 MB) is read in full every step. For one row oneDNN
streams it at about the machine's bandwidth (~29 ms on the 2-core VM), but for 2-9 rows oneDNN costs 1.8-2.7x
that and MKL 4-7x: their small-M GEMM does not keep the head's rows in cache across the rows of x. Verifying
gamma drafted tokens is exactly such a product, so the head made a 5-token verification ~1.8x a 1-token step and
ate most of what speculation saves. This kernel loads 4 rows of W into registers and multiplies them by up to 3
rows of x at a time (12 AVX2 FMA accumulators), so W is read from memory once whatever R is: 29 / 34 / 41 / 54 /
83 ms for 1 / 2 / 5 / 9 / 20 rows, against oneDNN's 29 / 52 / 59 / 78 / 102 (`bench/bench_perf.py --sections
head`, docs/BENCHMARKS.md, Performance).

Every output element is the same sequence of 8-lane FMAs over k followed by the same horizontal sum, whichever
R, row block or thread computes it: a token's logits do not depend on how many tokens are scored with it
(batch-invariant), so a verification pass gives the position the same head output as a 1-token step.

The source is compiled with the system C compiler on first use (about a second) into
~/.cache/specgate/native/<hash>/ and loaded with ctypes (which drops the GIL during the call). Its OpenMP loop
is linked to torch's own libgomp (same soname, already loaded by torch, rpath to torch/lib), so it runs on the
same OpenMP thread pool as torch's and oneDNN's kernels: a separate pool (Python worker threads were the first
version) fought oneDNN's spinning OpenMP threads for the cores and made whole steps slower. Where there is no C
compiler, no AVX2/FMA, or the build fails, `available()` is False and the runtime uses oneDNN;
`SPECGATE_NATIVE=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from specgate.models.dtypes import cpu_flags

SKINNY_MAX_ROWS = 20  # measured faster than oneDNN at every row count up to 20 (bench: 84 vs 96 ms at 20 rows)
SKINNY_MIN_ELEMENTS = 1 << 24  # weights of >= 16M elements (an LM head): smaller ones do not repay the thread hand-off

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* RR rows of x (stride K) times nn <= 4 rows of W (stride K), into O (row stride N) at column n. */
#define BLOCK(RR)                                                                                        \
static void block##RR(const float* x, const float* w, int64_t K, int64_t N, float* o, int64_t n, int nn) { \
    __m256 acc[RR][4];                                                                                   \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();             \
    for (int64_t k = 0; k < K; k += 8) {                                                                 \
        __m256 a[4];                                                                                     \
        for (int j = 0; j < 4; ++j) a[j] = j < nn ? _mm256_loadu_ps(w + j * K + k) : _mm256_setzero_ps(); \
        for (int i = 0; i < RR; ++i) {                                                                   \
            __m256 xv = _mm256_loadu_ps(x + i * K + k);                                                  \
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(a[j], xv, acc[i][j]);               \
        }                                                                                                \
    }                                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < nn; ++j) o[i * N + n + j] = hsum(acc[i][j]);        \
}
BLOCK(1)
BLOCK(2)
BLOCK(3)

/* O [R, N] = X [R, K] @ W [N, K]^T, the 4-row blocks of W split over `threads` OpenMP threads (static: each
   thread streams one contiguous range of W). K % 8 == 0. */
void skinny(const float* X, const float* W, float* O, int64_t R, int64_t K, int64_t N, int threads) {
    const int64_t blocks = (N + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = b * 4;
        const int nn = (int)(N - n < 4 ? N - n : 4);
        const float* w = W + n * K;
        int64_t r = 0;
        for (; r + 3 <= R; r += 3) block3(X + r * K, w, K, N, O + r * N, n, nn);
        if (R - r == 2) block2(X + r * K, w, K, N, O + r * N, n, nn);
        else if (R - r == 1) block1(X + r * K, w, K, N, O + r * N, n, nn);
    }
}
"""


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECGATE_CACHE", Path.home() / ".cache" / "specgate")) / "native"


def _build() -> Path | None:
    """Compile SOURCE into a shared library (cached by the hash of source and flags); None where that fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    torch_lib = Path(torch.__file__).parent / "lib"  # torch's own libgomp: one OpenMP runtime and thread pool
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
    digest = hashlib.sha256((SOURCE + " ".join(flags) + compiler).encode()).hexdigest()[:16]
    target = _cache_dir() / digest / "libspecgate_skinny.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            source = Path(work) / "skinny.c"
            source.write_text(SOURCE)
            built = Path(work) / target.name
            subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: a concurrent build by another process is harmless
    except (OSError, subprocess.SubprocessError):
        return None
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECGATE_NATIVE", "1") == "0":
        return None
    if not {"avx2", "fma"} <= cpu_flags():
        return None
    path = _build()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    library.skinny.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.skinny.restype = None
    return library


def available() -> bool:
    """True where the kernel is built and loaded (x86-64 with AVX2 and FMA, a C compiler, SPECGATE_NATIVE != 0)."""
    return _library() is not None


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether skinny_linear serves this product: float32 CPU tensors, 1..SKINNY_MAX_ROWS rows of x, a contiguous
    weight of >= SKINNY_MIN_ELEMENTS with K a multiple of 8, and the kernel available."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (
        1 <= rows <= SKINNY_MAX_ROWS
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() >= SKINNY_MIN_ELEMENTS
        and weight.shape[1] % 8 == 0
        and weight.is_contiguous()
        and available()
    )


def skinny_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [R, K] @ weight [N, K]^T -> [R, N] float32, W's rows split over torch's OpenMP threads."""
    library = _library()
    if library is None:
        raise ValueError("the native kernel is not available here (no C compiler, no AVX2/FMA, or SPECGATE_NATIVE=0): use linear()")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [R, K] and [N, K]")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape[1] % 8 or not weight.is_contiguous():
        raise ValueError(
            f"skinny_linear needs float32 tensors, a contiguous weight and K % 8 == 0 (got {x.dtype}, {weight.dtype}, "
            f"K={weight.shape[1]}, contiguous={weight.is_contiguous()})"
        )
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)  # [R, N]
    # one call (ctypes drops the GIL) whose OpenMP loop runs on torch's own OpenMP threads
    library.skinny(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k, weight.shape[0], torch.get_num_threads())
    return out
