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
            for (int i = 0; i < 6 && r + i < R; ++i) out[i] = O + (ROWS ? ROWS[r + i] : r + i) * N;       \
            const float* x = X + r * K;                                                                   \
            switch (R - r >= 6 ? 6 : R - r) {                                                             \
                case 6: q512_##KIND##_6(r == 0, x, w, row_bytes, BIAS, K, out, n, nn); break;             \
                case 5: q512_##KIND##_5(r == 0, x, w, row_bytes, BIAS, K, out, n, nn); break;             \
                case 4: q512_##KIND##_4(r == 0, x, w, row_bytes, BIAS, K, out, n, nn); break;             \
                case 3: q512_##KIND##_3(r == 0, x, w, row_bytes, BIAS, K, out, n, nn); break;             \
                case 2: q512_##KIND##_2(r == 0, x, w, row_bytes, BIAS, K, out, n, nn); break;             \
                default: q512_##KIND##_1(r == 0, x, w, row_bytes, BIAS, K, out, n, nn); break;            \
            }                                                                                             \
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

/* Bytes of one row of K weights of a kind (0 for a kind not served, or K not a multiple of its block). */
int64_t kind_row_bytes(int kind, int64_t K) {
    switch (kind) {
        case KIND_F32: return 4 * K;
        case KIND_BF16: return 2 * K;
        case KIND_Q8_0: return K % 32 ? 0 : K / 32 * 34;
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
        float_part(W->kind[0] == KIND_BF16, wide, X, W->data[0], BIAS, O, ROWS, R, K, N, t, T);
        return;
    }
    int64_t blocks = 0;
    for (int p = 0; p < W->parts; ++p) blocks += (W->rows[p] + 3) / 4;
    const int64_t lo = blocks * t / T, hi = blocks * (t + 1) / T;
    int64_t first = 0, n0 = 0;  /* the part's first block and first output column */
    for (int p = 0; p < W->parts; ++p) {
        const int64_t count = (W->rows[p] + 3) / 4;
        const int64_t b_lo = lo > first ? lo - first : 0, b_hi = hi < first + count ? hi - first : count;
        if (b_lo < b_hi) {
            const QRange range = quant_range(W->kind[p], wide);
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
        const uint8_t* row = (const uint8_t*)DATA + (IDX ? IDX[r] : r) * row_bytes;
        float* out = OUT + r * K;
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
