/* Shared declarations of specgate's C kernels (kernels.c: float32 / bf16 products, norms, attention, the decoder
   stack; quant.c: products over GGUF block-quantized weights). Built into one shared library by
   specgate.models.native, which mirrors the structs below with ctypes and checks the mirrors against
   specgate_struct_layout at load. */
#ifndef SPECGATE_H
#define SPECGATE_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#define PREFETCH_ROWS 8  /* rows of W ahead (two 4-row blocks) that a block asks the cache for */

/* What one part of a weight holds, per row of K elements. The quantized kinds keep ggml's type numbers and its
   block layouts (ggml-common.h), read as the GGUF ships them. */
enum {
    KIND_F32 = 0,   /* float32 [K] */
    KIND_BF16 = 1,  /* bfloat16 [K] (specgate's own number; ggml's BF16 is 30) */
    KIND_Q5_0 = 6,  /* K / 32 blocks of 22 bytes: fp16 scale, 32 high bits, 16 bytes of low nibbles */
    KIND_Q8_0 = 8,  /* K / 32 blocks of 34 bytes: fp16 scale, 32 int8 */
    KIND_Q4_K = 12, /* K / 256 blocks of 144 bytes: fp16 scale and min, 12 bytes of 6-bit sub-scales, 128 of nibbles */
    KIND_Q6_K = 14, /* K / 256 blocks of 210 bytes: 128 low nibbles, 64 of 2-bit highs, 16 int8 sub-scales, fp16 scale */
    /* specgate's own numbers: GGUF kinds rearranged at load for the int8 kernels, 4 rows interleaved (quant.c) */
    KIND_Q8_0_R4 = 108, /* Q8_0 (same size) */
    KIND_Q5_R4 = 109,   /* Q5_0 (same size) */
    KIND_Q4K_R4 = 110,  /* Q4_K (1.33x: float32 scales and offsets per 32) */
    KIND_Q6K_R4 = 111,  /* Q6_K (1.22x: float32 scales per 16) */
};

/* The `wide` argument of the products (and Config.wide): bits of what the CPU has, decided by it alone (never by R). */
#define WIDE_AVX512 1 /* AVX-512 float32 products (avx512f, avx512bw) */
#define WIDE_VNNI 2   /* quantized weights: int8 activations and integer dot products (avx512vnni, avx512vl) */
#define WIDE_ATTN 4   /* the decoder stack's attention in its AVX-512 variant (kernels.c attend_head16) */

#define WEIGHT_PARTS 4

/* A weight [N, K] as up to WEIGHT_PARTS row blocks, each of its own kind (a fused q/k/v product whose parts the
   GGUF quantized differently). Part p's rows are data[p] ([rows[p], K] in its kind's layout); N = sum rows[p].
   The parts of a quantized weight have rows % 4 == 0. */
typedef struct {
    const void* data[WEIGHT_PARTS];
    int64_t rows[WEIGHT_PARTS];
    int32_t kind[WEIGHT_PARTS];
    int32_t parts;
} Weight;

/* One decoder layer's weights for decode_layers (specgate.models.native.DecodeStack mirrors it with ctypes).
   Biases and norm scales float32 or NULL. */
typedef struct {
    Weight wqkv; const float* bqkv;  /* fused q/k/v [(HQ + 2 HKV) D, H] */
    Weight wo; const float* bo;      /* o [H, HQ D] */
    Weight wgu; const float* bgu;    /* fused gate/up [2 I, H] */
    Weight wd; const float* bd;      /* down [H, I] */
    const float* norm_in;            /* input norm [H] */
    const float* norm_attn;          /* Gemma: norm of the attention output; Llama: the pre-MLP norm */
    const float* norm_pre_ff;        /* Gemma: pre-MLP norm (NULL elsewhere) */
    const float* norm_post_ff;       /* Gemma: norm of the MLP output (NULL elsewhere) */
    const float* q_norm; const float* k_norm;  /* [D] or NULL */
    const float* inv_freq;           /* [D / 2] */
    int64_t window;                  /* sliding window, 0 = full attention */
    float scale;                     /* multiplies q . k */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    int32_t gemma;  /* Gemma-3 residuals: x += norm(sublayer(x)) (else x += sublayer(x)) */
    int32_t act;    /* 0 silu, 1 tanh gelu */
    int32_t wide;   /* WIDE_* bits: AVX-512 products where the CPU has them (K % 16 == 0), int8 activations, attention */
} Config;

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* kernels.c: thread t of T's share of a float32 / bf16 product (4-row blocks of W split evenly). */
void float_part(int bf16, int wide, const float* X, const void* W, const float* BIAS, float* O, const int64_t* ROWS,
                int64_t R, int64_t K, int64_t N, int t, int T);
/* quant.c: thread t of T's share of O [rows, N] = X [R, K] @ W^T (+ BIAS) for any Weight. */
void weight_part(const Weight* W, int wide, const float* X, const float* BIAS, float* O, const int64_t* ROWS,
                 int64_t R, int64_t K, int64_t N, int t, int T);

#endif
