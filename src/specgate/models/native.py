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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specgate.models.dtypes import cpu_flags

SKINNY_MAX_ROWS = 20  # a float32 LM head (>= HEAD_ELEMENTS): faster than oneDNN at every row count up to 20 (83 vs 102 ms)
LAYER_MAX_ROWS = 64  # a float32 layer weight: faster than oneDNN up to 64 rows (Gemma-3-270M's gate/up: 2.9 vs 3.3 ms)
# bf16 weights: the alternative past the limit is a chunked upcast to float32 before each GEMM, on every layer. Up
# to 160 rows covers every verification shape of a 16-request batch at gamma <= 8 (16 x 9 = 144 rows) and keeps
# them batch-invariant; at 64 such a forward doubled for 25% more rows (bench/bench_rows.py, docs/BENCHMARKS.md,
# Performance, "Wide verification forwards").
BF16_LAYER_MAX_ROWS = 160
BF16_HEAD_MAX_ROWS = 160
HEAD_ELEMENTS = 1 << 24  # weights of >= 16M elements are LM heads here
ATTENTION_THREAD_WORK = 1 << 18  # multiply-adds (rows x heads x D x keys) from which attend uses every thread
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # what the products read; x and the output are float32
NORM_MAX_ELEMENTS = 1 << 16  # rms_norm on the calling thread up to 64K elements (e.g. 20 rows of 640 x 4 heads)

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <omp.h>

#define PREFETCH_ROWS 8  /* rows of W ahead (two 4-row blocks) that a block asks the cache for */

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* Eight weights as float32: a float32 weight is loaded as it is; a bfloat16 weight (the upper half of a float32)
   is widened to 32 bits and shifted into place, which is exact (bf16 -> fp32 loses nothing). */
static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* RR rows of x (float32, stride K) times nn <= 4 rows of W (float32 or bf16, stride K), into O (row stride N) at
   column n, plus BIAS[n + j] where BIAS is given. 4 * RR accumulators + RR rows of x + 1 row of W: 16 ymm
   registers for RR = 3, no spills. A tail block (nn < 4) repeats its last row instead of branching in the loop;
   the repeats are not stored. With `prefetch` (the first pass of rows over a block; later passes find it in
   cache), the same rows of the block two blocks ahead are requested into cache while this one is multiplied: the
   hardware prefetcher alone falls behind on these short 4-row streams (on the AMD VM at several rows: the head at
   5 rows, 37 -> 33 ms; on the Intel Ice Lake VM at one row too: bf16 layer products 15 -> 11 ms). The products
   and sums are float32 in the same order for both weight types. */
#define BLOCK(RR, NAME, WT, LOADW)                                                                        \
static void NAME##RR(int prefetch, const float* x, const WT* w, const float* bias, int64_t K,             \
                     float* const* o, int64_t n, int nn) {                                                \
    const WT* wr[4];                                                                                      \
    for (int j = 0; j < 4; ++j) wr[j] = w + (j < nn ? j : nn - 1) * K;                                    \
    __m256 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();              \
    for (int64_t k = 0; k < K; k += 8) {                                                                  \
        __m256 xv[RR];                                                                                    \
        for (int i = 0; i < RR; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);                              \
        if (prefetch) for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(wr[j] + k + PREFETCH_ROWS * K), _MM_HINT_T0); \
        for (int j = 0; j < 4; ++j) {                                                                     \
            __m256 a = LOADW(wr[j] + k);                                                                  \
            for (int i = 0; i < RR; ++i) acc[i][j] = _mm256_fmadd_ps(a, xv[i], acc[i][j]);                \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < nn; ++j)                                             \
        o[i][n + j] = bias ? hsum(acc[i][j]) + bias[n + j] : hsum(acc[i][j]);                             \
}

/* The blocks b_lo..b_hi-1 (4 rows of W each) of O [R, N] = X [R, K] @ W [N, K]^T (+ BIAS [N]): one thread's
   share of a product. K % 8 == 0. */
#define RANGE(NAME, WT, B)                                                                                \
static void NAME(const float* X, const WT* W, const float* BIAS, float* O, const int64_t* ROWS, int64_t R,  \
                 int64_t K, int64_t N, int64_t b_lo, int64_t b_hi) {                                      \
    for (int64_t b = b_lo; b < b_hi; ++b) {                                                               \
        const int64_t n = b * 4;                                                                          \
        const int nn = (int)(N - n < 4 ? N - n : 4);                                                      \
        const WT* w = W + n * K;                                                                          \
        for (int64_t r = 0; r < R; r += 3) {                                                              \
            float* out[3];                                                                                \
            for (int i = 0; i < 3 && r + i < R; ++i) out[i] = O + (ROWS ? ROWS[r + i] : r + i) * N;       \
            if (R - r >= 3) B##3(r == 0, X + r * K, w, BIAS, K, out, n, nn);                              \
            else if (R - r == 2) B##2(r == 0, X + r * K, w, BIAS, K, out, n, nn);                         \
            else B##1(r == 0, X + r * K, w, BIAS, K, out, n, nn);                                         \
        }                                                                                                 \
    }                                                                                                     \
}
BLOCK(1, block_f32_, float, load_f32)
BLOCK(2, block_f32_, float, load_f32)
BLOCK(3, block_f32_, float, load_f32)
BLOCK(1, block_bf16_, uint16_t, load_bf16)
BLOCK(2, block_bf16_, uint16_t, load_bf16)
BLOCK(3, block_bf16_, uint16_t, load_bf16)
RANGE(range_f32, float, block_f32_)
RANGE(range_bf16, uint16_t, block_bf16_)

/* The same products with AVX-512 (16 lanes, 32 registers), for CPUs that have it (avx512f + avx512bw) and weights
   with K % 16 == 0: up to 6 rows of x against 4 rows of W (24 accumulators + 6 rows of x + 1 row of W: 31 zmm
   registers). Twice the multiply-adds per instruction, and 6 rows per pass over the W block instead of 3: a
   verification pass (5-9 rows) and bf16 weights (a widening per load) are partly compute-bound on 2 cores with
   AVX2 (Gemma-3-270M's bf16 head at 9 rows: 41 -> 29 ms). Which variant serves a weight depends only on the CPU
   and K, never on R, so batch invariance holds. */
#define AVX512 __attribute__((target("avx512f,avx512bw")))
static inline AVX512 __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline AVX512 __m512 load16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#define BLOCK512(RR, NAME, WT, LOADW)                                                                     \
static AVX512 void NAME##RR(int prefetch, const float* x, const WT* w, const float* bias, int64_t K,      \
                            float* const* o, int64_t n, int nn) {                                         \
    const WT* wr[4];                                                                                      \
    for (int j = 0; j < 4; ++j) wr[j] = w + (j < nn ? j : nn - 1) * K;                                    \
    __m512 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();              \
    for (int64_t k = 0; k < K; k += 16) {                                                                 \
        __m512 xv[RR];                                                                                    \
        for (int i = 0; i < RR; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);                              \
        if (prefetch) for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(wr[j] + k + PREFETCH_ROWS * K), _MM_HINT_T0); \
        for (int j = 0; j < 4; ++j) {                                                                     \
            __m512 a = LOADW(wr[j] + k);                                                                  \
            for (int i = 0; i < RR; ++i) acc[i][j] = _mm512_fmadd_ps(a, xv[i], acc[i][j]);                \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < nn; ++j)                                             \
        o[i][n + j] = bias ? _mm512_reduce_add_ps(acc[i][j]) + bias[n + j] : _mm512_reduce_add_ps(acc[i][j]); \
}
#define RANGE512(NAME, WT, B)                                                                             \
static AVX512 void NAME(const float* X, const WT* W, const float* BIAS, float* O, const int64_t* ROWS,     \
                        int64_t R, int64_t K, int64_t N, int64_t b_lo, int64_t b_hi) {                    \
    for (int64_t b = b_lo; b < b_hi; ++b) {                                                               \
        const int64_t n = b * 4;                                                                          \
        const int nn = (int)(N - n < 4 ? N - n : 4);                                                      \
        const WT* w = W + n * K;                                                                          \
        for (int64_t r = 0; r < R; r += 6) {                                                              \
            float* out[6];                                                                                \
            for (int i = 0; i < 6 && r + i < R; ++i) out[i] = O + (ROWS ? ROWS[r + i] : r + i) * N;       \
            const float* x = X + r * K;                                                                   \
            switch (R - r >= 6 ? 6 : R - r) {                                                             \
                case 6: B##6(r == 0, x, w, BIAS, K, out, n, nn); break;                                   \
                case 5: B##5(r == 0, x, w, BIAS, K, out, n, nn); break;                                   \
                case 4: B##4(r == 0, x, w, BIAS, K, out, n, nn); break;                                   \
                case 3: B##3(r == 0, x, w, BIAS, K, out, n, nn); break;                                   \
                case 2: B##2(r == 0, x, w, BIAS, K, out, n, nn); break;                                   \
                default: B##1(r == 0, x, w, BIAS, K, out, n, nn); break;                                  \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
}
#define BLOCKS512(NAME, WT, LOADW) BLOCK512(1, NAME, WT, LOADW) BLOCK512(2, NAME, WT, LOADW)                \
    BLOCK512(3, NAME, WT, LOADW) BLOCK512(4, NAME, WT, LOADW) BLOCK512(5, NAME, WT, LOADW) BLOCK512(6, NAME, WT, LOADW)
BLOCKS512(b512_f32_, float, load16_f32)
BLOCKS512(b512_bf16_, uint16_t, load16_bf16)
RANGE512(range512_f32, float, b512_f32_)
RANGE512(range512_bf16, uint16_t, b512_bf16_)

/* Thread t of T's share of one product, in the variant the weight's dtype (BF16), the CPU (WIDE) and K decide.
   Row r of the output goes to row ROWS[r] of O (ROWS NULL: row r). */
static void product_part(int bf16, int wide, const float* X, const void* W, const float* BIAS, float* O,
                         const int64_t* ROWS, int64_t R, int64_t K, int64_t N, int t, int T) {
    const int64_t blocks = (N + 3) / 4, lo = blocks * t / T, hi = blocks * (t + 1) / T;
    if (wide && K % 16 == 0) {
        if (bf16) range512_bf16(X, (const uint16_t*)W, BIAS, O, ROWS, R, K, N, lo, hi);
        else range512_f32(X, (const float*)W, BIAS, O, ROWS, R, K, N, lo, hi);
    } else {
        if (bf16) range_bf16(X, (const uint16_t*)W, BIAS, O, ROWS, R, K, N, lo, hi);
        else range_f32(X, (const float*)W, BIAS, O, ROWS, R, K, N, lo, hi);
    }
}

/* O [rows, N] = X [R, K] @ W [N, K]^T: X and O float32, W float32 (bf16 = 0) or bf16 (bf16 = 1); the 4-row blocks of
   W split over `threads` OpenMP threads, each streaming one contiguous range. K % 8 == 0. ROWS [R] (or NULL): the
   output row of each row of X (a ragged batch's real tokens scored straight into their padded places). */
void skinny(const float* X, const void* W, float* O, const int64_t* ROWS, int64_t R, int64_t K, int64_t N, int bf16,
            int wide, int threads) {
    #pragma omp parallel num_threads(threads)
    product_part(bf16, wide, X, W, NULL, O, ROWS, R, K, N, omp_get_thread_num(), omp_get_num_threads());
}

/* Sum of X [N] (N % 64 == 0) with 8 independent accumulators, split over `threads`: a streaming read at the
   machine's bandwidth, for the memory-bandwidth probe of bench/bench_perf.py (not used by the runtime). With
   PREFETCH > 0 each 256-byte chunk also asks for the chunk PREFETCH floats ahead (on the Ice Lake VM 4 KB ahead
   reads ~10% faster than the hardware prefetcher alone; the probe keeps the fastest of both). */
double read_sum(const float* X, int64_t N, int threads, int64_t PREFETCH) {
    double total = 0.0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t chunks = N / 64, t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t lo = chunks * t / count, hi = chunks * (t + 1) / count;
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t c = lo; c < hi; ++c) {
            const float* x = X + c * 64;
            if (PREFETCH > 0 && c * 64 + PREFETCH + 64 <= N)
                for (int i = 0; i < 4; ++i) _mm_prefetch((const char*)(x + PREFETCH + 16 * i), _MM_HINT_T0);
            for (int i = 0; i < 8; ++i) a[i] = _mm256_add_ps(a[i], _mm256_loadu_ps(x + 8 * i));
        }
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

/* Gemma's residual of one row: x [D] += norm(a) * s1, then, when s2 is given, o = norm(x) * s2 (the next norm). */
static void residual_norm_row(float* x, const float* a, const float* s1, const float* s2, float* o, int64_t D, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 v = _mm256_loadu_ps(a + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)D + eps));
    for (int64_t d = 0; d < D; d += 8) {
        __m256 normed = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(a + d), inv), _mm256_loadu_ps(s1 + d));
        _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_loadu_ps(x + d), normed));
    }
    if (s2) norm_row(x, s2, o, D, eps);
}

/* Gemma's residual: X [R, D] += norm(A) * S1, then, when S2 is given, O = norm(X) * S2 (the next norm). */
void residual_norm(float* X, const float* A, const float* S1, const float* S2, float* O, int64_t R, int64_t D, float eps) {
    for (int64_t r = 0; r < R; ++r) residual_norm_row(X + r * D, A + r * D, S1, S2, S2 ? O + r * D : NULL, D, eps);
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

/* One row's attention inputs, in place in row [(HQ + 2 HKV) D]: q and k heads normed (QS, KS: the q/k norm
   scales, or NULL) and rotated by RoPE at position p (INV [D/2] inverse frequencies; angle = (float)p * inv, as
   the reference computes it in float32), then its k and v written into the cache KC, VC [slots, HKV, L1, D] at
   (slot, head, p). D % 16 == 0, D <= 1024. */
static void prep_row(float* row, int64_t p, int64_t slot, const float* INV, const float* QS, const float* KS,
                     float eps, int64_t HQ, int64_t HKV, int64_t D, float* KC, float* VC, int64_t L1) {
    float c[512], s[512];
    for (int64_t i = 0; i < D / 2; ++i) {
        const float angle = (float)p * INV[i];
        c[i] = cosf(angle);
        s[i] = sinf(angle);
    }
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
        const int64_t at = ((slot * HKV + h) * L1 + p) * D;
        for (int64_t d = 0; d < D; ++d) { KC[at + d] = k[d]; VC[at + d] = v[d]; }
    }
}

/* The attention inputs of R rows, in place in QKV [R, (HQ + 2 HKV) D] (row stride W), each row as prep_row at
   (SLOT[r], POS[r]). Padding rows (POS < 0) are neither rotated nor written. */
void attn_prep(float* QKV, int64_t W, int64_t R, const int64_t* POS, const int64_t* SLOT, const float* INV,
               const float* QS, const float* KS, float eps, int64_t HQ, int64_t HKV, int64_t D,
               float* KC, float* VC, int64_t L1) {
    for (int64_t r = 0; r < R; ++r)
        if (POS[r] >= 0) prep_row(QKV + r * W, POS[r], SLOT[r], INV, QS, KS, eps, HQ, HKV, D, KC, VC, L1);
}

/* One query head's causal attention over the cache: q [D] attends to the keys of `slot`, kv head `kv`, at
   positions lo..p, lo = p - WINDOW + 1 on a sliding-window layer (WINDOW > 0) else 0; softmax(q . k * scale) @ v
   into o [D]; e [p + 1] is scratch for the scores. p < 0 (padding) gives zeros. D % 8 == 0. */
static void attend_head(const float* q, int64_t p, int64_t slot, int64_t kv, const float* KC, const float* VC,
                        int64_t L1, int64_t HKV, int64_t D, int64_t WINDOW, float scale, float* o, float* e) {
    if (p < 0) {
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        return;
    }
    const int64_t lo = WINDOW > 0 && p - WINDOW + 1 > 0 ? p - WINDOW + 1 : 0, n = p - lo + 1;
    const int64_t base = ((slot * HKV + kv) * L1 + lo) * D;
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
    /* values key by key: each key's row is read once, sequentially, and added into o, which stays in L1 */
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
    for (int64_t j = 0; j < n; ++j) {
        const float* v = VC + base + j * D;
        const __m256 w = _mm256_set1_ps(e[j]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
}

/* Causal attention of R query rows over the cache: row r, query head h (its q in QKV as attn_prep left it)
   attends as attend_head to slot SLOT[r], kv head h / (HQ / HKV), up to POS[r]; into O [R, HQ D]. The (row,
   head) pairs are split over `threads` OpenMP threads; SCRATCH [threads, L1] holds each thread's scores. */
void attend(const float* QKV, int64_t W, int64_t R, const int64_t* POS, const int64_t* SLOT, const float* KC,
            const float* VC, int64_t L1, int64_t HQ, int64_t HKV, int64_t D, int64_t WINDOW, float scale, float* O,
            float* SCRATCH, int threads) {
    const int64_t groups = HQ / HKV;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < R * HQ; ++t) {
        const int64_t r = t / HQ, h = t % HQ;
        attend_head(QKV + r * W + h * D, POS[r], SLOT[r], h / groups, KC, VC, L1, HKV, D, WINDOW, scale,
                    O + r * HQ * D + h * D, SCRATCH + omp_get_thread_num() * L1);
    }
}

/* exp(x) for 8 floats: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n);
   about 1 ulp, x clamped to [-87.3, 88.3] (no infinities or denormals come out). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The gated MLP's middle, 8 elements: act(g) * u with act = silu (ACT 0: g / (1 + e^-g)) or the tanh gelu (ACT 1:
   0.5 g (1 + tanh(z)) = g / (1 + e^-2z), z = sqrt(2/pi) (g + 0.044715 g^3)). */
static inline __m256 gated8(__m256 g, __m256 u, int act) {
    __m256 z = g;
    if (act == 1) {
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
    }
    const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
    return _mm256_mul_ps(_mm256_div_ps(g, denominator), u);
}

/* The first index of the maximum of x [n], NaN counting as the greatest value (the first NaN wins), as
   torch.argmax does; 8 lanes with their own running maxima and first indices, then the lanes in index order. */
static void argmax_span(const float* x, int64_t n, float* best_value, int64_t* best_index) {
    int64_t i = 0, index = 0;
    float value = n ? x[0] : -INFINITY;
    if (n >= 8) {
        __m256 vmax = _mm256_loadu_ps(x), nan_seen = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = vidx;
        const __m256i eight = _mm256_set1_epi32(8);
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            idx = _mm256_add_epi32(idx, eight);
            nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 greater = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);  /* strict: the first maximum stays */
            vmax = _mm256_blendv_ps(vmax, v, greater);
            vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(idx), greater));
        }
        if (_mm256_movemask_ps(nan_seen)) {  /* rare: find the first NaN the plain way */
            for (int64_t j = 0; j < n; ++j) if (x[j] != x[j]) { *best_value = x[j]; *best_index = j; return; }
        }
        float lanes[8];
        int32_t lane_index[8];
        _mm256_storeu_ps(lanes, vmax);
        _mm256_storeu_si256((__m256i*)lane_index, vidx);
        value = lanes[0], index = lane_index[0];
        for (int l = 1; l < 8; ++l)
            if (lanes[l] > value || (lanes[l] == value && lane_index[l] < index)) value = lanes[l], index = lane_index[l];
    } else {
        i = 1;
        if (value != value) { *best_value = value; *best_index = 0; return; }
    }
    for (; i < n; ++i) {
        if (x[i] != x[i]) { *best_value = x[i]; *best_index = i; return; }
        if (x[i] > value) value = x[i], index = i;
    }
    *best_value = value;
    *best_index = index;
}

/* OUT [R] = the argmax of each row of X [R, V] (float32, V < 2^31), as torch.argmax(-1): the rows split over
   `threads`, and when there are fewer rows than threads each row in parts, combined in order (ties and NaNs go to
   the earlier part), so the result never depends on the split. MAX [R] (or NULL): the maximum itself, NaN where
   the row has a NaN (as torch.amax). */
void argmax_rows(const float* X, int64_t R, int64_t V, int64_t* OUT, float* MAX, int threads) {
    if (R <= 0) return;
    if (R >= threads || 2 * threads > 1024) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            float value;
            argmax_span(X + r * V, V, &value, OUT + r);
            if (MAX) MAX[r] = value;
        }
        return;
    }
    const int64_t parts = (threads + R - 1) / R, tasks = R * parts;  /* tasks < 2 threads <= 1024 */
    float part_value[1024];
    int64_t part_index[1024];
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t r = t / parts, part = t % parts;
        const int64_t lo = V * part / parts, hi = V * (part + 1) / parts;
        argmax_span(X + r * V + lo, hi - lo, part_value + t, part_index + t);
        part_index[t] += lo;
    }
    for (int64_t r = 0; r < R; ++r) {
        float value = part_value[r * parts];
        int64_t index = part_index[r * parts];
        for (int64_t part = 1; part < parts && value == value; ++part) {  /* a NaN in an earlier part wins */
            const float v = part_value[r * parts + part];
            if (v != v || v > value) value = v, index = part_index[r * parts + part];
        }
        OUT[r] = index;
        if (MAX) MAX[r] = value;
    }
}

/* One decoder layer's weights for decode_layers (specgate.models.native.DecodeStack mirrors it with ctypes).
   Weights are float32 or bf16 (Config.bf16), row-major [N, K]; biases and norm scales float32 or NULL. */
typedef struct {
    const void* wqkv; const float* bqkv;  /* fused q/k/v [(HQ + 2 HKV) D, H] */
    const void* wo; const float* bo;      /* o [H, HQ D] */
    const void* wgu; const float* bgu;    /* fused gate/up [2 I, H] */
    const void* wd; const float* bd;      /* down [H, I] */
    const float* norm_in;                 /* input norm [H] */
    const float* norm_attn;               /* Gemma: norm of the attention output; Llama: the pre-MLP norm */
    const float* norm_pre_ff;             /* Gemma: pre-MLP norm (NULL elsewhere) */
    const float* norm_post_ff;            /* Gemma: norm of the MLP output (NULL elsewhere) */
    const float* q_norm; const float* k_norm;  /* [D] or NULL */
    const float* inv_freq;                /* [D / 2] */
    int64_t window;                       /* sliding window, 0 = full attention */
    float scale;                          /* multiplies q . k */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    int gemma;  /* Gemma-3 residuals: x += norm(sublayer(x)) (else x += sublayer(x)) */
    int act;    /* 0 silu, 1 tanh gelu */
    int bf16;   /* weights are bf16 */
    int wide;   /* AVX-512 products where K % 16 == 0 */
} Config;

/* The R rows X [R, hidden] (float32, updated in place) through every layer of the decoder: the same operations,
   in the same order, as the per-op C path (one call per product, attn_prep, attend, residual_norm), in ONE OpenMP
   parallel region: no Python, no dispatch, no thread wake-up between the ~10 pieces of a layer, only barriers.
   Products split W's blocks over the threads, norms and RoPE split the rows, attention the (row, head) pairs, the
   MLP's middle its elements; each piece computes a row's values in the same order whatever R or the thread
   count, so the result is batch-invariant like the per-op path's. POS, SLOT [R] (POS < 0: padding); KC[l], VC[l]
   layer l's cache [slots, kv_heads, L1, head_dim]. WORK: R * (2 hidden + (heads + 2 kv_heads) head_dim + heads
   head_dim + 3 intermediate) floats; SCRATCH: threads * L1 floats. */
void decode_layers(float* X, int64_t R, const int64_t* POS, const int64_t* SLOT, const Layer* layers, int64_t L,
                   const Config* c, float* const* KC, float* const* VC, int64_t L1, float* WORK, float* SCRATCH,
                   int threads) {
    const int64_t H = c->hidden, HQ = c->heads, HKV = c->kv_heads, D = c->head_dim, I = c->intermediate;
    const int64_t QKV_W = (HQ + 2 * HKV) * D, groups = HQ / HKV;
    float* h = WORK;              /* [R, H] a normed input */
    float* qkv = h + R * H;       /* [R, QKV_W] */
    float* attn = qkv + R * QKV_W;  /* [R, HQ D] */
    float* o = attn + R * HQ * D;   /* [R, H] a sublayer's output */
    float* gu = o + R * H;        /* [R, 2 I] */
    float* mid = gu + R * 2 * I;  /* [R, I] */
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t r_lo = R * t / T, r_hi = R * (t + 1) / T;  /* this thread's rows */
        float* e = SCRATCH + t * L1;
        for (int64_t l = 0; l < L; ++l) {
            const Layer* y = layers + l;
            for (int64_t r = r_lo; r < r_hi; ++r) norm_row(X + r * H, y->norm_in, h + r * H, H, c->eps);
            #pragma omp barrier
            product_part(c->bf16, c->wide, h, y->wqkv, y->bqkv, qkv, NULL, R, H, QKV_W, t, T);
            #pragma omp barrier
            for (int64_t r = r_lo; r < r_hi; ++r)
                if (POS[r] >= 0)
                    prep_row(qkv + r * QKV_W, POS[r], SLOT[r], y->inv_freq, y->q_norm, y->k_norm, c->eps, HQ, HKV, D, KC[l], VC[l], L1);
            #pragma omp barrier
            for (int64_t p = R * HQ * t / T; p < R * HQ * (t + 1) / T; ++p) {
                const int64_t r = p / HQ, head = p % HQ;
                attend_head(qkv + r * QKV_W + head * D, POS[r], SLOT[r], head / groups, KC[l], VC[l], L1, HKV, D,
                            y->window, y->scale, attn + r * HQ * D + head * D, e);
            }
            #pragma omp barrier
            product_part(c->bf16, c->wide, attn, y->wo, y->bo, o, NULL, R, HQ * D, H, t, T);
            #pragma omp barrier
            for (int64_t r = r_lo; r < r_hi; ++r) {
                float* x = X + r * H;
                if (c->gemma) {
                    residual_norm_row(x, o + r * H, y->norm_attn, y->norm_pre_ff, h + r * H, H, c->eps);
                } else {
                    for (int64_t d = 0; d < H; d += 8) _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(o + r * H + d)));
                    norm_row(x, y->norm_attn, h + r * H, H, c->eps);
                }
            }
            #pragma omp barrier
            product_part(c->bf16, c->wide, h, y->wgu, y->bgu, gu, NULL, R, H, 2 * I, t, T);
            #pragma omp barrier
            for (int64_t v = R * (I / 8) * t / T; v < R * (I / 8) * (t + 1) / T; ++v) {
                const int64_t r = v / (I / 8), i = (v % (I / 8)) * 8;
                _mm256_storeu_ps(mid + r * I + i, gated8(_mm256_loadu_ps(gu + r * 2 * I + i), _mm256_loadu_ps(gu + r * 2 * I + I + i), c->act));
            }
            #pragma omp barrier
            product_part(c->bf16, c->wide, mid, y->wd, y->bd, o, NULL, R, I, H, t, T);
            #pragma omp barrier
            for (int64_t r = r_lo; r < r_hi; ++r) {
                float* x = X + r * H;
                if (c->gemma) residual_norm_row(x, o + r * H, y->norm_post_ff, NULL, NULL, H, c->eps);
                else for (int64_t d = 0; d < H; d += 8) _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(o + r * H + d)));
            }
            #pragma omp barrier
        }
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
    library.skinny.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    library.skinny.restype = None
    library.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.rms_norm.restype = None
    library.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    library.read_sum.restype = ctypes.c_double
    library.residual_norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.residual_norm.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.attn_prep.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, i64, ptr, ptr, i64]
    library.attn_prep.restype = None
    library.attend.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, ctypes.c_int]
    library.attend.restype = None
    library.argmax_rows.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int]
    library.argmax_rows.restype = None
    library.decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    library.decode_layers.restype = None
    return library


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


def available() -> bool:
    """True where the kernel is built and loaded (x86-64 with AVX2 and FMA, a C compiler, SPECGATE_NATIVE != 0)."""
    return _library() is not None


def max_rows(weight: Tensor) -> int:
    """The most rows of x skinny_linear serves for this weight: SKINNY_MAX_ROWS for a float32 LM head,
    BF16_HEAD_MAX_ROWS for a bf16 one, layer_max_rows(dtype) for a layer's weight (beyond them oneDNN's blocked
    GEMM, or the chunked bf16 upcast, is faster: a prefill)."""
    if weight.numel() >= HEAD_ELEMENTS:
        return BF16_HEAD_MAX_ROWS if weight.dtype == torch.bfloat16 else SKINNY_MAX_ROWS
    return layer_max_rows(weight.dtype)


def layer_max_rows(weight_dtype: torch.dtype) -> int:
    """The most rows a forward runs through the C paths (the stack, or the per-layer kernels) with weights of this
    dtype: BF16_LAYER_MAX_ROWS for bf16, LAYER_MAX_ROWS otherwise."""
    return BF16_LAYER_MAX_ROWS if weight_dtype == torch.bfloat16 else LAYER_MAX_ROWS


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether skinny_linear serves this product: float32 x and a float32 or bfloat16 weight on the CPU, 1..
    max_rows(weight) rows of x, a contiguous weight with K a multiple of 8, and the kernel available."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
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
    # one call (ctypes drops the GIL) whose OpenMP loop runs on torch's own OpenMP threads; the AVX-512 variant
    # serves where the CPU has it and K % 16 == 0: decided by the CPU and K alone, never by R (batch invariance)
    library.skinny(x.data_ptr(), weight.data_ptr(), out.data_ptr(), out_rows.data_ptr() if out_rows is not None else None,
                   rows, k, weight.shape[0], int(weight.dtype == torch.bfloat16), int(wide_vectors()), torch.get_num_threads())
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


class _Layer(ctypes.Structure):  # mirrors the C struct Layer (field order and types)
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "wqkv", "bqkv", "wo", "bo", "wgu", "bgu", "wd", "bd", "norm_in", "norm_attn", "norm_pre_ff", "norm_post_ff",
        "q_norm", "k_norm", "inv_freq")] + [("window", ctypes.c_int64), ("scale", ctypes.c_float)]


class _Config(ctypes.Structure):  # mirrors the C struct Config
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float)] + [(name, ctypes.c_int) for name in ("gemma", "act", "bf16", "wide")]


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
        weight_dtype = first.qkv.dtype
        if weight_dtype not in WEIGHT_DTYPES or hidden % 8 or intermediate % 8 or head_dim % 16 or head_dim > 1024:
            raise ValueError(
                f"decode_layers needs float32 or bf16 weights, hidden and intermediate % 8 == 0 and head_dim % 16 == 0 "
                f"(<= 1024); got {weight_dtype}, hidden={hidden}, intermediate={intermediate}, head_dim={head_dim}"
            )
        shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                  "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        self._keep: list[Tensor] = []
        array = (_Layer * len(layers))()
        for index, layer in enumerate(layers):
            for name, shape in shapes.items():
                weight = getattr(layer, name)
                if tuple(weight.shape) != shape or weight.dtype != weight_dtype or not weight.is_contiguous():
                    raise ValueError(f"layer {index} {name}: {tuple(weight.shape)} {weight.dtype} must be a contiguous {shape} {weight_dtype}")
            pointers = {}
            for field, _ in _Layer._fields_[:-2]:
                tensor = getattr(layer, {"wqkv": "qkv", "bqkv": "qkv_bias", "wo": "o", "bo": "o_bias", "wgu": "gate_up",
                                         "bgu": "gate_up_bias", "wd": "down", "bd": "down_bias"}.get(field, field))
                if tensor is not None and field[0] != "w" and (tensor.dtype != torch.float32 or not tensor.is_contiguous()):
                    raise ValueError(f"layer {index} {field}: must be a contiguous float32 tensor (got {tensor.dtype})")
                if tensor is not None:
                    self._keep.append(tensor)
                pointers[field] = tensor.data_ptr() if tensor is not None else None
            array[index] = _Layer(**pointers, window=layer.window or 0, scale=layer.scale)
        self.layers = array
        self.config = _Config(hidden, heads, kv_heads, head_dim, intermediate, eps, int(gemma),
                              STACK_ACTIVATIONS[activation], int(weight_dtype == torch.bfloat16), int(wide_vectors()))
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
