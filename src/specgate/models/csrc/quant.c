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

/* Two 32-blocks of one row of x as the int8 kernels read them (384 bytes, 64-byte aligned). */
typedef struct {
    int8_t q[64];
    float dx[16];     /* lanes 0-7 block 2p's scale, 8-15 block 2p+1's */
    int32_t corr[16];   /* -128 * (sum of the 4 q bytes lane k covers): weights fed as q + 128 */
    int32_t corr16[16]; /* -16 * that sum: Q5_R4's q + 16 */
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
        _mm512_store_si512((__m512i*)a->corr16, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(psum, 4)));
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

/* Weights repacked at load for the int8 kernels (rows % 4 == 0, K % 64 == 0; an exact rearrangement): each 4-row
   block is one stream of K / 64 pairs of groups; in a pair, row j's 64 quants come as the kernel feeds them
   (unsigned: q + 128, q + 16, q + 32 or Q4_K's own q, the offset taken back by the activation's corr), then the
   pair's scales. A thread reads one sequential stream instead of four row streams, and decoding 64 weights
   costs at most a few byte operations, not the per-group unpacking of the GGUF layouts.
   - KIND_Q8_0_R4 (272 bytes a pair, Q8_0's size): 4 x 64 bytes q ^ 0x80; 8 fp16 scales (row j: 2j, 2j + 1).
   - KIND_Q5_R4 (176, Q5_0's size): 4 x 32 bytes of nibbles (weight e's low nibble, weight e + 32's high), 4 x 8
     bytes of fifth bits (bit e: weight e), 8 fp16 scales. q + 16 in 0..31.
   - KIND_Q4K_R4 (192, 1.33x Q4_K): 4 x 32 bytes of nibbles (Q4_K's own), 8 float32 scales d x sc and 8 offsets
     dmin x m (row j: 2j, 2j + 1).
   - KIND_Q6K_R4 (256, 1.22x Q6_K): 4 x 32 bytes of nibbles, 4 x 16 bytes of the 2 high bits (byte k, bits 2L:
     weight k + 16 L), 16 float32 scales d x sc per 16 weights (row j: 4j .. 4j + 3). q + 32 in 0..63.
   Each scale is the product ggml's dequantization forms (exact in float32), so a weight is ggml's value. */
static inline VNNI __m512 r4_pair_scales(__m512 all8, int j) {  /* [s_2j x 8, s_2j+1 x 8] */
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_set1_epi32(2 * j));
    return _mm512_permutexvar_ps(idx, all8);
}

static inline VNNI __m512 scales_fp16(const uint8_t* at, int j) {
    return r4_pair_scales(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)at))), j);
}

static inline VNNI __m512 scales_f32(const uint8_t* at, int j) {
    return r4_pair_scales(_mm512_castps256_ps512(_mm256_loadu_ps((const float*)at)), j);
}

static inline VNNI __m512 scales_quarters(const uint8_t* at, int j) {  /* [s_4j x 4, .., s_4j+3 x 4] */
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_set1_epi32(4 * j));
    return _mm512_permutexvar_ps(idx, _mm512_loadu_ps((const float*)at));
}

static inline VNNI __m512i nibbles64(const uint8_t* at) {  /* 32 bytes -> 64: low nibbles, then high nibbles */
    const __m256i v = _mm256_loadu_si256((const __m256i*)at);
    return _mm512_inserti64x4(_mm512_castsi256_si512(low_nibbles(v)), high_nibbles(v), 1);
}

static inline VNNI __m512i u_q8(const uint8_t* b, int j) { return _mm512_loadu_si512((const void*)(b + 64 * j)); }

static inline VNNI __m512i u_q5(const uint8_t* b, int j) {
    uint64_t bits;
    memcpy(&bits, b + 128 + 8 * j, sizeof bits);
    return _mm512_or_si512(nibbles64(b + 32 * j), _mm512_maskz_mov_epi8((__mmask64)bits, _mm512_set1_epi8(0x10)));
}

static inline VNNI __m512i u_q4k(const uint8_t* b, int j) { return nibbles64(b + 32 * j); }

static inline VNNI __m512i u_q6k(const uint8_t* b, int j) {
    /* the 16 bytes in each 128-bit lane L; bits 2L, 2L + 1 moved to bits 4, 5 (16-bit shifts; the bits they carry
       across a byte land outside 4..5 and are masked) */
    const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 128 + 16 * j)));
    const __m512i left = _mm512_sllv_epi16(h, _mm512_set_epi64(0, 0, 0, 0, 0x0002000200020002, 0x0002000200020002, 0x0004000400040004, 0x0004000400040004));
    const __m512i right = _mm512_srlv_epi16(h, _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0, 0, 0));
    const __m512i high = _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, left, right), _mm512_set1_epi8(0x30));
    return _mm512_or_si512(nibbles64(b + 32 * j), high);
}

#define SC_Q8(b, j) scales_fp16(b + 256, j)
#define SC_Q5(b, j) scales_fp16(b + 160, j)
#define SC_Q4K(b, j) scales_f32(b + 128, j)
#define SC_Q6K(b, j) scales_quarters(b + 192, j)

/* RR rows of x times one 4-row block of a repacked kind: per pair and weight row, one decode, then per row of x
   one vpdpbusd (started at the activation's correction CORR, or 0) and one FMA (plus Q4_K's offset). */
#define R4BLOCK(NAME, RR, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET)                                        \
static VNNI void NAME##_##RR(const ActPair* xa, int64_t pairs, const uint8_t* w, const float* bias,      \
                             float* const* o, int64_t n) {                                                \
    __m512 acc[RR][4];                                                                                    \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();              \
    for (int64_t p = 0; p < pairs; ++p) {                                                                 \
        const uint8_t* b = w + p * PAIR_BYTES;                                                            \
        for (int line = 0; line < PAIR_BYTES; line += 64)                                                 \
            _mm_prefetch((const char*)(b + 4 * PAIR_BYTES * pairs * I8_PREFETCH_BLOCKS + line), _MM_HINT_T0); \
        for (int j = 0; j < 4; ++j) {                                                                     \
            const __m512i u = DECODE(b, j);                                                               \
            const __m512 scale = SCALES(b, j);                                                            \
            const __m512 off = OFFSET ? scales_f32(b + 160, j) : _mm512_setzero_ps();                     \
            for (int i = 0; i < RR; ++i) {                                                                \
                const ActPair* a = xa + i * pairs + p;                                                    \
                const __m512 dx = _mm512_load_ps(a->dx);                                                  \
                const __m512i dot = _mm512_dpbusd_epi32(CORR, u, _mm512_load_si512((const __m512i*)a->q)); \
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, dx), acc[i][j]); \
                if (OFFSET) acc[i][j] = _mm512_fnmadd_ps(_mm512_mul_ps(off, dx), _mm512_load_ps(a->psum), acc[i][j]); \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < RR; ++i) for (int j = 0; j < 4; ++j)                                              \
        o[i][n + j] = bias ? _mm512_reduce_add_ps(acc[i][j]) + bias[n + j] : _mm512_reduce_add_ps(acc[i][j]); \
}

typedef void R4Block(const ActPair*, int64_t, const uint8_t*, const float*, float* const*, int64_t);

#define R4KIND(NAME, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET)                                             \
R4BLOCK(NAME, 1, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET) R4BLOCK(NAME, 2, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET) \
R4BLOCK(NAME, 3, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET) R4BLOCK(NAME, 4, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET) \
R4BLOCK(NAME, 5, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET) R4BLOCK(NAME, 6, PAIR_BYTES, DECODE, SCALES, CORR, OFFSET) \
static R4Block* const NAME##_blocks[7] = {NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};
R4KIND(r4q8, 272, u_q8, SC_Q8, _mm512_load_si512((const __m512i*)a->corr), 0)
R4KIND(r4q5, 176, u_q5, SC_Q5, _mm512_load_si512((const __m512i*)a->corr16), 0)
R4KIND(r4q4k, 192, u_q4k, SC_Q4K, _mm512_setzero_si512(), 1)
R4KIND(r4q6k, 256, u_q6k, SC_Q6K, _mm512_load_si512((const __m512i*)a->corr32), 0)

/* The 4-row blocks b_lo..b_hi-1 of a repacked part (whose first row is column N0 of O [rows, N]). */
static VNNI void r4_range(R4Block* const* blocks, const ActPair* XA, int64_t pairs, const uint8_t* W, int64_t row_bytes,
                          const float* BIAS, float* O, const int64_t* ROWS, int64_t R, int64_t N, int64_t N0,
                          int64_t b_lo, int64_t b_hi) {
    for (int64_t b = b_lo; b < b_hi; ++b) {
        for (int64_t r = 0; r < R; r += 6) {
            float* out[6];
            blocks[six_rows(out, O, ROWS, r, R, N)](XA + r * pairs, pairs, W + b * 4 * row_bytes, BIAS, out, N0 + b * 4);
        }
    }
}

#define R4RANGE(NAME)                                                                                     \
static VNNI void NAME##_range(const ActPair* XA, int64_t pairs, const uint8_t* W, int64_t row_bytes,     \
                              const float* BIAS, float* O, const int64_t* ROWS, int64_t R, int64_t K,     \
                              int64_t N, int64_t N0, int64_t rows, int64_t b_lo, int64_t b_hi) {          \
    (void)K, (void)rows;                                                                                  \
    r4_range(NAME##_blocks, XA, pairs, W, row_bytes, BIAS, O, ROWS, R, N, N0, b_lo, b_hi);                \
}
R4RANGE(r4q8)
R4RANGE(r4q5)
R4RANGE(r4q4k)
R4RANGE(r4q6k)

static int r4_pair_bytes(int kind) {
    switch (kind) {
        case KIND_Q8_0_R4: return 272;
        case KIND_Q5_R4: return 176;
        case KIND_Q4K_R4: return 192;
        case KIND_Q6K_R4: return 256;
        default: return 0;
    }
}

static float f32_at(const uint8_t* at) {
    float v;
    memcpy(&v, at, sizeof v);
    return v;
}

/* Row j of a repacked 4-row block's pair p as 64 floats (the embedding lookup and a prefill's chunks). */
static void r4_row_pair(int kind, const uint8_t* block, int64_t p, int j, float* out) {
    const uint8_t* b = block + p * r4_pair_bytes(kind);
    for (int e = 0; e < 64; ++e) {
        const int nibble = e < 32 ? b[32 * j + e] & 0x0F : b[32 * j + e - 32] >> 4;
        switch (kind) {
            case KIND_Q8_0_R4: out[e] = (float)(int8_t)(b[64 * j + e] ^ 0x80) * fp16(b + 256 + 4 * j + 2 * (e / 32)); break;
            case KIND_Q5_R4: out[e] = (float)((nibble | ((b[128 + 8 * j + e / 8] >> (e % 8)) & 1) << 4) - 16) * fp16(b + 160 + 4 * j + 2 * (e / 32)); break;
            case KIND_Q4K_R4: out[e] = f32_at(b + 128 + 4 * (2 * j + e / 32)) * (float)nibble - f32_at(b + 160 + 4 * (2 * j + e / 32)); break;
            default: out[e] = f32_at(b + 192 + 4 * (4 * j + e / 16)) * (float)((nibble | ((b[128 + 16 * j + e % 16] >> (2 * (e / 16))) & 3) << 4) - 32); break;
        }
    }
}

int64_t kind_row_bytes(int kind, int64_t K);

/* Row j's pair p of a Q5_0 / Q4_K / Q6_K row into a repacked pair at d (the layouts above). */
static void repack_row_pair(int kind, const uint8_t* row, int64_t p, int j, uint8_t* d) {
    int8_t q[64];
    float scales[4], offsets[2];
    for (int h = 0; h < 2; ++h) {
        const Group g = kind == KIND_Q5_0 ? group_q5_0(row, 2 * p + h) : kind == KIND_Q6_K ? group_q6_k(row, 2 * p + h) : group_q4_k(row, 2 * p + h);
        _mm256_storeu_si256((__m256i*)(q + 32 * h), g.q);
        scales[2 * h] = g.s_lo, scales[2 * h + 1] = g.s_hi, offsets[h] = g.off;
    }
    const int bias = kind == KIND_Q5_0 ? 16 : kind == KIND_Q6_K ? 32 : 0;
    for (int e = 0; e < 32; ++e) d[32 * j + e] = (uint8_t)(((q[e] + bias) & 0x0F) | ((q[e + 32] + bias) & 0x0F) << 4);
    if (kind == KIND_Q5_0) {
        uint64_t bits = 0;
        for (int e = 0; e < 64; ++e) bits |= (uint64_t)((q[e] + 16) >> 4 & 1) << e;
        memcpy(d + 128 + 8 * j, &bits, sizeof bits);
        for (int h = 0; h < 2; ++h) memcpy(d + 160 + 4 * j + 2 * h, row + (2 * p + h) * 22, 2);  /* the raw fp16 d */
    } else if (kind == KIND_Q4_K) {
        memcpy(d + 128 + 4 * 2 * j, (float[]){scales[0], scales[2]}, 8);
        memcpy(d + 160 + 4 * 2 * j, offsets, 8);
    } else {
        for (int k = 0; k < 16; ++k) {
            uint8_t v = 0;
            for (int L = 0; L < 4; ++L) v |= (uint8_t)(((q[k + 16 * L] + 32) >> 4 & 3) << (2 * L));
            d[128 + 16 * j + k] = v;
        }
        memcpy(d + 192 + 16 * j, scales, sizeof scales);
    }
}

/* A Q5_0 / Q4_K / Q6_K matrix rearranged into its repacked kind ([rows, K / 64 * pair bytes / 4] bytes). */
void repack_r4(const uint8_t* SRC, int kind, int64_t rows, int64_t K, uint8_t* DST, int threads) {
    const int64_t row_bytes = kind_row_bytes(kind, K), pairs = K / 64;
    const int packed = kind == KIND_Q5_0 ? KIND_Q5_R4 : kind == KIND_Q4_K ? KIND_Q4K_R4 : KIND_Q6K_R4;
    const int64_t pair_bytes = r4_pair_bytes(packed);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < rows / 4; ++blk)
        for (int64_t p = 0; p < pairs; ++p)
            for (int j = 0; j < 4; ++j)
                repack_row_pair(kind, SRC + (blk * 4 + j) * row_bytes, p, j, DST + (blk * pairs + p) * pair_bytes);
}

/* A Q8_0 matrix [rows, K / 32 * 34] (rows % 4 == 0, K % 64 == 0) rearranged into Q8_0_R4, same size. */
void repack_q8_0_r4(const uint8_t* SRC, int64_t rows, int64_t K, uint8_t* DST, int threads) {
    const int64_t row_bytes = K / 32 * 34, pairs = K / 64;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < rows / 4; ++blk) {
        for (int64_t p = 0; p < pairs; ++p) {
            uint8_t* d = DST + blk * 4 * row_bytes + p * 272;
            for (int j = 0; j < 4; ++j) {
                const uint8_t* s = SRC + (blk * 4 + j) * row_bytes + p * 68;
                for (int h = 0; h < 2; ++h) {
                    memcpy(d + 256 + 4 * j + 2 * h, s + 34 * h, 2);
                    for (int e = 0; e < 32; ++e) d[64 * j + 32 * h + e] = s[34 * h + 2 + e] ^ 0x80;
                }
            }
        }
    }
}

typedef void (*I8Range)(const ActPair*, int64_t, const uint8_t*, int64_t, const float*, float*, const int64_t*, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

static I8Range int8_range(int kind) {
    switch (kind) {
        case KIND_Q8_0: return i8range_q8_0;
        case KIND_Q5_0: return i8range_q5_0;
        case KIND_Q4_K: return i8range_q4_k;
        case KIND_Q6_K: return i8range_q6_k;
        case KIND_Q8_0_R4: return r4q8_range;
        case KIND_Q5_R4: return r4q5_range;
        case KIND_Q4K_R4: return r4q4k_range;
        case KIND_Q6K_R4: return r4q6k_range;
        default: return NULL;
    }
}

/* This thread's quantized copy of X [R, K] (each thread quantizes all R rows itself: no barrier, and a row's
   bytes never depend on the split). The buffer grows as needed and is kept for the thread's next call. */
static ActPair* thread_act(const float* X, int64_t R, int64_t K) {
    static __thread ActPair* buffer = NULL;
    static __thread int64_t capacity = 0;
    const int64_t pairs = (K + 63) / 64, need = R * pairs;
    if (need > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)need * sizeof(ActPair));
        capacity = buffer ? need : 0;
        if (!buffer) return NULL;
    }
    for (int64_t r = 0; r < R; ++r) quantize_act_row(X + r * K, K, buffer + r * pairs);
    return buffer;
}

/* OUT [R, (K + 63) / 64 * 64] = X's rows as the int8 kernels see them (q * dx per element): for the tests. */
void int8_activations(const float* X, int64_t R, int64_t K, float* OUT) {
    const int64_t pairs = (K + 63) / 64;
    const ActPair* a = thread_act(X, R, K);
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
        case KIND_Q8_0_R4: return K % 64 ? 0 : K / 32 * 34;
        case KIND_Q5_R4: case KIND_Q4K_R4: case KIND_Q6K_R4: return K % 64 ? 0 : K / 64 * r4_pair_bytes(kind) / 4;
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
    const ActPair* xa = (wide & WIDE_VNNI) || repacked ? thread_act(X, R, K) : NULL;  /* repacked kinds exist only with VNNI */
    int64_t blocks = 0;
    for (int p = 0; p < W->parts; ++p) blocks += (W->rows[p] + 3) / 4;
    const int64_t lo = blocks * t / T, hi = blocks * (t + 1) / T;
    int64_t first = 0, n0 = 0;  /* the part's first block and first output column */
    for (int p = 0; p < W->parts; ++p) {
        const int64_t count = (W->rows[p] + 3) / 4;
        const int64_t b_lo = lo > first ? lo - first : 0, b_hi = hi < first + count ? hi - first : count;
        if (b_lo < b_hi && xa) {
            const I8Range range = int8_range(W->kind[p]);
            if (range) range(xa, (K + 63) / 64, (const uint8_t*)W->data[p], kind_row_bytes(W->kind[p], K), BIAS, O, ROWS,
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
            for (int64_t p = 0; p < K / 64; ++p) r4_row_pair(kind, (const uint8_t*)DATA + (index / 4) * 4 * row_bytes, p, (int)(index % 4), out + 64 * p);
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
