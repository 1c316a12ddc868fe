/* Quantized linear on the integer dot-product units (AVX512-VNNI): the "int16" arithmetic.
 *
 * Activations become 16-bit integers, one scale per 32-element block, held as two signed
 * 8-bit parts (q = 256 hi + lo), so that the weights' integer codes meet them in exact int8
 * dot products (vpdpbusd: 64 multiply-adds per instruction against the FMA units' 16); each
 * block's integer sum is scaled and added in float32 in one fixed order. Per output element
 * y[m][n], whatever M is and however the work is split among threads:
 *   1. x row m, block b: amax = max |x|; s = amax / LQ_XQ_MAX (0 when amax is 0);
 *      q = rint(x / s) clamped to [-LQ_XQ_MAX, LQ_XQ_MAX]; hi = (q + 128) >> 8, lo = q - 256 hi;
 *      S = sum of q over the block (S16: over its first 16); sS = s * (float)S.
 *   2. w row n, block b: codes c (unsigned integers) with weight = scale * (c - offset) or
 *      scale * c + min (see w16_block); Q6_K has a scale per 16 elements (scale, scale2).
 *   3. I = 256 * (sum c * hi) + (sum c * lo), exact in int32; then in float32, in this order:
 *        offset formats:  acc = acc + (float)(I - offset * S) * (scale * s)
 *        min formats:     acc = acc + (float)I * (scale * s);  acc = acc + min * sS
 *        Q6_K:            acc = acc + (float)(I_a - 32 S16) * (scale * s);
 *                         acc = acc + (float)(I_b - 32 (S - S16)) * (scale2 * s)
 *      for blocks b = 0, 1, ... in order, from acc = 0; then y = acc + bias.
 * The integer parts are exact whichever instructions compute them; the float parts are the
 * same operations in the same order everywhere (the NumPy reference, reference.linear_int16,
 * follows them bit for bit). Each activation has about 15 significant bits against the block's
 * largest, so results lie within a few parts in 100,000 of the float32 arithmetic's.
 *
 * Compiled without -march: every function that uses the units carries a target attribute and
 * runs only after lq_int_available() has checked the CPU.
 */
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "quant_int.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET "avx512f,avx512bw,avx512vl,avx512vnni,f16c"
#define VNNI __attribute__((target(TARGET)))
#define VNNI_INLINE static inline __attribute__((always_inline, target(TARGET)))


/* ---- the weights of 16 rows, in registers --------------------------------------------------- */

/* The 32 codes of block `bi` of one row, as bytes in order (reference_int16.block_codes). */
VNNI_INLINE __m256i nibbles(__m128i q) {
    const __m128i m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

VNNI_INLINE __m256i row_codes(int index, const uint8_t *row, size_t bi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    switch (index) {
    case IX_Q4_0: return nibbles(_mm_loadu_si128((const __m128i *)((const block_q4_0 *)row + bi)->qs));
    case IX_Q4_1: return nibbles(_mm_loadu_si128((const __m128i *)((const block_q4_1 *)row + bi)->qs));
    case IX_Q5_0:
    case IX_Q5_1: {
        const uint8_t *qs = index == IX_Q5_0 ? ((const block_q5_0 *)row + bi)->qs : ((const block_q5_1 *)row + bi)->qs;
        const uint8_t *qh = index == IX_Q5_0 ? ((const block_q5_0 *)row + bi)->qh : ((const block_q5_1 *)row + bi)->qh;
        uint32_t bits;
        memcpy(&bits, qh, 4);
        return _mm256_or_si256(nibbles(_mm_loadu_si128((const __m128i *)qs)),
                               _mm256_and_si256(_mm256_movm_epi8((__mmask32)bits), _mm256_set1_epi8(0x10)));
    }
    case IX_Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)((const block_q8_0 *)row + bi)->qs),
                                _mm256_set1_epi8((char)0x80)); /* + 128 */
    case IX_Q4_K:
    case IX_Q5_K: {
        const size_t sb = bi / 8, sub = bi % 8;
        const uint8_t *qs = index == IX_Q4_K ? ((const block_q4_K *)row + sb)->qs : ((const block_q5_K *)row + sb)->qs;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (sub / 2)));
        __m256i c = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(q, 4) : q, m4);
        if (index == IX_Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)((const block_q5_K *)row + sb)->qh);
            const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128((int)sub)), _mm256_set1_epi8(1));
            c = _mm256_or_si256(c, _mm256_slli_epi16(bit, 4));
        }
        return c;
    }
    case IX_Q6_K: {
        const size_t sb = bi / 8, sub = bi % 8, h = sub / 4, part = sub % 4;
        const block_q6_K *b = (const block_q6_K *)row + sb;
        const __m256i low = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + (part & 1 ? 32 : 0)));
        const __m256i nib = _mm256_and_si256(part < 2 ? low : _mm256_srli_epi16(low, 4), m4);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128((int)(2 * part))), _mm256_set1_epi8(3));
        return _mm256_or_si256(nib, _mm256_slli_epi16(top, 4));
    }
    default: return _mm256_setzero_si256();
    }
}

/* out[j] lane c = dword j of rows[c], for 16 rows of 8 dwords: an 8 x 8 transpose in each half. */
VNNI_INLINE void transpose16x8(const __m256i rows[16], __m512i out[8]) {
    __m512i p[8], t[8], u[8];
    for (int k = 0; k < 8; k++) p[k] = _mm512_inserti64x4(_mm512_castsi256_si512(rows[k]), rows[k + 8], 1);
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm512_unpacklo_epi32(p[k], p[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(p[k], p[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
        u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
        u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
        u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int k = 0; k < 4; k++) {
        out[k] = _mm512_permutex2var_epi64(u[k], lo, u[k + 4]);
        out[k + 4] = _mm512_permutex2var_epi64(u[k], hi, u[k + 4]);
    }
}

/* The f16 field at byte `at` of block `bi` of each of `rows` rows, as 16 floats (0 past rows). */
VNNI_INLINE __m512 halves16(const uint8_t *w, size_t row_bytes, size_t rows, size_t block_bytes, size_t bi, size_t at) {
    uint16_t h[16] = {0};
    for (size_t r = 0; r < rows; r++) memcpy(&h[r], w + r * row_bytes + bi * block_bytes + at, 2);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

/* Block `bi` of `rows` rows of W (rows <= 16; the others zero) as vpdpbusd reads them, for a
 * format known at compile time (`index` a constant once inlined). */
VNNI_INLINE int_format unpack_rows(const int index, const uint8_t *w, size_t row_bytes, size_t rows, size_t bi,
                                   w16_block *out) {
    __m256i codes[16];
    __m512i t[8];
    for (size_t r = 0; r < 16; r++) codes[r] = r < rows ? row_codes(index, w + r * row_bytes, bi) : _mm256_setzero_si256();
    transpose16x8(codes, t);
    for (int j = 0; j < 8; j++) _mm512_storeu_si512((void *)out->codes[j], t[j]);
    int_format f = {KIND_OFFSET, 0};
    switch (index) {
    case IX_Q4_0: f.offset = 8; _mm512_storeu_ps(out->scale, halves16(w, row_bytes, rows, 18, bi, 0)); break;
    case IX_Q5_0: f.offset = 16; _mm512_storeu_ps(out->scale, halves16(w, row_bytes, rows, 22, bi, 0)); break;
    case IX_Q8_0: f.offset = 128; _mm512_storeu_ps(out->scale, halves16(w, row_bytes, rows, 34, bi, 0)); break;
    case IX_Q4_1:
    case IX_Q5_1: {
        const size_t bytes = index == IX_Q4_1 ? 20 : 24;
        f.kind = KIND_MIN;
        _mm512_storeu_ps(out->scale, halves16(w, row_bytes, rows, bytes, bi, 0));
        _mm512_storeu_ps(out->min, halves16(w, row_bytes, rows, bytes, bi, 2));
        break;
    }
    case IX_Q4_K:
    case IX_Q5_K: {
        const size_t bytes = index == IX_Q4_K ? 144 : 176, sb = bi / 8;
        f.kind = KIND_MIN;
        float sc[16] = {0}, mn[16] = {0};
        for (size_t r = 0; r < rows; r++) {
            uint8_t s6, m6;
            unpack_scales_k4(w + r * row_bytes + sb * bytes + 4, (int)(bi % 8), &s6, &m6);
            sc[r] = (float)s6, mn[r] = (float)m6;
        }
        const __m512 d = halves16(w, row_bytes, rows, bytes, sb, 0), dmin = halves16(w, row_bytes, rows, bytes, sb, 2);
        _mm512_storeu_ps(out->scale, _mm512_mul_ps(d, _mm512_loadu_ps(sc)));
        /* -(dmin * m): a negation is exact, so the sign may come after the product */
        _mm512_storeu_ps(out->min, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_loadu_ps(mn))));
        break;
    }
    case IX_Q6_K: {
        const size_t sb = bi / 8;
        f.kind = KIND_Q6, f.offset = 32;
        float s1[16] = {0}, s2[16] = {0};
        for (size_t r = 0; r < rows; r++) {
            const int8_t *scales = ((const block_q6_K *)(w + r * row_bytes) + sb)->scales;
            s1[r] = (float)scales[2 * (bi % 8)], s2[r] = (float)scales[2 * (bi % 8) + 1];
        }
        const __m512 d = halves16(w, row_bytes, rows, 210, sb, 208);
        _mm512_storeu_ps(out->scale, _mm512_mul_ps(d, _mm512_loadu_ps(s1)));
        _mm512_storeu_ps(out->scale2, _mm512_mul_ps(d, _mm512_loadu_ps(s2)));
        break;
    }
    default: break;
    }
    return f;
}

VNNI static int_format unpack16(int index, const uint8_t *w, size_t row_bytes, size_t rows, size_t bi,
                                     w16_block *out) {
    switch (index) {
    case IX_Q4_0: return unpack_rows(IX_Q4_0, w, row_bytes, rows, bi, out);
    case IX_Q4_1: return unpack_rows(IX_Q4_1, w, row_bytes, rows, bi, out);
    case IX_Q5_0: return unpack_rows(IX_Q5_0, w, row_bytes, rows, bi, out);
    case IX_Q5_1: return unpack_rows(IX_Q5_1, w, row_bytes, rows, bi, out);
    case IX_Q8_0: return unpack_rows(IX_Q8_0, w, row_bytes, rows, bi, out);
    case IX_Q4_K: return unpack_rows(IX_Q4_K, w, row_bytes, rows, bi, out);
    case IX_Q5_K: return unpack_rows(IX_Q5_K, w, row_bytes, rows, bi, out);
    default: return unpack_rows(IX_Q6_K, w, row_bytes, rows, bi, out);
    }
}

/* ---- activations ----------------------------------------------------------------------- */

VNNI static void quantize_row(const float *x, size_t k, lq_xblock *out, int q_max) {
    const __m512i qmax = _mm512_set1_epi32(q_max), qmin = _mm512_set1_epi32(-q_max);
    for (size_t b = 0; b < k / QK; b++, out++) {
        const __m512 x0 = _mm512_loadu_ps(x + QK * b), x1 = _mm512_loadu_ps(x + QK * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float s = amax > 0.0f ? amax / (float)q_max : 0.0f;
        __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
        if (s > 0.0f) {
            const __m512 sv = _mm512_set1_ps(s);
            q0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, sv)); /* round to nearest even */
            q1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, sv));
            q0 = _mm512_max_epi32(_mm512_min_epi32(q0, qmax), qmin);
            q1 = _mm512_max_epi32(_mm512_min_epi32(q1, qmax), qmin);
        }
        const __m512i bias = _mm512_set1_epi32(128);
        const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(q0, bias), 8);
        const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(q1, bias), 8);
        const __m512i l0 = _mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 8));
        const __m512i l1 = _mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 8));
        _mm_storeu_si128((__m128i *)out->hi, _mm512_cvtepi32_epi8(h0));
        _mm_storeu_si128((__m128i *)(out->hi + 16), _mm512_cvtepi32_epi8(h1));
        _mm_storeu_si128((__m128i *)out->lo, _mm512_cvtepi32_epi8(l0));
        _mm_storeu_si128((__m128i *)(out->lo + 16), _mm512_cvtepi32_epi8(l1));
        out->s = s;
        out->sum_lo = _mm512_reduce_add_epi32(q0);
        out->sum = out->sum_lo + _mm512_reduce_add_epi32(q1);
        out->s_sum = s * (float)out->sum;
    }
}

void lq_int_quantize(const float *x, size_t ldx, size_t m, size_t k, lq_xblock *out, int bits) {
    const int q_max = bits == 8 ? LQ_XQ8_MAX : LQ_XQ_MAX; /* 8 bits: |q| <= 127, so hi = 0 and lo = q */
    for (size_t r = 0; r < m; r++) quantize_row(x + r * ldx, k, out + r * (k / QK), q_max);
}

/* ---- products ---------------------------------------------------------------------------- */

typedef int32_t __attribute__((may_alias, aligned(1))) dword; /* 4 codes of X, read as one */

/* One block's weight scales for 16 rows, in registers (the fields of w16_block). */
typedef struct {
    __m512 scale, scale2, min;
} w16_scales;

VNNI_INLINE w16_scales load_block(const w16_block *wb, __m512i w[8]) {
    for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)wb->codes[j]);
    return (w16_scales){_mm512_loadu_ps(wb->scale), _mm512_loadu_ps(wb->scale2), _mm512_loadu_ps(wb->min)};
}

/* acc[r] (16 outputs of row r of X) += block b's terms, for MR_C rows of X from xb (nb apart):
 * the rows' dot products interleaved, so 2 MR_C independent chains fill the units. */
#define BLOCK_ROWS(MR_C, KIND, PARTS)                                                                        \
    VNNI_INLINE void block_rows_##MR_C##_##KIND##_##PARTS(const __m512i w[8], const w16_scales *ws, int offset,          \
                                                const lq_xblock *xb, size_t nb, __m512 *acc) {                \
        const int_format f = {KIND, offset};                                                                  \
        __m512i h[MR_C], l[MR_C], h2[KIND == KIND_Q6 ? MR_C : 1], l2[KIND == KIND_Q6 ? MR_C : 1];             \
        for (int r = 0; r < MR_C; r++) h[r] = l[r] = _mm512_setzero_si512();                                \
        for (int r = 0; r < (KIND == KIND_Q6 ? MR_C : 1); r++) h2[r] = l2[r] = _mm512_setzero_si512();     \
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR_C; r++) {                                          \
                const lq_xblock *x = xb + (size_t)r * nb;                                                     \
                const __m512i hb = _mm512_set1_epi32(((const dword *)x->hi)[j]);                              \
                const __m512i lb = _mm512_set1_epi32(((const dword *)x->lo)[j]);                              \
                if (f.kind == KIND_Q6 && j >= 4) {                                                            \
                    if (PARTS == 2) h2[r] = _mm512_dpbusd_epi32(h2[r], w[j], hb);                             \
                    l2[r] = _mm512_dpbusd_epi32(l2[r], w[j], lb);                                             \
                } else {                                                                                      \
                    if (PARTS == 2) h[r] = _mm512_dpbusd_epi32(h[r], w[j], hb);                               \
                    l[r] = _mm512_dpbusd_epi32(l[r], w[j], lb);                                               \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        const __m512 scale = ws->scale;                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR_C; r++) {                                              \
            const lq_xblock *x = xb + (size_t)r * nb;                                                         \
            const __m512 s = _mm512_set1_ps(x->s);                                                            \
            __m512i i = PARTS == 2 ? _mm512_add_epi32(_mm512_slli_epi32(h[r], 8), l[r]) : l[r];               \
            if (f.kind == KIND_Q6) {                                                                          \
                const __m512i ib = _mm512_sub_epi32(PARTS == 2 ? _mm512_add_epi32(_mm512_slli_epi32(h2[r], 8), l2[r]) : l2[r], \
                                                    _mm512_set1_epi32(32 * (x->sum - x->sum_lo)));            \
                i = _mm512_sub_epi32(i, _mm512_set1_epi32(32 * x->sum_lo));                                   \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(scale, s))); \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(ib),                          \
                                                             _mm512_mul_ps(ws->scale2, s)));              \
                continue;                                                                                     \
            }                                                                                                 \
            if (f.kind == KIND_OFFSET) i = _mm512_sub_epi32(i, _mm512_set1_epi32(f.offset * x->sum));       \
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(scale, s)));   \
            if (f.kind == KIND_MIN)                                                                           \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(ws->min, _mm512_set1_ps(x->s_sum)));           \
        }                                                                                                     \
    }

#define BLOCK_ROWS_OF(PARTS) BLOCK_ROWS(1, KIND_OFFSET, PARTS) BLOCK_ROWS(4, KIND_OFFSET, PARTS) \
    BLOCK_ROWS(1, KIND_MIN, PARTS) BLOCK_ROWS(4, KIND_MIN, PARTS) BLOCK_ROWS(1, KIND_Q6, PARTS) BLOCK_ROWS(4, KIND_Q6, PARTS)
BLOCK_ROWS_OF(2)
BLOCK_ROWS_OF(1)

#define MR 4 /* rows of X per pass over a group's blocks: their 16-output accumulators in registers */

/* The rows of X through a group's blocks, MR at a time and then one by one, into y (masked to
 * `rows` columns, plus the bias): LOAD, an expression of bi and w, puts block bi's codes in w[8]
 * and gives its w16_scales. */
#define ROWS_THROUGH_BLOCKS(KIND, PARTS, OFFSET, LOAD)                                                               \
        const __mmask16 keep = (__mmask16)((1u << rows) - 1);                                                 \
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();                     \
        size_t m0 = 0;                                                                                        \
        for (; m0 + MR <= m; m0 += MR) {                                                                      \
            __m512 acc[MR];                                                                                   \
            for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();                                       \
            for (size_t bi = 0; bi < nb; bi++) {                                                              \
                __m512i w[8];                                                                                 \
                const w16_scales ws = LOAD;                                                                   \
                block_rows_4_##KIND##_##PARTS(w, &ws, OFFSET, x + m0 * nb + bi, nb, acc);                               \
            }                                                                                                 \
            for (int r = 0; r < MR; r++)                                                                      \
                _mm512_mask_storeu_ps(y + (m0 + (size_t)r) * ldy, keep, bias ? _mm512_add_ps(acc[r], b) : acc[r]); \
        }                                                                                                     \
        for (; m0 < m; m0++) {                                                                                \
            __m512 acc[1] = {_mm512_setzero_ps()};                                                            \
            for (size_t bi = 0; bi < nb; bi++) {                                                              \
                __m512i w[8];                                                                                 \
                const w16_scales ws = LOAD;                                                                   \
                block_rows_1_##KIND##_##PARTS(w, &ws, OFFSET, x + m0 * nb + bi, nb, acc);                               \
            }                                                                                                 \
            _mm512_mask_storeu_ps(y + m0 * ldy, keep, bias ? _mm512_add_ps(acc[0], b) : acc[0]);             \
        }

#define GROUP_ROWS(KIND, PARTS)                                                                              \
    VNNI static void group_rows_##KIND##_##PARTS(const w16_block *wg, int offset, const lq_xblock *x, size_t nb, size_t m, \
                                       size_t rows, float *y, size_t ldy, const float *bias) {                 \
        ROWS_THROUGH_BLOCKS(KIND, PARTS, offset, load_block(wg + bi, w))                                             \
    }

GROUP_ROWS(KIND_OFFSET, 2)
GROUP_ROWS(KIND_MIN, 2)
GROUP_ROWS(KIND_Q6, 2)
GROUP_ROWS(KIND_OFFSET, 1)
GROUP_ROWS(KIND_MIN, 1)
GROUP_ROWS(KIND_Q6, 1)

/* Calls FN##_KIND_..._PARTS for format f's kind and the parts of the activations (1 or 2). */
#define BY_KIND_AND_PARTS(FN, f, parts, ...)                                                                  \
    do {                                                                                                      \
        if ((f).kind == KIND_Q6)                                                                              \
            (parts) == 2 ? FN##_KIND_Q6_2(__VA_ARGS__) : FN##_KIND_Q6_1(__VA_ARGS__);                         \
        else if ((f).kind == KIND_MIN)                                                                        \
            (parts) == 2 ? FN##_KIND_MIN_2(__VA_ARGS__) : FN##_KIND_MIN_1(__VA_ARGS__);                       \
        else                                                                                                  \
            (parts) == 2 ? FN##_KIND_OFFSET_2(__VA_ARGS__) : FN##_KIND_OFFSET_1(__VA_ARGS__);                 \
    } while (0)

static void group_rows(const w16_block *wg, int_format f, int parts, const lq_xblock *x, size_t nb, size_t m,
                       size_t rows, float *y, size_t ldy, const float *bias) {
    const size_t done = lq_amx_group_rows(wg, f.kind, f.offset, parts, x, nb, m, rows, y, ldy, bias); /* 16 at a time */
    x += done * nb, m -= done, y += done * ldy;
    if (m == 0) return;
    BY_KIND_AND_PARTS(group_rows, f, parts, wg, f.offset, x, nb, m, rows, y, ldy, bias);
}

size_t lq_int_scratch_bytes(size_t k) { return 2 * (k / QK) * sizeof(w16_block); } /* two groups */

void lq_int_rows(int index, const uint8_t *w, size_t row_bytes, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                 size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    w16_block *wg = scratch;
    const size_t nb = k / QK;
    for (size_t g = n0; g < n1; g += 16) {
        const size_t rows = n1 - g < 16 ? n1 - g : 16;
        int_format f = {KIND_OFFSET, 0};
        for (size_t bi = 0; bi < nb; bi++) f = unpack16(index, w + g * row_bytes, row_bytes, rows, bi, wg + bi);
        group_rows(wg, f, bits == 8 ? 1 : 2, x, nb, m, rows, y + g, ldy, bias ? bias + g : NULL);
    }
}

/* ---- weights packed at load ------------------------------------------------------------------ */

/* What unpack_rows computes on every call, done once: the packed layout (pk_layout in
 * quant_int.h). */

/* Block `bi` of a group, from its unit's header and its own bytes, as block_rows reads it. */
VNNI_INLINE w16_scales packed_block(const int index, const uint8_t *head, const uint8_t *b, __m512i w[8]) {
    const pk_layout L = layout_of(index);
    if (index == IX_Q8_0) {
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(b + 64 * j));
    } else {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * j));
            w[j] = _mm512_and_si512(v, m4);
            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
    }
    if (index == IX_Q5_0 || index == IX_Q5_1 || index == IX_Q5_K || index == IX_Q6_K) {
        const uint64_t *plane = (const uint64_t *)(b + L.planes);
        const __m512i b4 = _mm512_set1_epi8(0x10), b5 = _mm512_set1_epi8(0x20);
        for (int j = 0; j < 8; j++) w[j] = _mm512_mask_add_epi8(w[j], (__mmask64)plane[j], w[j], b4); /* | 16 */
        if (index == IX_Q6_K)
            for (int j = 0; j < 8; j++) w[j] = _mm512_mask_add_epi8(w[j], (__mmask64)plane[8 + j], w[j], b5);
    }
    const __m512 zero = _mm512_setzero_ps();
    w16_scales s = {zero, zero, zero};
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define BYTES_U(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define BYTES_S(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
    switch (index) {
    case IX_Q4_0: case IX_Q5_0: case IX_Q8_0: s.scale = HALVES(b + L.d); break;
    case IX_Q4_1: case IX_Q5_1: s.scale = HALVES(b + L.d), s.min = HALVES(b + L.m); break;
    case IX_Q4_K: case IX_Q5_K:
        s.scale = _mm512_mul_ps(HALVES(head), BYTES_U(b + L.d));
        s.min = _mm512_sub_ps(zero, _mm512_mul_ps(HALVES(head + 32), BYTES_U(b + L.m)));
        break;
    default: { /* Q6_K */
        const __m512 d = HALVES(head);
        s.scale = _mm512_mul_ps(d, BYTES_S(b + L.d)), s.scale2 = _mm512_mul_ps(d, BYTES_S(b + L.m));
    }
    }
#undef HALVES
#undef BYTES_U
#undef BYTES_S
    return s;
}

/* Up to this many rows of X, blocks are unpacked in registers for each 4 rows; above, once into
 * a scratch (measured at 12 and 16 rows: 1.04-1.13x for Q4_K and Q4_1 in registers, 0.82-0.85x
 * for Q6_K, whose two bit planes cost more to unpack four times than to store once). */
static size_t packed_fused_max(int index) { return index == IX_Q6_K ? 8 : 16; }

/* A group of 16 rows of W (packed) unpacked into `out` (nb blocks) for format INDEX; and y =
 * the group . the m rows of X with the blocks unpacked in registers for each 4 rows (m small). */
#define PACKED_GROUP(INDEX, KIND, OFFSET)                                                                    \
    VNNI static int_format packed_unpack_##INDEX(const uint8_t *g, size_t nb, w16_block *out) {               \
        const pk_layout L = layout_of(INDEX);                                                                 \
        const size_t unit = L.head_bytes + L.unit_blocks * L.block_bytes;                                     \
        for (size_t bi = 0; bi < nb; bi++) {                                                                  \
            const uint8_t *head = g + bi / L.unit_blocks * unit;                                              \
            __m512i w[8];                                                                                     \
            const w16_scales s = packed_block(INDEX, head, head + L.head_bytes + bi % L.unit_blocks * L.block_bytes, w); \
            for (int j = 0; j < 8; j++) _mm512_storeu_si512((void *)out[bi].codes[j], w[j]);                  \
            _mm512_storeu_ps(out[bi].scale, s.scale);                                                         \
            _mm512_storeu_ps(out[bi].scale2, s.scale2);                                                       \
            _mm512_storeu_ps(out[bi].min, s.min);                                                             \
        }                                                                                                     \
        return (int_format){KIND, OFFSET};                                                                    \
    }                                                                                                         \
    PACKED_FUSED(INDEX, KIND, OFFSET, 2)                                                                      \
    PACKED_FUSED(INDEX, KIND, OFFSET, 1)

#define PACKED_FUSED(INDEX, KIND, OFFSET, PARTS)                                                             \
    VNNI static void packed_fused_##INDEX##_##PARTS(const uint8_t *g, const lq_xblock *x, size_t nb, size_t m, \
                                                    size_t rows, float *y, size_t ldy, const float *bias) {   \
        const pk_layout L = layout_of(INDEX);                                                                 \
        const size_t unit = L.head_bytes + L.unit_blocks * L.block_bytes;                                     \
        ROWS_THROUGH_BLOCKS(KIND, PARTS, OFFSET, packed_block(INDEX, g + bi / L.unit_blocks * unit,           \
                                                              g + bi / L.unit_blocks * unit + L.head_bytes +  \
                                                              bi % L.unit_blocks * L.block_bytes, w))         \
    }

PACKED_GROUP(IX_Q4_0, KIND_OFFSET, 8)
PACKED_GROUP(IX_Q4_1, KIND_MIN, 0)
PACKED_GROUP(IX_Q5_0, KIND_OFFSET, 16)
PACKED_GROUP(IX_Q5_1, KIND_MIN, 0)
PACKED_GROUP(IX_Q8_0, KIND_OFFSET, 128)
PACKED_GROUP(IX_Q4_K, KIND_MIN, 0)
PACKED_GROUP(IX_Q5_K, KIND_MIN, 0)
PACKED_GROUP(IX_Q6_K, KIND_Q6, 32)

static int_format packed_unpack(int index, const uint8_t *g, size_t nb, w16_block *out) {
    switch (index) {
    case IX_Q4_0: return packed_unpack_IX_Q4_0(g, nb, out);
    case IX_Q4_1: return packed_unpack_IX_Q4_1(g, nb, out);
    case IX_Q5_0: return packed_unpack_IX_Q5_0(g, nb, out);
    case IX_Q5_1: return packed_unpack_IX_Q5_1(g, nb, out);
    case IX_Q8_0: return packed_unpack_IX_Q8_0(g, nb, out);
    case IX_Q4_K: return packed_unpack_IX_Q4_K(g, nb, out);
    case IX_Q5_K: return packed_unpack_IX_Q5_K(g, nb, out);
    default: return packed_unpack_IX_Q6_K(g, nb, out);
    }
}

static void packed_fused(int index, int parts, const uint8_t *g, const lq_xblock *x, size_t nb, size_t m,
                         size_t rows, float *y, size_t ldy, const float *bias) {
#define FUSED(IX) (parts == 2 ? packed_fused_##IX##_2 : packed_fused_##IX##_1)(g, x, nb, m, rows, y, ldy, bias)
    switch (index) {
    case IX_Q4_0: FUSED(IX_Q4_0); break;
    case IX_Q4_1: FUSED(IX_Q4_1); break;
    case IX_Q5_0: FUSED(IX_Q5_0); break;
    case IX_Q5_1: FUSED(IX_Q5_1); break;
    case IX_Q8_0: FUSED(IX_Q8_0); break;
    case IX_Q4_K: FUSED(IX_Q4_K); break;
    case IX_Q5_K: FUSED(IX_Q5_K); break;
    default: FUSED(IX_Q6_K); break;
    }
#undef FUSED
}

/* ---- two groups at a time: a batch of rows of X ---------------------------------------------- */

#define MR_P 4 /* rows of X per pass over a pair of groups */

/* The exact integer sums of dwords j0 .. j1 - 1 of one block, for MR_P rows of X (nb blocks
 * apart from x) against two groups of W: each broadcast of X feeds both groups, so a pair
 * loads half as many activations per dot product as one group does. */
VNNI_INLINE void pair_sums(const int parts, const w16_block *wa, const w16_block *wb, const lq_xblock *x, size_t nb,
                           int j0, int j1, __m512i sa[MR_P], __m512i sb[MR_P]) {
    __m512i ha[MR_P], la[MR_P], hb[MR_P], lb[MR_P];
    for (int r = 0; r < MR_P; r++) ha[r] = la[r] = hb[r] = lb[r] = _mm512_setzero_si512();
    _Pragma("GCC unroll 8") for (int j = j0; j < j1; j++) {
        const __m512i a = _mm512_loadu_si512((const void *)wa->codes[j]);
        const __m512i b = _mm512_loadu_si512((const void *)wb->codes[j]);
        _Pragma("GCC unroll 4") for (int r = 0; r < MR_P; r++) {
            const lq_xblock *xr = x + (size_t)r * nb;
            const __m512i xh = _mm512_set1_epi32(((const dword *)xr->hi)[j]);
            const __m512i xl = _mm512_set1_epi32(((const dword *)xr->lo)[j]);
            if (parts == 2) {
                ha[r] = _mm512_dpbusd_epi32(ha[r], a, xh);
                hb[r] = _mm512_dpbusd_epi32(hb[r], b, xh);
            }
            la[r] = _mm512_dpbusd_epi32(la[r], a, xl);
            lb[r] = _mm512_dpbusd_epi32(lb[r], b, xl);
        }
    }
    for (int r = 0; r < MR_P; r++) {
        sa[r] = parts == 2 ? _mm512_add_epi32(_mm512_slli_epi32(ha[r], 8), la[r]) : la[r];
        sb[r] = parts == 2 ? _mm512_add_epi32(_mm512_slli_epi32(hb[r], 8), lb[r]) : lb[r];
    }
}

/* acc += (float)(i - correction) * (scale * s): one term of step 3 for one row of X. */
VNNI_INLINE __m512 add_term(__m512 acc, __m512i i, int correction, const float *scale, float s) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(i, _mm512_set1_epi32(correction)));
    return _mm512_add_ps(acc, _mm512_mul_ps(f, _mm512_mul_ps(_mm512_loadu_ps(scale), _mm512_set1_ps(s))));
}

/* One block of two groups for MR_P rows of X, in block_rows's arithmetic. */
VNNI_INLINE void pair_block(const int kind, const int parts, const int offset, const w16_block *wa, const w16_block *wb,
                            const lq_xblock *x, size_t nb, __m512 acc_a[MR_P], __m512 acc_b[MR_P]) {
    __m512i sa[MR_P], sb[MR_P];
    pair_sums(parts, wa, wb, x, nb, 0, kind == KIND_Q6 ? 4 : 8, sa, sb);
    for (int r = 0; r < MR_P; r++) {
        const lq_xblock *xr = x + (size_t)r * nb;
        const int c = kind == KIND_Q6 ? 32 * xr->sum_lo : kind == KIND_OFFSET ? offset * xr->sum : 0;
        acc_a[r] = add_term(acc_a[r], sa[r], c, wa->scale, xr->s);
        acc_b[r] = add_term(acc_b[r], sb[r], c, wb->scale, xr->s);
        if (kind == KIND_MIN) {
            const __m512 ss = _mm512_set1_ps(xr->s_sum);
            acc_a[r] = _mm512_add_ps(acc_a[r], _mm512_mul_ps(_mm512_loadu_ps(wa->min), ss));
            acc_b[r] = _mm512_add_ps(acc_b[r], _mm512_mul_ps(_mm512_loadu_ps(wb->min), ss));
        }
    }
    if (kind != KIND_Q6) return;
    pair_sums(parts, wa, wb, x, nb, 4, 8, sa, sb);
    for (int r = 0; r < MR_P; r++) {
        const lq_xblock *xr = x + (size_t)r * nb;
        const int c = 32 * (xr->sum - xr->sum_lo);
        acc_a[r] = add_term(acc_a[r], sa[r], c, wa->scale2, xr->s);
        acc_b[r] = add_term(acc_b[r], sb[r], c, wb->scale2, xr->s);
    }
}

/* y = two groups of W (wa: 16 rows, wb: rows_b rows; nb blocks each, unpacked) . the m rows of X,
 * plus the bias: MR_P rows of X at a time, the rest through group_rows's one-row kernel. */
#define PAIR_ROWS(KIND, PARTS)                                                                               \
    VNNI static void pair_rows_##KIND##_##PARTS(const w16_block *wa, const w16_block *wb, int offset, const lq_xblock *x,  \
                                      size_t nb, size_t m, size_t rows_b, float *y, size_t ldy, const float *bias) { \
        const __mmask16 keep_b = (__mmask16)((1u << rows_b) - 1);                                             \
        const __m512 bias_a = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                             \
        const __m512 bias_b = bias ? _mm512_maskz_loadu_ps(keep_b, bias + 16) : _mm512_setzero_ps();          \
        size_t m0 = 0;                                                                                        \
        for (; m0 + MR_P <= m; m0 += MR_P) {                                                                  \
            __m512 acc_a[MR_P], acc_b[MR_P];                                                                  \
            for (int r = 0; r < MR_P; r++) acc_a[r] = acc_b[r] = _mm512_setzero_ps();                        \
            for (size_t bi = 0; bi < nb; bi++) pair_block(KIND, PARTS, offset, wa + bi, wb + bi, x + m0 * nb + bi, nb, acc_a, acc_b); \
            for (int r = 0; r < MR_P; r++) {                                                                  \
                float *yr = y + (m0 + (size_t)r) * ldy;                                                       \
                _mm512_storeu_ps(yr, bias ? _mm512_add_ps(acc_a[r], bias_a) : acc_a[r]);                      \
                _mm512_mask_storeu_ps(yr + 16, keep_b, bias ? _mm512_add_ps(acc_b[r], bias_b) : acc_b[r]);    \
            }                                                                                                 \
        }                                                                                                     \
        if (m0 == m) return;                                                                                  \
        group_rows_##KIND##_##PARTS(wa, offset, x + m0 * nb, nb, m - m0, 16, y + m0 * ldy, ldy, bias);                  \
        group_rows_##KIND##_##PARTS(wb, offset, x + m0 * nb, nb, m - m0, rows_b, y + m0 * ldy + 16, ldy, bias ? bias + 16 : NULL); \
    }

PAIR_ROWS(KIND_OFFSET, 2)
PAIR_ROWS(KIND_MIN, 2)
PAIR_ROWS(KIND_Q6, 2)
PAIR_ROWS(KIND_OFFSET, 1)
PAIR_ROWS(KIND_MIN, 1)
PAIR_ROWS(KIND_Q6, 1)

static void pair_rows(int_format f, int parts, const w16_block *wa, const w16_block *wb, const lq_xblock *x, size_t nb,
                      size_t m, size_t rows_b, float *y, size_t ldy, const float *bias) {
    BY_KIND_AND_PARTS(pair_rows, f, parts, wa, wb, f.offset, x, nb, m, rows_b, y, ldy, bias);
}

size_t lq_int_packed_bytes(int index, size_t n, size_t k) {
    return lq_int_supports(index) ? (n + 15) / 16 * group_bytes(index, k / QK) : 0;
}

void lq_int_rows_packed(int index, const uint8_t *packed, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                        size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    const size_t nb = k / QK, gb = group_bytes(index, nb);
    const int parts = bits == 8 ? 1 : 2;
    w16_block *wa = scratch, *wb = wa + nb;
    /* many rows: two groups unpacked at a time, except where the AMX tiles take one at a time */
    const int pairs = m > packed_fused_max(index) && (index == IX_Q6_K || !lq_amx_available());
    for (size_t g = n0; g < n1;) {
        const size_t rows = n1 - g < 16 ? n1 - g : 16;
        const uint8_t *wg = packed + g / 16 * gb;
        float *yg = y + g;
        const float *bg = bias ? bias + g : NULL;
        if (m <= packed_fused_max(index)) {
            packed_fused(index, parts, wg, x, nb, m, rows, yg, ldy, bg);
        } else if (pairs && n1 - g > 16) {
            const size_t rows_b = n1 - g - 16 < 16 ? n1 - g - 16 : 16;
            const int_format f = packed_unpack(index, wg, nb, wa);
            packed_unpack(index, wg + gb, nb, wb);
            pair_rows(f, parts, wa, wb, x, nb, m, rows_b, yg, ldy, bg);
            g += 32;
            continue;
        } else {
            group_rows(wa, packed_unpack(index, wg, nb, wa), parts, x, nb, m, rows, yg, ldy, bg);
        }
        g += 16;
    }
}

/* Block bi's codes of a group, packed (pack_codes_fn): transposed by unpack16, then split. */
VNNI static void pack_codes(int index, const uint8_t *wg, size_t row_bytes, size_t rows, size_t bi, uint8_t *b) {
    const pk_layout L = layout_of(index);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    w16_block t;
    unpack16(index, wg, row_bytes, rows, bi, &t);
    __m512i c[8];
    for (int j = 0; j < 8; j++) c[j] = _mm512_loadu_si512((const void *)t.codes[j]);
    if (index == IX_Q8_0) {
        for (int j = 0; j < 8; j++) _mm512_storeu_si512((void *)(b + 64 * j), c[j]);
    } else {
        for (int j = 0; j < 4; j++)
            _mm512_storeu_si512((void *)(b + 64 * j), _mm512_or_si512(_mm512_and_si512(c[j], m4),
                                                                      _mm512_slli_epi16(_mm512_and_si512(c[j + 4], m4), 4)));
    }
    if (L.planes) {
        uint64_t *plane = (uint64_t *)(b + L.planes);
        for (int j = 0; j < 8; j++) plane[j] = _mm512_test_epi8_mask(c[j], _mm512_set1_epi8(0x10));
        if (index == IX_Q6_K)
            for (int j = 0; j < 8; j++) plane[8 + j] = _mm512_test_epi8_mask(c[j], _mm512_set1_epi8(0x20));
    }
}

/* Pack the groups g0 <= g < g1 of W (n rows) into `out` (lq_int_packed_bytes, the layout above). */
void lq_int_pack(int index, const uint8_t *w, size_t row_bytes, size_t n, size_t k, size_t g0, size_t g1,
                 uint8_t *out) {
    pack_groups(index, w, row_bytes, n, k, g0, g1, out, pack_codes);
}

int lq_int_supports(int index) {
    switch (index) {
    case IX_Q4_0: case IX_Q4_1: case IX_Q5_0: case IX_Q5_1: case IX_Q8_0: case IX_Q4_K: case IX_Q5_K: case IX_Q6_K:
        return 1;
    default: return 0;
    }
}

int lq_int_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("f16c");
}

#else /* not x86-64 */
void lq_int_quantize(const float *x, size_t ldx, size_t m, size_t k, lq_xblock *out, int bits) {
    (void)x, (void)ldx, (void)m, (void)k, (void)out, (void)bits;
}
size_t lq_int_scratch_bytes(size_t k) { return k; }
void lq_int_rows(int index, const uint8_t *w, size_t row_bytes, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                 size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    (void)bits, (void)index, (void)w, (void)row_bytes, (void)n0, (void)n1, (void)k, (void)x, (void)m, (void)y, (void)ldy;
    (void)bias, (void)scratch;
}
int lq_int_supports(int index) { (void)index; return 0; }
size_t lq_int_packed_bytes(int index, size_t n, size_t k) { (void)index, (void)n, (void)k; return 0; }
void lq_int_rows_packed(int index, const uint8_t *packed, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                        size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    (void)bits, (void)index, (void)packed, (void)n0, (void)n1, (void)k, (void)x, (void)m, (void)y, (void)ldy, (void)bias;
    (void)scratch;
}
void lq_int_pack(int index, const uint8_t *w, size_t row_bytes, size_t n, size_t k, size_t g0, size_t g1,
                 uint8_t *out) {
    (void)index, (void)w, (void)row_bytes, (void)n, (void)k, (void)g0, (void)g1, (void)out;
}
int lq_int_available(void) { return 0; }
#endif
