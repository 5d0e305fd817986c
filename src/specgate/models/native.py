"""C kernels for the decode and verification steps of the float32 runtime: few-row matrix products, RMSNorm, and
one attention layer's work between its products (q/k norms, RoPE, the KV-cache write, causal attention).

Why: a decode step here is ~1 GB of weights read by matrix-vector products plus ~1,000 small torch ops.
- Products (`skinny`): for one row oneDNN streams a weight at about the machine's bandwidth, but for 2-9 rows
  oneDNN costs 1.8-2.7x that and MKL 4-7x: their small-M GEMM does not keep the weight's rows in cache across
  the rows of x. Verifying gamma drafted tokens is exactly such a product. This kernel loads 4 rows of W and
  multiplies them by up to 3 rows of x at a time (12 AVX2 FMA accumulators), so W is read from memory once
  whatever R is; with several rows it also prefetches two blocks ahead. Gemma-3-270M's head at 1 / 5 / 9 rows:
  26 / 42 / 35 ms against oneDNN's 24 / 87 / 56; its 72 layer products of a step: 16.7 / 20.3 / 22.0 ms against
  20.2 / 39.2 / 38.8 (`bench/bench_perf.py --sections head,layers`, docs/BENCHMARKS.md, Performance, run 4).
- Between the products (`attn_prep`, `attend`, `residual_norm`, `rms_norm`): ~25 torch ops per layer (norms,
  rotate-half RoPE, index_put into the cache, SDPA with a boolean mask, residual adds) become 3-4 C calls that
  work on each row directly; a Gemma-3-270M batch-1 step through torch's ops instead costs 1.2x (quiet rounds of
  the bench's floor section, which measures both paths).

Every output element is computed by the same sequence of operations whichever R, row block or thread computes
it: a token's result does not depend on what else is in the call (batch-invariant), so a verification pass gives
each position the same logits as 1-token steps.

The source is compiled with the system C compiler on first use (about a second) into
~/.cache/specgate/native/<hash>/ and loaded with ctypes (which drops the GIL during the call). Its OpenMP loops
are linked to torch's own libgomp (same soname, already loaded by torch, rpath to torch/lib), so they run on the
same OpenMP thread pool as torch's and oneDNN's kernels: a separate pool (Python worker threads were the first
version) fought oneDNN's spinning OpenMP threads for the cores and made whole steps slower. Where there is no C
compiler, no AVX2/FMA, or the build fails, `available()` is False and the runtime uses oneDNN and torch ops;
`SPECGATE_NATIVE=0` turns the kernels off.
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

SKINNY_MAX_ROWS = 20  # an LM head (>= HEAD_ELEMENTS): faster than oneDNN at every row count up to 20 (83 vs 102 ms)
LAYER_MAX_ROWS = 64  # a layer's weight: faster than oneDNN up to 64 rows (Gemma-3-270M's gate/up: 2.9 vs 3.3 ms)
HEAD_ELEMENTS = 1 << 24  # weights of >= 16M elements are LM heads here
ATTENTION_THREAD_WORK = 1 << 18  # multiply-adds (rows x heads x D x keys) from which attend uses every thread
NORM_MAX_ELEMENTS = 1 << 16  # rms_norm on the calling thread up to 64K elements (e.g. 20 rows of 640 x 4 heads)

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* RR rows of x (stride K) times nn <= 4 rows of W (stride K), into O (row stride N) at column n. 4 * RR
   accumulators + RR rows of x + 1 row of W: 16 ymm registers for RR = 3, no spills. A tail block (nn < 4)
   repeats its last row instead of branching in the loop; the repeats are not stored. With `prefetch`, the same
   rows of the block two blocks ahead are requested into cache while this one is multiplied: with several rows
   of x the loop does enough arithmetic per byte that the hardware prefetcher alone falls behind (the head at 5
   rows: 37 -> 33 ms); with one row it does not pay, so the caller asks for it only for R > 1. */
#define BLOCK(RR)                                                                                         \
static void block##RR(int prefetch, const float* x, const float* w, int64_t K, int64_t N, float* o,        \
                      int64_t n, int nn) {                                                                \
    const float* wr[4];                                                                                   \
    for (int j = 0; j < 4; ++j) wr[j] = w + (j < nn ? j : nn - 1) * K;                                    \
    __m256 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();              \
    for (int64_t k = 0; k < K; k += 8) {                                                                  \
        __m256 xv[RR];                                                                                    \
        for (int i = 0; i < RR; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);                              \
        if (prefetch) for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(wr[j] + k + 8 * K), _MM_HINT_T0); \
        for (int j = 0; j < 4; ++j) {                                                                     \
            __m256 a = _mm256_loadu_ps(wr[j] + k);                                                        \
            for (int i = 0; i < RR; ++i) acc[i][j] = _mm256_fmadd_ps(a, xv[i], acc[i][j]);                \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < nn; ++j) o[i * N + n + j] = hsum(acc[i][j]);         \
}
BLOCK(1)
BLOCK(2)
BLOCK(3)

/* O [R, N] = X [R, K] @ W [N, K]^T, the 4-row blocks of W split over `threads` OpenMP threads (static: each
   thread streams one contiguous range of W). K % 8 == 0. */
void skinny(const float* X, const float* W, float* O, int64_t R, int64_t K, int64_t N, int threads) {
    const int64_t blocks = (N + 3) / 4;
    const int prefetch = R > 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = b * 4;
        const int nn = (int)(N - n < 4 ? N - n : 4);
        const float* w = W + n * K;
        int64_t r = 0;
        for (; r + 3 <= R; r += 3) block3(prefetch && r == 0, X + r * K, w, K, N, O + r * N, n, nn);
        if (R - r == 2) block2(prefetch && r == 0, X + r * K, w, K, N, O + r * N, n, nn);
        else if (R - r == 1) block1(prefetch && r == 0, X + r * K, w, K, N, O + r * N, n, nn);
    }
}

/* Sum of X [N] (N % 64 == 0) with 8 independent accumulators, split over `threads`: a streaming read at the
   machine's bandwidth, for the memory-bandwidth probe of bench/bench_perf.py (not used by the runtime). */
double read_sum(const float* X, int64_t N, int threads) {
    double total = 0.0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t chunks = N / 64, t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t lo = chunks * t / count, hi = chunks * (t + 1) / count;
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t c = lo; c < hi; ++c)
            for (int i = 0; i < 8; ++i) a[i] = _mm256_add_ps(a[i], _mm256_loadu_ps(X + c * 64 + 8 * i));
        for (int i = 1; i < 8; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
        total += hsum(a[0]);
    }
    return total;
}

/* v [D] / sqrt(mean(v^2) + eps) * s [D] into o (o may be v). D % 8 == 0. The sum of squares is the same sequence
   of 8-lane FMAs for every row, whatever the batch (batch-invariant, like skinny). */
static void norm_row(const float* v, const float* s, float* o, int64_t D, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x = _mm256_loadu_ps(v + d);
        acc = _mm256_fmadd_ps(x, x, acc);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)D + eps));
    for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(v + d), inv), _mm256_loadu_ps(s + d)));
}

/* O [R, D] = X [R, D] / sqrt(mean(X^2) + eps) * S [D], row by row, on the calling thread (a decode step's rows
   are a few KB: a thread hand-off would cost more than the work). */
void rms_norm(const float* X, const float* S, float* O, int64_t R, int64_t D, float eps) {
    for (int64_t r = 0; r < R; ++r) norm_row(X + r * D, S, O + r * D, D, eps);
}

/* Gemma's residual: X [R, D] += norm(A) * S1, then, when S2 is given, O = norm(X) * S2 (the next norm). */
void residual_norm(float* X, const float* A, const float* S1, const float* S2, float* O, int64_t R, int64_t D, float eps) {
    for (int64_t r = 0; r < R; ++r) {
        float* x = X + r * D;
        const float* a = A + r * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 v = _mm256_loadu_ps(a + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)D + eps));
        for (int64_t d = 0; d < D; d += 8) {
            __m256 normed = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(a + d), inv), _mm256_loadu_ps(S1 + d));
            _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_loadu_ps(x + d), normed));
        }
        if (S2) norm_row(x, S2, O + r * D, D, eps);
    }
}

/* RoPE of one head vector in place (the rotate-half convention): for i < D/2,
   v[i] = v[i] c[i] - v[i + D/2] s[i], v[i + D/2] = v[i + D/2] c[i] + v[i] s[i]. D % 16 == 0. */
static void rope_row(float* v, const float* c, const float* s, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i += 8) {
        __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + h + i);
        __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
        _mm256_storeu_ps(v + h + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
    }
}

/* The attention inputs of R rows, in place in QKV [R, (HQ + 2 HKV) D] (row stride W): q and k heads normed
   (QS, KS: the q/k norm scales, or NULL) and rotated by RoPE at the row's position (INV [D/2] inverse
   frequencies; angle = (float)pos * inv, as the reference computes it in float32), then each row's k and v
   written into the cache KC, VC [slots, HKV, L1, D] at (SLOT[r], head, POS[r]). Padding rows (POS < 0) are
   neither rotated nor written. D % 16 == 0, D <= 1024. */
void attn_prep(float* QKV, int64_t W, int64_t R, const int64_t* POS, const int64_t* SLOT, const float* INV,
               const float* QS, const float* KS, float eps, int64_t HQ, int64_t HKV, int64_t D,
               float* KC, float* VC, int64_t L1) {
    float c[512], s[512];
    for (int64_t r = 0; r < R; ++r) {
        const int64_t p = POS[r];
        if (p < 0) continue;
        for (int64_t i = 0; i < D / 2; ++i) {
            const float angle = (float)p * INV[i];
            c[i] = cosf(angle);
            s[i] = sinf(angle);
        }
        float* row = QKV + r * W;
        for (int64_t h = 0; h < HQ; ++h) {
            float* q = row + h * D;
            if (QS) norm_row(q, QS, q, D, eps);
            rope_row(q, c, s, D);
        }
        for (int64_t h = 0; h < HKV; ++h) {
            float* k = row + (HQ + h) * D;
            const float* v = row + (HQ + HKV + h) * D;
            if (KS) norm_row(k, KS, k, D, eps);
            rope_row(k, c, s, D);
            const int64_t at = ((SLOT[r] * HKV + h) * L1 + p) * D;
            for (int64_t d = 0; d < D; ++d) { KC[at + d] = k[d]; VC[at + d] = v[d]; }
        }
    }
}

/* Causal attention of R query rows over the cache: row r, query head h (its q in QKV as attn_prep left it)
   attends to the keys of slot SLOT[r], kv head h / (HQ / HKV), at positions lo..POS[r], lo = POS[r] - WINDOW + 1
   on a sliding-window layer (WINDOW > 0) else 0; softmax(q . k * scale) @ v into O [R, HQ D]. A padding row
   (POS < 0) gets zeros. The (row, head) pairs are split over `threads` OpenMP threads; SCRATCH [threads, L1]
   holds each thread's scores. D % 8 == 0. */
void attend(const float* QKV, int64_t W, int64_t R, const int64_t* POS, const int64_t* SLOT, const float* KC,
            const float* VC, int64_t L1, int64_t HQ, int64_t HKV, int64_t D, int64_t WINDOW, float scale, float* O,
            float* SCRATCH, int threads) {
    const int64_t groups = HQ / HKV;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < R * HQ; ++t) {
        const int64_t r = t / HQ, h = t % HQ, p = POS[r];
        float* o = O + r * HQ * D + h * D;
        if (p < 0) {
            for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
            continue;
        }
        const int64_t lo = WINDOW > 0 && p - WINDOW + 1 > 0 ? p - WINDOW + 1 : 0, n = p - lo + 1;
        const int64_t base = ((SLOT[r] * HKV + h / groups) * L1 + lo) * D;
        const float* q = QKV + r * W + h * D;
        float* e = SCRATCH + omp_get_thread_num() * L1;
        float m = -INFINITY;
        const int64_t D32 = D - D % 32;  /* the 32-wide part: 4 independent accumulators; then 8 at a time */
        for (int64_t j = 0; j < n; ++j) {
            const float* k = KC + base + j * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D32; d += 32) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 16), _mm256_loadu_ps(k + d + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 24), _mm256_loadu_ps(k + d + 24), a3);
            }
            for (int64_t d = D32; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
            e[j] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) * scale;
            if (e[j] > m) m = e[j];
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) { e[j] = expf(e[j] - m); sum += e[j]; }
        for (int64_t d0 = 0; d0 < D32; d0 += 32) {  /* values: 32 output columns in registers across all keys */
            __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps(), o2 = _mm256_setzero_ps(), o3 = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; ++j) {
                const float* v = VC + base + j * D + d0;
                const __m256 w = _mm256_set1_ps(e[j]);
                o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), o0);
                o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), o1);
                o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), o2);
                o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), o3);
            }
            _mm256_storeu_ps(o + d0, o0);
            _mm256_storeu_ps(o + d0 + 8, o1);
            _mm256_storeu_ps(o + d0 + 16, o2);
            _mm256_storeu_ps(o + d0 + 24, o3);
        }
        for (int64_t d0 = D32; d0 < D; d0 += 8) {
            __m256 o0 = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; ++j) o0 = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), _mm256_loadu_ps(VC + base + j * D + d0), o0);
            _mm256_storeu_ps(o + d0, o0);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
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
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]
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
    library.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.rms_norm.restype = None
    library.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    library.read_sum.restype = ctypes.c_double
    library.residual_norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.residual_norm.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.attn_prep.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, i64, ptr, ptr, i64]
    library.attn_prep.restype = None
    library.attend.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, ctypes.c_int]
    library.attend.restype = None
    return library


def _require(fallback: str) -> ctypes.CDLL:
    """The loaded library, or ValueError naming why it is missing and what to use instead."""
    library = _library()
    if library is None:
        raise ValueError(f"the native kernel is not available here (no C compiler, no AVX2/FMA, or SPECGATE_NATIVE=0): use {fallback}")
    return library


def available() -> bool:
    """True where the kernel is built and loaded (x86-64 with AVX2 and FMA, a C compiler, SPECGATE_NATIVE != 0)."""
    return _library() is not None


def max_rows(weight: Tensor) -> int:
    """The most rows of x skinny_linear serves for this weight: SKINNY_MAX_ROWS for an LM head, LAYER_MAX_ROWS
    for a layer's weight (beyond them oneDNN's blocked GEMM is faster: a prefill)."""
    return SKINNY_MAX_ROWS if weight.numel() >= HEAD_ELEMENTS else LAYER_MAX_ROWS


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether skinny_linear serves this product: float32 CPU tensors, 1..max_rows(weight) rows of x, a contiguous
    weight with K a multiple of 8, and the kernel available."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and weight.dim() == 2
        and 1 <= rows <= max_rows(weight)
        and weight.shape[1] % 8 == 0
        and weight.is_contiguous()
        and available()
    )


def skinny_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [R, K] @ weight [N, K]^T -> [R, N] float32, W's rows split over torch's OpenMP threads."""
    library = _require("linear()")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [R, K] and [N, K]")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape[1] % 8 or not weight.is_contiguous():
        raise ValueError(
            f"skinny_linear needs float32 tensors, a contiguous weight and K % 8 == 0 (got {x.dtype}, {weight.dtype}, "
            f"K={weight.shape[1]}, contiguous={weight.is_contiguous()})"
        )
    return skinny_product(x.contiguous(), weight, library)


def skinny_product(x: Tensor, weight: Tensor, library: ctypes.CDLL | None = None) -> Tensor:
    """skinny_linear without its checks, for a caller that made them (transformer.linear after applies(): a decode
    step's ~70 products are not validated twice). x [R, K] contiguous."""
    library = library or _library()
    rows, k = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)  # [R, N]
    # one call (ctypes drops the GIL) whose OpenMP loop runs on torch's own OpenMP threads
    library.skinny(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k, weight.shape[0], torch.get_num_threads())
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


def attention_applies(rows: int, head_dim: int, keys: Tensor) -> bool:
    """Whether attn_prep / attend serve this forward: 1..LAYER_MAX_ROWS rows (decode and verification; a prefill
    keeps torch's flash attention), head_dim a multiple of 16 up to 1024, a contiguous float32 CPU cache."""
    return (
        1 <= rows <= LAYER_MAX_ROWS
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
    )
    return out


def read_sum(x: Tensor) -> float:
    """The sum of a contiguous float32 tensor whose size is a multiple of 64, read with AVX2 on torch's OpenMP
    threads: bench/bench_perf.py's bandwidth probe (a plain streaming read; torch's own sum is slower here)."""
    library = _require("torch.sum")
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() % 64:
        raise ValueError(f"read_sum needs a contiguous float32 tensor of a multiple of 64 elements (got {x.dtype}, {x.numel()})")
    return library.read_sum(x.data_ptr(), x.numel(), torch.get_num_threads())
