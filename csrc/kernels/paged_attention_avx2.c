/* Paged attention's per-chunk steps at the AVX2 + FMA level: the portable steps' float32
 * operations in the same order, 8 lanes at a time (paged_attention.h). */
#include "paged_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))

/* Lanes l < n of 8 set (n clipped to 0..8), as a maskload mask. */
AVX2_INLINE __m256i lanes_below(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* fold16() of 4 sets of partial sums given as lanes 0-7 (lo) and 8-15 (hi): the 4 results. */
AVX2_INLINE __m128 fold16x4(const __m256 lo[4], const __m256 hi[4]) {
    __m128 t[4];
    for (int j = 0; j < 4; j++) {
        const __m256 h = _mm256_add_ps(lo[j], hi[j]); /* h_l = a_l + a_{l+8} */
        t[j] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)); /* h_l + h_{l+4} */
    }
    _MM_TRANSPOSE4_PS(t[0], t[1], t[2], t[3]); /* t_l = lane l of the four */
    return _mm_add_ps(_mm_add_ps(t[0], t[2]), _mm_add_ps(t[1], t[3]));
}

/* fold16() of the 8 lanes h_l = a_l + a_{l+8}. */
AVX2_INLINE float fold8(__m256 h) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t)); /* (t0 + t2, t1 + t3) */
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

AVX2 static void scores_avx2(const float *const *q, int64_t rows, int64_t d, const float *const *krow, int64_t len,
                             float scale, float *s) {
    const int64_t d16 = d / LP_LANES * LP_LANES;
    const __m256i m_lo = lanes_below(d - d16), m_hi = lanes_below(d - d16 - 8); /* the tail's lanes */
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q[r];
        float *sr = s + r * LP_CHUNK;
        int64_t p = 0;
        for (; p + 4 <= len; p += 4) { /* four keys at a time: eight independent chains */
            const float *k[4] = {krow[p], krow[p + 1], krow[p + 2], krow[p + 3]};
            __m256 lo[4], hi[4];
            for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d16; i += LP_LANES) {
                const __m256 x0 = _mm256_loadu_ps(qr + i), x1 = _mm256_loadu_ps(qr + i + 8);
                for (int j = 0; j < 4; j++) {
                    lo[j] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k[j] + i), lo[j]);
                    hi[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(k[j] + i + 8), hi[j]);
                }
            }
            if (d16 < d) { /* the lanes past d add 0 * 0 = +0, which leaves a partial sum as it is */
                const __m256 x0 = _mm256_maskload_ps(qr + d16, m_lo), x1 = _mm256_maskload_ps(qr + d16 + 8, m_hi);
                for (int j = 0; j < 4; j++) {
                    lo[j] = _mm256_fmadd_ps(x0, _mm256_maskload_ps(k[j] + d16, m_lo), lo[j]);
                    hi[j] = _mm256_fmadd_ps(x1, _mm256_maskload_ps(k[j] + d16 + 8, m_hi), hi[j]);
                }
            }
            _mm_storeu_ps(sr + p, _mm_mul_ps(fold16x4(lo, hi), _mm_set1_ps(scale)));
        }
        for (; p < len; p++) {
            const float *k = krow[p];
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int64_t i = 0; i < d16; i += LP_LANES) {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), _mm256_loadu_ps(k + i), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i + 8), _mm256_loadu_ps(k + i + 8), hi);
            }
            if (d16 < d) {
                lo = _mm256_fmadd_ps(_mm256_maskload_ps(qr + d16, m_lo), _mm256_maskload_ps(k + d16, m_lo), lo);
                hi = _mm256_fmadd_ps(_mm256_maskload_ps(qr + d16 + 8, m_hi), _mm256_maskload_ps(k + d16 + 8, m_hi), hi);
            }
            sr[p] = fold8(_mm256_add_ps(lo, hi)) * scale;
        }
    }
}

LP_EXP_NEG_VECTOR(AVX2_INLINE, exp_neg8, 256)

AVX2_INLINE void exps_avx2(float *s, int64_t len, float m, float *sum) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 a[2] = {_mm256_loadu_ps(sum), _mm256_loadu_ps(sum + 8)}; /* partial sums, lanes 0-7 and 8-15 */
    for (int j = 0; j < LP_CHUNK / 8; j++) {
        const __m256 keep = _mm256_castsi256_ps(lanes_below(len - 8 * j));
        const __m256 e = _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * j), mv)), keep);
        _mm256_storeu_ps(s + 8 * j, e);
        a[j & 1] = _mm256_add_ps(a[j & 1], e);
    }
    _mm256_storeu_ps(sum, a[0]);
    _mm256_storeu_ps(sum + 8, a[1]);
}

/* The larger of m and s[p < n] (a maximum is exact: any order gives it). */
AVX2_INLINE float max_avx2(const float *s, int64_t n, float m) {
    __m256 x = _mm256_set1_ps(m);
    for (int j = 0; j < LP_CHUNK / 8; j++)
        x = _mm256_max_ps(x, _mm256_blendv_ps(x, _mm256_loadu_ps(s + 8 * j),
                                              _mm256_castsi256_ps(lanes_below(n - 8 * j))));
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    return _mm_cvtss_f32(_mm_max_ss(y, _mm_shuffle_ps(y, y, 1)));
}

AVX2 static void softmax_avx2(float *s, int64_t rows, int64_t n, float *max, float *sum, float *acc, int64_t dv,
                              int fresh) {
    for (int64_t r = 0; r < rows; r++) {
        float *sr = s + r * LP_CHUNK;
        const float m = max_avx2(sr, n, max[r]);
        if (m > max[r] && !fresh) rescale(acc + r * dv, dv, sum + r * LP_LANES, max[r], m);
        max[r] = m;
        exps_avx2(sr, n, m, sum + r * LP_LANES);
    }
}

AVX2 static void axpy_avx2(float *acc, const float *w, int64_t rows, const float *const *vrow, int64_t len,
                           int64_t dv) {
    for (int64_t r = 0; r < rows; r++, acc += dv, w += LP_CHUNK) {
        int64_t e0 = 0;
        for (; e0 + 32 <= dv; e0 += 32) { /* 32 accumulators in registers across the keys */
            __m256 a0 = _mm256_loadu_ps(acc + e0), a1 = _mm256_loadu_ps(acc + e0 + 8);
            __m256 a2 = _mm256_loadu_ps(acc + e0 + 16), a3 = _mm256_loadu_ps(acc + e0 + 24);
            for (int64_t p = 0; p < len; p++) {
                const float *v = vrow[p] + e0;
                const __m256 wp = _mm256_set1_ps(w[p]);
                a0 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(acc + e0, a0), _mm256_storeu_ps(acc + e0 + 8, a1);
            _mm256_storeu_ps(acc + e0 + 16, a2), _mm256_storeu_ps(acc + e0 + 24, a3);
        }
        for (; e0 + 8 <= dv; e0 += 8) {
            __m256 a0 = _mm256_loadu_ps(acc + e0);
            for (int64_t p = 0; p < len; p++)
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[p]), _mm256_loadu_ps(vrow[p] + e0), a0);
            _mm256_storeu_ps(acc + e0, a0);
        }
        for (; e0 < dv; e0++)
            for (int64_t p = 0; p < len; p++) acc[e0] = fmaf(w[p], vrow[p][e0], acc[e0]);
    }
}

/* ---- over an int8 cache: the codes widened to float in registers ---------------------------- */

/* 8 int8 codes as floats (exact). */
AVX2_INLINE __m256 codes8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The last n < 16 codes of a row, zero-padded to 16 (no read past the row). */
AVX2_INLINE void tail16(const int8_t *p, int64_t n, int8_t out[16]) {
    memset(out, 0, 16);
    memcpy(out, p, (size_t)n);
}

AVX2 static void scores_q8_avx2(const float *const *q, int64_t rows, int64_t d, const int8_t *const *krow,
                                const float *ks, int64_t len, float scale, float *s) {
    const int64_t d16 = d / LP_LANES * LP_LANES;
    const __m256i m_lo = lanes_below(d - d16), m_hi = lanes_below(d - d16 - 8); /* the tail's lanes */
    int8_t tail[4][16];
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q[r];
        float *sr = s + r * LP_CHUNK;
        int64_t p = 0;
        for (; p + 4 <= len; p += 4) { /* four keys at a time: eight independent chains */
            const int8_t *k[4] = {krow[p], krow[p + 1], krow[p + 2], krow[p + 3]};
            __m256 lo[4], hi[4];
            for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d16; i += LP_LANES) {
                const __m256 x0 = _mm256_loadu_ps(qr + i), x1 = _mm256_loadu_ps(qr + i + 8);
                for (int j = 0; j < 4; j++) {
                    lo[j] = _mm256_fmadd_ps(x0, codes8(k[j] + i), lo[j]);
                    hi[j] = _mm256_fmadd_ps(x1, codes8(k[j] + i + 8), hi[j]);
                }
            }
            if (d16 < d) { /* the lanes past d add 0 * 0 = +0, which leaves a partial sum as it is */
                const __m256 x0 = _mm256_maskload_ps(qr + d16, m_lo), x1 = _mm256_maskload_ps(qr + d16 + 8, m_hi);
                for (int j = 0; j < 4; j++) {
                    tail16(k[j] + d16, d - d16, tail[j]);
                    lo[j] = _mm256_fmadd_ps(x0, codes8(tail[j]), lo[j]);
                    hi[j] = _mm256_fmadd_ps(x1, codes8(tail[j] + 8), hi[j]);
                }
            }
            const __m128 dots = _mm_mul_ps(fold16x4(lo, hi), _mm_loadu_ps(ks + p));
            _mm_storeu_ps(sr + p, _mm_mul_ps(dots, _mm_set1_ps(scale)));
        }
        for (; p < len; p++) {
            const int8_t *k = krow[p];
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int64_t i = 0; i < d16; i += LP_LANES) {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), codes8(k + i), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i + 8), codes8(k + i + 8), hi);
            }
            if (d16 < d) {
                tail16(k + d16, d - d16, tail[0]);
                lo = _mm256_fmadd_ps(_mm256_maskload_ps(qr + d16, m_lo), codes8(tail[0]), lo);
                hi = _mm256_fmadd_ps(_mm256_maskload_ps(qr + d16 + 8, m_hi), codes8(tail[0] + 8), hi);
            }
            sr[p] = fold8(_mm256_add_ps(lo, hi)) * ks[p] * scale;
        }
    }
}

AVX2 static void axpy_q8_avx2(float *acc, const float *w, int64_t rows, const int8_t *const *vrow, const float *vs,
                              int64_t len, int64_t dv) {
    for (int64_t r = 0; r < rows; r++, acc += dv, w += LP_CHUNK) {
        int64_t e0 = 0;
        for (; e0 + 32 <= dv; e0 += 32) { /* 32 accumulators in registers across the keys */
            __m256 a0 = _mm256_loadu_ps(acc + e0), a1 = _mm256_loadu_ps(acc + e0 + 8);
            __m256 a2 = _mm256_loadu_ps(acc + e0 + 16), a3 = _mm256_loadu_ps(acc + e0 + 24);
            for (int64_t p = 0; p < len; p++) {
                const int8_t *v = vrow[p] + e0;
                const __m256 wp = _mm256_set1_ps(w[p] * vs[p]);
                a0 = _mm256_fmadd_ps(wp, codes8(v), a0);
                a1 = _mm256_fmadd_ps(wp, codes8(v + 8), a1);
                a2 = _mm256_fmadd_ps(wp, codes8(v + 16), a2);
                a3 = _mm256_fmadd_ps(wp, codes8(v + 24), a3);
            }
            _mm256_storeu_ps(acc + e0, a0), _mm256_storeu_ps(acc + e0 + 8, a1);
            _mm256_storeu_ps(acc + e0 + 16, a2), _mm256_storeu_ps(acc + e0 + 24, a3);
        }
        for (; e0 + 8 <= dv; e0 += 8) {
            __m256 a0 = _mm256_loadu_ps(acc + e0);
            for (int64_t p = 0; p < len; p++)
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[p] * vs[p]), codes8(vrow[p] + e0), a0);
            _mm256_storeu_ps(acc + e0, a0);
        }
        for (; e0 < dv; e0++)
            for (int64_t p = 0; p < len; p++) acc[e0] = fmaf(w[p] * vs[p], (float)vrow[p][e0], acc[e0]);
    }
}

static const lp_steps steps_avx2 = {scores_avx2, softmax_avx2, axpy_avx2, scores_q8_avx2, axpy_q8_avx2};

const lp_steps *lp_steps_avx2(void) { return &steps_avx2; }
#else
const lp_steps *lp_steps_avx2(void) { return NULL; }
#endif
