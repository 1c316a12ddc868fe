/* AVX-512 (F, BW, VL) kernels for quant.c: 16 floats per vector, mask registers for the 5th
 * bit of the q5 formats and for tails, tiles of 16 rows.
 *
 * Compiled without -march: every function carries a target attribute and runs only after
 * lq_kernels_avx512() has checked the CPU. Decoders multiply, then add (no FMA), so they stay
 * bit-exact with the reference; the dot products use FMA freely.
 */
#include "quant.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define AVX512 __attribute__((target(TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(TARGET)))

#define TILE 16

AVX512_INLINE float half(lq_half h) { return _cvtsh_ss(h); }

AVX512_INLINE __m512 to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }

AVX512_INLINE __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

AVX512_INLINE __mmask16 tail_mask(size_t n) { return (__mmask16)((1u << n) - 1); }

/* Ask for the weight bytes a few rows ahead of [p, p + n): at M = 1 the kernels stream weights
 * at close to memory speed, and the hardware prefetcher alone leaves ~10% on the table. */
AVX512_INLINE void prefetch_ahead(const void *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + LQ_PREFETCH_BYTES + i, _MM_HINT_T0);
}

/* ---- integer values of 32 elements as floats: v[0] = elements 0..15, v[1] = 16..31 -------- */

/* Small unsigned codes become floats through a table lookup instead of a conversion: a
 * permute reads only the low 4 (or, from two tables, 5) bits of each index lane, so the low
 * nibble needs no mask, and the permutes run beside the FMAs rather than on their port. */
AVX512_INLINE __m512 lookup16(__m512i codes, int offset) {
    const __m512 table = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_ps((float)offset));
    return _mm512_permutexvar_ps(codes, table);
}

AVX512_INLINE void q4_values(const uint8_t *qs, int offset, __m512 v[2]) {
    const __m512i raw = u8x16(qs);
    v[0] = lookup16(raw, offset);
    v[1] = lookup16(_mm512_srli_epi32(raw, 4), offset);
}

/* 5-bit codes through a 32-entry table held in two registers. */
AVX512_INLINE __m512 lookup32(__m512i codes, int offset) {
    const __m512 off = _mm512_set1_ps((float)offset);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lo = _mm512_sub_ps(iota, off), hi = _mm512_sub_ps(_mm512_add_ps(iota, _mm512_set1_ps(16)), off);
    return _mm512_permutex2var_ps(lo, codes, hi);
}

/* The 5th bit of element j is bit j of qh: a mask register says which lanes get 16. */
AVX512_INLINE void q5_values(const uint8_t *qs, const uint8_t *qhp, int offset, __m512 v[2]) {
    uint32_t qh;
    memcpy(&qh, qhp, 4);
    const __m512i raw = u8x16(qs), sixteen = _mm512_set1_epi32(16);
    const __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi32(0x0f)), hi = _mm512_srli_epi32(raw, 4);
    v[0] = lookup32(_mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xffff), lo, sixteen), offset);
    v[1] = lookup32(_mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen), offset);
}

AVX512_INLINE void q8_values(const int8_t *qs, __m512 v[2]) {
    v[0] = to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    v[1] = to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
}

/* Sub-blocks 2c (v0) and 2c+1 (v1) of a q4_K / q5_K super-block; qh NULL for q4_K. */
AVX512_INLINE void k4_values(const uint8_t *qs, const uint8_t *qh, int c, __m512 v0[2], __m512 v1[2]) {
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (int g = 0; g < 2; g++) {
        const __m512i raw = u8x16(qs + 32 * c + 16 * g);
        __m512i lo = _mm512_and_si512(raw, _mm512_set1_epi32(0x0f)), hi = _mm512_srli_epi32(raw, 4);
        if (qh) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(qh + 16 * g));
            lo = _mm512_mask_or_epi32(lo, _mm_test_epi8_mask(h, _mm_set1_epi8((char)(1 << (2 * c)))), lo, sixteen);
            hi = _mm512_mask_or_epi32(hi, _mm_test_epi8_mask(h, _mm_set1_epi8((char)(1 << (2 * c + 1)))), hi, sixteen);
            v0[g] = lookup32(lo, 0);
            v1[g] = lookup32(hi, 0);
        } else { /* the lookup reads only the low nibble of raw */
            v0[g] = lookup16(raw, 0);
            v1[g] = lookup16(hi, 0);
        }
    }
}

/* The 8 scales d * sc_j and mins dmin * m_j of a q4_K / q5_K super-block (products in f32,
 * as the reference computes them). */
AVX512_INLINE void k4_scales(const uint8_t *packed, float d, float dmin, __m256 *scale, __m256 *minimum) {
    uint8_t sc[8], mn[8];
    unpack_scales_k4_le(packed, sc, mn);
    const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    *scale = _mm256_mul_ps(_mm256_set1_ps(d), s);
    *minimum = _mm256_mul_ps(_mm256_set1_ps(dmin), m);
}

/* The 64 elements 128h + 16g + {0, 32, 64, 96} of a q6_K super-block (t = 0..3 in v[t]),
 * minus 32: ql bytes a and b hold the low nibbles of t = 0, 1 and the high nibbles of t = 2,
 * 3; the 2-bit pairs of qh byte hq hold their top bits. */
AVX512_INLINE void q6_values(const block_q6_K *b, int h, int g, __m512 v[4]) {
    const __m512i a = u8x16(b->ql + 64 * h + 16 * g), c = u8x16(b->ql + 64 * h + 32 + 16 * g);
    const __m512i hq = u8x16(b->qh + 32 * h + 16 * g);
    const __m512i low4 = _mm512_set1_epi32(0x0f), top2 = _mm512_set1_epi32(0x30), off = _mm512_set1_epi32(32);
    const __m512i q[4] = {
        _mm512_or_si512(_mm512_and_si512(a, low4), _mm512_and_si512(_mm512_slli_epi32(hq, 4), top2)),
        _mm512_or_si512(_mm512_and_si512(c, low4), _mm512_and_si512(_mm512_slli_epi32(hq, 2), top2)),
        _mm512_or_si512(_mm512_srli_epi32(a, 4), _mm512_and_si512(hq, top2)),
        _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_and_si512(_mm512_srli_epi32(hq, 2), top2)),
    };
    for (int t = 0; t < 4; t++) v[t] = to_float(_mm512_sub_epi32(q[t], off));
}

/* d * scale for the 16 groups of 16 elements of a q6_K super-block. */
AVX512_INLINE __m512 q6_scales(const block_q6_K *b) {
    const __m512 s = to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->scales)));
    return _mm512_mul_ps(_mm512_set1_ps(half(b->d)), s);
}

/* ---- decoders (bit-exact: d * q, then + m or - m) ---------------------------------------- */

AVX512_INLINE void store_scaled(float *dst, const __m512 v[2], float d) {
    const __m512 dv = _mm512_set1_ps(d);
    _mm512_storeu_ps(dst, _mm512_mul_ps(dv, v[0]));
    _mm512_storeu_ps(dst + 16, _mm512_mul_ps(dv, v[1]));
}

AVX512_INLINE void store_affine(float *dst, const __m512 v[2], float d, float m) {
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_mul_ps(dv, v[0]), mv));
    _mm512_storeu_ps(dst + 16, _mm512_add_ps(_mm512_mul_ps(dv, v[1]), mv));
}

AVX512_INLINE void store_shifted(float *dst, const __m512 v[2], float d, float m) {
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    _mm512_storeu_ps(dst, _mm512_sub_ps(_mm512_mul_ps(dv, v[0]), mv));
    _mm512_storeu_ps(dst + 16, _mm512_sub_ps(_mm512_mul_ps(dv, v[1]), mv));
}

AVX512_INLINE __m512 f16x16(const uint16_t *p, __mmask16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }

AVX512_INLINE __m512 bf16x16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

static AVX512 void decode_f16(const void *row, float *dst, size_t k) {
    const uint16_t *p = row;
    size_t i = 0;
    for (; i + 16 <= k; i += 16) _mm512_storeu_ps(dst + i, f16x16(p + i, 0xffff));
    if (i < k) _mm512_mask_storeu_ps(dst + i, tail_mask(k - i), f16x16(p + i, tail_mask(k - i)));
}

static AVX512 void decode_bf16(const void *row, float *dst, size_t k) {
    const uint16_t *p = row;
    size_t i = 0;
    for (; i + 16 <= k; i += 16) _mm512_storeu_ps(dst + i, bf16x16(p + i, 0xffff));
    if (i < k) _mm512_mask_storeu_ps(dst + i, tail_mask(k - i), bf16x16(p + i, tail_mask(k - i)));
}

static AVX512 void decode_q4_0(const void *row, float *dst, size_t k) {
    const block_q4_0 *b = row;
    __m512 v[2];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q4_values(b[i].qs, 8, v);
        store_scaled(dst, v, half(b[i].d));
    }
}

static AVX512 void decode_q4_1(const void *row, float *dst, size_t k) {
    const block_q4_1 *b = row;
    __m512 v[2];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q4_values(b[i].qs, 0, v);
        store_affine(dst, v, half(b[i].d), half(b[i].m));
    }
}

static AVX512 void decode_q5_0(const void *row, float *dst, size_t k) {
    const block_q5_0 *b = row;
    __m512 v[2];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q5_values(b[i].qs, b[i].qh, 16, v);
        store_scaled(dst, v, half(b[i].d));
    }
}

static AVX512 void decode_q5_1(const void *row, float *dst, size_t k) {
    const block_q5_1 *b = row;
    __m512 v[2];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q5_values(b[i].qs, b[i].qh, 0, v);
        store_affine(dst, v, half(b[i].d), half(b[i].m));
    }
}

static AVX512 void decode_q8_0(const void *row, float *dst, size_t k) {
    const block_q8_0 *b = row;
    __m512 v[2];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q8_values(b[i].qs, v);
        store_scaled(dst, v, half(b[i].d));
    }
}

/* q4_K and q5_K: d_j * q - min_j per sub-block j. */
AVX512_INLINE void decode_k4(const uint8_t *packed, const uint8_t *qs, const uint8_t *qh, float d, float dmin,
                             float *dst) {
    float scale[8], minimum[8];
    __m256 s, m;
    __m512 v0[2], v1[2];
    k4_scales(packed, d, dmin, &s, &m);
    _mm256_storeu_ps(scale, s);
    _mm256_storeu_ps(minimum, m);
    for (int c = 0; c < 4; c++, dst += 64) {
        k4_values(qs, qh, c, v0, v1);
        store_shifted(dst, v0, scale[2 * c], minimum[2 * c]);
        store_shifted(dst + 32, v1, scale[2 * c + 1], minimum[2 * c + 1]);
    }
}

static AVX512 void decode_q4_K(const void *row, float *dst, size_t k) {
    const block_q4_K *b = row;
    for (size_t i = 0; i < k / QK_K; i++, dst += QK_K)
        decode_k4(b[i].scales, b[i].qs, NULL, half(b[i].d), half(b[i].dmin), dst);
}

static AVX512 void decode_q5_K(const void *row, float *dst, size_t k) {
    const block_q5_K *b = row;
    for (size_t i = 0; i < k / QK_K; i++, dst += QK_K)
        decode_k4(b[i].scales, b[i].qs, b[i].qh, half(b[i].d), half(b[i].dmin), dst);
}

static AVX512 void decode_q6_K(const void *row, float *dst, size_t k) {
    const block_q6_K *b = row;
    float scale[16];
    __m512 v[4];
    for (size_t i = 0; i < k / QK_K; i++, dst += QK_K) {
        _mm512_storeu_ps(scale, q6_scales(b + i));
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 2; g++) {
                q6_values(b + i, h, g, v);
                for (int t = 0; t < 4; t++) { /* element 128h + 32t + 16g, scale group 8h + 2t + g */
                    const __m512 sv = _mm512_set1_ps(scale[8 * h + 2 * t + g]);
                    _mm512_storeu_ps(dst + 128 * h + 32 * t + 16 * g, _mm512_mul_ps(sv, v[t]));
                }
            }
    }
}

/* ---- reduction of a tile ----------------------------------------------------------------- */

/* Lane i of the result is the sum of the 16 lanes of a[i], every a[i] reduced by the same tree:
 * 256-bit halves, then 128-bit quarters, then element pairs. */
AVX512_INLINE __m512 reduce16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* [a2i (8 lanes) | a2i+1 (8 lanes)] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* [a4i | a4i+1 | a4i+2 | a4i+3], 4 lanes each */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* quarter q: [a8i+q, a8i+4+q], 2 lanes each */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xee));
    /* quarter q: [aq, a4+q, a8+q, a12+q] -> natural order */
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}

/* y[j] = sum of the lanes of acc[j] (+ bias[j]) for j < rows. */
AVX512_INLINE void store_tile(const __m512 acc[16], size_t rows, float *y, const float *bias) {
    const __mmask16 keep = tail_mask(rows);
    __m512 s = reduce16(acc);
    if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(keep, bias));
    _mm512_mask_storeu_ps(y, keep, s);
}

/* ---- M = 1: one row . x as a vector of 16 partial sums ----------------------------------- */

/* v (2 vectors of 32 consecutive elements) . x, lane-wise */
AVX512_INLINE __m512 dot32(const __m512 v[2], const float *x) {
    return _mm512_fmadd_ps(v[1], _mm512_loadu_ps(x + 16), _mm512_mul_ps(v[0], _mm512_loadu_ps(x)));
}

AVX512_INLINE __m512 row_f32(const float *w, const float *x, size_t k) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    size_t i = 0;
    for (; i + 64 <= k; i += 64) {
        prefetch_ahead(w + i, 64 * sizeof(float));
        for (int g = 0; g < 4; g++)
            acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16 * g), _mm512_loadu_ps(x + i + 16 * g), acc[g]);
    }
    for (; i + 16 <= k; i += 16) acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc[0]);
    if (i < k) {
        const __mmask16 t = tail_mask(k - i);
        acc[1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(t, w + i), _mm512_maskz_loadu_ps(t, x + i), acc[1]);
    }
    return _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
}

/* f16 (bf16 when brain) row . x */
AVX512_INLINE __m512 row_half(const uint16_t *w, const float *x, size_t k, const int brain) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    size_t i = 0;
    for (; i + 64 <= k; i += 64) {
        prefetch_ahead(w + i, 64 * sizeof(uint16_t));
        for (int g = 0; g < 4; g++) {
            const __m512 wv = brain ? bf16x16(w + i + 16 * g, 0xffff) : f16x16(w + i + 16 * g, 0xffff);
            acc[g] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i + 16 * g), acc[g]);
        }
    }
    for (; i + 16 <= k; i += 16) {
        const __m512 wv = brain ? bf16x16(w + i, 0xffff) : f16x16(w + i, 0xffff);
        acc[0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), acc[0]);
    }
    if (i < k) {
        const __mmask16 t = tail_mask(k - i);
        const __m512 wv = brain ? bf16x16(w + i, t) : f16x16(w + i, t);
        acc[1] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(t, x + i), acc[1]);
    }
    return _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
}

/* The 32-element formats: sum over blocks of d * (q . x), plus m * sum(x) for q4_1 / q5_1.
 * Scales come 16 blocks at a time from one gather and one conversion, so the per-block work
 * is the decode and three FMAs. */
enum { L_Q4_0, L_Q4_1, L_Q5_0, L_Q5_1, L_Q8_0 };

AVX512_INLINE void legacy_values(const void *block, const int kind, __m512 v[2]) {
    switch (kind) {
    case L_Q4_0: q4_values(((const block_q4_0 *)block)->qs, 8, v); break;
    case L_Q4_1: q4_values(((const block_q4_1 *)block)->qs, 0, v); break;
    case L_Q5_0: q5_values(((const block_q5_0 *)block)->qs, ((const block_q5_0 *)block)->qh, 16, v); break;
    case L_Q5_1: q5_values(((const block_q5_1 *)block)->qs, ((const block_q5_1 *)block)->qh, 0, v); break;
    default: q8_values(((const block_q8_0 *)block)->qs, v); break;
    }
}

/* The first 4 bytes (d, and m where there is one) of `count` blocks `stride` bytes apart. */
AVX512_INLINE __m512i block_heads(const uint8_t *first, const int stride, size_t count) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(stride));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tail_mask(count), offsets, first, 1);
}

AVX512_INLINE __m512 low_halves(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }

AVX512_INLINE __m512 high_halves(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); }

AVX512_INLINE __m512 row_legacy(const uint8_t *blocks, const float *x, const float *xsum, size_t k, const int kind,
                                const int stride, const int has_min) {
    const size_t nb = k / QK;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), v[2]; /* named: kept in registers */
    float d[16];
    for (size_t g = 0; g < nb; g += 16) {
        const size_t count = nb - g < 16 ? nb - g : 16;
        const __m512i heads = block_heads(blocks + g * (size_t)stride, stride, count);
        _mm512_storeu_ps(d, low_halves(heads));
        if (has_min) /* lane-wise m * sum(x), reduced with the rest */
            acc1 = _mm512_fmadd_ps(high_halves(heads), _mm512_maskz_loadu_ps(tail_mask(count), xsum + g), acc1);
        for (size_t i = 0; i < count; i++) { /* even blocks into acc0, odd into acc1 */
            prefetch_ahead(blocks + (g + i) * (size_t)stride, (size_t)stride);
            legacy_values(blocks + (g + i) * (size_t)stride, kind, v);
            const __m512 t = dot32(v, x + (g + i) * QK);
            if (i & 1) acc1 = _mm512_fmadd_ps(_mm512_set1_ps(d[i]), t, acc1);
            else acc0 = _mm512_fmadd_ps(_mm512_set1_ps(d[i]), t, acc0);
        }
    }
    return _mm512_add_ps(acc0, acc1);
}

/* q4_K / q5_K: sum over sub-blocks j of d_j * (q . x) - min_j * sum(x). */
AVX512_INLINE __m512 row_k4(const uint8_t *row, const float *x, const float *xsum, size_t k, const int five) {
    const size_t stride = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, v0[2], v1[2];
    __m256 mins = _mm256_setzero_ps();
    float scale[8];
    for (size_t i = 0; i < k / QK_K; i++) {
        const uint8_t *blk = row + i * stride;
        prefetch_ahead(blk, stride);
        const block_q4_K *b4 = (const block_q4_K *)blk; /* q5_K starts with the same fields */
        const uint8_t *qh = five ? ((const block_q5_K *)blk)->qh : NULL;
        const uint8_t *qs = five ? ((const block_q5_K *)blk)->qs : b4->qs;
        __m256 s, m;
        k4_scales(b4->scales, half(b4->d), half(b4->dmin), &s, &m);
        _mm256_storeu_ps(scale, s);
        mins = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + 8 * i), mins);
        const float *xb = x + i * QK_K;
        for (int c = 0; c < 4; c++) {
            k4_values(qs, qh, c, v0, v1);
            acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * c]), dot32(v0, xb + 64 * c), acc[0]);
            acc[1] = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * c + 1]), dot32(v1, xb + 64 * c + 32), acc[1]);
        }
    }
    return _mm512_sub_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_zextps256_ps512(mins));
}

/* q6_K: one scale per 16 elements, i.e. per vector. */
AVX512_INLINE __m512 row_q6_K(const block_q6_K *b, const float *x, size_t k) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, v[4];
    float scale[16];
    for (size_t i = 0; i < k / QK_K; i++) {
        prefetch_ahead(b + i, sizeof(block_q6_K));
        _mm512_storeu_ps(scale, q6_scales(b + i));
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 2; g++) {
                q6_values(b + i, h, g, v);
                const float *xp = x + i * QK_K + 128 * h + 16 * g;
                for (int t = 0; t < 4; t++)
                    acc[t & 1] = _mm512_fmadd_ps(_mm512_set1_ps(scale[8 * h + 2 * t + g]),
                                                 _mm512_mul_ps(v[t], _mm512_loadu_ps(xp + 32 * t)), acc[t & 1]);
            }
    }
    return _mm512_add_ps(acc[0], acc[1]);
}

AVX512_INLINE __m512 row_dot(const uint8_t *row, const float *x, const float *xsum, size_t k, const int ix) {
    switch (ix) {
    case IX_F32: return row_f32((const float *)row, x, k);
    case IX_F16: return row_half((const uint16_t *)row, x, k, 0);
    case IX_BF16: return row_half((const uint16_t *)row, x, k, 1);
    case IX_Q4_0: return row_legacy(row, x, xsum, k, L_Q4_0, sizeof(block_q4_0), 0);
    case IX_Q4_1: return row_legacy(row, x, xsum, k, L_Q4_1, sizeof(block_q4_1), 1);
    case IX_Q5_0: return row_legacy(row, x, xsum, k, L_Q5_0, sizeof(block_q5_0), 0);
    case IX_Q5_1: return row_legacy(row, x, xsum, k, L_Q5_1, sizeof(block_q5_1), 1);
    case IX_Q8_0: return row_legacy(row, x, xsum, k, L_Q8_0, sizeof(block_q8_0), 0);
    case IX_Q4_K: return row_k4(row, x, xsum, k, 0);
    case IX_Q5_K: return row_k4(row, x, xsum, k, 1);
    default: return row_q6_K((const block_q6_K *)row, x, k);
    }
}

/* Up to 16 rows, each kept as 16 partial sums, reduced together at the end. */
AVX512_INLINE void dot_tile(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias, const int ix) {
    __m512 acc[16];
    for (size_t j = 0; j < 16; j++)
        acc[j] = j < rows ? row_dot((const uint8_t *)w + j * row_bytes, x, xsum, k, ix) : _mm512_setzero_ps();
    store_tile(acc, rows, y, bias);
}

static AVX512 void dot_f32(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                           float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_F32);
}

static AVX512 void dot_f16(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                           float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_F16);
}

static AVX512 void dot_bf16(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_BF16);
}

static AVX512 void dot_q4_0(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q4_0);
}

static AVX512 void dot_q4_1(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q4_1);
}

static AVX512 void dot_q5_0(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q5_0);
}

static AVX512 void dot_q5_1(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q5_1);
}

static AVX512 void dot_q8_0(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q8_0);
}

static AVX512 void dot_q4_K(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q4_K);
}

static AVX512 void dot_q5_K(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q5_K);
}

static AVX512 void dot_q6_K(const void *w, size_t row_bytes, size_t rows, const float *x, const float *xsum, size_t k,
                            float *y, const float *bias) {
    dot_tile(w, row_bytes, rows, x, xsum, k, y, bias, IX_Q6_K);
}

/* ---- M > 1: a decoded tile of 16 rows of W . rows of X ----------------------------------- */

/* acc[r * nr + j] += w[j] . x[r] lane-wise, for nr rows of w and mr rows of x (nr * mr = 16);
 * nr and mr are constants at each call site, so the loops unroll into registers. */
AVX512_INLINE void tile_block(const float *w, size_t k, const float *x, size_t ldx, const int nr, const int mr,
                              __m512 acc[16]) {
    for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 xv[2];
        for (int r = 0; r < mr; r++) xv[r] = _mm512_loadu_ps(x + (size_t)r * ldx + i);
        for (int j = 0; j < nr; j++) {
            const __m512 wv = _mm512_loadu_ps(w + (size_t)j * k + i);
            for (int r = 0; r < mr; r++) acc[r * nr + j] = _mm512_fmadd_ps(wv, xv[r], acc[r * nr + j]);
        }
    }
    if (i < k) { /* f16/bf16/f32 rows of any length */
        const __mmask16 t = tail_mask(k - i);
        __m512 xv[2];
        for (int r = 0; r < mr; r++) xv[r] = _mm512_maskz_loadu_ps(t, x + (size_t)r * ldx + i);
        for (int j = 0; j < nr; j++) {
            const __m512 wv = _mm512_maskz_loadu_ps(t, w + (size_t)j * k + i);
            for (int r = 0; r < mr; r++) acc[r * nr + j] = _mm512_fmadd_ps(wv, xv[r], acc[r * nr + j]);
        }
    }
}

/* Two rows of x at a time against 8 + 8 rows of w (10 loads per 16 FMAs); one row of x
 * against all 16 for an odd last row. */
static AVX512 void tile(const float *w, size_t rows, size_t k, const float *x, size_t ldx, size_t m, float *y,
                        size_t ldy, const float *bias) {
    __m512 acc[16];
    size_t r = 0;
    for (; r + 2 <= m; r += 2) {
        for (size_t j0 = 0; j0 < rows; j0 += 8) {
            tile_block(w + j0 * k, k, x + r * ldx, ldx, 8, 2, acc);
            const __m512 s = reduce16(acc); /* [row r: w j0..j0+7 | row r+1: w j0..j0+7] */
            const __mmask8 keep = (__mmask8)tail_mask(rows - j0 < 8 ? rows - j0 : 8);
            const __m256 lo = _mm512_castps512_ps256(s), hi = _mm512_castps512_ps256(_mm512_shuffle_f32x4(s, s, 0xee));
            const __m256 b = bias ? _mm256_maskz_loadu_ps(keep, bias + j0) : _mm256_setzero_ps();
            _mm256_mask_storeu_ps(y + r * ldy + j0, keep, bias ? _mm256_add_ps(lo, b) : lo);
            _mm256_mask_storeu_ps(y + (r + 1) * ldy + j0, keep, bias ? _mm256_add_ps(hi, b) : hi);
        }
    }
    if (r < m) {
        tile_block(w, k, x + r * ldx, ldx, 16, 1, acc);
        store_tile(acc, rows, y + r * ldy, bias);
    }
}

static const lq_kernels KERNELS = {
    .name = "avx512",
    .decode = {
        [IX_F32] = lq_decode_f32, [IX_F16] = decode_f16, [IX_BF16] = decode_bf16,
        [IX_Q4_0] = decode_q4_0, [IX_Q4_1] = decode_q4_1, [IX_Q5_0] = decode_q5_0,
        [IX_Q5_1] = decode_q5_1, [IX_Q8_0] = decode_q8_0, [IX_Q4_K] = decode_q4_K,
        [IX_Q5_K] = decode_q5_K, [IX_Q6_K] = decode_q6_K,
    },
    .dot = {
        [IX_F32] = dot_f32, [IX_F16] = dot_f16, [IX_BF16] = dot_bf16,
        [IX_Q4_0] = dot_q4_0, [IX_Q4_1] = dot_q4_1, [IX_Q5_0] = dot_q5_0,
        [IX_Q5_1] = dot_q5_1, [IX_Q8_0] = dot_q8_0, [IX_Q4_K] = dot_q4_K,
        [IX_Q5_K] = dot_q5_K, [IX_Q6_K] = dot_q6_K,
    },
    .tile = tile,
    .tile_rows = TILE,
};

const lq_kernels *lq_kernels_avx512(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return &KERNELS;
    return NULL;
}

#else /* not x86-64 */
const lq_kernels *lq_kernels_avx512(void) { return NULL; }
#endif
