/* AVX2 + FMA + F16C kernels for quant.c: 8 floats per vector.
 *
 * The arithmetic of this level (quant.h), the same for every output whatever M is: weights
 * decoded exactly (d * q, then + m or - m), one 8-lane accumulator per output updated by
 * acc = fma(w[8c .. 8c+7], x[8c .. 8c+7], acc) for chunks c in order (a partial last chunk
 * zero-padded), lanes summed by the halving tree of reduce8, then + bias. M = 1 (and M = 2 for
 * the block formats, each weight decoded once for both rows; measured 10-20% faster than decode
 * + tile) decodes in registers, 4 rows at a time; more rows multiply decoded rows in register
 * blocks. (Tried and dropped: decoding in registers for the first 2 rows of X and keeping the
 * rows for the others, as the AVX-512 level does up to 64 rows: 5-10% slower here at M = 3..16.)
 *
 * Compiled without -march: every function carries a target attribute and runs only after
 * lq_kernels_avx2() has checked the CPU.
 */
#include "quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include "quant_x86.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

#define DOT_ROWS 8  /* rows of W per M = 1 call: one reduce8 */
#define TILE_ROWS 8 /* rows of W decoded at a time for M > 1 (a multiple: quant.c) */
#define GROUP 4     /* rows of W decoded together in registers at M = 1 (independent FMA chains) */
#define MAX_MX 2    /* rows of X the block formats' kernels of a few rows take at once (16 registers) */

AVX2_INLINE __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

AVX2_INLINE __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

AVX2_INLINE __m256i tail_mask(size_t n) { /* the first n of 8 lanes */
    static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(ones + 8 - n));
}

/* ---- integer values of 32 elements as floats: v[g] = elements 8g .. 8g+7 ----------------- */

/* The 32 nibbles of a q4/q5 block: low nibbles are elements 0..15, high nibbles 16..31. */
AVX2_INLINE void nibbles(const uint8_t *qs, __m256i q[4]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, m), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    q[0] = _mm256_cvtepu8_epi32(lo);
    q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepu8_epi32(hi);
    q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

AVX2_INLINE void q4_values(const uint8_t *qs, int offset, __m256 v[4]) {
    __m256i q[4];
    nibbles(qs, q);
    for (int g = 0; g < 4; g++) v[g] = to_float(_mm256_sub_epi32(q[g], _mm256_set1_epi32(offset)));
}

/* 16 where bit 8g+i of qh is set, for the 8 elements i of group g. */
AVX2_INLINE __m256i fifth_bit(uint32_t qh, int g) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i v = _mm256_and_si256(_mm256_set1_epi32((int)((qh >> (8 * g)) & 0xff)), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi32(v, sel), _mm256_set1_epi32(16));
}

AVX2_INLINE void q5_values(const uint8_t *qs, const uint8_t *qhp, int offset, __m256 v[4]) {
    __m256i q[4];
    uint32_t qh;
    memcpy(&qh, qhp, 4);
    nibbles(qs, q);
    for (int g = 0; g < 4; g++)
        v[g] = to_float(_mm256_sub_epi32(_mm256_or_si256(q[g], fifth_bit(qh, g)), _mm256_set1_epi32(offset)));
}

AVX2_INLINE void q8_values(const int8_t *qs, __m256 v[4]) {
    for (int g = 0; g < 4; g++) v[g] = to_float(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * g))));
}

/* 16 where bit j of each of the 8 bytes h (widened to int32) is set. */
AVX2_INLINE __m256i bit_j(__m256i h, int j) {
    return _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi32(1)), 4);
}

/* Sub-blocks 2c (v0) and 2c+1 (v1) of a q4_K / q5_K super-block; qh NULL for q4_K. */
AVX2_INLINE void k4_values(const uint8_t *qs, const uint8_t *qh, int c, __m256 v0[4], __m256 v1[4]) {
    const __m256i m = _mm256_set1_epi32(0x0f);
    for (int g = 0; g < 4; g++) {
        const __m256i raw = u8x8(qs + 32 * c + 8 * g);
        __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_srli_epi32(raw, 4);
        if (qh) {
            const __m256i h = u8x8(qh + 8 * g);
            lo = _mm256_or_si256(lo, bit_j(h, 2 * c));
            hi = _mm256_or_si256(hi, bit_j(h, 2 * c + 1));
        }
        v0[g] = to_float(lo);
        v1[g] = to_float(hi);
    }
}

/* The 8 scales d * sc_j and mins dmin * m_j of a q4_K / q5_K super-block. */
AVX2_INLINE void k4_scales(const uint8_t *packed, float d, float dmin, __m256 *scale, __m256 *minimum) {
    uint8_t sc[8], mn[8];
    unpack_scales_k4_le(packed, sc, mn);
    *scale = _mm256_mul_ps(_mm256_set1_ps(d), to_float(u8x8(sc)));
    *minimum = _mm256_mul_ps(_mm256_set1_ps(dmin), to_float(u8x8(mn)));
}

/* The 32 elements 128h + 8g + {0, 32, 64, 96} of a q6_K super-block (t = 0..3 in v[t]),
 * minus 32; see quant.c for the bit layout. */
AVX2_INLINE void q6_values(const block_q6_K *b, int h, int g, __m256 v[4]) {
    const __m256i a = u8x8(b->ql + 64 * h + 8 * g), c = u8x8(b->ql + 64 * h + 32 + 8 * g);
    const __m256i hq = u8x8(b->qh + 32 * h + 8 * g);
    const __m256i low4 = _mm256_set1_epi32(0x0f), top2 = _mm256_set1_epi32(0x30), off = _mm256_set1_epi32(32);
    const __m256i q[4] = {
        _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi32(hq, 4), top2)),
        _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_slli_epi32(hq, 2), top2)),
        _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_and_si256(hq, top2)),
        _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_and_si256(_mm256_srli_epi32(hq, 2), top2)),
    };
    for (int t = 0; t < 4; t++) v[t] = to_float(_mm256_sub_epi32(q[t], off));
}

/* q - 32 for the 32 elements 128h + 32t .. +31 of a q6_K super-block (quant_x86.h: q6_codes),
 * as floats v[g] = elements 128h + 32t + 8g .. +7. */
AVX2_INLINE void q6_quarter(const block_q6_K *b, int h, int t, __m256 v[4]) {
    const __m256i q = q6_codes(b, h, t);
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    v[0] = to_float(_mm256_cvtepi8_epi32(q0));
    v[1] = to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)));
    v[2] = to_float(_mm256_cvtepi8_epi32(q1));
    v[3] = to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)));
}

/* d * scale for the 16 groups of 16 elements of a q6_K super-block, in two vectors. */
AVX2_INLINE void q6_scales(const block_q6_K *b, float out[16]) {
    const __m256 d = _mm256_set1_ps(half(b->d));
    const __m128i s = _mm_loadu_si128((const __m128i *)b->scales);
    _mm256_storeu_ps(out, _mm256_mul_ps(d, to_float(_mm256_cvtepi8_epi32(s))));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8)))));
}

/* ---- decoders (bit-exact: d * q, then + m or - m) ---------------------------------------- */

/* d * q + m (or - m) as one fma: d * q is exact in f32 (a half scale, or a half times a 6-bit
 * sub-block scale, times a code of at most 5 bits), so the single rounding gives the bits of the
 * reference's two (quant.h). */

AVX2_INLINE void store_scaled(float *dst, const __m256 v[4], float d) {
    const __m256 dv = _mm256_set1_ps(d);
    for (int g = 0; g < 4; g++) _mm256_storeu_ps(dst + 8 * g, _mm256_mul_ps(dv, v[g]));
}

AVX2_INLINE void store_affine(float *dst, const __m256 v[4], float d, float m) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    for (int g = 0; g < 4; g++) _mm256_storeu_ps(dst + 8 * g, _mm256_fmadd_ps(dv, v[g], mv));
}

AVX2_INLINE void store_shifted(float *dst, const __m256 v[4], float d, float m) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    for (int g = 0; g < 4; g++) _mm256_storeu_ps(dst + 8 * g, _mm256_fmsub_ps(dv, v[g], mv));
}

AVX2_INLINE __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

AVX2_INLINE __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static AVX2 void decode_f16(const void *row, float *dst, size_t k) {
    const uint16_t *p = row;
    size_t i = 0;
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(dst + i, f16x8(p + i));
    for (; i < k; i++) dst[i] = half(p[i]);
}

static AVX2 void decode_bf16(const void *row, float *dst, size_t k) {
    const uint16_t *p = row;
    size_t i = 0;
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(dst + i, bf16x8(p + i));
    for (; i < k; i++) dst[i] = lq_bf16_to_float(p[i]);
}

static AVX2 void decode_q4_0(const void *row, float *dst, size_t k) {
    const block_q4_0 *b = row;
    __m256 v[4];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q4_values(b[i].qs, 8, v);
        store_scaled(dst, v, half(b[i].d));
    }
}

static AVX2 void decode_q4_1(const void *row, float *dst, size_t k) {
    const block_q4_1 *b = row;
    __m256 v[4];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q4_values(b[i].qs, 0, v);
        store_affine(dst, v, half(b[i].d), half(b[i].m));
    }
}

static AVX2 void decode_q5_0(const void *row, float *dst, size_t k) {
    const block_q5_0 *b = row;
    __m256 v[4];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q5_values(b[i].qs, b[i].qh, 16, v);
        store_scaled(dst, v, half(b[i].d));
    }
}

static AVX2 void decode_q5_1(const void *row, float *dst, size_t k) {
    const block_q5_1 *b = row;
    __m256 v[4];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q5_values(b[i].qs, b[i].qh, 0, v);
        store_affine(dst, v, half(b[i].d), half(b[i].m));
    }
}

static AVX2 void decode_q8_0(const void *row, float *dst, size_t k) {
    const block_q8_0 *b = row;
    __m256 v[4];
    for (size_t i = 0; i < k / QK; i++, dst += QK) {
        q8_values(b[i].qs, v);
        store_scaled(dst, v, half(b[i].d));
    }
}

/* q4_K and q5_K: d_j * q - min_j per sub-block j. */
AVX2_INLINE void decode_k4(const uint8_t *packed, const uint8_t *qs, const uint8_t *qh, float d, float dmin,
                           float *dst) {
    float scale[8], minimum[8];
    __m256 s, m, v0[4], v1[4];
    k4_scales(packed, d, dmin, &s, &m);
    _mm256_storeu_ps(scale, s);
    _mm256_storeu_ps(minimum, m);
    for (int c = 0; c < 4; c++, dst += 64) {
        k4_values(qs, qh, c, v0, v1);
        store_shifted(dst, v0, scale[2 * c], minimum[2 * c]);
        store_shifted(dst + 32, v1, scale[2 * c + 1], minimum[2 * c + 1]);
    }
}

static AVX2 void decode_q4_K(const void *row, float *dst, size_t k) {
    const block_q4_K *b = row;
    for (size_t i = 0; i < k / QK_K; i++, dst += QK_K)
        decode_k4(b[i].scales, b[i].qs, NULL, half(b[i].d), half(b[i].dmin), dst);
}

static AVX2 void decode_q5_K(const void *row, float *dst, size_t k) {
    const block_q5_K *b = row;
    for (size_t i = 0; i < k / QK_K; i++, dst += QK_K)
        decode_k4(b[i].scales, b[i].qs, b[i].qh, half(b[i].d), half(b[i].dmin), dst);
}

static AVX2 void decode_q6_K(const void *row, float *dst, size_t k) {
    const block_q6_K *b = row;
    float scale[16];
    __m256 v[4];
    for (size_t i = 0; i < k / QK_K; i++, dst += QK_K) {
        q6_scales(b + i, scale);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++) {
                q6_values(b + i, h, g, v);
                for (int t = 0; t < 4; t++) /* element 128h + 32t + 8g, scale group 8h + 2t + g/2 */
                    _mm256_storeu_ps(dst + 128 * h + 32 * t + 8 * g,
                                     _mm256_mul_ps(_mm256_set1_ps(scale[8 * h + 2 * t + g / 2]), v[t]));
            }
    }
}

/* ---- reduction of a tile ----------------------------------------------------------------- */

/* Lane i of the result is the sum of the 8 lanes of a[i], every a[i] reduced by the same tree:
 * 128-bit halves, then element pairs. */
AVX2_INLINE __m256 reduce8(const __m256 a[8]) {
    __m256 b[4], c[2], e[1];
    LQ_TREE_STEP(b, a, 4, _mm256_add_ps, _mm256_permute2f128_ps, 0x20, 0x31); /* [a2i (4 lanes) | a2i+1 (4 lanes)] */
    LQ_TREE_STEP(c, b, 2, _mm256_add_ps, _mm256_shuffle_ps, 0x44, 0xee); /* half h: [a4i+h, a4i+2+h], 2 lanes each */
    LQ_TREE_STEP(e, c, 1, _mm256_add_ps, _mm256_shuffle_ps, 0x88, 0xdd); /* half h: [ah, a2+h, a4+h, a6+h] */
    return _mm256_permutevar8x32_ps(e[0], _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* natural order */
}

/* y[j] = v[j] (+ bias[j]) for j < n <= 8. */
AVX2_INLINE void store_row(float *y, __m256 v, const float *bias, size_t n) {
    if (n == 8) {
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(y, v);
        return;
    }
    const __m256i keep = tail_mask(n);
    if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias, keep));
    _mm256_maskstore_ps(y, keep, v);
}

/* ---- M = 1 (and 2): 4 rows at a time, decoded in registers ---------------------------------- */

/* acc[r] = the accumulator (step 2) of row[r] . x, r < GROUP: the rows advance together, so
 * each block of x is loaded once and the 4 FMA chains hide each other's latency. */

/* 8 weights of an f32 (kind 0), f16 (1) or bf16 (2) row from element i */
AVX2_INLINE __m256 floats8(const uint8_t *row, size_t i, const int kind) {
    if (kind == 0) return _mm256_loadu_ps((const float *)row + i);
    return kind == 1 ? f16x8((const uint16_t *)row + i) : bf16x8((const uint16_t *)row + i);
}

AVX2_INLINE void group_float(const uint8_t *const row[GROUP], const float *x, size_t k, const int kind,
                             __m256 out[GROUP]) {
    const size_t width = kind == 0 ? 4 : 2;
    __m256 acc[GROUP];
    for (int r = 0; r < GROUP; r++) acc[r] = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        for (int r = 0; r < GROUP; r++) {
            if ((i & 31) == 0) prefetch_ahead(row[r] + i * width, 32 * width);
            acc[r] = _mm256_fmadd_ps(floats8(row[r], i, kind), xv, acc[r]);
        }
    }
    if (i < k) { /* the zero-padded last chunk, as the tile path's masked loads give it */
        const __m256i t = tail_mask(k - i);
        const __m256 xv = _mm256_maskload_ps(x + i, t);
        for (int r = 0; r < GROUP; r++) {
            float w[8] = {0};
            for (size_t j = 0; i + j < k; j++) {
                const uint16_t *h = (const uint16_t *)row[r] + i + j;
                w[j] = kind == 0 ? ((const float *)row[r])[i + j] : kind == 1 ? half(*h) : lq_bf16_to_float(*h);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w), xv, acc[r]);
        }
    }
    for (int r = 0; r < GROUP; r++) out[r] = acc[r];
}

/* The 32-element formats: the weights of a block, exactly as the decoders store them. */
enum { L_Q4_0, L_Q4_1, L_Q5_0, L_Q5_1, L_Q8_0 };

AVX2_INLINE void legacy_weights(const uint8_t *blk, const int kind, float d, float m, __m256 w[4]) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    switch (kind) {
    case L_Q4_0: q4_values(((const block_q4_0 *)blk)->qs, 8, w); break;
    case L_Q4_1: q4_values(((const block_q4_1 *)blk)->qs, 0, w); break;
    case L_Q5_0: q5_values(((const block_q5_0 *)blk)->qs, ((const block_q5_0 *)blk)->qh, 16, w); break;
    case L_Q5_1: q5_values(((const block_q5_1 *)blk)->qs, ((const block_q5_1 *)blk)->qh, 0, w); break;
    default: q8_values(((const block_q8_0 *)blk)->qs, w); break;
    }
    for (int g = 0; g < 4; g++) /* one fma where there is a min: see store_affine */
        w[g] = kind == L_Q4_1 || kind == L_Q5_1 ? _mm256_fmadd_ps(dv, w[g], mv) : _mm256_mul_ps(dv, w[g]);
}

/* The first 4 bytes (d, and m where there is one) of `count` blocks `stride` bytes apart. */
AVX2_INLINE __m256i block_heads(const uint8_t *first, const int stride, size_t count) {
    const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)first, offsets, tail_mask(count), 1);
}

/* The low (shift 0) or high (shift 16) half of each 32-bit lane, as f16 -> f32. */
AVX2_INLINE __m256 halves(__m256i v, const int shift) {
    const __m256i h = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

AVX2_INLINE void group_legacy(const uint8_t *const row[GROUP], const float *x, size_t ldx, const int mx, size_t k,
                              const int kind, const int stride, const int has_min, __m256 out[]) {
    const size_t nb = k / QK;
    __m256 acc[GROUP * MAX_MX], w[4];
    float d[GROUP][8], m[GROUP][8];
    for (int a = 0; a < GROUP * mx; a++) acc[a] = _mm256_setzero_ps();
    for (size_t g = 0; g < nb; g += 8) {
        const size_t count = nb - g < 8 ? nb - g : 8;
        for (int r = 0; r < GROUP; r++) {
            const __m256i heads = block_heads(row[r] + g * (size_t)stride, stride, count);
            _mm256_storeu_ps(d[r], halves(heads, 0));
            if (has_min) _mm256_storeu_ps(m[r], halves(heads, 16));
        }
        for (size_t i = 0; i < count; i++) {
            const float *xb = x + (g + i) * QK;
            for (int j = 0; j < GROUP; j++) {
                const uint8_t *blk = row[j] + (g + i) * (size_t)stride;
                prefetch_ahead(blk, (size_t)stride);
                legacy_weights(blk, kind, d[j][i], has_min ? m[j][i] : 0.0f, w);
                for (int r = 0; r < mx; r++)
                    for (int v = 0; v < 4; v++)
                        acc[GROUP * r + j] =
                            _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xb + (size_t)r * ldx + 8 * v), acc[GROUP * r + j]);
            }
        }
    }
    for (int a = 0; a < GROUP * mx; a++) out[a] = acc[a];
}

/* q4_K / q5_K: scale_j * q - min_j per sub-block j. */
AVX2_INLINE void group_k4(const uint8_t *const row[GROUP], const float *x, size_t ldx, const int mx, size_t k,
                          const int five, __m256 out[]) {
    const size_t stride = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    __m256 acc[GROUP * MAX_MX], v0[4], v1[4];
    float scale[GROUP][8], minimum[GROUP][8];
    for (int a = 0; a < GROUP * mx; a++) acc[a] = _mm256_setzero_ps();
    for (size_t i = 0; i < k / QK_K; i++) {
        for (int r = 0; r < GROUP; r++) {
            const block_q4_K *b4 = (const block_q4_K *)(row[r] + i * stride); /* q5_K starts alike */
            prefetch_ahead(b4, stride);
            __m256 s, mn;
            k4_scales(b4->scales, half(b4->d), half(b4->dmin), &s, &mn);
            _mm256_storeu_ps(scale[r], s);
            _mm256_storeu_ps(minimum[r], mn);
        }
        for (int c = 0; c < 4; c++) {
            const float *xc = x + i * QK_K + 64 * c;
            for (int j = 0; j < GROUP; j++) {
                const uint8_t *blk = row[j] + i * stride;
                const uint8_t *qh = five ? ((const block_q5_K *)blk)->qh : NULL;
                const uint8_t *qs = five ? ((const block_q5_K *)blk)->qs : ((const block_q4_K *)blk)->qs;
                k4_values(qs, qh, c, v0, v1);
                const __m256 s0 = _mm256_set1_ps(scale[j][2 * c]), n0 = _mm256_set1_ps(minimum[j][2 * c]);
                const __m256 s1 = _mm256_set1_ps(scale[j][2 * c + 1]), n1 = _mm256_set1_ps(minimum[j][2 * c + 1]);
                for (int g = 0; g < 8; g++) { /* elements 64c + 8g .. +7 */
                    const __m256 w = g < 4 ? _mm256_fmsub_ps(s0, v0[g], n0) : _mm256_fmsub_ps(s1, v1[g - 4], n1);
                    for (int r = 0; r < mx; r++)
                        acc[GROUP * r + j] =
                            _mm256_fmadd_ps(w, _mm256_loadu_ps(xc + (size_t)r * ldx + 8 * g), acc[GROUP * r + j]);
                }
            }
        }
    }
    for (int a = 0; a < GROUP * mx; a++) out[a] = acc[a];
}

/* q6_K, 32 elements at a time in element order: quarter 4h + t holds elements 128h + 32t ..
 * +31 (see q6_quarter), vector g of it scale group 8h + 2t + g / 2. */
AVX2_INLINE void group_q6_K(const uint8_t *const row[GROUP], const float *x, size_t ldx, const int mx, size_t k,
                            __m256 out[]) {
    __m256 acc[GROUP * MAX_MX], v[4];
    float scale[GROUP][16];
    for (int a = 0; a < GROUP * mx; a++) acc[a] = _mm256_setzero_ps();
    for (size_t i = 0; i < k / QK_K; i++) {
        for (int r = 0; r < GROUP; r++) {
            prefetch_ahead((const block_q6_K *)row[r] + i, sizeof(block_q6_K));
            q6_scales((const block_q6_K *)row[r] + i, scale[r]);
        }
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++) {
                const float *xq = x + i * QK_K + 128 * h + 32 * t;
                for (int j = 0; j < GROUP; j++) {
                    q6_quarter((const block_q6_K *)row[j] + i, h, t, v);
                    for (int g = 0; g < 4; g++) {
                        const __m256 w = _mm256_mul_ps(_mm256_set1_ps(scale[j][8 * h + 2 * t + g / 2]), v[g]);
                        for (int r = 0; r < mx; r++)
                            acc[GROUP * r + j] =
                                _mm256_fmadd_ps(w, _mm256_loadu_ps(xq + (size_t)r * ldx + 8 * g), acc[GROUP * r + j]);
                    }
                }
            }
    }
    for (int a = 0; a < GROUP * mx; a++) out[a] = acc[a];
}

AVX2_INLINE void group_dot(const uint8_t *const row[GROUP], const float *x, size_t ldx, const int mx, size_t k,
                           const int ix, __m256 acc[]) {
    switch (ix) {
    case IX_F32: group_float(row, x, k, 0, acc); break; /* mx = 1 only */
    case IX_F16: group_float(row, x, k, 1, acc); break;
    case IX_BF16: group_float(row, x, k, 2, acc); break;
    case IX_Q4_0: group_legacy(row, x, ldx, mx, k, L_Q4_0, sizeof(block_q4_0), 0, acc); break;
    case IX_Q4_1: group_legacy(row, x, ldx, mx, k, L_Q4_1, sizeof(block_q4_1), 1, acc); break;
    case IX_Q5_0: group_legacy(row, x, ldx, mx, k, L_Q5_0, sizeof(block_q5_0), 0, acc); break;
    case IX_Q5_1: group_legacy(row, x, ldx, mx, k, L_Q5_1, sizeof(block_q5_1), 1, acc); break;
    case IX_Q8_0: group_legacy(row, x, ldx, mx, k, L_Q8_0, sizeof(block_q8_0), 0, acc); break;
    case IX_Q4_K: group_k4(row, x, ldx, mx, k, 0, acc); break;
    case IX_Q5_K: group_k4(row, x, ldx, mx, k, 1, acc); break;
    default: group_q6_K(row, x, ldx, mx, k, acc); break;
    }
}

/* y[r][j] = w[j] . x[r] (+ bias[j]) for j < rows <= 8 (rows row_bytes apart), r < mx (x rows ldx
 * apart, y rows ldy apart): each weight decoded once for the mx rows. */
AVX2_INLINE void dot_rows(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx, const int mx,
                          size_t k, float *y, size_t ldy, const float *bias, const int ix) {
    __m256 acc[MAX_MX][DOT_ROWS];
    for (int r = 0; r < mx; r++)
        for (int j = 0; j < DOT_ROWS; j++) acc[r][j] = _mm256_setzero_ps();
    for (size_t j0 = 0; j0 < rows; j0 += GROUP) {
        const uint8_t *row[GROUP];
        for (size_t r = 0; r < GROUP; r++) /* past the last row: repeat it, results unused */
            row[r] = (const uint8_t *)w + (j0 + r < rows ? j0 + r : rows - 1) * row_bytes;
        __m256 part[GROUP * MAX_MX];
        group_dot(row, x, ldx, mx, k, ix, part);
        for (int r = 0; r < mx; r++)
            for (int j = 0; j < GROUP; j++) acc[r][j0 + j] = part[GROUP * r + j];
    }
    for (int r = 0; r < mx; r++) store_row(y + (size_t)r * ldy, reduce8(acc[r]), bias, rows);
}

/* M = 1, and (DOTM) m = 2 rows of X for the block formats, each weight decoded once for both. */
#define DOT(name, ix)                                                                                        \
    static AVX2 void name(const void *w, size_t row_bytes, size_t rows, const float *x, size_t k, float *y, \
                          const float *bias) {                                                               \
        dot_rows(w, row_bytes, rows, x, 0, 1, k, y, 0, bias, ix);                                            \
    }
#define DOTM(name, ix)                                                                                       \
    DOT(name, ix)                                                                                            \
    static AVX2 void name##_m(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx,     \
                              size_t m, size_t k, float *y, size_t ldy, const float *bias) {                 \
        (void)m; /* MAX_MX */                                                                                \
        dot_rows(w, row_bytes, rows, x, ldx, MAX_MX, k, y, ldy, bias, ix);                                   \
    }
DOT(dot_f32, IX_F32)
DOT(dot_f16, IX_F16)
DOT(dot_bf16, IX_BF16)
DOTM(dot_q4_0, IX_Q4_0)
DOTM(dot_q4_1, IX_Q4_1)
DOTM(dot_q5_0, IX_Q5_0)
DOTM(dot_q5_1, IX_Q5_1)
DOTM(dot_q8_0, IX_Q8_0)
DOTM(dot_q4_K, IX_Q4_K)
DOTM(dot_q5_K, IX_Q5_K)
DOTM(dot_q6_K, IX_Q6_K)
#undef DOTM
#undef DOT

/* ---- M > 1: decoded rows of W times rows of X, 2 x 4 outputs at a time -------------------- */

/* acc[r * nr + j] += w[j] . x[r] lane-wise, for nr rows of w and mr rows of x (nr * mr = 8);
 * nr and mr are constants at each call site, so the loops unroll into registers. */
AVX2_INLINE void tile_block(const float *w, size_t k, const float *x, size_t ldx, const int nr, const int mr,
                            __m256 acc[8]) {
    for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 xv[2];
        for (int r = 0; r < mr; r++) xv[r] = _mm256_loadu_ps(x + (size_t)r * ldx + i);
        for (int j = 0; j < nr; j++) {
            const __m256 wv = _mm256_loadu_ps(w + (size_t)j * k + i);
            for (int r = 0; r < mr; r++) acc[r * nr + j] = _mm256_fmadd_ps(wv, xv[r], acc[r * nr + j]);
        }
    }
    if (i < k) { /* f16/bf16/f32 rows of any length */
        const __m256i t = tail_mask(k - i);
        __m256 xv[2];
        for (int r = 0; r < mr; r++) xv[r] = _mm256_maskload_ps(x + (size_t)r * ldx + i, t);
        for (int j = 0; j < nr; j++) {
            const __m256 wv = _mm256_maskload_ps(w + (size_t)j * k + i, t);
            for (int r = 0; r < mr; r++) acc[r * nr + j] = _mm256_fmadd_ps(wv, xv[r], acc[r * nr + j]);
        }
    }
}

/* y[0][j], y[1][j] (ldy apart) = the lane sums of acc[j], acc[4 + j] (+ bias[j]) for j < n <= 4. */
AVX2_INLINE void store_pair(const __m256 acc[8], size_t n, float *y, size_t ldy, const float *bias) {
    const __m256 s = reduce8(acc); /* [row 0: w 0..3 | row 1: w 0..3] */
    const __m128i keep = _mm256_castsi256_si128(tail_mask(n));
    __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
    if (bias) {
        const __m128 b = _mm_maskload_ps(bias, keep);
        lo = _mm_add_ps(lo, b);
        hi = _mm_add_ps(hi, b);
    }
    _mm_maskstore_ps(y, keep, lo);
    _mm_maskstore_ps(y + ldy, keep, hi);
}

/* Two rows of x at a time against 4 rows of w; one row of x against 8 for an odd last row
 * (the tile holds a multiple of 8 rows, those past `rows` zero). */
static AVX2 void tile(const float *w, size_t rows, size_t k, const float *x, size_t ldx, size_t m, float *y,
                      size_t ldy, const float *bias) {
    __m256 acc[8];
    size_t r = 0;
    for (; r + 2 <= m; r += 2)
        for (size_t j0 = 0; j0 < rows; j0 += 4) {
            tile_block(w + j0 * k, k, x + r * ldx, ldx, 4, 2, acc);
            store_pair(acc, rows - j0 < 4 ? rows - j0 : 4, y + r * ldy + j0, ldy, bias ? bias + j0 : NULL);
        }
    if (r < m)
        for (size_t j0 = 0; j0 < rows; j0 += 8) {
            tile_block(w + j0 * k, k, x + r * ldx, ldx, 8, 1, acc);
            store_row(y + r * ldy + j0, reduce8(acc), bias ? bias + j0 : NULL, rows - j0 < 8 ? rows - j0 : 8);
        }
}

/* Lane 0 of the sum of the two 128-bit halves of s: what fma_loop returns (any lane would do). */
AVX2_INLINE float halves_lane0(__m256 s) {
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

/* The level's multiply-add peak (quant.h: fma_loop). */
LQ_FMA_LOOP(AVX2, 256, halves_lane0)

static const lq_kernels KERNELS = {
    LQ_SIMD_LEVEL("avx2", 8, 8),
    .dotm = {LQ_BLOCK_ENTRIES(dot, _m)}, /* f32/f16/bf16 rows of any length keep to decode + tile */
};

const lq_kernels *lq_kernels_avx2(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return &KERNELS;
    return NULL;
}

#else /* not x86 */
const lq_kernels *lq_kernels_avx2(void) { return NULL; }
#endif
