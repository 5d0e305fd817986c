/* Products over GGUF block-quantized weights, read as the GGUF ships them (Q8_0, Q5_0, Q4_K, Q6_K), with float32
   activations and outputs.

   Every 32 consecutive weights of a row are decoded in registers to float32: q * s (- o for Q4_K) with the block's
   scales, which reproduces ggml's (and gguf.quants') dequantization bit for bit (each q * s is exact in float32,
   so at most the Q4_K offset subtraction rounds, once, as there). The decoded weights then go through exactly the
   FMA sequence of kernels.c's float32 product: the 8 (AVX2) or 16 (AVX-512) lane accumulators see k in the same
   order, so a quantized product is bit-identical to the float32 product of the dequantized matrix, and like it
   batch-invariant: a weight block is decoded once per pass and multiplied into each of up to 3 (AVX2) or 6
   (AVX-512) rows of x, each row's sum in the same order whatever R, the row block or the thread. */
#include "specgate.h"

static inline float fp16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* 32 weights of a row as small integers q (int8 lanes; Q4_K's are 0..15) with w = q * s_lo (lanes 0..15) or
   q * s_hi (16..31), minus off (Q4_K only). */
typedef struct {
    __m256i q;
    float s_lo, s_hi, off;
} Group;

/* 0xFF in byte i where bit i of x is set (llama.cpp's bytes_from_bits_32). */
static inline __m256i bytes_from_bits(uint32_t x) {
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuffle);
    return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

/* Group g (weights 32 g .. 32 g + 31) of a row of each kind. */
static inline Group group_q8_0(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + g * 34;
    const float d = fp16(b);
    return (Group){_mm256_loadu_si256((const __m256i*)(b + 2)), d, d, 0.0f};
}

static inline Group group_q5_0(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + g * 22;
    uint32_t high;
    memcpy(&high, b + 2, sizeof high);
    const __m128i qs = _mm_loadu_si128((const __m128i*)(b + 6));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    /* nibble | bit << 4, minus 16: where the bit is clear, nibble - 16 = nibble | 0xF0 as int8 */
    q = _mm256_or_si256(q, _mm256_andnot_si256(bytes_from_bits(high), _mm256_set1_epi8((char)0xF0)));
    const float d = fp16(b);
    return (Group){q, d, d, 0.0f};
}

static inline Group group_q4_k(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g >> 3) * 144;
    const int s = (int)(g & 7);
    const uint8_t* sc = b + 4;
    int scale, min;
    if (s < 4) {
        scale = sc[s] & 63;
        min = sc[s + 4] & 63;
    } else {
        scale = (sc[s + 4] & 0x0F) | ((sc[s - 4] >> 6) << 4);
        min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (s >> 1)));
    const float d = fp16(b) * (float)scale;
    return (Group){(s & 1) ? high_nibbles(bytes) : low_nibbles(bytes), d, d, fp16(b + 2) * (float)min};
}

static inline Group group_q6_k(const uint8_t* row, int64_t g) {
    const uint8_t* b = row + (g >> 3) * 210;
    const int s = (int)(g & 7), half = s >> 2, r = s & 3;
    const __m256i low = _mm256_loadu_si256((const __m256i*)(b + 64 * half + 32 * (r & 1)));
    const __m256i high = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * half));
    const __m256i two = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(r >= 2 ? high_nibbles(low) : low_nibbles(low), _mm256_slli_epi16(two, 4)),
                                      _mm256_set1_epi8(32));
    const int8_t* sc = (const int8_t*)(b + 192) + 8 * half + 2 * r;
    const float d = fp16(b + 208);
    return (Group){q, d * (float)sc[0], d * (float)sc[1], 0.0f};
}

/* The group's 32 weights as four float32 vectors (AVX2). */
static inline void widen8(Group q, int offset, __m256 w[4]) {
    const __m128i lo = _mm256_castsi256_si128(q.q), hi = _mm256_extracti128_si256(q.q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])), _mm256_set1_ps(i < 2 ? q.s_lo : q.s_hi));
        w[i] = offset ? _mm256_sub_ps(v, _mm256_set1_ps(q.off)) : v;
    }
}

/* RR rows of x times nn <= 4 rows of a weight of one quantized kind (rows of row_bytes bytes), into O at column n
   (+ BIAS): kernels.c's BLOCK with the weight decoded group by group. */
#define QBLOCK(RR, KIND, GROUP, OFFSET)                                                                   \
static void qblock_##KIND##_##RR(int prefetch, const float* x, const uint8_t* w, int64_t row_bytes,       \
                                 const float* bias, int64_t K, float* const* o, int64_t n, int nn) {      \
    const uint8_t* wr[4];                                                                                 \
    for (int j = 0; j < 4; ++j) wr[j] = w + (j < nn ? j : nn - 1) * row_bytes;                            \
    const int64_t group_bytes = row_bytes * 32 / K;                                                       \
    __m256 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();              \
    for (int64_t g = 0; g < K / 32; ++g) {                                                                \
        if (prefetch) for (int j = 0; j < 4; ++j)                                                         \
            _mm_prefetch((const char*)(wr[j] + PREFETCH_ROWS * row_bytes + g * group_bytes), _MM_HINT_T0); \
        for (int j = 0; j < 4; ++j) {                                                                     \
            __m256 v[4];                                                                                  \
            widen8(GROUP(wr[j], g), OFFSET, v);                                                           \
            for (int i = 0; i < RR; ++i) for (int u = 0; u < 4; ++u)                                      \
                acc[i][j] = _mm256_fmadd_ps(v[u], _mm256_loadu_ps(x + i * K + 32 * g + 8 * u), acc[i][j]); \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < nn; ++j)                                             \
        o[i][n + j] = bias ? hsum(acc[i][j]) + bias[n + j] : hsum(acc[i][j]);                             \
}

/* The blocks b_lo..b_hi-1 (4 rows each) of one part, whose first row is column N0 of O [rows, N]. */
#define QRANGE(KIND)                                                                                      \
static void qrange_##KIND(const float* X, const uint8_t* W, int64_t row_bytes, const float* BIAS, float* O,  \
                          const int64_t* ROWS, int64_t R, int64_t K, int64_t N, int64_t N0, int64_t rows,   \
                          int64_t b_lo, int64_t b_hi) {                                                   \
    for (int64_t b = b_lo; b < b_hi; ++b) {                                                               \
        const int64_t n = N0 + b * 4;                                                                     \
        const int nn = (int)(rows - b * 4 < 4 ? rows - b * 4 : 4);                                        \
        const uint8_t* w = W + b * 4 * row_bytes;                                                         \
        for (int64_t r = 0; r < R; r += 3) {                                                              \
            float* out[3];                                                                                \
            for (int i = 0; i < 3 && r + i < R; ++i) out[i] = O + (ROWS ? ROWS[r + i] : r + i) * N;       \
            if (R - r >= 3) qblock_##KIND##_3(r == 0, X + r * K, w, row_bytes, BIAS, K, out, n, nn);      \
            else if (R - r == 2) qblock_##KIND##_2(r == 0, X + r * K, w, row_bytes, BIAS, K, out, n, nn); \
            else qblock_##KIND##_1(r == 0, X + r * K, w, row_bytes, BIAS, K, out, n, nn);                 \
        }                                                                                                 \
    }                                                                                                     \
}
#define QKIND(KIND, GROUP, OFFSET) QBLOCK(1, KIND, GROUP, OFFSET) QBLOCK(2, KIND, GROUP, OFFSET)           \
    QBLOCK(3, KIND, GROUP, OFFSET) QRANGE(KIND)
QKIND(q8_0, group_q8_0, 0)
QKIND(q5_0, group_q5_0, 0)
QKIND(q4_k, group_q4_k, 1)
QKIND(q6_k, group_q6_k, 0)

/* The same with AVX-512: a group is two 16-lane vectors, up to 6 rows of x per pass (kernels.c's BLOCK512). */
#define AVX512 __attribute__((target("avx512f,avx512bw")))
static inline AVX512 void widen16(Group q, int offset, __m512 w[2]) {
    const __m128i part[2] = {_mm256_castsi256_si128(q.q), _mm256_extracti128_si256(q.q, 1)};
    for (int i = 0; i < 2; ++i) {
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part[i])), _mm512_set1_ps(i ? q.s_hi : q.s_lo));
        w[i] = offset ? _mm512_sub_ps(v, _mm512_set1_ps(q.off)) : v;
    }
}

#define QBLOCK512(RR, KIND, GROUP, OFFSET)                                                                \
static AVX512 void q512_##KIND##_##RR(int prefetch, const float* x, const uint8_t* w, int64_t row_bytes,  \
                                      const float* bias, int64_t K, float* const* o, int64_t n, int nn) { \
    const uint8_t* wr[4];                                                                                 \
    for (int j = 0; j < 4; ++j) wr[j] = w + (j < nn ? j : nn - 1) * row_bytes;                            \
    const int64_t group_bytes = row_bytes * 32 / K;                                                       \
    __m512 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();              \
    for (int64_t g = 0; g < K / 32; ++g) {                                                                \
        if (prefetch) for (int j = 0; j < 4; ++j)                                                         \
            _mm_prefetch((const char*)(wr[j] + PREFETCH_ROWS * row_bytes + g * group_bytes), _MM_HINT_T0); \
        for (int j = 0; j < 4; ++j) {                                                                     \
            __m512 v[2];                                                                                  \
            widen16(GROUP(wr[j], g), OFFSET, v);                                                          \
            for (int i = 0; i < RR; ++i) for (int u = 0; u < 2; ++u)                                      \
                acc[i][j] = _mm512_fmadd_ps(v[u], _mm512_loadu_ps(x + i * K + 32 * g + 16 * u), acc[i][j]); \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < nn; ++j)                                             \
        o[i][n + j] = bias ? _mm512_reduce_add_ps(acc[i][j]) + bias[n + j] : _mm512_reduce_add_ps(acc[i][j]); \
}

/* Output row pointers of x's rows r .. r + 5 (fewer at the end); returns how many. */
static inline int six_rows(float* out[6], float* O, const int64_t* ROWS, int64_t r, int64_t R, int64_t N) {
    const int count = R - r >= 6 ? 6 : (int)(R - r);
    for (int i = 0; i < count; ++i) out[i] = O + (ROWS ? ROWS[r + i] : r + i) * N;
    return count;
}

typedef void Q512Block(int, const float*, const uint8_t*, int64_t, const float*, int64_t, float* const*, int64_t, int);

#define QRANGE512(KIND)                                                                                   \
static AVX512 void q512range_##KIND(const float* X, const uint8_t* W, int64_t row_bytes, const float* BIAS,  \
                                    float* O, const int64_t* ROWS, int64_t R, int64_t K, int64_t N,       \
                                    int64_t N0, int64_t rows, int64_t b_lo, int64_t b_hi) {               \
    for (int64_t b = b_lo; b < b_hi; ++b) {                                                               \
        const int64_t n = N0 + b * 4;                                                                     \
        const int nn = (int)(rows - b * 4 < 4 ? rows - b * 4 : 4);                                        \
        const uint8_t* w = W + b * 4 * row_bytes;                                                         \
        for (int64_t r = 0; r < R; r += 6) {                                                              \
            float* out[6];                                                                                \
            Q512Block* const block[7] = {NULL, q512_##KIND##_1, q512_##KIND##_2, q512_##KIND##_3,         \
                                         q512_##KIND##_4, q512_##KIND##_5, q512_##KIND##_6};              \
            block[six_rows(out, O, ROWS, r, R, N)](r == 0, X + r * K, w, row_bytes, BIAS, K, out, n, nn);  \
        }                                                                                                 \
    }                                                                                                     \
}
#define QKIND512(KIND, GROUP, OFFSET) QBLOCK512(1, KIND, GROUP, OFFSET) QBLOCK512(2, KIND, GROUP, OFFSET)  \
    QBLOCK512(3, KIND, GROUP, OFFSET) QBLOCK512(4, KIND, GROUP, OFFSET) QBLOCK512(5, KIND, GROUP, OFFSET) \
    QBLOCK512(6, KIND, GROUP, OFFSET) QRANGE512(KIND)
QKIND512(q8_0, group_q8_0, 0)
QKIND512(q5_0, group_q5_0, 0)
QKIND512(q4_k, group_q4_k, 1)
QKIND512(q6_k, group_q6_k, 0)

/* ---- int8 activations (AVX-512 VNNI): llama.cpp's method, kept batch-invariant ------------------------------

   Where the CPU has AVX-512 VNNI, a product over quantized weights first rounds each row of x to int8 per
   32-block (ActPair: q = round_half_even(x * 127 / amax), dx = amax / 127, both float32 arithmetic), then takes
   each weight group's dot product with it in integers (vpdpbusd: 64 byte products a pass, exact) and sums
   dot * (weight scale * dx) in float32 (16 lanes: two groups of 8). A signed weight q is fed as the byte q ^ 0x80
   = q + 128 and corrected by the block's -128 * sum(q_x) (precomputed per lane, the accumulator's start value).
   Each row of x is quantized on its own and summed in the same order whatever R, the row block or the thread:
   batch-invariant like the float32 path, with fewer instructions per weight (the float32 widening is gone). It
   is no longer bit-equal to the float32 model of the dequantized weights: the activations are rounded (about
   0.2% of amax per block), as llama.cpp rounds them. A block of x holding inf or NaN gets a NaN dx, so a
   non-finite activation still gives non-finite logits. */
#ifndef I8_PREFETCH_BLOCKS
#define I8_PREFETCH_BLOCKS 2
#endif
#ifndef I8_PREFETCH_ROWS
#define I8_PREFETCH_ROWS 4
#endif
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))

/* Two 32-blocks of one row of x as the int8 kernels read them (320 bytes, 64-byte aligned). */
typedef struct {
    int8_t q[64];
    float dx[16];     /* lanes 0-7 block 2p's scale, 8-15 block 2p+1's */
    int32_t corr[16];   /* -128 * (sum of the 4 q bytes lane k covers): weights fed as q + 128 */
    int32_t corr32[16]; /* -32 * that sum: Q6K_R4's q + 32 */
    float psum[16];     /* that sum (Q4_K's min term) */
} ActPair;

static VNNI void quantize_act_row(const float* x, int64_t K, ActPair* out) {
    const int64_t pairs = (K + 63) / 64;
    for (int64_t p = 0; p < pairs; ++p) {
        ActPair* a = out + p;
        __m128i q[4];
        float dx[2] = {0.0f, 0.0f};
        for (int h = 0; h < 2; ++h) {
            const int64_t k = 64 * p + 32 * h;
            if (k >= K) {
                q[2 * h] = q[2 * h + 1] = _mm_setzero_si128();
                continue;
            }
            const __m512 v0 = _mm512_loadu_ps(x + k), v1 = _mm512_loadu_ps(x + k + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float poison = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_mul_ps(v0, _mm512_setzero_ps()), _mm512_mul_ps(v1, _mm512_setzero_ps())));
            const float id = amax > 0.0f && amax <= 3.4e38f ? 127.0f / amax : 0.0f;
            q[2 * h] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id))));
            q[2 * h + 1] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id))));
            dx[h] = amax / 127.0f + poison;  /* NaN where the block holds inf or NaN */
        }
        __m512i bytes = _mm512_castsi128_si512(q[0]);
        bytes = _mm512_inserti32x4(bytes, q[1], 1);
        bytes = _mm512_inserti32x4(bytes, q[2], 2);
        bytes = _mm512_inserti32x4(bytes, q[3], 3);
        _mm512_store_si512((__m512i*)a->q, bytes);
        _mm512_store_ps(a->dx, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dx[0]), _mm512_set1_ps(dx[1])));
        const __m512i psum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), bytes);
        _mm512_store_si512((__m512i*)a->corr, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(psum, 7)));
        _mm512_store_si512((__m512i*)a->corr32, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(psum, 5)));
        _mm512_store_ps(a->psum, _mm512_cvtepi32_ps(psum));
    }
}

/* Two weight groups (2p, 2p+1) of a row as the int8 kernels read them: bytes u (q ^ 0x80 for a signed kind, q for
   Q4_K), per-lane scales (lane k covers bytes 4k..4k+3) and, for Q4_K, per-lane mins. A row whose K is an odd
   number of groups has a lone last group: its other half is zero (and x's is zero). */
typedef struct {
    __m512i u;
    __m512 scale, off;
} Pair;

static inline VNNI __m512 lane_scales(float a, float b, float c, float d) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_setr_ps(a, b, c, d)));
}

static inline VNNI Pair pair_of(Group g0, Group g1, int lone, int is_signed) {
    __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(g0.q), lone ? _mm256_setzero_si256() : g1.q, 1);
    if (is_signed) u = _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));
    const Pair pair = {u, lane_scales(g0.s_lo, g0.s_hi, lone ? 0.0f : g1.s_lo, lone ? 0.0f : g1.s_hi),
                       lane_scales(g0.off, g0.off, lone ? 0.0f : g1.off, lone ? 0.0f : g1.off)};
    return pair;
}

#define PAIR_KIND(KIND, SIGNED)                                                                           \
static inline VNNI Pair pair_##KIND(const uint8_t* row, int64_t p, int64_t groups) {                      \
    const int lone = 2 * p + 1 >= groups;                                                                 \
    return pair_of(group_##KIND(row, 2 * p), group_##KIND(row, lone ? 2 * p : 2 * p + 1), lone, SIGNED);  \
}
PAIR_KIND(q8_0, 1)
PAIR_KIND(q5_0, 1)
PAIR_KIND(q6_k, 1)

/* Q4_K's groups 2p and 2p+1 are the low and high nibbles of the same 32 bytes. */
static inline VNNI Pair pair_q4_k(const uint8_t* row, int64_t p, int64_t groups) {
    (void)groups;
    const Group g0 = group_q4_k(row, 2 * p), g1 = group_q4_k(row, 2 * p + 1);
    return pair_of(g0, g1, 0, 0);
}

/* RR rows of quantized x (RR ActPair rows of `pairs` each) times nn <= 4 rows of a weight, into O at column n. */
#define I8BLOCK(RR, KIND, SIGNED, OFFSET)                                                                 \
static VNNI void i8_##KIND##_##RR(int prefetch, const ActPair* xa, int64_t pairs, const uint8_t* w,       \
                                  int64_t row_bytes, const float* bias, int64_t K, float* const* o,       \
                                  int64_t n, int nn) {                                                    \
    const uint8_t* wr[4];                                                                                 \
    for (int j = 0; j < 4; ++j) wr[j] = w + (j < nn ? j : nn - 1) * row_bytes;                            \
    const int64_t groups = K / 32, pair_bytes = row_bytes * 64 / K;                                       \
    __m512 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();              \
    for (int64_t p = 0; p < pairs; ++p) {                                                                 \
        if (prefetch) for (int j = 0; j < 4; ++j) {                                                       \
            _mm_prefetch((const char*)(wr[j] + I8_PREFETCH_ROWS * row_bytes + p * pair_bytes), _MM_HINT_T0); \
            _mm_prefetch((const char*)(wr[j] + I8_PREFETCH_ROWS * row_bytes + p * pair_bytes + 64), _MM_HINT_T0); \
        }                                                                                                 \
        for (int j = 0; j < 4; ++j) {                                                                     \
            const Pair pr = pair_##KIND(wr[j], p, groups);                                                \
            for (int i = 0; i < RR; ++i) {                                                                \
                const ActPair* a = xa + i * pairs + p;                                                    \
                const __m512 dx = _mm512_load_ps(a->dx);                                                  \
                const __m512i dot = _mm512_dpbusd_epi32(SIGNED ? _mm512_load_si512((const __m512i*)a->corr) \
                                                        : _mm512_setzero_si512(), pr.u, _mm512_load_si512((const __m512i*)a->q)); \
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(pr.scale, dx), acc[i][j]); \
                if (OFFSET) acc[i][j] = _mm512_fnmadd_ps(_mm512_mul_ps(pr.off, dx), _mm512_load_ps(a->psum), acc[i][j]); \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < nn; ++j)                                             \
        o[i][n + j] = bias ? _mm512_reduce_add_ps(acc[i][j]) + bias[n + j] : _mm512_reduce_add_ps(acc[i][j]); \
}

typedef void I8Block(int, const ActPair*, int64_t, const uint8_t*, int64_t, const float*, int64_t, float* const*, int64_t, int);

#define I8RANGE(KIND)                                                                                     \
static VNNI void i8range_##KIND(const ActPair* XA, int64_t pairs, const uint8_t* W, int64_t row_bytes,   \
                                const float* BIAS, float* O, const int64_t* ROWS, int64_t R, int64_t K,   \
                                int64_t N, int64_t N0, int64_t rows, int64_t b_lo, int64_t b_hi) {        \
    for (int64_t b = b_lo; b < b_hi; ++b) {                                                               \
        const int64_t n = N0 + b * 4;                                                                     \
        const int nn = (int)(rows - b * 4 < 4 ? rows - b * 4 : 4);                                        \
        const uint8_t* w = W + b * 4 * row_bytes;                                                         \
        for (int64_t r = 0; r < R; r += 6) {                                                              \
            float* out[6];                                                                                \
            I8Block* const block[7] = {NULL, i8_##KIND##_1, i8_##KIND##_2, i8_##KIND##_3, i8_##KIND##_4,  \
                                       i8_##KIND##_5, i8_##KIND##_6};                                     \
            block[six_rows(out, O, ROWS, r, R, N)](r == 0, XA + r * pairs, pairs, w, row_bytes, BIAS, K, out, n, nn); \
        }                                                                                                 \
    }                                                                                                     \
}
#define I8KIND(KIND, SIGNED, OFFSET) I8BLOCK(1, KIND, SIGNED, OFFSET) I8BLOCK(2, KIND, SIGNED, OFFSET)    \
    I8BLOCK(3, KIND, SIGNED, OFFSET) I8BLOCK(4, KIND, SIGNED, OFFSET) I8BLOCK(5, KIND, SIGNED, OFFSET)    \
    I8BLOCK(6, KIND, SIGNED, OFFSET) I8RANGE(KIND)
I8KIND(q8_0, 1, 0)
I8KIND(q5_0, 1, 0)
I8KIND(q4_k, 0, 1)
I8KIND(q6_k, 1, 0)

/* Weights repacked at load for the int8 kernels (rows % 4 == 0, K % 128 == 0; exact rearrangements). Each 4-row
   block becomes one sequential stream, read once for all rows of x.

   Q8_0, Q5_0 and Q4_K (block-transposed, "T4"): the stream is K / 128 steps; a step holds 4 rows x 4 groups of 32
   weights (16 groups) as 8 vectors of 64 bytes, vector s lane L = 4 j + b (row j, group b) carrying weights
   4 s .. 4 s + 3 of that group, then the 16 groups' scales in lane order. One int32 lane then sums a whole group
   in 8 vpdpbusd (exact, integer) before a single conversion and FMA with the group's scale x the activation's:
   per row of x, 4 rows of W and 128 weights, 8 vpdpbusd + 3 float ops, against 8 + 24 when each vpdpbusd result
   was scaled on its own. The activation side (ActT4) holds x's 4 groups the same way, replicated over j.
   - KIND_Q8_0_R4 (544 bytes a step, Q8_0's size): 8 x 64 bytes q ^ 0x80; 16 fp16 scales.
   - KIND_Q5_R4 (352, Q5_0's size): 4 x 64 bytes of nibbles (low: vector c, high: vector c + 4), 8 x 8 bytes of
     fifth bits (vector s, bit e: byte e), 16 fp16 scales. q + 16 in 0..31.
   - KIND_Q4K_R4 (384, 1.33x Q4_K): nibbles as Q5's, 16 float32 scales d x sc and 16 offsets dmin x m.
   Q6_K scales every 16 weights, so it keeps a pair layout ("R4"): each 4-row block is K / 64 pairs of groups, row
   j's 64 quants as q + 32 (4 x 32 bytes of nibbles, weight e's low nibble and weight e + 32's high; 4 x 16 bytes of
   the 2 high bits, byte k bits 2L: weight k + 16 L), then 16 float32 scales d x sc per 16 weights (row j: 4j ..
   4j + 3); 256 bytes a pair (KIND_Q6K_R4, 1.22x Q6_K).
   Each scale is the product ggml's dequantization forms (exact in float32), so a weight is ggml's value. */

/* One row of x's 4 groups (128 values) as the T4 kernels read them (192 bytes, 64-byte aligned); each 16-byte
   field is broadcast to the four 128-bit lanes (one per weight row j) as it is loaded. */
typedef struct {
    int8_t q[8][16];    /* vector s, dword g: x's bytes 4 s .. 4 s + 3 of group g */
    float dx[4];        /* group g's scale */
    int32_t corr[4];    /* -128 x the group's sum of q: Q8_0 weights fed as q + 128 */
    int32_t corr16[4];  /* -16 x it: Q5_0's q + 16 */
    float psum[4];      /* the sum (Q4_K's offset term) */
} ActT4;

/* x's pairs 2t and 2t + 1 (groups 4t .. 4t + 3) as ActT4 steps (K % 128 == 0). */
static VNNI void act_t4_row(const ActPair* a, int64_t steps, ActT4* out) {
    for (int64_t t = 0; t < steps; ++t) {
        const ActPair* lo = a + 2 * t;
        const ActPair* hi = lo + 1;
        const __m512i q_lo = _mm512_load_si512((const __m512i*)lo->q), q_hi = _mm512_load_si512((const __m512i*)hi->q);
        __m128i sum = _mm_setzero_si128();
        for (int s = 0; s < 8; ++s) {  /* dword g takes dword 8 g + s of the 128 bytes */
            const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 8, 16, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_set1_epi32(s));
            const __m128i v = _mm512_castsi512_si128(_mm512_permutex2var_epi32(q_lo, idx, q_hi));
            _mm_store_si128((__m128i*)out[t].q[s], v);
            sum = _mm_dpbusd_epi32(sum, _mm_set1_epi8(1), v);
        }
        _mm_store_ps(out[t].dx, _mm_setr_ps(lo->dx[0], lo->dx[8], hi->dx[0], hi->dx[8]));
        _mm_store_si128((__m128i*)out[t].corr, _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sum, 7)));
        _mm_store_si128((__m128i*)out[t].corr16, _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sum, 4)));
        _mm_store_ps(out[t].psum, _mm_cvtepi32_ps(sum));
    }
}

static inline VNNI void t4_nibbles(const uint8_t* b, __m512i u[8]) {
    for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512((const void*)(b + 64 * c));
        u[c] = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
        u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
    }
}

static inline VNNI void t4_q8(const uint8_t* b, __m512i u[8]) {
    for (int s = 0; s < 8; ++s) u[s] = _mm512_loadu_si512((const void*)(b + 64 * s));
}

static inline VNNI void t4_q5(const uint8_t* b, __m512i u[8]) {
    t4_nibbles(b, u);
    for (int s = 0; s < 8; ++s) {
        uint64_t bits;
        memcpy(&bits, b + 256 + 8 * s, sizeof bits);
        u[s] = _mm512_mask_add_epi8(u[s], (__mmask64)bits, u[s], _mm512_set1_epi8(0x10));
    }
}

#define T4_SC_FP16(b, at) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((b) + (at))))
#define T4_SC_F32(b, at) _mm512_loadu_ps((const float*)((b) + (at)))

/* RR rows of x times one 4-row block of a T4 kind, into O's columns n .. n + 3. Lane L of row i's accumulator sums
   row L / 4's group L % 4 of every step; the four lanes of a row are added in one fixed order at the end. */
#define T4BLOCK(NAME, RR, STEP_BYTES, DECODE, SCALES, CORR, OFFSET)                                       \
static VNNI void NAME##_##RR(const ActT4* xa, int64_t steps, const uint8_t* w, const float* bias,        \
                             float* const* o, int64_t n) {                                                \
    __m512 acc[RR];                                                                                       \
    for (int i = 0; i < RR; ++i) acc[i] = _mm512_setzero_ps();                                            \
    for (int64_t t = 0; t < steps; ++t) {                                                                 \
        const uint8_t* b = w + t * STEP_BYTES;                                                            \
        for (int line = 0; line < STEP_BYTES; line += 64)                                                 \
            _mm_prefetch((const char*)(b + STEP_BYTES * steps * T4_PREFETCH_BLOCKS + line), _MM_HINT_T1);  \
        __m512i u[8];                                                                                     \
        DECODE(b, u);                                                                                     \
        const __m512 scale = SCALES(b);                                                                   \
        for (int i = 0; i < RR; ++i) {                                                                    \
            const ActT4* a = xa + i * steps + t;                                                          \
            __m512i even = CORR(a), odd = _mm512_setzero_si512();      \
            for (int s = 0; s < 8; s += 2) {                                                              \
                even = _mm512_dpbusd_epi32(even, u[s], _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)a->q[s]))); \
                odd = _mm512_dpbusd_epi32(odd, u[s + 1], _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)a->q[s + 1]))); \
            }                                                                                             \
            const __m512 dx = _mm512_broadcast_f32x4(_mm_load_ps(a->dx));                                 \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even, odd)), _mm512_mul_ps(scale, dx), acc[i]); \
            if (OFFSET) acc[i] = _mm512_fnmadd_ps(_mm512_mul_ps(T4_SC_F32(b, 320), dx), _mm512_broadcast_f32x4(_mm_load_ps(a->psum)), acc[i]); \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) {                                                                        \
        float lanes[16];                                                                                  \
        _mm512_storeu_ps(lanes, acc[i]);                                                                  \
        for (int j = 0; j < 4; ++j) {                                                                     \
            const float sum = (lanes[4 * j] + lanes[4 * j + 1]) + (lanes[4 * j + 2] + lanes[4 * j + 3]);  \
            o[i][n + j] = bias ? sum + bias[n + j] : sum;                                                 \
        }                                                                                                 \
    }                                                                                                     \
}

#ifndef T4_PREFETCH_BLOCKS
#define T4_PREFETCH_BLOCKS 16
#endif
#define T4_ROWS 12 /* rows of x per pass over a block: a verification of up to 12 tokens reads W once */
typedef void T4Block(const ActT4*, int64_t, const uint8_t*, const float*, float* const*, int64_t);

#define T4KIND(NAME, STEP_BYTES, DECODE, SCALES, CORR, OFFSET)                                             \
T4BLOCK(NAME, 1, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) T4BLOCK(NAME, 2, STEP_BYTES, DECODE, SCALES, CORR, OFFSET)  \
T4BLOCK(NAME, 3, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) T4BLOCK(NAME, 4, STEP_BYTES, DECODE, SCALES, CORR, OFFSET)  \
T4BLOCK(NAME, 5, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) T4BLOCK(NAME, 6, STEP_BYTES, DECODE, SCALES, CORR, OFFSET)  \
T4BLOCK(NAME, 7, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) T4BLOCK(NAME, 8, STEP_BYTES, DECODE, SCALES, CORR, OFFSET)  \
T4BLOCK(NAME, 9, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) T4BLOCK(NAME, 10, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) \
T4BLOCK(NAME, 11, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) T4BLOCK(NAME, 12, STEP_BYTES, DECODE, SCALES, CORR, OFFSET) \
static T4Block* const NAME##_blocks[T4_ROWS + 1] = {NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, \
    NAME##_7, NAME##_8, NAME##_9, NAME##_10, NAME##_11, NAME##_12};
#define SC_T4Q8(b) T4_SC_FP16(b, 512)
#define SC_T4Q5(b) T4_SC_FP16(b, 320)
#define SC_T4Q4K(b) T4_SC_F32(b, 256)
#define START_CORR(a) _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)(a)->corr))
#define START_CORR16(a) _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)(a)->corr16))
#define START_ZERO(a) _mm512_setzero_si512()
T4KIND(t4q8, 544, t4_q8, SC_T4Q8, START_CORR, 0)
T4KIND(t4q5, 352, t4_q5, SC_T4Q5, START_CORR16, 0)
T4KIND(t4q4k, 384, t4_nibbles, SC_T4Q4K, START_ZERO, 1)  /* Q4_K's q is unsigned: no correction */

/* Q6K_R4: per pair and weight row one decode, then per row of x one vpdpbusd (started at -32 x its sums) and one
   FMA. */
static inline VNNI __m512i u_q6k(const uint8_t* b, int j) {
    /* the 16 bytes in each 128-bit lane L; bits 2L, 2L + 1 moved to bits 4, 5 (16-bit shifts; the bits they carry
       across a byte land outside 4..5 and are masked) */
    const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 32 * j));
    const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(low_nibbles(v)), high_nibbles(v), 1);
    const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 128 + 16 * j)));
    const __m512i left = _mm512_sllv_epi16(h, _mm512_set_epi64(0, 0, 0, 0, 0x0002000200020002, 0x0002000200020002, 0x0004000400040004, 0x0004000400040004));
    const __m512i right = _mm512_srlv_epi16(h, _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0, 0, 0));
    const __m512i high = _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, left, right), _mm512_set1_epi8(0x30));
    return _mm512_or_si512(nibbles, high);
}

#define R4BLOCK(RR)                                                                                       \
static VNNI void r4q6k_##RR(const ActPair* xa, int64_t pairs, const uint8_t* w, const float* bias,       \
                            float* const* o, int64_t n) {                                                 \
    __m512 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();              \
    for (int64_t p = 0; p < pairs; ++p) {                                                                 \
        const uint8_t* b = w + p * 256;                                                                   \
        for (int line = 0; line < 256; line += 64)                                                        \
            _mm_prefetch((const char*)(b + 4 * 256 * pairs * I8_PREFETCH_BLOCKS + line), _MM_HINT_T0);    \
        for (int j = 0; j < 4; ++j) {                                                                     \
            const __m512i u = u_q6k(b, j);                                                                \
            const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_set1_epi32(4 * j)); \
            const __m512 scale = _mm512_permutexvar_ps(idx, _mm512_loadu_ps((const float*)(b + 192)));    \
            for (int i = 0; i < RR; ++i) {                                                                \
                const ActPair* a = xa + i * pairs + p;                                                    \
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_load_si512((const __m512i*)a->corr32), u,  \
                                                        _mm512_load_si512((const __m512i*)a->q));         \
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_load_ps(a->dx)), acc[i][j]); \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j)                                              \
        o[i][n + j] = bias ? _mm512_reduce_add_ps(acc[i][j]) + bias[n + j] : _mm512_reduce_add_ps(acc[i][j]); \
}
typedef void R4Block(const ActPair*, int64_t, const uint8_t*, const float*, float* const*, int64_t);
R4BLOCK(1) R4BLOCK(2) R4BLOCK(3) R4BLOCK(4) R4BLOCK(5) R4BLOCK(6)
static R4Block* const r4q6k_blocks[7] = {NULL, r4q6k_1, r4q6k_2, r4q6k_3, r4q6k_4, r4q6k_5, r4q6k_6};

/* x quantized for the int8 kernels: per row, K / 64 ActPairs and (K % 128 == 0) K / 128 ActT4 steps. */
typedef struct {
    const ActPair* pairs;
    const ActT4* t4;
} Acts;

/* The 4-row blocks b_lo..b_hi-1 of a repacked part (whose first row is column N0 of O [rows, N]). */
#define T4RANGE(NAME)                                                                                     \
static VNNI void NAME##_range(const Acts* XA, int64_t pairs, const uint8_t* W, int64_t row_bytes,        \
                              const float* BIAS, float* O, const int64_t* ROWS, int64_t R, int64_t K,     \
                              int64_t N, int64_t N0, int64_t rows, int64_t b_lo, int64_t b_hi) {          \
    (void)K, (void)rows;                                                                                  \
    for (int64_t b = b_lo; b < b_hi; ++b) {                                                               \
        for (int64_t r = 0; r < R; r += T4_ROWS) {                                                        \
            float* out[T4_ROWS];                                                                          \
            const int count = R - r >= T4_ROWS ? T4_ROWS : (int)(R - r);                                  \
            for (int i = 0; i < count; ++i) out[i] = O + (ROWS ? ROWS[r + i] : r + i) * N;                \
            NAME##_blocks[count](XA->t4 + r * (pairs / 2), pairs / 2, W + b * 4 * row_bytes, BIAS, out, N0 + b * 4); \
        }                                                                                                 \
    }                                                                                                     \
}
T4RANGE(t4q8)
T4RANGE(t4q5)
T4RANGE(t4q4k)

static VNNI void r4q6k_range(const Acts* XA, int64_t pairs, const uint8_t* W, int64_t row_bytes, const float* BIAS,
                             float* O, const int64_t* ROWS, int64_t R, int64_t K, int64_t N, int64_t N0, int64_t rows,
                             int64_t b_lo, int64_t b_hi) {
    (void)K, (void)rows;
    for (int64_t b = b_lo; b < b_hi; ++b) {
        for (int64_t r = 0; r < R; r += 6) {
            float* out[6];
            r4q6k_blocks[six_rows(out, O, ROWS, r, R, N)](XA->pairs + r * pairs, pairs, W + b * 4 * row_bytes, BIAS, out, N0 + b * 4);
        }
    }
}

/* Bytes of a repacked kind's 4-row unit (a T4 step of 128 weights, a Q6K_R4 pair of 64). */
static int64_t repacked_unit_bytes(int kind) {
    switch (kind) {
        case KIND_Q8_0_R4: return 544;
        case KIND_Q5_R4: return 352;
        case KIND_Q4K_R4: return 384;
        case KIND_Q6K_R4: return 256;
        default: return 0;
    }
}

static float f32_at(const uint8_t* at) {
    float v;
    memcpy(&v, at, sizeof v);
    return v;
}

/* Row j of a repacked 4-row block's unit u as floats (128 for T4, 64 for Q6K_R4): the embedding lookup and a
   prefill's chunks. */
static void repacked_row_unit(int kind, const uint8_t* block, int64_t unit, int j, float* out) {
    const uint8_t* b = block + unit * repacked_unit_bytes(kind);
    if (kind == KIND_Q6K_R4) {
        for (int e = 0; e < 64; ++e) {
            const int nibble = e < 32 ? b[32 * j + e] & 0x0F : b[32 * j + e - 32] >> 4;
            out[e] = f32_at(b + 192 + 4 * (4 * j + e / 16)) * (float)((nibble | ((b[128 + 16 * j + e % 16] >> (2 * (e / 16))) & 3) << 4) - 32);
        }
        return;
    }
    for (int e = 0; e < 128; ++e) {
        const int lane = 4 * j + e / 32, s = e % 32 / 4, at = 4 * lane + e % 4;  /* vector s, byte at */
        const int nibble = (b[64 * (s % 4) + at] >> (s >= 4 ? 4 : 0)) & 0x0F;
        switch (kind) {
            case KIND_Q8_0_R4: out[e] = (float)(int8_t)(b[64 * s + at] ^ 0x80) * fp16(b + 512 + 2 * lane); break;
            case KIND_Q5_R4: out[e] = (float)((nibble | ((b[256 + 8 * s + at / 8] >> (at % 8)) & 1) << 4) - 16) * fp16(b + 320 + 2 * lane); break;
            default: out[e] = f32_at(b + 256 + 4 * lane) * (float)nibble - f32_at(b + 320 + 4 * lane); break;
        }
    }
}

int64_t kind_row_bytes(int kind, int64_t K);

/* Step t of 4 rows (ROW: the block's first row, row_bytes apart) of a Q8_0 / Q5_0 / Q4_K matrix into T4 at d. */
static void repack_t4_step(int kind, const uint8_t* row, int64_t row_bytes, int64_t t, uint8_t* d) {
    for (int j = 0; j < 4; ++j) {
        for (int g = 0; g < 4; ++g) {
            const uint8_t* r = row + j * row_bytes;
            const int64_t group = 4 * t + g;
            const Group q = kind == KIND_Q8_0 ? group_q8_0(r, group) : kind == KIND_Q5_0 ? group_q5_0(r, group) : group_q4_k(r, group);
            int8_t v[32];
            _mm256_storeu_si256((__m256i*)v, q.q);
            const int lane = 4 * j + g;
            for (int m = 0; m < 32; ++m) {
                const int s = m / 4, at = 4 * lane + m % 4;
                if (kind == KIND_Q8_0) {
                    d[64 * s + at] = (uint8_t)v[m] ^ 0x80;
                    continue;
                }
                const int u = kind == KIND_Q5_0 ? v[m] + 16 : v[m];
                d[64 * (s % 4) + at] |= (uint8_t)((u & 0x0F) << (s >= 4 ? 4 : 0));
                if (kind == KIND_Q5_0) d[256 + 8 * s + at / 8] |= (uint8_t)((u >> 4 & 1) << (at % 8));
            }
            if (kind == KIND_Q8_0) memcpy(d + 512 + 2 * lane, r + group * 34, 2);  /* the raw fp16 d */
            else if (kind == KIND_Q5_0) memcpy(d + 320 + 2 * lane, r + group * 22, 2);
            else {
                memcpy(d + 256 + 4 * lane, &q.s_lo, 4);
                memcpy(d + 320 + 4 * lane, &q.off, 4);
            }
        }
    }
}

/* Pair p of a Q6_K row j into a Q6K_R4 pair at d. */
static void repack_q6k_pair(const uint8_t* row, int64_t p, int j, uint8_t* d) {
    int8_t q[64];
    float scales[4];
    for (int h = 0; h < 2; ++h) {
        const Group g = group_q6_k(row, 2 * p + h);
        _mm256_storeu_si256((__m256i*)(q + 32 * h), g.q);
        scales[2 * h] = g.s_lo, scales[2 * h + 1] = g.s_hi;
    }
    for (int e = 0; e < 32; ++e) d[32 * j + e] = (uint8_t)(((q[e] + 32) & 0x0F) | ((q[e + 32] + 32) & 0x0F) << 4);
    for (int k = 0; k < 16; ++k) {
        uint8_t v = 0;
        for (int L = 0; L < 4; ++L) v |= (uint8_t)(((q[k + 16 * L] + 32) >> 4 & 3) << (2 * L));
        d[128 + 16 * j + k] = v;
    }
    memcpy(d + 192 + 16 * j, scales, sizeof scales);
}

/* A Q8_0 / Q5_0 / Q4_K / Q6_K matrix [rows, K] (rows % 4 == 0, K % 128 == 0) rearranged into its repacked kind
   ([rows, kind_row_bytes(repacked kind, K)] bytes). */
void repack(const uint8_t* SRC, int kind, int64_t rows, int64_t K, uint8_t* DST, int threads) {
    const int64_t row_bytes = kind_row_bytes(kind, K);
    const int packed = kind == KIND_Q8_0 ? KIND_Q8_0_R4 : kind == KIND_Q5_0 ? KIND_Q5_R4 : kind == KIND_Q4_K ? KIND_Q4K_R4 : KIND_Q6K_R4;
    const int64_t unit = repacked_unit_bytes(packed), units = packed == KIND_Q6K_R4 ? K / 64 : K / 128;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < rows / 4; ++blk) {
        uint8_t* d = DST + blk * units * unit;
        memset(d, 0, (size_t)(units * unit));
        for (int64_t u = 0; u < units; ++u) {
            if (packed == KIND_Q6K_R4) {
                for (int j = 0; j < 4; ++j) repack_q6k_pair(SRC + (blk * 4 + j) * row_bytes, u, j, d + u * unit);
            } else {
                repack_t4_step(kind, SRC + blk * 4 * row_bytes, row_bytes, u, d + u * unit);
            }
        }
    }
}

typedef void (*I8Range)(const Acts*, int64_t, const uint8_t*, int64_t, const float*, float*, const int64_t*, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

#define GGUF_RANGE(KIND)                                                                                  \
static VNNI void gguf_##KIND(const Acts* XA, int64_t pairs, const uint8_t* W, int64_t row_bytes, const float* BIAS,  \
                             float* O, const int64_t* ROWS, int64_t R, int64_t K, int64_t N, int64_t N0,  \
                             int64_t rows, int64_t b_lo, int64_t b_hi) {                                  \
    i8range_##KIND(XA->pairs, pairs, W, row_bytes, BIAS, O, ROWS, R, K, N, N0, rows, b_lo, b_hi);         \
}
GGUF_RANGE(q8_0)
GGUF_RANGE(q5_0)
GGUF_RANGE(q4_k)
GGUF_RANGE(q6_k)

static I8Range int8_range(int kind) {
    switch (kind) {
        case KIND_Q8_0: return gguf_q8_0;
        case KIND_Q5_0: return gguf_q5_0;
        case KIND_Q4_K: return gguf_q4_k;
        case KIND_Q6_K: return gguf_q6_k;
        case KIND_Q8_0_R4: return t4q8_range;
        case KIND_Q5_R4: return t4q5_range;
        case KIND_Q4K_R4: return t4q4k_range;
        case KIND_Q6K_R4: return r4q6k_range;
        default: return NULL;
    }
}

/* This thread's quantized copy of X [R, K] (each thread quantizes all R rows itself: no barrier, and a row's
   bytes never depend on the split). The buffers grow as needed and are kept for the thread's next call. */
static Acts thread_act(const float* X, int64_t R, int64_t K) {
    static __thread ActPair* buffer = NULL;
    static __thread ActT4* steps_buffer = NULL;
    static __thread int64_t capacity = 0;
    const int64_t pairs = (K + 63) / 64, need = R * pairs;
    if (need > capacity) {
        free(buffer);
        free(steps_buffer);
        buffer = aligned_alloc(64, (size_t)need * sizeof(ActPair));
        steps_buffer = aligned_alloc(64, (size_t)(need / 2 + 1) * sizeof(ActT4));
        capacity = buffer && steps_buffer ? need : 0;
        if (!capacity) return (Acts){NULL, NULL};
    }
    for (int64_t r = 0; r < R; ++r) quantize_act_row(X + r * K, K, buffer + r * pairs);
    if (K % 128 == 0)
        for (int64_t r = 0; r < R; ++r) act_t4_row(buffer + r * pairs, K / 128, steps_buffer + r * (K / 128));
    return (Acts){buffer, K % 128 == 0 ? steps_buffer : NULL};
}

/* OUT [R, (K + 63) / 64 * 64] = X's rows as the int8 kernels see them (q * dx per element): for the tests. */
void int8_activations(const float* X, int64_t R, int64_t K, float* OUT) {
    const int64_t pairs = (K + 63) / 64;
    const ActPair* a = thread_act(X, R, K).pairs;
    for (int64_t r = 0; r < R; ++r)
        for (int64_t p = 0; p < pairs; ++p)
            for (int e = 0; e < 64; ++e) OUT[(r * pairs + p) * 64 + e] = (float)a[r * pairs + p].q[e] * a[r * pairs + p].dx[e / 32 * 8];
}

/* Bytes of one row of K weights of a kind (0 for a kind not served, or K not a multiple of its block). */
int64_t kind_row_bytes(int kind, int64_t K) {
    switch (kind) {
        case KIND_F32: return 4 * K;
        case KIND_BF16: return 2 * K;
        case KIND_Q8_0: return K % 32 ? 0 : K / 32 * 34;
        case KIND_Q8_0_R4: case KIND_Q5_R4: case KIND_Q4K_R4: return K % 128 ? 0 : K / 128 * repacked_unit_bytes(kind) / 4;
        case KIND_Q6K_R4: return K % 64 ? 0 : K / 64 * repacked_unit_bytes(kind) / 4;
        case KIND_Q5_0: return K % 32 ? 0 : K / 32 * 22;
        case KIND_Q4_K: return K % 256 ? 0 : K / 256 * 144;
        case KIND_Q6_K: return K % 256 ? 0 : K / 256 * 210;
        default: return 0;
    }
}

typedef void (*QRange)(const float*, const uint8_t*, int64_t, const float*, float*, const int64_t*, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t);

static QRange quant_range(int kind, int wide) {
    switch (kind) {
        case KIND_Q8_0: return wide ? q512range_q8_0 : qrange_q8_0;
        case KIND_Q5_0: return wide ? q512range_q5_0 : qrange_q5_0;
        case KIND_Q4_K: return wide ? q512range_q4_k : qrange_q4_k;
        case KIND_Q6_K: return wide ? q512range_q6_k : qrange_q6_k;
        default: return NULL;
    }
}

/* Thread t of T's share of O [rows, N] = X [R, K] @ W^T (+ BIAS [N]): W's 4-row blocks, counted across its parts,
   split evenly over the threads; each part in its kind's kernel. A one-part float32 / bf16 weight goes to
   kernels.c's float_part. A quantized kind's variant (AVX2 or AVX-512) depends on the CPU (WIDE) alone. */
void weight_part(const Weight* W, int wide, const float* X, const float* BIAS, float* O, const int64_t* ROWS,
                 int64_t R, int64_t K, int64_t N, int t, int T) {
    if (W->parts == 1 && (W->kind[0] == KIND_F32 || W->kind[0] == KIND_BF16)) {
        float_part(W->kind[0] == KIND_BF16, wide & WIDE_AVX512, X, W->data[0], BIAS, O, ROWS, R, K, N, t, T);
        return;
    }
    int repacked = 0;
    for (int p = 0; p < W->parts; ++p) repacked |= W->kind[p] >= KIND_Q8_0_R4;
    const Acts acts = (wide & WIDE_VNNI) || repacked ? thread_act(X, R, K) : (Acts){NULL, NULL};  /* repacked kinds exist only with VNNI */
    int64_t blocks = 0;
    for (int p = 0; p < W->parts; ++p) blocks += (W->rows[p] + 3) / 4;
    const int64_t lo = blocks * t / T, hi = blocks * (t + 1) / T;
    int64_t first = 0, n0 = 0;  /* the part's first block and first output column */
    for (int p = 0; p < W->parts; ++p) {
        const int64_t count = (W->rows[p] + 3) / 4;
        const int64_t b_lo = lo > first ? lo - first : 0, b_hi = hi < first + count ? hi - first : count;
        if (b_lo < b_hi && acts.pairs) {
            const I8Range range = int8_range(W->kind[p]);
            if (range) range(&acts, (K + 63) / 64, (const uint8_t*)W->data[p], kind_row_bytes(W->kind[p], K), BIAS, O, ROWS,
                             R, K, N, n0, W->rows[p], b_lo, b_hi);
        } else if (b_lo < b_hi) {
            const QRange range = quant_range(W->kind[p], wide & WIDE_AVX512);
            if (range) range(X, (const uint8_t*)W->data[p], kind_row_bytes(W->kind[p], K), BIAS, O, ROWS, R, K, N, n0,
                             W->rows[p], b_lo, b_hi);
        }
        first += count;
        n0 += W->rows[p];
    }
}

/* O [rows, N] = X [R, K] @ W^T for any Weight (parts of float32, bf16 or quantized rows), W's blocks split over
   `threads` OpenMP threads; ROWS as in skinny. */
void weight_product(const float* X, const Weight* W, float* O, const int64_t* ROWS, int64_t R, int64_t K, int64_t N,
                    int wide, int threads) {
    #pragma omp parallel num_threads(threads)
    weight_part(W, wide, X, NULL, O, ROWS, R, K, N, omp_get_thread_num(), omp_get_num_threads());
}

/* OUT [R, K] = rows IDX[r] (IDX NULL: row r) of one quantized part, dequantized (as ggml does it), split over
   `threads`: the embedding lookup of a quantized table, and the float32 chunks of a prefill's product. */
void dequantize_rows(const void* DATA, int kind, int64_t K, const int64_t* IDX, int64_t R, float* OUT, int threads) {
    const int64_t row_bytes = kind_row_bytes(kind, K);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        const int64_t index = IDX ? IDX[r] : r;
        const uint8_t* row = (const uint8_t*)DATA + index * row_bytes;
        float* out = OUT + r * K;
        if (kind >= KIND_Q8_0_R4) {
            const int64_t width = kind == KIND_Q6K_R4 ? 64 : 128;
            for (int64_t u = 0; u < K / width; ++u)
                repacked_row_unit(kind, (const uint8_t*)DATA + (index / 4) * 4 * row_bytes, u, (int)(index % 4), out + width * u);
            continue;
        }
        for (int64_t g = 0; g < K / 32; ++g) {
            __m256 v[4];
            switch (kind) {
                case KIND_Q8_0: widen8(group_q8_0(row, g), 0, v); break;
                case KIND_Q5_0: widen8(group_q5_0(row, g), 0, v); break;
                case KIND_Q4_K: widen8(group_q4_k(row, g), 1, v); break;
                case KIND_Q6_K: widen8(group_q6_k(row, g), 0, v); break;
                default: for (int u = 0; u < 4; ++u) v[u] = _mm256_set1_ps(NAN); break;
            }
            for (int u = 0; u < 4; ++u) _mm256_storeu_ps(out + 32 * g + 8 * u, v[u]);
        }
    }
}

/* The layout of a struct the Python side mirrors with ctypes: OUT[0] = sizeof, OUT[1..] = each field's offset in
   declaration order (a Weight field counts once). Returns the number of values written, or -1 for an unknown
   name or too small a CAPACITY. specgate.models.native compares them with its ctypes mirrors at load. */
int64_t specgate_struct_layout(const char* name, int64_t* OUT, int64_t capacity) {
#define FIELD(S, F) offsetof(S, F)
    static const int64_t weight[] = {sizeof(Weight), FIELD(Weight, data), FIELD(Weight, rows), FIELD(Weight, kind), FIELD(Weight, parts)};
    static const int64_t layer[] = {sizeof(Layer), FIELD(Layer, wqkv), FIELD(Layer, bqkv), FIELD(Layer, wo), FIELD(Layer, bo),
        FIELD(Layer, wgu), FIELD(Layer, bgu), FIELD(Layer, wd), FIELD(Layer, bd), FIELD(Layer, norm_in), FIELD(Layer, norm_attn),
        FIELD(Layer, norm_pre_ff), FIELD(Layer, norm_post_ff), FIELD(Layer, q_norm), FIELD(Layer, k_norm),
        FIELD(Layer, inv_freq), FIELD(Layer, window), FIELD(Layer, scale)};
    static const int64_t config[] = {sizeof(Config), FIELD(Config, hidden), FIELD(Config, heads), FIELD(Config, kv_heads),
        FIELD(Config, head_dim), FIELD(Config, intermediate), FIELD(Config, eps), FIELD(Config, gemma), FIELD(Config, act),
        FIELD(Config, wide)};
#undef FIELD
    const int64_t* values = NULL;
    int64_t count = 0;
    if (!strcmp(name, "Weight")) values = weight, count = sizeof weight / sizeof *weight;
    else if (!strcmp(name, "Layer")) values = layer, count = sizeof layer / sizeof *layer;
    else if (!strcmp(name, "Config")) values = config, count = sizeof config / sizeof *config;
    if (!values || count > capacity) return -1;
    for (int64_t i = 0; i < count; ++i) OUT[i] = values[i];
    return count;
}
