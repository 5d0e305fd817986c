#include "specgate.h"

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
void float_part(int bf16, int wide, const float* X, const void* W, const float* BIAS, float* O,
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
    float_part(bf16, wide, X, W, NULL, O, ROWS, R, K, N, omp_get_thread_num(), omp_get_num_threads());
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
   into o [D]; e [p + 1] is scratch for the scores. p < 0 (padding) gives zeros. D % 8 == 0. AVX2. */
static void attend_head8(const float* q, int64_t p, int64_t slot, int64_t kv, const float* KC, const float* VC,
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

/* attend_head with AVX-512 (D % 16 == 0), for CPUs that have it: the same softmax(q . k * scale) @ v in about a
   third of the instructions, which pays where the keys are already in cache (a prefill chunk's rows attend to the
   same keys). The scores four keys at a time (one accumulator per key, each 16 lanes of q loaded once for the
   four; a lone key's sum runs in the same order), the exponentials 8 at a time (exp8, the tail by a mask), the
   values with o's chunk of up to 256 floats held in registers across the keys instead of loaded and stored per
   key. A key's score, its exponential and each o[d]'s key order depend on the key's place and n alone, never on
   R or the thread, so a row's output is batch-invariant as before. */
#define V_CHUNK(NV)                                                                                         \
static inline AVX512 void v_chunk##NV(const float* e, const float* V, int64_t n, int64_t D, float* o) {      \
    __m512 acc[NV];                                                                                         \
    for (int i = 0; i < NV; ++i) acc[i] = _mm512_setzero_ps();                                             \
    for (int64_t j = 0; j < n; ++j) {                                                                     \
        const __m512 w = _mm512_set1_ps(e[j]);                                                             \
        const float* v = V + j * D;                                                                       \
        for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * i), acc[i]);  \
    }                                                                                                     \
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + 16 * i, acc[i]);                                    \
}
V_CHUNK(1)
V_CHUNK(2)
V_CHUNK(4)
V_CHUNK(8)
V_CHUNK(16)

static AVX512 void attend_head16(const float* q, int64_t p, int64_t slot, int64_t kv, const float* KC, const float* VC,
                                 int64_t L1, int64_t HKV, int64_t D, int64_t WINDOW, float scale, float* o, float* e) {
    if (p < 0) {
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        return;
    }
    const int64_t lo = WINDOW > 0 && p - WINDOW + 1 > 0 ? p - WINDOW + 1 : 0, n = p - lo + 1;
    const float* K = KC + ((slot * HKV + kv) * L1 + lo) * D;
    const float* V = VC + ((slot * HKV + kv) * L1 + lo) * D;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float* k = K + j * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 qv = _mm512_loadu_ps(q + d);
            a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + d), a0);
            a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + D + d), a1);
            a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + 2 * D + d), a2);
            a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + 3 * D + d), a3);
        }
        e[j] = _mm512_reduce_add_ps(a0) * scale;
        e[j + 1] = _mm512_reduce_add_ps(a1) * scale;
        e[j + 2] = _mm512_reduce_add_ps(a2) * scale;
        e[j + 3] = _mm512_reduce_add_ps(a3) * scale;
    }
    for (; j < n; ++j) {
        const float* k = K + j * D;
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), a0);
        e[j] = _mm512_reduce_add_ps(a0) * scale;
    }
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (j = 0; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(e + j));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; ++i) m = lanes[i] > m ? lanes[i] : m;
    for (; j < n; ++j) m = e[j] > m ? e[j] : m;
    const __m256 mb = _mm256_set1_ps(m), lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 total = _mm256_setzero_ps();
    for (j = 0; j < n; j += 8) {
        const float left = (float)(n - j < 8 ? n - j : 8);
        const __m256i mask = _mm256_castps_si256(_mm256_cmp_ps(lane_index, _mm256_set1_ps(left), _CMP_LT_OQ));
        const __m256 x = exp8(_mm256_sub_ps(_mm256_maskload_ps(e + j, mask), mb));
        _mm256_maskstore_ps(e + j, mask, x);
        total = _mm256_add_ps(total, _mm256_and_ps(x, _mm256_castsi256_ps(mask)));
    }
    const float sum = hsum(total);
    for (int64_t d0 = 0; d0 < D; d0 += 256) {
        int64_t left = (D - d0) / 16 < 16 ? (D - d0) / 16 : 16, at = d0;  /* this chunk's vectors: 16, 8, 4, 2, 1 at a time */
        if (left >= 16) { v_chunk16(e, V + at, n, D, o + at); at += 256; left -= 16; }
        if (left >= 8) { v_chunk8(e, V + at, n, D, o + at); at += 128; left -= 8; }
        if (left >= 4) { v_chunk4(e, V + at, n, D, o + at); at += 64; left -= 4; }
        if (left >= 2) { v_chunk2(e, V + at, n, D, o + at); at += 32; left -= 2; }
        if (left >= 1) v_chunk1(e, V + at, n, D, o + at);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
}

/* The variant the CPU decides (WIDE: AVX-512, with D % 16 == 0), never R. */
static void attend_head(const float* q, int64_t p, int64_t slot, int64_t kv, const float* KC, const float* VC,
                        int64_t L1, int64_t HKV, int64_t D, int64_t WINDOW, float scale, float* o, float* e, int wide) {
    if (wide && D % 16 == 0) attend_head16(q, p, slot, kv, KC, VC, L1, HKV, D, WINDOW, scale, o, e);
    else attend_head8(q, p, slot, kv, KC, VC, L1, HKV, D, WINDOW, scale, o, e);
}

/* Causal attention of R query rows over the cache: row r, query head h (its q in QKV as attn_prep left it)
   attends as attend_head to slot SLOT[r], kv head h / (HQ / HKV), up to POS[r]; into O [R, HQ D]. The (row,
   head) pairs are split over `threads` OpenMP threads; SCRATCH [threads, L1] holds each thread's scores. WIDE:
   the AVX-512 variant (specgate.h WIDE_ATTN). */
void attend(const float* QKV, int64_t W, int64_t R, const int64_t* POS, const int64_t* SLOT, const float* KC,
            const float* VC, int64_t L1, int64_t HQ, int64_t HKV, int64_t D, int64_t WINDOW, float scale, float* O,
            float* SCRATCH, int threads, int wide) {
    const int64_t groups = HQ / HKV;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < R * HQ; ++t) {
        const int64_t r = t / HQ, h = t % HQ;
        attend_head(QKV + r * W + h * D, POS[r], SLOT[r], h / groups, KC, VC, L1, HKV, D, WINDOW, scale,
                    O + r * HQ * D + h * D, SCRATCH + omp_get_thread_num() * L1, wide);
    }
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
            weight_part(&y->wqkv, c->wide, h, y->bqkv, qkv, NULL, R, H, QKV_W, t, T);
            #pragma omp barrier
            for (int64_t r = r_lo; r < r_hi; ++r)
                if (POS[r] >= 0)
                    prep_row(qkv + r * QKV_W, POS[r], SLOT[r], y->inv_freq, y->q_norm, y->k_norm, c->eps, HQ, HKV, D, KC[l], VC[l], L1);
            #pragma omp barrier
            for (int64_t p = R * HQ * t / T; p < R * HQ * (t + 1) / T; ++p) {
                const int64_t r = p / HQ, head = p % HQ;
                attend_head(qkv + r * QKV_W + head * D, POS[r], SLOT[r], head / groups, KC[l], VC[l], L1, HKV, D,
                            y->window, y->scale, attn + r * HQ * D + head * D, e, (c->wide & WIDE_ATTN) != 0);
            }
            #pragma omp barrier
            weight_part(&y->wo, c->wide, attn, y->bo, o, NULL, R, HQ * D, H, t, T);
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
            weight_part(&y->wgu, c->wide, h, y->bgu, gu, NULL, R, H, 2 * I, t, T);
            #pragma omp barrier
            for (int64_t v = R * (I / 8) * t / T; v < R * (I / 8) * (t + 1) / T; ++v) {
                const int64_t r = v / (I / 8), i = (v % (I / 8)) * 8;
                _mm256_storeu_ps(mid + r * I + i, gated8(_mm256_loadu_ps(gu + r * 2 * I + i), _mm256_loadu_ps(gu + r * 2 * I + I + i), c->act));
            }
            #pragma omp barrier
            weight_part(&y->wd, c->wide, mid, y->bd, o, NULL, R, I, H, t, T);
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
