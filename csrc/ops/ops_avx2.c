/* The kernels of ops_body.h for AVX2 (8 floats per vector): the portable bodies compiled for this
 * level, and attention's two inner loops written with intrinsics, which compute the same float
 * operations in the same order (lo_scores, lo_values), so the same bits. No FMA. Runs only
 * after lo_kernels_avx2() has checked the CPU.
 */
#include "ops_body.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))

_Static_assert(LO_LANES == 16, "two vectors hold the partial sums of a dot product");

/* Integer mask of the first n (clamped to 0..8) of 8 lanes, for maskload / maskstore. */
AVX2_INLINE __m256i first_lanes(int64_t n) {
    static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(ones + 8 - (n < 0 ? 0 : n > 8 ? 8 : n)));
}

/* Lane j of the result is lo_tree of key j's 16 partial sums (lo[j]: lanes 0-7, hi[j]: 8-15),
 * for 4 keys at once: the tree's halving steps (lane l + l+8, l+4, l+2, l+1) through shuffles. */
AVX2_INLINE __m128 tree4(const __m256 lo[4], const __m256 hi[4]) {
    __m256 p[4], c[2];
    for (int j = 0; j < 4; j++) p[j] = _mm256_add_ps(lo[j], hi[j]);
    for (int m = 0; m < 2; m++) /* [r of key 2m | r of key 2m+1] */
        c[m] = _mm256_add_ps(_mm256_permute2f128_ps(p[2 * m], p[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(p[2 * m], p[2 * m + 1], 0x31));
    /* half i: [s0, s1 of key i, s0, s1 of key 2+i] */
    const __m256 d = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x44), _mm256_shuffle_ps(c[0], c[1], 0xEE));
    /* half i: [key i, key 2+i, key i, key 2+i] */
    const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(d, d, 0x88), _mm256_shuffle_ps(d, d, 0xDD));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
}

/* lo_scores, 4 keys at a time, every KV head and row of those keys before the next ones (a
 * partial block reads its last key again and drops it). */
static AVX2 void scores_avx2(const lo_attention_args *a, const float *q, const float *k, int64_t n, int64_t t,
                             int64_t rows, float *scores) {
    const int64_t g = a->h / a->kh, d = a->d, rem = d % 16, full = d - rem;
    const __m256i tail_lo = first_lanes(rem), tail_hi = first_lanes(rem - 8);
    const __m128 scale = _mm_set1_ps((float)a->scale);
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        const int64_t keys = n - j0 < 4 ? n - j0 : 4;
        for (int64_t kv = 0; kv < a->kh; kv++) {
            const float *key[4];
            for (int jj = 0; jj < 4; jj++) key[jj] = k + (j0 + (jj < keys ? jj : keys - 1)) * a->k_s0 + kv * a->k_s1;
            for (int64_t i = 0; i < rows; i++)
                for (int64_t h = kv * g; h < (kv + 1) * g; h++) {
                    const float *qh = q + i * a->q_s0 + h * a->q_s1;
                    __m256 lo[4], hi[4];
                    for (int jj = 0; jj < 4; jj++) lo[jj] = hi[jj] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < full; c += 16) {
                        const __m256 q0 = _mm256_loadu_ps(qh + c), q1 = _mm256_loadu_ps(qh + c + 8);
                        for (int jj = 0; jj < 4; jj++) {
                            lo[jj] = _mm256_add_ps(lo[jj], _mm256_mul_ps(q0, _mm256_loadu_ps(key[jj] + c)));
                            hi[jj] = _mm256_add_ps(hi[jj], _mm256_mul_ps(q1, _mm256_loadu_ps(key[jj] + c + 8)));
                        }
                    }
                    if (rem) { /* the lanes past d add +0, which leaves a partial sum (never -0) as it is */
                        const __m256 q0 = _mm256_maskload_ps(qh + full, tail_lo);
                        const __m256 q1 = _mm256_maskload_ps(qh + full + 8, tail_hi);
                        for (int jj = 0; jj < 4; jj++) {
                            const __m256 k0 = _mm256_maskload_ps(key[jj] + full, tail_lo);
                            const __m256 k1 = _mm256_maskload_ps(key[jj] + full + 8, tail_hi);
                            lo[jj] = _mm256_add_ps(lo[jj], _mm256_mul_ps(q0, k0));
                            hi[jj] = _mm256_add_ps(hi[jj], _mm256_mul_ps(q1, k1));
                        }
                    }
                    float s[4], *out = scores + (i * a->h + h) * t + j0;
                    _mm_storeu_ps(s, _mm_mul_ps(tree4(lo, hi), scale));
                    for (int jj = 0; jj < keys; jj++) out[jj] = s[jj];
                }
        }
    }
}

/* Keys [j0, j1) of lo_values for `heads` score rows sc[] of one KV head (a constant after
 * inlining, so the sums stay in registers) and the up to 16 values of the masks: ac[] += sc[] * v,
 * key by key. */
AVX2_INLINE void values_block(const float *const sc[4], float *const ac[4], const float *v, int64_t v_s0, int64_t j0,
                              int64_t j1, const int heads, __m256i m0, __m256i m1) {
    __m256 sum[4][2];
    for (int h = 0; h < heads; h++) {
        sum[h][0] = _mm256_maskload_ps(ac[h], m0);
        sum[h][1] = _mm256_maskload_ps(ac[h] + 8, m1);
    }
    for (int64_t j = j0; j < j1; j++) {
        const float *val = v + j * v_s0;
        const __m256 x0 = _mm256_maskload_ps(val, m0), x1 = _mm256_maskload_ps(val + 8, m1);
        for (int h = 0; h < heads; h++) {
            const __m256 p = _mm256_broadcast_ss(sc[h] + j);
            sum[h][0] = _mm256_add_ps(sum[h][0], _mm256_mul_ps(p, x0));
            sum[h][1] = _mm256_add_ps(sum[h][1], _mm256_mul_ps(p, x1));
        }
    }
    for (int h = 0; h < heads; h++) {
        _mm256_maskstore_ps(ac[h], m0, sum[h][0]);
        _mm256_maskstore_ps(ac[h] + 8, m1, sum[h][1]);
    }
}

/* lo_values, LO_VALUE_KEYS keys at a time (every KV head of those keys before the next ones), for
 * up to 4 score rows (rows and heads of one KV head) and 16 values at once. */
static AVX2 void values_avx2(const lo_attention_args *a, const float *scores, const float *v, int64_t n, int64_t t,
                             int64_t rows, float *acc) {
    const int64_t g = a->h / a->kh, dv = a->dv, pairs = rows * g; /* score rows of one KV head */
    memset(acc, 0, (size_t)(rows * a->h * dv) * sizeof(float));
    for (int64_t j0 = 0; j0 < n; j0 += LO_VALUE_KEYS) {
        const int64_t j1 = n - j0 < LO_VALUE_KEYS ? n : j0 + LO_VALUE_KEYS;
        for (int64_t kv = 0; kv < a->kh; kv++) {
            for (int64_t e0 = 0; e0 < dv; e0 += 16) {
                const __m256i m0 = first_lanes(dv - e0), m1 = first_lanes(dv - e0 - 8);
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
                    case 1: values_block(sc, ac, vk, a->v_s0, j0, j1, 1, m0, m1); break;
                    case 2: values_block(sc, ac, vk, a->v_s0, j0, j1, 2, m0, m1); break;
                    case 3: values_block(sc, ac, vk, a->v_s0, j0, j1, 3, m0, m1); break;
                    default: values_block(sc, ac, vk, a->v_s0, j0, j1, 4, m0, m1); break;
                    }
                }
            }
        }
    }
}

static AVX2 void norm_avx2(const lo_norm_args *a, const float *w) { lo_norm_body(a, w); }
static AVX2 void swiglu_avx2(const lo_swiglu_args *a) { lo_gated_body(a, 0); }
static AVX2 void rope_avx2(const lo_rope_args *a, const float *cos, const float *sin) { lo_rope_body(a, cos, sin); }
static AVX2 void attention_avx2(const lo_attention_args *a, const float *k, const float *v, int64_t t, int causal,
                                float *scratch) {
    lo_attention_body(a, k, v, t, causal, scratch, scores_avx2, values_avx2);
}

static const lo_kernels KERNELS = {"avx2", norm_avx2, swiglu_avx2, rope_avx2, attention_avx2};

const lo_kernels *lo_kernels_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? &KERNELS : NULL;
}

#else /* not x86 */
const lo_kernels *lo_kernels_avx2(void) { return NULL; }
#endif
