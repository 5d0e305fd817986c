/* The exact verifier's temperature-only step read straight from the target's logits (the native path of
   specgate.sampling.verifier.rejection_sample_logits, which documents the semantics and the random draws):

     for i = 0 .. n-1:  accept draft x_i iff u_i * q_i(x_i) < p_i(x_i), p_i = softmax(logits_i / T) in float64;
     at the first rejection i: one token from the normalised residual (p_i - q_i)+ (p_i where it is all zero);
     all n accepted: one bonus token from p_n.

   Per position it makes one pass over the V logits (the softmax normaliser, with the exp row kept in a scratch
   row), and one more over the scratch row to sample: the torch path's max, chunked exp-sum, probability row and
   residual chunks took ~3 ms a step on Gemma's 262,144-token vocabulary; this takes a few tenths. q comes dense
   (SUPPORT NULL, K = V) or on K columns (q[SUPPORT[j]] += Q[j], duplicates adding up), so the EAGLE head's q over
   its 12,288-token map never becomes a 262,144-wide row. The sampling is the same two-level inverse CDF (block
   totals of 512 tokens in float32, accumulated in float64, then the float64 running sum inside the chosen block)
   and never emits a token whose mass is zero. */
#include "specgate.h"

#define VERIFY_BLOCK 512 /* tokens per block of the two-level inverse CDF (verifier.BLOCK_SIZE) */

/* exp(x) for 8 floats, and exactly 0 below exp8's clamp: a -inf logit is a zero probability and must stay one. */
static inline __m256 exp8_or_zero(__m256 x) {
    return _mm256_and_ps(exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ));
}

static inline float exp1_or_zero(float x) { return x < -87.3f ? 0.0f : expf(x); }

/* E[k] = exp((x[k] - m) / T) for k < V (inv_t = 1 / T); returns sum_k E[k]: float32 lanes within each block of
   VERIFY_BLOCK tokens, the blocks added in float64. */
static double exp_row(const float* x, int64_t V, float m, float inv_t, float* E) {
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
    double total = 0.0;
    for (int64_t start = 0; start < V; start += VERIFY_BLOCK) {
        const int64_t stop = start + VERIFY_BLOCK < V ? start + VERIFY_BLOCK : V;
        __m256 acc = _mm256_setzero_ps();
        int64_t k = start;
        for (; k + 8 <= stop; k += 8) {
            const __m256 e = exp8_or_zero(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + k), vm), vt));
            _mm256_storeu_ps(E + k, e);
            acc = _mm256_add_ps(acc, e);
        }
        float tail = 0.0f;
        for (; k < stop; ++k) {
            E[k] = exp1_or_zero((x[k] - m) * inv_t);
            tail += E[k];
        }
        total += (double)(hsum(acc) + tail);
    }
    return total;
}

/* TOTALS[b] = the float32 sum of block b of E [V] (8 lanes), as float64; returns their float64 sum in block order. */
static double block_totals(const float* E, int64_t V, double* TOTALS) {
    double total = 0.0;
    for (int64_t start = 0, b = 0; start < V; start += VERIFY_BLOCK, ++b) {
        const int64_t stop = start + VERIFY_BLOCK < V ? start + VERIFY_BLOCK : V;
        __m256 acc = _mm256_setzero_ps();
        int64_t k = start;
        for (; k + 8 <= stop; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(E + k));
        float tail = 0.0f;
        for (; k < stop; ++k) tail += E[k];
        TOTALS[b] = (double)(hsum(acc) + tail);
        total += TOTALS[b];
    }
    return total;
}

/* One token from the unnormalised masses E [V] (block totals TOTALS, their sum total > 0) with the uniform u: the
   first token whose running mass exceeds u * total. The target stays below each level's total, so the chosen block
   and token have mass > 0. */
static int64_t inverse_cdf(const float* E, int64_t V, const double* TOTALS, double total, double u) {
    const int64_t blocks = (V + VERIFY_BLOCK - 1) / VERIFY_BLOCK;
    double target = u * total;
    if (target >= total) target = nextafter(total, 0.0);
    double before = 0.0;
    int64_t b = 0;
    while (b < blocks - 1 && !(before + TOTALS[b] > target)) before += TOTALS[b++];
    const int64_t start = b * VERIFY_BLOCK, stop = start + VERIFY_BLOCK < V ? start + VERIFY_BLOCK : V;
    double last = 0.0;
    for (int64_t k = start; k < stop; ++k) last += E[k];
    double offset = target - before > 0.0 ? target - before : 0.0;
    if (offset >= last) offset = nextafter(last, 0.0);
    double run = 0.0;
    for (int64_t k = start; k < stop; ++k) {
        run += E[k];
        if (run > offset) return k;
    }
    return stop - 1;
}

/* q_i(x) from Q [K] over SUPPORT [K] (NULL: the identity, K = V): the sum of the entries whose column is x. */
static double draft_prob(const float* Q, const int64_t* SUPPORT, int64_t K, int64_t x) {
    if (SUPPORT == NULL) return (double)Q[x];
    double q = 0.0;
    for (int64_t j = 0; j < K; ++j)
        if (SUPPORT[j] == x) q += (double)Q[j];
    return q;
}

/* E := (E - z q)+ with q = Q [K] over SUPPORT [K] (NULL: identity): the residual's masses in E's units (E = z p). */
static void subtract_draft(float* E, float z, const float* Q, const int64_t* SUPPORT, int64_t K) {
    for (int64_t j = 0; j < K; ++j) {
        const int64_t c = SUPPORT == NULL ? j : SUPPORT[j];
        const float r = E[c] - z * Q[j];
        E[c] = r > 0.0f ? r : 0.0f;
    }
}

/* One row: L [G + 1, V] logits, MAX [G + 1] their maxima, DRAFTS [n] (n <= G), Q [G, K] or NULL (q one-hot at each
   draft), AU [n] accept uniforms, su the sample uniform; E [V] and TOTALS [blocks] scratch. */
static void verify_row(const float* L, int64_t V, const float* MAX, double T, const int64_t* DRAFTS,
                       int64_t n, const float* Q, const int64_t* SUPPORT, int64_t K, const double* AU, double su,
                       float* E, double* TOTALS, int64_t* ACCEPTED, int64_t* TOKEN) {
    const float inv_t = (float)(1.0 / T);
    int64_t i = 0;
    double z = 0.0;
    for (; i < n; ++i) {
        const float* x = L + i * V;
        z = exp_row(x, V, MAX[i], inv_t, E);
        const int64_t d = DRAFTS[i];
        const double p_x = exp(((double)x[d] - (double)MAX[i]) / T - log(z));
        const double q_x = Q == NULL ? 1.0 : draft_prob(Q + i * K, SUPPORT, K, d);
        if (!(AU[i] * q_x < p_x)) break;
    }
    *ACCEPTED = i;
    if (i == n) {
        exp_row(L + i * V, V, MAX[i], inv_t, E);  /* every draft accepted: the bonus token from p_n */
    } else if (Q == NULL) {
        E[DRAFTS[i]] = 0.0f;  /* q one-hot at the draft: the residual is p without it */
    } else {
        subtract_draft(E, (float)z, Q + i * K, SUPPORT, K);
    }
    double total = block_totals(E, V, TOTALS);
    if (!(total > 0.0)) {  /* p == q: the residual is empty, nothing to correct; sample p */
        exp_row(L + i * V, V, MAX[i], inv_t, E);
        total = block_totals(E, V, TOTALS);
    }
    *TOKEN = inverse_cdf(E, V, TOTALS, total, su);
}

/* A ragged batch: L [B, P, V] logits (P = G + 1), MAX [B, P], DRAFTS [B, G], NDRAFTS [B] (0..G), Q [B, G, K] or NULL,
   SUPPORT [K] or NULL (K = V), AU [B, G], SU [B] -> ACCEPTED [B], TOKENS [B]. Scratch per thread: SCRATCH
   [threads, V] float32, TOTALS [threads, ceil(V / 512)] float64. */
void verify_rows(const float* L, int64_t B, int64_t P, int64_t V, const float* MAX, double T, const int64_t* DRAFTS,
                 const int64_t* NDRAFTS, const float* Q, const int64_t* SUPPORT, int64_t K, const double* AU,
                 const double* SU, int64_t* ACCEPTED, int64_t* TOKENS, float* SCRATCH, double* TOTALS, int threads) {
    const int64_t G = P - 1, blocks = (V + VERIFY_BLOCK - 1) / VERIFY_BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b) {
        const int64_t t = omp_get_thread_num();
        verify_row(L + b * P * V, V, MAX + b * P, T, DRAFTS + b * G, NDRAFTS[b], Q == NULL ? NULL : Q + b * G * K,
                   SUPPORT, K, AU + b * G, SU[b], SCRATCH + t * V, TOTALS + t * blocks, ACCEPTED + b, TOKENS + b);
    }
}
