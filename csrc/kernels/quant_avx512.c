/* AVX-512 (F, BW, VL) kernels for quant.c: 16 floats per vector, mask registers for the 5th
 * bit of the q5 formats and for tails.
 *
 * The arithmetic of this level, the same for every output y = w . x + b whatever M is:
 *   1. each weight decoded to f32 exactly as the reference does (d * q, then + m or - m);
 *   2. one 16-lane accumulator per output: acc = fma(w[16c .. 16c+15], x[16c .. 16c+15], acc)
 *      for chunks c = 0, 1, ... in order, the last chunk of an f32/f16/bf16 row whose length is
 *      not a multiple of 16 zero-padded;
 *   3. the 16 lanes summed by the halving tree of reduce16, then + b.
 * M <= 4 (dot_rows) decodes in registers, 4 rows of W at a time (8 for the 32-element formats
 * at M = 1), each weight once for all the rows of X. 4 < M <= 64 or more while X fits in L2
 * (fused_rows, the block formats but q4_K / q5_K): 4 rows of W decoded in registers for rows
 * 0 .. 3 of X and kept for the 4 x 4 register blocks of the others. Otherwise decoded rows
 * (decode_*) in 4 x 4 blocks. All follow those three steps exactly, so a row of Y has the same
 * bits whatever M is and wherever the row sits in X.
 *
 * Compiled without -march: every function carries a target attribute and runs only after
 * lq_kernels_avx512() has checked the CPU.
 */
#include "quant.h"

#if defined(__x86_64__)
#include "quant_x86.h"

#define TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define AVX512 __attribute__((target(TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(TARGET)))

#define DOT_ROWS 16 /* rows of W per dot_rows call: one reduce16 per row of X */
#define TILE_ROWS 16 /* most rows of W decoded at a time by decode + tile (quant.c: LQ_TILE_BYTES) */
#define GROUP 4      /* rows of W decoded together in registers at M = 1 (independent FMA chains) */
#define GROUP_MAX 8  /* ... for the 32-element formats at M = 1 (measured: Q4_1 3-6% faster than 4) */
#define MAX_MX 4     /* rows of X the kernels of a few rows (dot_rows) take at once */

AVX512_INLINE __m512 to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }

AVX512_INLINE __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

AVX512_INLINE __mmask16 tail_mask(size_t n) { return (__mmask16)((1u << n) - 1); }

AVX512_INLINE __m512 iota16(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

/* ---- exact weights of one block, in registers -------------------------------------------- */

/* 4- and 5-bit codes become weights through a table of the block's 16 (32) possible values,
 * computed once per block: one multiply (and add) per 32 weights instead of one per 16, and a
 * permute reads only the low 4 (5) bits of each index lane, so the low nibble needs no mask.
 * d * q + m is one fma: d (a half: 11 significant bits) times q (an integer below 32: 5 bits)
 * is exact in f32, so fma's single rounding gives the same bits as the reference's rounded
 * d * q, then + m (one instruction per table instead of two). */
AVX512_INLINE __m512 table16(float d, __m512 codes, float m, const int has_min) {
    return has_min ? _mm512_fmadd_ps(_mm512_set1_ps(d), codes, _mm512_set1_ps(m))
                   : _mm512_mul_ps(_mm512_set1_ps(d), codes);
}

/* Weights of 16 nibbles (raw bytes, low nibble first) from a 16-entry table. */
AVX512_INLINE void nibble_weights(__m512i raw, __m512 table, __m512 *lo, __m512 *hi) {
    *lo = _mm512_permutexvar_ps(raw, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
}

/* The 5-bit codes of 16 bytes of nibbles: bit j of `low` (`high`) is bit 4 of the low (high)
 * nibble of byte j. */
AVX512_INLINE void five_bit_codes(__m512i raw, __mmask16 low, __mmask16 high, __m512i *lo, __m512i *hi) {
    const __m512i sixteen = _mm512_set1_epi32(16);
    const __m512i l = _mm512_and_si512(raw, _mm512_set1_epi32(0x0f)), h = _mm512_srli_epi32(raw, 4);
    *lo = _mm512_mask_or_epi32(l, low, l, sixteen);
    *hi = _mm512_mask_or_epi32(h, high, h, sixteen);
}

enum { L_Q4_0, L_Q4_1, L_Q5_0, L_Q5_1, L_Q8_0 };

/* The 32 weights of a block of a 32-element format: w[0] = elements 0..15, w[1] = 16..31;
 * d and m are its scale and minimum (m unused where the format has none). */
AVX512_INLINE void legacy_weights(const uint8_t *blk, const int kind, float d, float m, __m512 w[2]) {
    const __m512 iota = iota16();
    switch (kind) {
    case L_Q4_0:
        nibble_weights(u8x16(((const block_q4_0 *)blk)->qs), table16(d, _mm512_sub_ps(iota, _mm512_set1_ps(8)), 0, 0),
                       &w[0], &w[1]);
        break;
    case L_Q4_1:
        nibble_weights(u8x16(((const block_q4_1 *)blk)->qs), table16(d, iota, m, 1), &w[0], &w[1]);
        break;
    case L_Q5_0:
    case L_Q5_1: {
        const int has_min = kind == L_Q5_1;
        const uint8_t *qs = has_min ? ((const block_q5_1 *)blk)->qs : ((const block_q5_0 *)blk)->qs;
        const uint8_t *qhp = has_min ? ((const block_q5_1 *)blk)->qh : ((const block_q5_0 *)blk)->qh;
        uint32_t qh;
        memcpy(&qh, qhp, 4);
        const __m512 base = has_min ? iota : _mm512_sub_ps(iota, _mm512_set1_ps(16)); /* q - offset, q < 16 */
        const __m512 t0 = table16(d, base, m, has_min);
        const __m512 t1 = table16(d, _mm512_add_ps(base, _mm512_set1_ps(16)), m, has_min);
        __m512i lo, hi;
        five_bit_codes(u8x16(qs), (__mmask16)(qh & 0xffff), (__mmask16)(qh >> 16), &lo, &hi);
        w[0] = _mm512_permutex2var_ps(t0, lo, t1);
        w[1] = _mm512_permutex2var_ps(t0, hi, t1);
        break;
    }
    default: { /* q8_0: (float)q * d */
        const int8_t *qs = ((const block_q8_0 *)blk)->qs;
        const __m512 dv = _mm512_set1_ps(d);
        w[0] = _mm512_mul_ps(to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), dv);
        w[1] = _mm512_mul_ps(to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))), dv);
        break;
    }
    }
}

/* The first 4 bytes (d, and m where there is one) of `count` blocks `stride` bytes apart, as
 * floats: d[i] and m[i] of block i. */
AVX512_INLINE void block_heads(const uint8_t *first, const int stride, size_t count, float d[16], float m[16],
                               const int has_min) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(stride));
    const __m512i heads = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tail_mask(count), offsets, first, 1);
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads)));
    if (has_min) _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(heads, 16))));
    /* Read them back from memory: a broadcast from memory is a load, while the compiler's
     * alternative (permutes of the register) competes with the decode's permutes for a port. */
    __asm__ volatile("" : : "m"(*(const float(*)[16])d), "m"(*(const float(*)[16])m) : "memory");
}

/* The 8 scales d * sc_j and mins dmin * m_j of a q4_K / q5_K super-block (products in f32,
 * as the reference computes them). */
AVX512_INLINE void k4_scales(const uint8_t *packed, float d, float dmin, float scale[8], float minimum[8]) {
    uint8_t sc[8], mn[8];
    unpack_scales_k4_le(packed, sc, mn);
    const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), s));
    _mm256_storeu_ps(minimum, _mm256_mul_ps(_mm256_set1_ps(dmin), m));
}

/* Weights 64c .. 64c+63 of a q4_K / q5_K super-block (sub-blocks 2c from the low nibbles, 2c+1
 * from the high ones) in element order: scale * q - min, from per-sub-block tables. qh NULL
 * for q4_K. scale * q - min is one fms: scale = d * sc is exact (11 + 6 significant bits), and
 * so is scale * q (q < 32: at most 22 bits), so the single rounding matches the reference's
 * rounded product, then - min. */
AVX512_INLINE void k4_weights(const uint8_t *qs, const uint8_t *qh, int c, const float scale[8],
                              const float minimum[8], __m512 w[4]) {
    const __m512 iota = iota16(), n0 = _mm512_set1_ps(minimum[2 * c]), n1 = _mm512_set1_ps(minimum[2 * c + 1]);
    const __m512 s0 = _mm512_set1_ps(scale[2 * c]), s1 = _mm512_set1_ps(scale[2 * c + 1]);
    if (!qh) {
        const __m512 t0 = _mm512_fmsub_ps(s0, iota, n0), t1 = _mm512_fmsub_ps(s1, iota, n1);
        for (int g = 0; g < 2; g++) {
            const __m512i raw = u8x16(qs + 32 * c + 16 * g);
            w[g] = _mm512_permutexvar_ps(raw, t0);
            w[2 + g] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), t1);
        }
        return;
    }
    const __m512 top = _mm512_add_ps(iota, _mm512_set1_ps(16));
    const __m512 t0a = _mm512_fmsub_ps(s0, iota, n0), t0b = _mm512_fmsub_ps(s0, top, n0);
    const __m512 t1a = _mm512_fmsub_ps(s1, iota, n1), t1b = _mm512_fmsub_ps(s1, top, n1);
    for (int g = 0; g < 2; g++) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(qh + 16 * g));
        __m512i lo, hi;
        five_bit_codes(u8x16(qs + 32 * c + 16 * g), _mm_test_epi8_mask(h, _mm_set1_epi8((char)(1 << (2 * c)))),
                       _mm_test_epi8_mask(h, _mm_set1_epi8((char)(1 << (2 * c + 1)))), &lo, &hi);
        w[g] = _mm512_permutex2var_ps(t0a, lo, t0b);
        w[2 + g] = _mm512_permutex2var_ps(t1a, hi, t1b);
    }
}

/* d * scale for the 16 groups of 16 elements of a q6_K super-block. */
AVX512_INLINE void q6_scales(const block_q6_K *b, float scale[16]) {
    const __m512 s = to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->scales)));
    _mm512_storeu_ps(scale, _mm512_mul_ps(_mm512_set1_ps(half(b->d)), s));
}

/* Weights 128h + 32t .. +31 of a q6_K super-block, (d * scale) * (q - 32), in w[0] (scale
 * group 8h + 2t) and w[1] (8h + 2t + 1); q - 32 from quant_x86.h's q6_codes. */
AVX512_INLINE void q6_pair(const block_q6_K *b, int h, int t, const float scale[16], __m512 w[2]) {
    const __m256i q = q6_codes(b, h, t);
    w[0] = _mm512_mul_ps(_mm512_set1_ps(scale[8 * h + 2 * t]),
                         to_float(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    w[1] = _mm512_mul_ps(_mm512_set1_ps(scale[8 * h + 2 * t + 1]),
                         to_float(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
}

AVX512_INLINE __m512 f16x16(const uint16_t *p, __mmask16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }

AVX512_INLINE __m512 bf16x16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/* 16 weights of an f32 (kind 0), f16 (1) or bf16 (2) row from element i, lanes outside mask 0. */
AVX512_INLINE __m512 floats16(const uint8_t *row, size_t i, const int kind, __mmask16 k) {
    if (kind == 0) return _mm512_maskz_loadu_ps(k, (const float *)row + i);
    return kind == 1 ? f16x16((const uint16_t *)row + i, k) : bf16x16((const uint16_t *)row + i, k);
}

/* ---- decoders: one row -> k floats (the M > 1 path and llaisys_quant_dequantize) --------- */

AVX512_INLINE void decode_float(const void *row, float *dst, size_t k, const int kind) {
    size_t i = 0;
    for (; i + 16 <= k; i += 16) {
        if ((i & 31) == 0) prefetch_ahead((const uint8_t *)row + i * (kind == 0 ? 4 : 2), kind == 0 ? 128 : 64);
        _mm512_storeu_ps(dst + i, floats16(row, i, kind, 0xffff));
    }
    if (i < k) _mm512_mask_storeu_ps(dst + i, tail_mask(k - i), floats16(row, i, kind, tail_mask(k - i)));
}

static AVX512 void decode_f16(const void *row, float *dst, size_t k) { decode_float(row, dst, k, 1); }

static AVX512 void decode_bf16(const void *row, float *dst, size_t k) { decode_float(row, dst, k, 2); }

AVX512_INLINE void decode_legacy(const uint8_t *blocks, float *dst, size_t k, const int kind, const int stride,
                                 const int has_min) {
    const size_t nb = k / QK;
    float d[16], m[16];
    __m512 w[2];
    for (size_t g = 0; g < nb; g += 16) {
        const size_t count = nb - g < 16 ? nb - g : 16;
        block_heads(blocks + g * (size_t)stride, stride, count, d, m, has_min);
        for (size_t i = 0; i < count; i++, dst += QK) {
            const uint8_t *blk = blocks + (g + i) * (size_t)stride;
            prefetch_ahead(blk, (size_t)stride);
            legacy_weights(blk, kind, d[i], m[i], w);
            _mm512_storeu_ps(dst, w[0]);
            _mm512_storeu_ps(dst + 16, w[1]);
        }
    }
}

static AVX512 void decode_q4_0(const void *row, float *dst, size_t k) {
    decode_legacy(row, dst, k, L_Q4_0, sizeof(block_q4_0), 0);
}

static AVX512 void decode_q4_1(const void *row, float *dst, size_t k) {
    decode_legacy(row, dst, k, L_Q4_1, sizeof(block_q4_1), 1);
}

static AVX512 void decode_q5_0(const void *row, float *dst, size_t k) {
    decode_legacy(row, dst, k, L_Q5_0, sizeof(block_q5_0), 0);
}

static AVX512 void decode_q5_1(const void *row, float *dst, size_t k) {
    decode_legacy(row, dst, k, L_Q5_1, sizeof(block_q5_1), 1);
}

static AVX512 void decode_q8_0(const void *row, float *dst, size_t k) {
    decode_legacy(row, dst, k, L_Q8_0, sizeof(block_q8_0), 0);
}

AVX512_INLINE void decode_k4(const uint8_t *row, float *dst, size_t k, const int five) {
    const size_t stride = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    float scale[8], minimum[8];
    __m512 w[4];
    for (size_t i = 0; i < k / QK_K; i++) {
        const uint8_t *blk = row + i * stride;
        const block_q4_K *b4 = (const block_q4_K *)blk; /* q5_K starts with the same fields */
        const uint8_t *qh = five ? ((const block_q5_K *)blk)->qh : NULL;
        const uint8_t *qs = five ? ((const block_q5_K *)blk)->qs : b4->qs;
        prefetch_ahead(blk, stride);
        k4_scales(b4->scales, half(b4->d), half(b4->dmin), scale, minimum);
        for (int c = 0; c < 4; c++, dst += 64) {
            k4_weights(qs, qh, c, scale, minimum, w);
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(dst + 16 * v, w[v]);
        }
    }
}

static AVX512 void decode_q4_K(const void *row, float *dst, size_t k) { decode_k4(row, dst, k, 0); }

static AVX512 void decode_q5_K(const void *row, float *dst, size_t k) { decode_k4(row, dst, k, 1); }

static AVX512 void decode_q6_K(const void *row, float *dst, size_t k) {
    const block_q6_K *b = row;
    float scale[16];
    __m512 w[2];
    for (size_t i = 0; i < k / QK_K; i++, dst += QK_K) {
        prefetch_ahead(b + i, sizeof(block_q6_K));
        q6_scales(b + i, scale);
        for (int p = 0; p < 8; p++) { /* elements 32p .. 32p + 31 */
            q6_pair(b + i, p >> 2, p & 3, scale, w);
            _mm512_storeu_ps(dst + 32 * p, w[0]);
            _mm512_storeu_ps(dst + 32 * p + 16, w[1]);
        }
    }
}

/* ---- the lane reduction (step 3) ---------------------------------------------------------- */

/* Lane i of the result is the sum of the 16 lanes of a[i], every a[i] reduced by the same tree:
 * lanes l and l + 8, then l and l + 4, then l and l + 2, then the last pair. */
AVX512_INLINE __m512 reduce16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2], e[1];
    LQ_TREE_STEP(b, a, 8, _mm512_add_ps, _mm512_shuffle_f32x4, 0x44, 0xee); /* [a2i (8 lanes) | a2i+1 (8 lanes)] */
    LQ_TREE_STEP(c, b, 4, _mm512_add_ps, _mm512_shuffle_f32x4, 0x88, 0xdd); /* [a4i | .. | a4i+3], 4 lanes each */
    LQ_TREE_STEP(d, c, 2, _mm512_add_ps, _mm512_shuffle_ps, 0x44, 0xee); /* quarter q: [a8i+q, a8i+4+q], 2 lanes */
    LQ_TREE_STEP(e, d, 1, _mm512_add_ps, _mm512_shuffle_ps, 0x88, 0xdd); /* quarter q: [aq, a4+q, a8+q, a12+q] */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e[0]); /* natural order */
}

/* ---- few rows of X (M <= MAX_MX): 4 (or 8) rows of W at a time, decoded in registers ------- */

/* acc[G * r + j] = the accumulator (step 2) of row[j] . x[r], j < G <= GROUP_MAX, r < mx (x rows
 * ldx apart; G and mx constants at each call site): the rows of W advance together, each weight
 * is decoded once for all mx rows of X, and the G * mx FMA chains hide each other's latency. */
AVX512_INLINE void group_legacy(const uint8_t *const row[], const int G, const float *x, size_t ldx, const int mx,
                                size_t k, const int kind, const int stride, const int has_min, __m512 out[]) {
    __m512 acc[GROUP_MAX * MAX_MX];
    for (int a = 0; a < G * mx; a++) acc[a] = _mm512_setzero_ps();
    const size_t nb = k / QK;
    float d[GROUP_MAX][16], m[GROUP_MAX][16];
    __m512 w[2];
    for (size_t g = 0; g < nb; g += 16) {
        const size_t count = nb - g < 16 ? nb - g : 16;
        for (int r = 0; r < G; r++) block_heads(row[r] + g * (size_t)stride, stride, count, d[r], m[r], has_min);
        for (size_t i = 0; i < count; i++) {
            const float *xb = x + (g + i) * QK;
            __m512 x0[MAX_MX], x1[MAX_MX];
            for (int r = 0; r < mx; r++) {
                x0[r] = _mm512_loadu_ps(xb + (size_t)r * ldx);
                x1[r] = _mm512_loadu_ps(xb + (size_t)r * ldx + 16);
            }
            for (int j = 0; j < G; j++) {
                const uint8_t *blk = row[j] + (g + i) * (size_t)stride;
                prefetch_ahead(blk, (size_t)stride);
                legacy_weights(blk, kind, d[j][i], m[j][i], w);
                for (int r = 0; r < mx; r++) {
                    acc[G * r + j] = _mm512_fmadd_ps(w[0], x0[r], acc[G * r + j]);
                    acc[G * r + j] = _mm512_fmadd_ps(w[1], x1[r], acc[G * r + j]);
                }
            }
        }
    }
    for (int a = 0; a < G * mx; a++) out[a] = acc[a];
}

/* group_legacy for mx > 1 rows of X, G = GROUP rows of W, software-pipelined: the weights of
 * block i + 1 are decoded before the multiply-adds of block i, so those never wait for a decode
 * (measured at M = 4, Q4_1, weights in cache: 89 G multiply-adds/s instead of 72 at K = 576, 97
 * instead of 85 at K = 1536). The same weights and FMAs in the same order; d (and m) read from
 * each block as it comes instead of gathered 16 blocks at a time. */
AVX512_INLINE void group_legacy_pipelined(const uint8_t *const row[], const float *x, size_t ldx, const int mx,
                                          size_t k, const int kind, const int stride, const int has_min,
                                          __m512 out[], float *dec) {
    __m512 acc[GROUP * MAX_MX], cur[GROUP][2], next[GROUP][2];
    for (int a = 0; a < GROUP * mx; a++) acc[a] = _mm512_setzero_ps();
    const size_t nb = k / QK;
    for (int j = 0; j < GROUP; j++) {
        lq_half dm[2]; /* d, and m where the format has one: the first 4 bytes of every block */
        memcpy(dm, row[j], 4);
        legacy_weights(row[j], kind, half(dm[0]), has_min ? half(dm[1]) : 0.0f, cur[j]);
    }
    for (size_t i = 0; i < nb; i++) {
        const size_t ahead = i + 1 < nb ? i + 1 : i; /* the last block decodes itself again, unused */
        for (int j = 0; j < GROUP; j++) {
            const uint8_t *blk = row[j] + ahead * (size_t)stride;
            lq_half dm[2];
            memcpy(dm, blk, 4);
            prefetch_ahead(blk, (size_t)stride);
            legacy_weights(blk, kind, half(dm[0]), has_min ? half(dm[1]) : 0.0f, next[j]);
        }
        if (dec)
            for (int j = 0; j < GROUP; j++) {
                _mm512_storeu_ps(dec + (size_t)j * k + i * QK, cur[j][0]);
                _mm512_storeu_ps(dec + (size_t)j * k + i * QK + 16, cur[j][1]);
            }
        const float *xb = x + i * QK;
        for (int r = 0; r < mx; r++) {
            const __m512 x0 = _mm512_loadu_ps(xb + (size_t)r * ldx), x1 = _mm512_loadu_ps(xb + (size_t)r * ldx + 16);
            for (int j = 0; j < GROUP; j++) {
                acc[GROUP * r + j] = _mm512_fmadd_ps(cur[j][0], x0, acc[GROUP * r + j]);
                acc[GROUP * r + j] = _mm512_fmadd_ps(cur[j][1], x1, acc[GROUP * r + j]);
            }
        }
        for (int j = 0; j < GROUP; j++) {
            cur[j][0] = next[j][0];
            cur[j][1] = next[j][1];
        }
    }
    for (int a = 0; a < GROUP * mx; a++) out[a] = acc[a];
}

AVX512_INLINE void group_k4(const uint8_t *const row[GROUP], const float *x, size_t ldx, const int mx, size_t k,
                            const int five, __m512 out[]) {
    __m512 acc[GROUP * MAX_MX];
    for (int a = 0; a < GROUP * mx; a++) acc[a] = _mm512_setzero_ps();
    const size_t stride = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    float scale[GROUP][8], minimum[GROUP][8];
    __m512 w[4];
    for (size_t i = 0; i < k / QK_K; i++) {
        for (int j = 0; j < GROUP; j++) {
            const block_q4_K *b4 = (const block_q4_K *)(row[j] + i * stride); /* q5_K starts alike */
            prefetch_ahead(b4, stride);
            k4_scales(b4->scales, half(b4->d), half(b4->dmin), scale[j], minimum[j]);
        }
        for (int c = 0; c < 4; c++) {
            const float *xc = x + i * QK_K + 64 * c;
            if (mx == 1) { /* x in registers, shared by the 4 rows */
                const __m512 xv[4] = {_mm512_loadu_ps(xc), _mm512_loadu_ps(xc + 16), _mm512_loadu_ps(xc + 32),
                                      _mm512_loadu_ps(xc + 48)};
                for (int j = 0; j < GROUP; j++) {
                    const uint8_t *blk = row[j] + i * stride;
                    const uint8_t *qh = five ? ((const block_q5_K *)blk)->qh : NULL;
                    const uint8_t *qs = five ? ((const block_q5_K *)blk)->qs : ((const block_q4_K *)blk)->qs;
                    k4_weights(qs, qh, c, scale[j], minimum[j], w);
                    for (int v = 0; v < 4; v++) acc[j] = _mm512_fmadd_ps(w[v], xv[v], acc[j]);
                }
            } else { /* x from L1, one load per FMA */
                for (int j = 0; j < GROUP; j++) {
                    const uint8_t *blk = row[j] + i * stride;
                    const uint8_t *qh = five ? ((const block_q5_K *)blk)->qh : NULL;
                    const uint8_t *qs = five ? ((const block_q5_K *)blk)->qs : ((const block_q4_K *)blk)->qs;
                    k4_weights(qs, qh, c, scale[j], minimum[j], w);
                    for (int r = 0; r < mx; r++)
                        for (int v = 0; v < 4; v++)
                            acc[GROUP * r + j] = _mm512_fmadd_ps(w[v], _mm512_loadu_ps(xc + (size_t)r * ldx + 16 * v),
                                                                 acc[GROUP * r + j]);
                }
            }
        }
    }
    for (int a = 0; a < GROUP * mx; a++) out[a] = acc[a];
}

AVX512_INLINE void group_q6_K(const uint8_t *const row[GROUP], const float *x, size_t ldx, const int mx, size_t k,
                              __m512 out[], float *dec) {
    __m512 acc[GROUP * MAX_MX], w[2];
    for (int a = 0; a < GROUP * mx; a++) acc[a] = _mm512_setzero_ps();
    float scale[GROUP][16];
    for (size_t i = 0; i < k / QK_K; i++) {
        for (int j = 0; j < GROUP; j++) {
            const block_q6_K *b = (const block_q6_K *)row[j] + i;
            prefetch_ahead(b, sizeof(block_q6_K));
            q6_scales(b, scale[j]);
        }
        for (int p = 0; p < 8; p++) { /* elements 32p .. 32p + 31 */
            const float *xp = x + i * QK_K + 32 * p;
            __m512 x0[MAX_MX], x1[MAX_MX];
            for (int r = 0; r < mx; r++) {
                x0[r] = _mm512_loadu_ps(xp + (size_t)r * ldx);
                x1[r] = _mm512_loadu_ps(xp + (size_t)r * ldx + 16);
            }
            for (int j = 0; j < GROUP; j++) {
                q6_pair((const block_q6_K *)row[j] + i, p >> 2, p & 3, scale[j], w);
                if (dec) {
                    _mm512_storeu_ps(dec + (size_t)j * k + i * QK_K + 32 * p, w[0]);
                    _mm512_storeu_ps(dec + (size_t)j * k + i * QK_K + 32 * p + 16, w[1]);
                }
                for (int r = 0; r < mx; r++) {
                    acc[GROUP * r + j] = _mm512_fmadd_ps(w[0], x0[r], acc[GROUP * r + j]);
                    acc[GROUP * r + j] = _mm512_fmadd_ps(w[1], x1[r], acc[GROUP * r + j]);
                }
            }
        }
    }
    for (int a = 0; a < GROUP * mx; a++) out[a] = acc[a];
}

AVX512_INLINE void group_float(const uint8_t *const row[GROUP], const float *x, size_t ldx, const int mx, size_t k,
                               const int kind, __m512 out[]) {
    __m512 acc[GROUP * MAX_MX];
    for (int a = 0; a < GROUP * mx; a++) acc[a] = _mm512_setzero_ps();
    const size_t width = kind == 0 ? 4 : 2;
    size_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 xv[MAX_MX];
        for (int r = 0; r < mx; r++) xv[r] = _mm512_loadu_ps(x + (size_t)r * ldx + i);
        for (int j = 0; j < GROUP; j++) {
            if ((i & 31) == 0) prefetch_ahead(row[j] + i * width, 32 * width);
            const __m512 wv = floats16(row[j], i, kind, 0xffff);
            for (int r = 0; r < mx; r++) acc[GROUP * r + j] = _mm512_fmadd_ps(wv, xv[r], acc[GROUP * r + j]);
        }
    }
    if (i < k) {
        const __mmask16 t = tail_mask(k - i);
        __m512 xv[MAX_MX];
        for (int r = 0; r < mx; r++) xv[r] = _mm512_maskz_loadu_ps(t, x + (size_t)r * ldx + i);
        for (int j = 0; j < GROUP; j++) {
            const __m512 wv = floats16(row[j], i, kind, t);
            for (int r = 0; r < mx; r++) acc[GROUP * r + j] = _mm512_fmadd_ps(wv, xv[r], acc[GROUP * r + j]);
        }
    }
    for (int a = 0; a < GROUP * mx; a++) out[a] = acc[a];
}

/* rows of W per group: GROUP_MAX for the 32-element formats at M = 1, else GROUP. */
AVX512_INLINE int group_rows(const int mx, const int ix) {
    return mx == 1 && ix >= IX_Q4_0 && ix <= IX_Q8_0 ? GROUP_MAX : GROUP;
}

/* The 32-element formats: GROUP_MAX rows of W at M = 1, GROUP software-pipelined for more. */
AVX512_INLINE void legacy_dot(const uint8_t *const row[], const float *x, size_t ldx, const int mx, size_t k,
                              const int kind, const int stride, const int has_min, __m512 acc[], float *dec) {
    if (mx > 1)
        group_legacy_pipelined(row, x, ldx, mx, k, kind, stride, has_min, acc, dec);
    else
        group_legacy(row, GROUP_MAX, x, ldx, 1, k, kind, stride, has_min, acc);
}

/* acc[G * r + j] for the rows of W of `row` (G = group_rows(mx, ix)) and r < mx; dec, where not
 * NULL (the fused kernels, mx = MAX_MX), receives the decoded rows, k floats apart. */
AVX512_INLINE void group_dot(const uint8_t *const row[GROUP_MAX], const float *x, size_t ldx, const int mx, size_t k,
                             const int ix, __m512 acc[], float *dec) {
    switch (ix) {
    case IX_F32: group_float(row, x, ldx, mx, k, 0, acc); break;
    case IX_F16: group_float(row, x, ldx, mx, k, 1, acc); break;
    case IX_BF16: group_float(row, x, ldx, mx, k, 2, acc); break;
    case IX_Q4_0: legacy_dot(row, x, ldx, mx, k, L_Q4_0, sizeof(block_q4_0), 0, acc, dec); break;
    case IX_Q4_1: legacy_dot(row, x, ldx, mx, k, L_Q4_1, sizeof(block_q4_1), 1, acc, dec); break;
    case IX_Q5_0: legacy_dot(row, x, ldx, mx, k, L_Q5_0, sizeof(block_q5_0), 0, acc, dec); break;
    case IX_Q5_1: legacy_dot(row, x, ldx, mx, k, L_Q5_1, sizeof(block_q5_1), 1, acc, dec); break;
    case IX_Q8_0: legacy_dot(row, x, ldx, mx, k, L_Q8_0, sizeof(block_q8_0), 0, acc, dec); break;
    case IX_Q4_K: group_k4(row, x, ldx, mx, k, 0, acc); break; /* no dec: q4_K / q5_K have no fused kernels */
    case IX_Q5_K: group_k4(row, x, ldx, mx, k, 1, acc); break;
    default: group_q6_K(row, x, ldx, mx, k, acc, dec); break;
    }
}

/* y[r][j] = w[j] . x[r] (+ bias[j]) for j < rows <= 16 (rows row_bytes apart), r < mx (x rows
 * ldx apart, y rows ldy apart). */
AVX512_INLINE void dot_rows(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx, const int mx,
                            size_t k, float *y, size_t ldy, const float *bias, const int ix) {
    __m512 acc[MAX_MX][DOT_ROWS];
    for (int r = 0; r < mx; r++)
        for (int j = 0; j < DOT_ROWS; j++) acc[r][j] = _mm512_setzero_ps();
    const int G = group_rows(mx, ix);
    for (size_t j0 = 0; j0 < rows; j0 += (size_t)G) {
        const uint8_t *row[GROUP_MAX];
        for (int r = 0; r < G; r++) /* past the last row: repeat it, results unused */
            row[r] = (const uint8_t *)w + (j0 + (size_t)r < rows ? j0 + (size_t)r : rows - 1) * row_bytes;
        __m512 part[GROUP_MAX * MAX_MX];
        group_dot(row, x, ldx, mx, k, ix, part, NULL);
        for (int r = 0; r < mx; r++)
            for (int j = 0; j < G; j++) acc[r][j0 + j] = part[G * r + j];
    }
    const __mmask16 keep = tail_mask(rows);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mx; r++) {
        __m512 s = reduce16(acc[r]);
        if (bias) s = _mm512_add_ps(s, b);
        _mm512_mask_storeu_ps(y + (size_t)r * ldy, keep, s);
    }
}

/* M = 1, and 2 <= m <= MAX_MX rows of X (each weight decoded once for all of them). */
#define DOT(name, ix)                                                                                          \
    static AVX512 void name(const void *w, size_t row_bytes, size_t rows, const float *x, size_t k, float *y, \
                            const float *bias) {                                                               \
        dot_rows(w, row_bytes, rows, x, 0, 1, k, y, 0, bias, ix);                                              \
    }                                                                                                          \
    static AVX512 void name##_m(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx,      \
                                size_t m, size_t k, float *y, size_t ldy, const float *bias) {                 \
        switch (m) {                                                                                           \
        case 2: dot_rows(w, row_bytes, rows, x, ldx, 2, k, y, ldy, bias, ix); break;                           \
        case 3: dot_rows(w, row_bytes, rows, x, ldx, 3, k, y, ldy, bias, ix); break;                           \
        default: dot_rows(w, row_bytes, rows, x, ldx, 4, k, y, ldy, bias, ix); break;                          \
        }                                                                                                      \
    }
DOT(dot_f32, IX_F32)
DOT(dot_f16, IX_F16)
DOT(dot_bf16, IX_BF16)
DOT(dot_q4_0, IX_Q4_0)
DOT(dot_q4_1, IX_Q4_1)
DOT(dot_q5_0, IX_Q5_0)
DOT(dot_q5_1, IX_Q5_1)
DOT(dot_q8_0, IX_Q8_0)
DOT(dot_q4_K, IX_Q4_K)
DOT(dot_q5_K, IX_Q5_K)
DOT(dot_q6_K, IX_Q6_K)
#undef DOT

/* ---- M > 4: decoded rows of W times rows of X, 4 x 4 outputs at a time -------------------- */

/* acc[4r + j] = the accumulator (step 2) of w[j] . x[r] for r < mr, j < 4; w holds 4 decoded
 * rows k floats apart, x rows are ldx apart. mr is a constant at each call site. */
AVX512_INLINE void block4(const float *w, size_t k, const float *x, size_t ldx, const int mr, __m512 acc[16]) {
    for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 xv[4];
        for (int r = 0; r < mr; r++) xv[r] = _mm512_loadu_ps(x + (size_t)r * ldx + i);
        for (int j = 0; j < 4; j++) {
            const __m512 wv = _mm512_loadu_ps(w + (size_t)j * k + i);
            for (int r = 0; r < mr; r++) acc[4 * r + j] = _mm512_fmadd_ps(wv, xv[r], acc[4 * r + j]);
        }
    }
    if (i < k) { /* f32/f16/bf16 rows of any length: the zero-padded last chunk */
        const __mmask16 t = tail_mask(k - i);
        __m512 xv[4];
        for (int r = 0; r < mr; r++) xv[r] = _mm512_maskz_loadu_ps(t, x + (size_t)r * ldx + i);
        for (int j = 0; j < 4; j++) {
            const __m512 wv = _mm512_maskz_loadu_ps(t, w + (size_t)j * k + i);
            for (int r = 0; r < mr; r++) acc[4 * r + j] = _mm512_fmadd_ps(wv, xv[r], acc[4 * r + j]);
        }
    }
}

/* y[r][j] = lane sum of acc[4r + j] (+ bias[j]) for r < mr, j < nr. */
AVX512_INLINE void store_block(const __m512 acc[16], size_t mr, size_t nr, float *y, size_t ldy, const float *bias) {
    const __mmask8 keep = (__mmask8)((1u << nr) - 1);
    __m512 s = reduce16(acc); /* lanes 4r .. 4r+3: row r */
    if (bias) s = _mm512_add_ps(s, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(keep, bias)));
    _mm_mask_storeu_ps(y, keep, _mm512_castps512_ps128(s));
    if (mr > 1) _mm_mask_storeu_ps(y + ldy, keep, _mm512_extractf32x4_ps(s, 1));
    if (mr > 2) _mm_mask_storeu_ps(y + 2 * ldy, keep, _mm512_extractf32x4_ps(s, 2));
    if (mr > 3) _mm_mask_storeu_ps(y + 3 * ldy, keep, _mm512_extractf32x4_ps(s, 3));
}

AVX512_INLINE void block_any(const float *w, size_t k, const float *x, size_t ldx, size_t mr, __m512 acc[16]) {
    switch (mr) {
    case 4: block4(w, k, x, ldx, 4, acc); break;
    case 3: block4(w, k, x, ldx, 3, acc); break;
    case 2: block4(w, k, x, ldx, 2, acc); break;
    default: block4(w, k, x, ldx, 1, acc); break;
    }
}

/* Each group of 4 rows of x meets every row of the tile (a few rows, in L1; measured: 6 x 4
 * blocks spill registers and came out slower). */
static AVX512 void tile(const float *w, size_t rows, size_t k, const float *x, size_t ldx, size_t m, float *y,
                        size_t ldy, const float *bias) {
    __m512 acc[16];
    for (size_t r0 = 0; r0 < m; r0 += 4)
        for (size_t j0 = 0; j0 < rows; j0 += 4) {
            const size_t mr = m - r0 < 4 ? m - r0 : 4;
            block_any(w + j0 * k, k, x + r0 * ldx, ldx, mr, acc);
            store_block(acc, mr, rows - j0 < 4 ? rows - j0 : 4, y + r0 * ldy + j0, ldy, bias ? bias + j0 : NULL);
        }
}

/* ---- M > 4 (quant.h: LQ_FUSED_*): decoded in registers for the first rows of X, kept for the rest */

/* y[r][j] = w[j] . x[r] (+ bias[j]) for j < rows <= GROUP, r < m: the rows of W are decoded in
 * registers while they meet rows 0 .. 3 of X (the kernels of a few rows above, mx = 4), and
 * stored as they are decoded into buf (GROUP rows of k floats) for the 4 x 4 blocks of the
 * other rows of X. The decoding runs between multiply-adds instead of before them (measured
 * at M = 16, Q4_1, K = 576, 1 thread, weights in cache: 108 G multiply-adds/s instead of 95
 * with each tile decoded apart). q4_K / q5_K keep decode + tile: their fused pass, x read
 * from L1 for every FMA, came out slower than their fast decoder. (Tried and dropped: decoding
 * the next tile a block at a time between the 4 x 4 blocks' FMAs; faster in a standalone loop,
 * 118 against 108 G multiply-adds/s, but slower here, 90 against 110 at M = 16.) */
AVX512_INLINE void fused_rows(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx, size_t m,
                              size_t k, float *y, size_t ldy, const float *bias, float *buf, const int ix) {
    const uint8_t *row[GROUP_MAX];
    for (size_t j = 0; j < GROUP; j++) /* past the last row: repeat it, results unused */
        row[j] = (const uint8_t *)w + (j < rows ? j : rows - 1) * row_bytes;
    __m512 acc[16];
    group_dot(row, x, ldx, MAX_MX, k, ix, acc, buf); /* acc[4r + j], as block4 lays them out */
    store_block(acc, MAX_MX, rows, y, ldy, bias);
    for (size_t r0 = MAX_MX; r0 < m; r0 += 4) {
        const size_t mr = m - r0 < 4 ? m - r0 : 4;
        block_any(buf, k, x + r0 * ldx, ldx, mr, acc);
        store_block(acc, mr, rows, y + r0 * ldy, ldy, bias);
    }
}

#define FUSED(name, ix)                                                                                       \
    static AVX512 void name(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx,        \
                            size_t m, size_t k, float *y, size_t ldy, const float *bias, float *buf) {       \
        fused_rows(w, row_bytes, rows, x, ldx, m, k, y, ldy, bias, buf, ix);                                 \
    }
FUSED(fused_q4_0, IX_Q4_0)
FUSED(fused_q4_1, IX_Q4_1)
FUSED(fused_q5_0, IX_Q5_0)
FUSED(fused_q5_1, IX_Q5_1)
FUSED(fused_q8_0, IX_Q8_0)
FUSED(fused_q6_K, IX_Q6_K)
#undef FUSED

/* The level's multiply-add peak (quant.h: fma_loop). */
LQ_FMA_LOOP(AVX512, 512, _mm512_reduce_add_ps)

static const lq_kernels KERNELS = {
    LQ_SIMD_LEVEL("avx512", 16, 4),
    .dotm = {LQ_ALL_ENTRIES(dot, _m)},
    .fused = {
        [IX_Q4_0] = fused_q4_0, [IX_Q4_1] = fused_q4_1, [IX_Q5_0] = fused_q5_0, [IX_Q5_1] = fused_q5_1,
        [IX_Q8_0] = fused_q8_0, [IX_Q6_K] = fused_q6_K,
    },
    .fused_rows = GROUP,
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
