/* The integer arithmetics (int16, int8: quant_int.c) on CPUs with AVX2 and AVX-VNNI but not
 * AVX512-VNNI (Intel's client cores from Alder Lake on), in 256-bit registers.
 *
 * The same steps in the same order as quant_int.c, so every row has the bits of the AVX-512
 * kernels and of the NumPy reference: activations quantized per 32-element block, exact int32
 * block sums from vpdpbusd (VEX form, 8 rows of W in a register), then the float steps per block
 * in order. Weights are read packed (pk_layout, quant_int.h): a group of 16 rows of W is
 * unpacked KB blocks at a time into a small scratch that stays in L1, and each half of the
 * group (8 rows, one register of outputs) meets 4 rows of X at a time, their sums carried in y
 * from one run of blocks to the next (storing a float and loading it back keeps its bits).
 * Weights as stored are packed a group at a time first. Packing is plain C (once, at load).
 *
 * Compiled without -march: every function that uses the units carries a target attribute and
 * runs only after lq_avx_available() has checked the CPU.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "quant_int.h"

#define KB 16 /* blocks of a group unpacked at a time: 11 KiB, in L1 beside the rows of X */

/* The 32 codes of block `bi` of one row (reference_int16.block_codes), in plain C. */
static void row_block_codes(int index, const uint8_t *row, size_t bi, uint8_t c[QK]) {
    switch (index) {
    case IX_Q4_0:
    case IX_Q4_1:
    case IX_Q5_0:
    case IX_Q5_1: {
        const uint8_t *qs = index == IX_Q4_0   ? ((const block_q4_0 *)row + bi)->qs
                            : index == IX_Q4_1 ? ((const block_q4_1 *)row + bi)->qs
                            : index == IX_Q5_0 ? ((const block_q5_0 *)row + bi)->qs
                                               : ((const block_q5_1 *)row + bi)->qs;
        uint32_t high = 0;
        if (index == IX_Q5_0) memcpy(&high, ((const block_q5_0 *)row + bi)->qh, 4);
        if (index == IX_Q5_1) memcpy(&high, ((const block_q5_1 *)row + bi)->qh, 4);
        for (int i = 0; i < QK / 2; i++) c[i] = qs[i] & 15, c[i + QK / 2] = qs[i] >> 4;
        for (int i = 0; i < QK; i++) c[i] |= (uint8_t)(((high >> i) & 1) << 4);
        return;
    }
    case IX_Q8_0:
        for (int i = 0; i < QK; i++) c[i] = (uint8_t)(((const block_q8_0 *)row + bi)->qs[i] + 128);
        return;
    case IX_Q4_K:
    case IX_Q5_K: {
        const size_t sb = bi / 8, sub = bi % 8;
        const uint8_t *qs = index == IX_Q4_K ? ((const block_q4_K *)row + sb)->qs : ((const block_q5_K *)row + sb)->qs;
        for (int i = 0; i < QK; i++) {
            const uint8_t q = qs[32 * (sub / 2) + i];
            c[i] = sub % 2 ? q >> 4 : q & 15;
            if (index == IX_Q5_K) c[i] |= (uint8_t)(((((const block_q5_K *)row + sb)->qh[i] >> sub) & 1) << 4);
        }
        return;
    }
    default: { /* Q6_K */
        const size_t sb = bi / 8, sub = bi % 8, h = sub / 4, part = sub % 4;
        const block_q6_K *b = (const block_q6_K *)row + sb;
        for (int i = 0; i < QK; i++) {
            const uint8_t low = b->ql[64 * h + (part & 1 ? 32 : 0) + i];
            const uint8_t top = (b->qh[32 * h + i] >> (2 * part)) & 3;
            c[i] = (uint8_t)((part < 2 ? low & 15 : low >> 4) | top << 4);
        }
    }
    }
}

/* Block bi's codes of a group, packed (pack_codes_fn), in plain C: lq_int_pack's bytes. */
static void pack_codes(int index, const uint8_t *wg, size_t row_bytes, size_t rows, size_t bi, uint8_t *b) {
    const pk_layout L = layout_of(index);
    uint64_t *plane = (uint64_t *)(b + L.planes);
    for (size_t r = 0; r < rows; r++) {
        uint8_t c[QK];
        row_block_codes(index, wg + r * row_bytes, bi, c);
        for (int e = 0; e < QK; e++) {
            const int j = e / 4, at = 4 * (int)r + e % 4; /* vector j, byte at */
            if (index == IX_Q8_0)
                b[64 * j + at] = c[e];
            else
                b[64 * (j % 4) + at] |= (uint8_t)((c[e] & 15) << (j < 4 ? 0 : 4));
            if (L.planes && (c[e] & 0x10)) plane[j] |= 1ull << at;
            if (index == IX_Q6_K && (c[e] & 0x20)) plane[8 + j] |= 1ull << at;
        }
    }
}

/* lq_int_pack's layout, in plain C (the same bytes). */
void lq_avx_pack(int index, const uint8_t *w, size_t row_bytes, size_t n, size_t k, size_t g0, size_t g1,
                 uint8_t *out) {
    pack_groups(index, w, row_bytes, n, k, g0, g1, out, pack_codes);
}

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#include <immintrin.h>

#define YMM __attribute__((target("avx2,fma,f16c,avxvnni")))
#define YMM_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c,avxvnni")))

typedef int32_t __attribute__((may_alias, aligned(1))) dword; /* 4 codes of X, read as one */

int lq_avx_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avxvnni");
}

/* ---- activations (quant_int.c's quantize_row, the same bits) ------------------------------ */

YMM static void quantize_row(const float *x, size_t k, lq_xblock *out, int q_max) {
    for (size_t b = 0; b < k / QK; b++, out++) {
        const float *xb = x + QK * b;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float s = amax > 0.0f ? amax / (float)q_max : 0.0f;
        int32_t sum = 0, sum_lo = 0;
        for (int i = 0; i < QK; i++) {
            int32_t q = 0;
            if (s > 0.0f) {
                q = (int32_t)nearbyintf(xb[i] / s); /* to nearest even, as cvtps2dq */
                q = q > q_max ? q_max : q < -q_max ? -q_max : q;
            }
            const int32_t hi = (q + 128) >> 8;
            out->hi[i] = (int8_t)hi, out->lo[i] = (int8_t)(q - 256 * hi);
            sum += q;
            if (i < QK / 2) sum_lo += q;
        }
        out->s = s, out->sum = sum, out->sum_lo = sum_lo, out->s_sum = s * (float)sum;
    }
}

void lq_avx_quantize(const float *x, size_t ldx, size_t m, size_t k, lq_xblock *out, int bits) {
    const int q_max = bits == 8 ? LQ_XQ8_MAX : LQ_XQ_MAX;
    for (size_t r = 0; r < m; r++) quantize_row(x + r * ldx, k, out + r * (k / QK), q_max);
}

/* ---- weights: a packed block into w16_block ------------------------------------------------- */

/* 32 bytes, 0xff where bit i of `bits` is set. */
YMM_INLINE __m256i bit_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

YMM_INLINE __m256 halves8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

YMM_INLINE __m256 bytes8(const uint8_t *p, int is_signed) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* Block `bi` of a packed group (its unit's header `head`, its bytes `b`) as w16_block. */
YMM_INLINE void unpack_block(const int index, const uint8_t *head, const uint8_t *b, w16_block *out) {
    const pk_layout L = layout_of(index);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        __m256i w[8];
        if (index == IX_Q8_0) {
            for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(b + 64 * j + 32 * h));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 * j + 32 * h));
                w[j] = _mm256_and_si256(v, m4);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
        }
        if (L.planes) {
            const uint64_t *plane = (const uint64_t *)(b + L.planes);
            for (int j = 0; j < 8; j++) {
                w[j] = _mm256_or_si256(w[j], _mm256_and_si256(bit_bytes((uint32_t)(plane[j] >> (32 * h))),
                                                              _mm256_set1_epi8(0x10)));
                if (index == IX_Q6_K)
                    w[j] = _mm256_or_si256(w[j], _mm256_and_si256(bit_bytes((uint32_t)(plane[8 + j] >> (32 * h))),
                                                                  _mm256_set1_epi8(0x20)));
            }
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(out->codes[j][8 * h]), w[j]);
        const __m256 zero = _mm256_setzero_ps();
        __m256 scale = zero, scale2 = zero, min = zero;
        switch (index) {
        case IX_Q4_0: case IX_Q5_0: case IX_Q8_0: scale = halves8(b + L.d + 16 * h); break;
        case IX_Q4_1: case IX_Q5_1: scale = halves8(b + L.d + 16 * h), min = halves8(b + L.m + 16 * h); break;
        case IX_Q4_K: case IX_Q5_K:
            scale = _mm256_mul_ps(halves8(head + 16 * h), bytes8(b + L.d + 8 * h, 0));
            min = _mm256_sub_ps(zero, _mm256_mul_ps(halves8(head + 32 + 16 * h), bytes8(b + L.m + 8 * h, 0)));
            break;
        default: { /* Q6_K */
            const __m256 d = halves8(head + 16 * h);
            scale = _mm256_mul_ps(d, bytes8(b + L.d + 8 * h, 1)), scale2 = _mm256_mul_ps(d, bytes8(b + L.m + 8 * h, 1));
        }
        }
        _mm256_storeu_ps(out->scale + 8 * h, scale);
        _mm256_storeu_ps(out->scale2 + 8 * h, scale2);
        _mm256_storeu_ps(out->min + 8 * h, min);
    }
}

/* ---- products ------------------------------------------------------------------------------ */

/* acc[r] (8 outputs: rows 8h .. 8h + 7 of the group) += block wb's terms for MR_C rows of X
 * from xb (nb blocks apart), in block_rows's arithmetic (quant_int.c, step 3). */
YMM_INLINE void half_block(const int kind, const int parts, const int mr, const w16_block *wb, int h, int offset,
                           const lq_xblock *xb, size_t nb, __m256 *acc) {
    for (int pass = 0; pass < (kind == KIND_Q6 ? 2 : 1); pass++) {
        const int j0 = kind == KIND_Q6 ? 4 * pass : 0, j1 = kind == KIND_Q6 ? j0 + 4 : 8;
        __m256i hs[4], ls[4];
        for (int r = 0; r < mr; r++) hs[r] = ls[r] = _mm256_setzero_si256();
        for (int j = j0; j < j1; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)wb->codes[j][8 * h]);
            for (int r = 0; r < mr; r++) {
                const lq_xblock *x = xb + (size_t)r * nb;
                if (parts == 2) hs[r] = _mm256_dpbusd_avx_epi32(hs[r], w, _mm256_set1_epi32(((const dword *)x->hi)[j]));
                ls[r] = _mm256_dpbusd_avx_epi32(ls[r], w, _mm256_set1_epi32(((const dword *)x->lo)[j]));
            }
        }
        const __m256 scale = _mm256_loadu_ps((pass ? wb->scale2 : wb->scale) + 8 * h);
        for (int r = 0; r < mr; r++) {
            const lq_xblock *x = xb + (size_t)r * nb;
            const __m256i i = parts == 2 ? _mm256_add_epi32(_mm256_slli_epi32(hs[r], 8), ls[r]) : ls[r];
            const int c = kind == KIND_Q6 ? 32 * (pass ? x->sum - x->sum_lo : x->sum_lo)
                          : kind == KIND_OFFSET ? offset * x->sum : 0;
            const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(i, _mm256_set1_epi32(c)));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(f, _mm256_mul_ps(scale, _mm256_set1_ps(x->s))));
            if (kind == KIND_MIN)
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_loadu_ps(wb->min + 8 * h), _mm256_set1_ps(x->s_sum)));
        }
    }
}

/* Rows [m0, m0 + mr) of X through blocks [b0, b1) of one half of a group (unpacked in `chunk`,
 * block b0 first), the sums so far in y (none before block 0), the bias added after the last. */
#define HALF_ROWS(KIND, PARTS, MR_C)                                                                         \
    YMM static void half_rows_##KIND##_##PARTS##_##MR_C(const w16_block *chunk, int h, int offset, const lq_xblock *x, \
                                                      size_t nb, size_t b0, size_t b1, float *y, size_t ldy,     \
                                                      const float *bias, __m256i keep) {                         \
        __m256 acc[MR_C];                                                                                     \
        for (int r = 0; r < MR_C; r++)                                                                        \
            acc[r] = b0 ? _mm256_maskload_ps(y + (size_t)r * ldy + 8 * h, keep) : _mm256_setzero_ps();      \
        for (size_t bi = b0; bi < b1; bi++) half_block(KIND, PARTS, MR_C, chunk + (bi - b0), h, offset, x + bi, nb, acc); \
        for (int r = 0; r < MR_C; r++) {                                                                      \
            if (bias && b1 == nb) acc[r] = _mm256_add_ps(acc[r], _mm256_maskload_ps(bias + 8 * h, keep));    \
            _mm256_maskstore_ps(y + (size_t)r * ldy + 8 * h, keep, acc[r]);                                  \
        }                                                                                                     \
    }

#define HALF_ROWS_ALL(KIND)                                                                                  \
    HALF_ROWS(KIND, 2, 4) HALF_ROWS(KIND, 2, 1) HALF_ROWS(KIND, 1, 4) HALF_ROWS(KIND, 1, 1)

HALF_ROWS_ALL(KIND_OFFSET)
HALF_ROWS_ALL(KIND_MIN)
HALF_ROWS_ALL(KIND_Q6)

typedef void half_rows_fn(const w16_block *, int, int, const lq_xblock *, size_t, size_t, size_t, float *, size_t,
                          const float *, __m256i);

static half_rows_fn *half_rows_for(int kind, int parts, int four) {
#define PICK(KIND) \
    (parts == 2 ? (four ? half_rows_##KIND##_2_4 : half_rows_##KIND##_2_1) : (four ? half_rows_##KIND##_1_4 : half_rows_##KIND##_1_1))
    return kind == KIND_Q6 ? PICK(KIND_Q6) : kind == KIND_MIN ? PICK(KIND_MIN) : PICK(KIND_OFFSET);
#undef PICK
}

static int_format format_of(int index) {
    switch (index) {
    case IX_Q4_0: return (int_format){KIND_OFFSET, 8};
    case IX_Q5_0: return (int_format){KIND_OFFSET, 16};
    case IX_Q8_0: return (int_format){KIND_OFFSET, 128};
    case IX_Q6_K: return (int_format){KIND_Q6, 32};
    default: return (int_format){KIND_MIN, 0};
    }
}

/* A unpacked run of blocks, for each format known at compile time. */
#define UNPACK_RUN(INDEX)                                                                                    \
    YMM static void unpack_run_##INDEX(const uint8_t *g, size_t b0, size_t b1, w16_block *chunk) {            \
        const pk_layout L = layout_of(INDEX);                                                                 \
        const size_t unit = L.head_bytes + L.unit_blocks * L.block_bytes;                                     \
        for (size_t bi = b0; bi < b1; bi++) {                                                                 \
            const uint8_t *head = g + bi / L.unit_blocks * unit;                                              \
            unpack_block(INDEX, head, head + L.head_bytes + bi % L.unit_blocks * L.block_bytes, chunk + (bi - b0)); \
        }                                                                                                     \
    }

UNPACK_RUN(IX_Q4_0)
UNPACK_RUN(IX_Q4_1)
UNPACK_RUN(IX_Q5_0)
UNPACK_RUN(IX_Q5_1)
UNPACK_RUN(IX_Q8_0)
UNPACK_RUN(IX_Q4_K)
UNPACK_RUN(IX_Q5_K)
UNPACK_RUN(IX_Q6_K)

static void unpack_run(int index, const uint8_t *g, size_t b0, size_t b1, w16_block *chunk) {
    switch (index) {
    case IX_Q4_0: unpack_run_IX_Q4_0(g, b0, b1, chunk); break;
    case IX_Q4_1: unpack_run_IX_Q4_1(g, b0, b1, chunk); break;
    case IX_Q5_0: unpack_run_IX_Q5_0(g, b0, b1, chunk); break;
    case IX_Q5_1: unpack_run_IX_Q5_1(g, b0, b1, chunk); break;
    case IX_Q8_0: unpack_run_IX_Q8_0(g, b0, b1, chunk); break;
    case IX_Q4_K: unpack_run_IX_Q4_K(g, b0, b1, chunk); break;
    case IX_Q5_K: unpack_run_IX_Q5_K(g, b0, b1, chunk); break;
    default: unpack_run_IX_Q6_K(g, b0, b1, chunk); break;
    }
}

/* y (m rows, `rows` columns) = a packed group . X, plus the bias. */
YMM static void group_y(int index, int parts, const uint8_t *g, const lq_xblock *x, size_t nb, size_t m, size_t rows,
                        float *y, size_t ldy, const float *bias, w16_block *chunk) {
    const int_format f = format_of(index);
    half_rows_fn *four = half_rows_for(f.kind, parts, 1), *one = half_rows_for(f.kind, parts, 0);
    const size_t run = nb < KB ? nb : KB;
    for (size_t b0 = 0; b0 < nb; b0 += run) {
        const size_t b1 = nb - b0 < run ? nb : b0 + run;
        unpack_run(index, g, b0, b1, chunk);
        for (int h = 0; h < 2 && (size_t)(8 * h) < rows; h++) {
            const int n_out = rows - 8 * (size_t)h < 8 ? (int)(rows - 8 * (size_t)h) : 8;
            const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n_out), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            size_t m0 = 0;
            for (; m0 + 4 <= m; m0 += 4) four(chunk, h, f.offset, x + m0 * nb, nb, b0, b1, y + m0 * ldy, ldy, bias, keep);
            for (; m0 < m; m0++) one(chunk, h, f.offset, x + m0 * nb, nb, b0, b1, y + m0 * ldy, ldy, bias, keep);
        }
    }
}

size_t lq_avx_scratch_bytes(size_t k) { return KB * sizeof(w16_block) + group_bytes(IX_Q8_0, k / QK) + 64; }

void lq_avx_rows_packed(int index, const uint8_t *packed, size_t n0, size_t n1, size_t k, const lq_xblock *x, size_t m,
                        float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    const size_t nb = k / QK, gb = group_bytes(index, nb);
    for (size_t g = n0; g < n1; g += 16)
        group_y(index, bits == 8 ? 1 : 2, packed + g / 16 * gb, x, nb, m, n1 - g < 16 ? n1 - g : 16, y + g, ldy,
                bias ? bias + g : NULL, scratch);
}

void lq_avx_rows(int index, const uint8_t *w, size_t row_bytes, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                 size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    const size_t nb = k / QK;
    w16_block *chunk = scratch;
    uint8_t *group = (uint8_t *)scratch + KB * sizeof(w16_block);
    for (size_t g = n0; g < n1; g += 16) {
        lq_avx_pack(index, w + g * row_bytes, row_bytes, n1 - g, k, 0, 1, group); /* this group alone */
        group_y(index, bits == 8 ? 1 : 2, group, x, nb, m, n1 - g < 16 ? n1 - g : 16, y + g, ldy,
                bias ? bias + g : NULL, chunk);
    }
}

#else /* no AVX-VNNI compiler support, or not x86-64 */
int lq_avx_available(void) { return 0; }
void lq_avx_quantize(const float *x, size_t ldx, size_t m, size_t k, lq_xblock *out, int bits) {
    (void)x, (void)ldx, (void)m, (void)k, (void)out, (void)bits;
}
size_t lq_avx_scratch_bytes(size_t k) { return k; }
void lq_avx_rows_packed(int index, const uint8_t *packed, size_t n0, size_t n1, size_t k, const lq_xblock *x, size_t m,
                        float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    (void)index, (void)packed, (void)n0, (void)n1, (void)k, (void)x, (void)m, (void)y, (void)ldy, (void)bias;
    (void)scratch, (void)bits;
}
void lq_avx_rows(int index, const uint8_t *w, size_t row_bytes, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                 size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits) {
    (void)index, (void)w, (void)row_bytes, (void)n0, (void)n1, (void)k, (void)x, (void)m, (void)y, (void)ldy;
    (void)bias, (void)scratch, (void)bits;
}
#endif
