/* The kernels of ops_body.h for AVX-512 (16 floats per vector): the portable bodies compiled
 * for this level, and attention's two inner loops written with intrinsics, which compute the
 * same float operations in the same order (lo_scores, lo_values), so the same bits. No FMA.
 * Runs only after lo_kernels_avx512() has checked the CPU.
 */
#include "ops_body.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET "avx512f,avx512vl,avx512dq,avx2"
#define AVX512 __attribute__((target(TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(TARGET)))

_Static_assert(LO_LANES == 16, "one vector holds the partial sums of a dot product");

/* Lane j of the result is lo_tree of acc[j] (the 16 partial sums of key j), for 16 keys at once:
 * the tree's halving steps (lane l + lane l+8, l+4, l+2, l+1) run on pairs of keys through
 * shuffles, then the lanes are put back in key order. */
AVX512_INLINE __m512 tree16(const __m512 acc[16]) {
    __m512 b[8], c[4], d[2];
    for (int m = 0; m < 8; m++) /* [q of key 2m | q of key 2m+1], q_l = p_l + p_l+8 */
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; m++) /* 128-bit blocks: r of keys 4m .. 4m+3, r_l = q_l + q_l+4 */
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; m++) /* block i: [s0, s1 of key 8m+i, s0, s1 of key 8m+4+i], s_l = r_l + r_l+2 */
        d[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xEE));
    /* block i: keys i, i+4, i+8, i+12 (s0 + s1) */
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}

/* lo_scores, 16 keys at a time, every KV head and row of those keys before the next ones (a
 * partial block reads its last key again and drops it). */
static AVX512 void scores_avx512(const lo_attention_args *a, const float *q, const float *k, int64_t n, int64_t t,
                                 int64_t rows, float *scores) {
    const int64_t g = a->h / a->kh, d = a->d;
    const __mmask16 tail = (__mmask16)((1u << (d % 16)) - 1);
    const __m512 scale = _mm512_set1_ps((float)a->scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t keys = n - j0 < 16 ? n - j0 : 16;
        const __mmask16 stored = (__mmask16)((1u << keys) - 1);
        for (int64_t kv = 0; kv < a->kh; kv++) {
            const float *key[16];
            for (int jj = 0; jj < 16; jj++) key[jj] = k + (j0 + (jj < keys ? jj : keys - 1)) * a->k_s0 + kv * a->k_s1;
            for (int64_t i = 0; i < rows; i++)
                for (int64_t h = kv * g; h < (kv + 1) * g; h++) {
                    const float *qh = q + i * a->q_s0 + h * a->q_s1;
                    __m512 acc[16];
                    for (int jj = 0; jj < 16; jj++) acc[jj] = _mm512_setzero_ps();
                    int64_t c = 0;
                    for (; c + 16 <= d; c += 16) {
                        const __m512 qv = _mm512_loadu_ps(qh + c);
                        for (int jj = 0; jj < 16; jj++)
                            acc[jj] = _mm512_add_ps(acc[jj], _mm512_mul_ps(qv, _mm512_loadu_ps(key[jj] + c)));
                    }
                    if (tail) { /* the lanes past d add +0, which leaves a partial sum (never -0) as it is */
                        const __m512 qv = _mm512_maskz_loadu_ps(tail, qh + c);
                        for (int jj = 0; jj < 16; jj++)
                            acc[jj] = _mm512_add_ps(acc[jj],
                                                    _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(tail, key[jj] + c)));
                    }
                    _mm512_mask_storeu_ps(scores + (i * a->h + h) * t + j0, stored,
                                          _mm512_mul_ps(tree16(acc), scale));
                }
        }
    }
}

/* Keys [j0, j1) of lo_values for `heads` score rows sc[] of one KV head and `cols` vectors of up
 * to 16 of the values of `mask` (both constants after inlining, so the sums stay in registers):
 * ac[] += sc[] * v, key by key. */
AVX512_INLINE void values_block(const float *const sc[4], float *const ac[4], const float *v, int64_t v_s0,
                                int64_t j0, int64_t j1, const int heads, const int cols, const __mmask16 mask[4]) {
    __m512 sum[4][4];
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < cols; c++) sum[h][c] = _mm512_maskz_loadu_ps(mask[c], ac[h] + 16 * c);
    for (int64_t j = j0; j < j1; j++) {
        const float *val = v + j * v_s0;
        __m512 x[4];
        for (int c = 0; c < cols; c++) x[c] = _mm512_maskz_loadu_ps(mask[c], val + 16 * c);
        for (int h = 0; h < heads; h++) {
            const __m512 p = _mm512_set1_ps(sc[h][j]);
            for (int c = 0; c < cols; c++) sum[h][c] = _mm512_add_ps(sum[h][c], _mm512_mul_ps(p, x[c]));
        }
    }
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < cols; c++) _mm512_mask_storeu_ps(ac[h] + 16 * c, mask[c], sum[h][c]);
}

/* values_block for `cols` (1 to 4) known only at run time: the last values of a head (Dv not a
 * multiple of 64) take only the vectors they fill. */
AVX512_INLINE void values_cols(const float *const sc[4], float *const ac[4], const float *v, int64_t v_s0,
                               int64_t j0, int64_t j1, const int heads, int cols, const __mmask16 mask[4]) {
    switch (cols) {
    case 1: values_block(sc, ac, v, v_s0, j0, j1, heads, 1, mask); break;
    case 2: values_block(sc, ac, v, v_s0, j0, j1, heads, 2, mask); break;
    case 3: values_block(sc, ac, v, v_s0, j0, j1, heads, 3, mask); break;
    default: values_block(sc, ac, v, v_s0, j0, j1, heads, 4, mask); break;
    }
}

/* lo_values, LO_VALUE_KEYS keys at a time (every KV head of those keys before the next ones), for
 * up to 4 score rows (rows and heads of one KV head) and 64 values at once. */
static AVX512 void values_avx512(const lo_attention_args *a, const float *scores, const float *v, int64_t n,
                                 int64_t t, int64_t rows, float *acc) {
    const int64_t g = a->h / a->kh, dv = a->dv, pairs = rows * g; /* score rows of one KV head */
    memset(acc, 0, (size_t)(rows * a->h * dv) * sizeof(float));
    for (int64_t j0 = 0; j0 < n; j0 += LO_VALUE_KEYS) {
        const int64_t j1 = n - j0 < LO_VALUE_KEYS ? n : j0 + LO_VALUE_KEYS;
        for (int64_t kv = 0; kv < a->kh; kv++) {
            for (int64_t e0 = 0; e0 < dv; e0 += 64) {
                __mmask16 mask[4];
                for (int c = 0; c < 4; c++) {
                    const int64_t lanes = dv - e0 - 16 * c;
                    mask[c] = lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
                }
                const int cols = dv - e0 >= 64 ? 4 : (int)(dv - e0 + 15) / 16;
                const float *vk = v + kv * a->v_s1 + e0;
                for (int64_t p0 = 0; p0 < pairs; p0 += 4) {
                    const float *sc[4];
                    float *ac[4];
                    const int m = pairs - p0 < 4 ? (int)(pairs - p0) : 4;
                    for (int u = 0; u < m; u++) {
                        const int64_t r = (p0 + u) / g * a->h + kv * g + (p0 + u) % g;
                        sc[u] = scores + r * t;
                        ac[u] = acc + r * dv + e0;
                    }
                    switch (m) {
                    case 1: values_cols(sc, ac, vk, a->v_s0, j0, j1, 1, cols, mask); break;
                    case 2: values_cols(sc, ac, vk, a->v_s0, j0, j1, 2, cols, mask); break;
                    case 3: values_cols(sc, ac, vk, a->v_s0, j0, j1, 3, cols, mask); break;
                    default: values_cols(sc, ac, vk, a->v_s0, j0, j1, 4, cols, mask); break;
                    }
                }
            }
        }
    }
}

static AVX512 void norm_avx512(const lo_norm_args *a, const float *w) { lo_norm_body(a, w); }
static AVX512 void swiglu_avx512(const lo_swiglu_args *a) { lo_gated_body(a, 0); }
static AVX512 void rope_avx512(const lo_rope_args *a, const float *cos, const float *sin) { lo_rope_body(a, cos, sin); }
static AVX512 void attention_avx512(const lo_attention_args *a, const float *k, const float *v, int64_t t,
                                    int causal, float *scratch) {
    lo_attention_body(a, k, v, t, causal, scratch, scores_avx512, values_avx512);
}

static const lo_kernels KERNELS = {"avx512", norm_avx512, swiglu_avx512, rope_avx512, attention_avx512};

const lo_kernels *lo_kernels_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512dq") ? &KERNELS : NULL;
}

#else /* not x86-64 */
const lo_kernels *lo_kernels_avx512(void) { return NULL; }
#endif
