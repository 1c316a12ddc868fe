/* Paged attention's per-chunk steps at the AVX-512 level: the portable steps' float32
 * operations in the same order, 16 lanes at a time (paged_attention.h). */
#include "paged_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX512_TARGET "avx512f,avx512vl,avx2,fma"
#define AVX512 __attribute__((target(AVX512_TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))

/* Lanes l < n of 16 set (n clipped to 0..16). */
AVX512_INLINE __mmask16 mask_below(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* Lane j of the result is fold16() of a[j] (the 16 partial sums of key j), for 8 keys at once:
 * the halving steps (lane l + lane l+8, l+4, l+2, l+1) run on pairs of keys through shuffles,
 * then the lanes are put back in key order. */
AVX512_INLINE __m256 fold16x8(const __m512 a[8]) {
    __m512 b[4], c[2];
    for (int m = 0; m < 4; m++) /* [h of key 2m | h of key 2m+1], h_l = a_l + a_{l+8} */
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
    for (int m = 0; m < 2; m++) /* 128-bit block i: r of key 4m + i, r_l = h_l + h_{l+4} */
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
    /* block i: [u0, u1 of key i, u0, u1 of key 4 + i], u_l = r_l + r_{l+2} */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
    /* block i: [key i, key 4 + i, key i, key 4 + i] (u0 + u1) */
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(u, u, 0x88), _mm512_shuffle_ps(u, u, 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, e));
}

/* Scores of `nr` rows (a constant after inlining: 24 sums stay in registers) and 8 keys, all 8
 * stored (a row of s has room: the ones past the chunk's keys are never read). */
AVX512_INLINE void scores_tile(const float *const *q, const int nr, int64_t d16, __mmask16 tail,
                               const float *const k[8], __m256 scale, float *s) {
    __m512 a[3][8];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 8; j++) a[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d16; i += LP_LANES) {
        __m512 x[3];
        for (int r = 0; r < nr; r++) x[r] = _mm512_loadu_ps(q[r] + i);
        for (int j = 0; j < 8; j++) {
            __m512 kj = _mm512_loadu_ps(k[j] + i);
            __asm__("" : "+v"(kj)); /* one load for the nr rows, not one folded into each FMA */
            for (int r = 0; r < nr; r++) a[r][j] = _mm512_fmadd_ps(x[r], kj, a[r][j]);
        }
    }
    if (tail) { /* the lanes past d add 0 * 0 = +0, which leaves a partial sum as it is */
        __m512 x[3];
        for (int r = 0; r < nr; r++) x[r] = _mm512_maskz_loadu_ps(tail, q[r] + d16);
        for (int j = 0; j < 8; j++) {
            const __m512 kj = _mm512_maskz_loadu_ps(tail, k[j] + d16);
            for (int r = 0; r < nr; r++) a[r][j] = _mm512_fmadd_ps(x[r], kj, a[r][j]);
        }
    }
    for (int r = 0; r < nr; r++) _mm256_storeu_ps(s + r * LP_CHUNK, _mm256_mul_ps(fold16x8(a[r]), scale));
}

/* 8 keys at a time (a partial group reads its last key again), 3 rows at a time. */
AVX512 static void scores_avx512(const float *const *q, int64_t rows, int64_t d, const float *const *krow,
                                 int64_t len, float scale, float *s) {
    const int64_t d16 = d / LP_LANES * LP_LANES;
    const __mmask16 tail = mask_below(d - d16);
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t p0 = 0; p0 < len; p0 += 8) {
        const int64_t keys = len - p0 < 8 ? len - p0 : 8;
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = krow[p0 + (j < keys ? j : keys - 1)];
        int64_t r = 0;
        for (; r + 3 <= rows; r += 3) scores_tile(q + r, 3, d16, tail, k, sc, s + r * LP_CHUNK + p0);
        if (rows - r == 2) scores_tile(q + r, 2, d16, tail, k, sc, s + r * LP_CHUNK + p0);
        if (rows - r == 1) scores_tile(q + r, 1, d16, tail, k, sc, s + r * LP_CHUNK + p0);
    }
}

LP_EXP_NEG_VECTOR(AVX512_INLINE, exp_neg16, 512)

/* keep[j]: the lanes of s[16 j ..] below len. */
AVX512_INLINE void exps_avx512(float *s, const __mmask16 keep[LP_CHUNK / 16], float m, float *sum) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 a = _mm512_loadu_ps(sum);
    for (int j = 0; j < LP_CHUNK / 16; j++) {
        const __m512 e = _mm512_maskz_mov_ps(keep[j], exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * j), mv)));
        _mm512_storeu_ps(s + 16 * j, e);
        a = _mm512_add_ps(a, e);
    }
    _mm512_storeu_ps(sum, a);
}

AVX512 static void softmax_avx512(float *s, int64_t rows, int64_t n, float *max, float *sum, float *acc, int64_t dv,
                                int fresh) {
    const __m512 none = _mm512_set1_ps(-INFINITY);
    __mmask16 keep[LP_CHUNK / 16];
    for (int j = 0; j < LP_CHUNK / 16; j++) keep[j] = mask_below(n - 16 * j);
    for (int64_t r = 0; r < rows; r++) {
        float *sr = s + r * LP_CHUNK;
        __m512 x = none;
        for (int j = 0; j < LP_CHUNK / 16; j++) x = _mm512_max_ps(x, _mm512_mask_loadu_ps(none, keep[j], sr + 16 * j));
        const float top = _mm512_reduce_max_ps(x), m = top > max[r] ? top : max[r]; /* exact in any order */
        if (m > max[r] && !fresh) rescale(acc + r * dv, dv, sum + r * LP_LANES, max[r], m);
        max[r] = m;
        exps_avx512(sr, keep, m, sum + r * LP_LANES);
    }
}

/* acc += w v over the chunk's keys for `nr` rows and the up to 64 values of `mask` (4 x 16
 * lanes) from e0, all 64 when `full` (both constants after inlining): the sums stay in
 * registers across the keys. */
AVX512_INLINE void axpy_block(float *acc, const float *w, const int nr, const float *const *vrow, int64_t len,
                              int64_t dv, int64_t e0, const __mmask16 mask[4], const int full) {
    __m512 a[4][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) {
            const float *src = acc + r * dv + e0 + 16 * c;
            a[r][c] = full ? _mm512_loadu_ps(src) : _mm512_maskz_loadu_ps(mask[c], src);
        }
    for (int64_t p = 0; p < len; p++) {
        const float *v = vrow[p] + e0;
        __m512 x[4];
        for (int c = 0; c < 4; c++)
            x[c] = full ? _mm512_loadu_ps(v + 16 * c) : _mm512_maskz_loadu_ps(mask[c], v + 16 * c);
        for (int r = 0; r < nr; r++) {
            const __m512 wp = _mm512_set1_ps(w[r * LP_CHUNK + p]);
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_fmadd_ps(wp, x[c], a[r][c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) {
            float *dst = acc + r * dv + e0 + 16 * c;
            if (full)
                _mm512_storeu_ps(dst, a[r][c]);
            else
                _mm512_mask_storeu_ps(dst, mask[c], a[r][c]);
        }
}

/* axpy_block over the rows, 4 at a time. */
AVX512_INLINE void axpy_rows(float *acc, const float *w, int64_t rows, const float *const *vrow, int64_t len,
                             int64_t dv, int64_t e0, const __mmask16 mask[4], const int full) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) axpy_block(acc + r * dv, w + r * LP_CHUNK, 4, vrow, len, dv, e0, mask, full);
    switch (rows - r) {
    case 3: axpy_block(acc + r * dv, w + r * LP_CHUNK, 3, vrow, len, dv, e0, mask, full); break;
    case 2: axpy_block(acc + r * dv, w + r * LP_CHUNK, 2, vrow, len, dv, e0, mask, full); break;
    case 1: axpy_block(acc + r * dv, w + r * LP_CHUNK, 1, vrow, len, dv, e0, mask, full); break;
    default: break;
    }
}

AVX512 static void axpy_avx512(float *acc, const float *w, int64_t rows, const float *const *vrow, int64_t len,
                               int64_t dv) {
    for (int64_t e0 = 0; e0 < dv; e0 += 64) {
        __mmask16 mask[4];
        for (int c = 0; c < 4; c++) mask[c] = mask_below(dv - e0 - 16 * c);
        if (dv - e0 >= 64)
            axpy_rows(acc, w, rows, vrow, len, dv, e0, mask, 1);
        else
            axpy_rows(acc, w, rows, vrow, len, dv, e0, mask, 0);
    }
}

/* ---- over an int8 cache: the codes widened to float in registers ---------------------------- */

/* 16 int8 codes as floats (exact). */
AVX512_INLINE __m512 codes16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* scores_tile over int8 keys: the 8 keys' dot products times their scales ks8, then scale. A
 * head dim with a tail reads each key's last codes from a zero-padded copy. */
AVX512_INLINE void scores_tile_q8(const float *const *q, const int nr, int64_t d16, int64_t d, __mmask16 tail,
                                  const int8_t *const k[8], __m256 ks8, __m256 scale, float *s) {
    __m512 a[3][8];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 8; j++) a[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d16; i += LP_LANES) {
        __m512 x[3];
        for (int r = 0; r < nr; r++) x[r] = _mm512_loadu_ps(q[r] + i);
        for (int j = 0; j < 8; j++) {
            __m512 kj = codes16(k[j] + i);
            __asm__("" : "+v"(kj)); /* one conversion for the nr rows */
            for (int r = 0; r < nr; r++) a[r][j] = _mm512_fmadd_ps(x[r], kj, a[r][j]);
        }
    }
    if (tail) { /* the lanes past d add 0 * 0 = +0, which leaves a partial sum as it is */
        __m512 x[3];
        for (int r = 0; r < nr; r++) x[r] = _mm512_maskz_loadu_ps(tail, q[r] + d16);
        for (int j = 0; j < 8; j++) {
            int8_t pad[16] = {0};
            memcpy(pad, k[j] + d16, (size_t)(d - d16));
            const __m512 kj = codes16(pad);
            for (int r = 0; r < nr; r++) a[r][j] = _mm512_fmadd_ps(x[r], kj, a[r][j]);
        }
    }
    for (int r = 0; r < nr; r++)
        _mm256_storeu_ps(s + r * LP_CHUNK, _mm256_mul_ps(_mm256_mul_ps(fold16x8(a[r]), ks8), scale));
}

/* 8 keys at a time (a partial group reads its last key again; its scales past the chunk's keys
 * are 0), 3 rows at a time. */
AVX512 static void scores_q8_avx512(const float *const *q, int64_t rows, int64_t d, const int8_t *const *krow,
                                    const float *ks, int64_t len, float scale, float *s) {
    const int64_t d16 = d / LP_LANES * LP_LANES;
    const __mmask16 tail = mask_below(d - d16);
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t p0 = 0; p0 < len; p0 += 8) {
        const int64_t keys = len - p0 < 8 ? len - p0 : 8;
        const int8_t *k[8];
        for (int j = 0; j < 8; j++) k[j] = krow[p0 + (j < keys ? j : keys - 1)];
        const __m256 ks8 = _mm256_loadu_ps(ks + p0);
        int64_t r = 0;
        for (; r + 3 <= rows; r += 3) scores_tile_q8(q + r, 3, d16, d, tail, k, ks8, sc, s + r * LP_CHUNK + p0);
        if (rows - r == 2) scores_tile_q8(q + r, 2, d16, d, tail, k, ks8, sc, s + r * LP_CHUNK + p0);
        if (rows - r == 1) scores_tile_q8(q + r, 1, d16, d, tail, k, ks8, sc, s + r * LP_CHUNK + p0);
    }
}

/* axpy_block over int8 values: acc += (w * vs) v for `nr` rows and the up to 64 values from e0
 * (`n` of them; all 64 when `full`). */
AVX512_INLINE void axpy_block_q8(float *acc, const float *w, const int nr, const int8_t *const *vrow,
                                 const float *vs, int64_t len, int64_t dv, int64_t e0, const __mmask16 mask[4],
                                 const int full) {
    __m512 a[4][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) {
            const float *src = acc + r * dv + e0 + 16 * c;
            a[r][c] = full ? _mm512_loadu_ps(src) : _mm512_maskz_loadu_ps(mask[c], src);
        }
    for (int64_t p = 0; p < len; p++) {
        const int8_t *v = vrow[p] + e0;
        int8_t pad[64];
        if (!full) { /* the last values of the row, zero-padded (no read past the row) */
            memset(pad, 0, sizeof pad);
            memcpy(pad, v, (size_t)(dv - e0));
            v = pad;
        }
        __m512 x[4];
        for (int c = 0; c < 4; c++) x[c] = codes16(v + 16 * c);
        for (int r = 0; r < nr; r++) {
            const __m512 wp = _mm512_set1_ps(w[r * LP_CHUNK + p] * vs[p]);
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_fmadd_ps(wp, x[c], a[r][c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) {
            float *dst = acc + r * dv + e0 + 16 * c;
            if (full)
                _mm512_storeu_ps(dst, a[r][c]);
            else
                _mm512_mask_storeu_ps(dst, mask[c], a[r][c]);
        }
}

AVX512_INLINE void axpy_rows_q8(float *acc, const float *w, int64_t rows, const int8_t *const *vrow, const float *vs,
                                int64_t len, int64_t dv, int64_t e0, const __mmask16 mask[4], const int full) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
        axpy_block_q8(acc + r * dv, w + r * LP_CHUNK, 4, vrow, vs, len, dv, e0, mask, full);
    switch (rows - r) {
    case 3: axpy_block_q8(acc + r * dv, w + r * LP_CHUNK, 3, vrow, vs, len, dv, e0, mask, full); break;
    case 2: axpy_block_q8(acc + r * dv, w + r * LP_CHUNK, 2, vrow, vs, len, dv, e0, mask, full); break;
    case 1: axpy_block_q8(acc + r * dv, w + r * LP_CHUNK, 1, vrow, vs, len, dv, e0, mask, full); break;
    default: break;
    }
}

AVX512 static void axpy_q8_avx512(float *acc, const float *w, int64_t rows, const int8_t *const *vrow,
                                  const float *vs, int64_t len, int64_t dv) {
    for (int64_t e0 = 0; e0 < dv; e0 += 64) {
        __mmask16 mask[4];
        for (int c = 0; c < 4; c++) mask[c] = mask_below(dv - e0 - 16 * c);
        if (dv - e0 >= 64)
            axpy_rows_q8(acc, w, rows, vrow, vs, len, dv, e0, mask, 1);
        else
            axpy_rows_q8(acc, w, rows, vrow, vs, len, dv, e0, mask, 0);
    }
}

static const lp_steps steps_avx512 = {scores_avx512, softmax_avx512, axpy_avx512, scores_q8_avx512,
                                      axpy_q8_avx512};

const lp_steps *lp_steps_avx512(void) { return &steps_avx512; }
#else
const lp_steps *lp_steps_avx512(void) { return NULL; }
#endif
