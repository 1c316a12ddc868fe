/* Quantized linear on GGUF block formats: the exported API, the portable scalar kernels and the
 * choice of SIMD level.
 *
 *   Y (M, N) = X (M, K) . W (N, K)^T + bias (N)      X, Y, bias float32; W encoded rows
 *
 * M = 1 (decoding one token): each row of W is dotted with x straight from its blocks.
 * A few rows (M <= dotm_max, batched decoding of a few sequences): the same, each weight decoded
 * in registers once for all M rows. A batch of decoding sequences (up to LQ_FUSED_MAX_M rows, or
 * more while X fits in L2), where the level has fused kernels: a few rows of W decoded in
 * registers for the first rows of X and kept, as decoded, for the others. More rows: a tile of
 * rows of W is decoded once into a float buffer, then multiplied with all M rows of X in
 * register blocks, so the weight bytes are read once whatever M is. All paths follow one
 * arithmetic per output element (quant.h), and work is split over rows of W only (never over
 * K), so every output has the same bits whatever M and the thread count are.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/simd_choice.h"

#include "quant.h"
#include "quant_int.h"

enum { LQ_OK = 0, LQ_ERR_TYPE = -1, LQ_ERR_SHAPE = -2, LQ_ERR_MEMORY = -3 };

/* ---- formats ----------------------------------------------------------------------------- */

typedef struct {
    int type, index;
    int block_elems, block_bytes;
} format_t;

static const format_t FORMATS[] = {
    {LQ_F32, IX_F32, 1, 4},          {LQ_F16, IX_F16, 1, 2},          {LQ_BF16, IX_BF16, 1, 2},
    {LQ_Q4_0, IX_Q4_0, QK, 18},      {LQ_Q4_1, IX_Q4_1, QK, 20},      {LQ_Q5_0, IX_Q5_0, QK, 22},
    {LQ_Q5_1, IX_Q5_1, QK, 24},      {LQ_Q8_0, IX_Q8_0, QK, 34},      {LQ_Q4_K, IX_Q4_K, QK_K, 144},
    {LQ_Q5_K, IX_Q5_K, QK_K, 176},   {LQ_Q6_K, IX_Q6_K, QK_K, 210},
};

static const format_t *find_format(int type) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].type == type) return &FORMATS[i];
    return NULL;
}

/* ---- scalar decoders (the portable reference for the SIMD ones) -------------------------- */

/* The shared bodies below are inlined into each decoder, where their constant flags fold away. */
#define INLINE static inline __attribute__((always_inline))

void lq_decode_f32(const void *row, float *dst, size_t k) { memcpy(dst, row, k * sizeof(float)); }

/* A row of f16 values, or with bf16 of bf16 ones. */
INLINE void decode_16bit(const void *row, float *dst, size_t k, const int bf16) {
    const uint8_t *p = row;
    for (size_t i = 0; i < k; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16 ? lq_bf16_to_float(h) : lq_half_to_float(h);
    }
}

static void decode_f16(const void *row, float *dst, size_t k) { decode_16bit(row, dst, k, 0); }

static void decode_bf16(const void *row, float *dst, size_t k) { decode_16bit(row, dst, k, 1); }

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 32 values of a q4_0 / q4_1 / q5_0 / q5_1 block: codes q from the nibbles of qs (element
 * j low, j + 16 high), with bit j of the 32-bit word at qh as bit 4 where qh is not NULL;
 * d * (q - offset), or with offset 0 (the formats with a minimum) d * q + m. */
INLINE void decode_nibbles(const uint8_t *qs, const uint8_t *qh, float d, float m, const int offset, float *dst) {
    const uint32_t high = qh ? load_u32(qh) : 0;
    for (int j = 0; j < QK / 2; j++) {
        const int lo = (qs[j] & 0x0f) | (((high >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
        dst[j] = offset ? d * (float)(lo - offset) : d * (float)lo + m;
        dst[j + QK / 2] = offset ? d * (float)(hi - offset) : d * (float)hi + m;
    }
}

static void decode_q4_0(const void *row, float *dst, size_t k) {
    const block_q4_0 *b = row;
    for (size_t i = 0; i < k / QK; i++) decode_nibbles(b[i].qs, NULL, lq_half_to_float(b[i].d), 0, 8, dst + i * QK);
}

static void decode_q4_1(const void *row, float *dst, size_t k) {
    const block_q4_1 *b = row;
    for (size_t i = 0; i < k / QK; i++)
        decode_nibbles(b[i].qs, NULL, lq_half_to_float(b[i].d), lq_half_to_float(b[i].m), 0, dst + i * QK);
}

static void decode_q5_0(const void *row, float *dst, size_t k) {
    const block_q5_0 *b = row;
    for (size_t i = 0; i < k / QK; i++) decode_nibbles(b[i].qs, b[i].qh, lq_half_to_float(b[i].d), 0, 16, dst + i * QK);
}

static void decode_q5_1(const void *row, float *dst, size_t k) {
    const block_q5_1 *b = row;
    for (size_t i = 0; i < k / QK; i++)
        decode_nibbles(b[i].qs, b[i].qh, lq_half_to_float(b[i].d), lq_half_to_float(b[i].m), 0, dst + i * QK);
}

static void decode_q8_0(const void *row, float *dst, size_t k) {
    const block_q8_0 *b = row;
    for (size_t i = 0; i < k / QK; i++, b++, dst += QK) {
        const float d = lq_half_to_float(b->d);
        for (int j = 0; j < QK; j++) dst[j] = (float)b->qs[j] * d;
    }
}

/* A q4_K / q5_K super-block (qh NULL for q4_K): d_j * q - min_j per sub-block j, chunk c of 32
 * bytes holding sub-blocks 2c (low nibbles) and 2c+1 (high), bit 2c (2c+1) of qh[l] the fifth
 * bit of their element l. */
INLINE void decode_k4(const uint8_t *scales, const uint8_t *qs, const uint8_t *qh, float d, float dmin,
                      float *dst) {
    for (int c = 0; c < 4; c++, dst += 64) {
        uint8_t sc0, m0, sc1, m1;
        unpack_scales_k4(scales, 2 * c, &sc0, &m0);
        unpack_scales_k4(scales, 2 * c + 1, &sc1, &m1);
        const float d0 = d * (float)sc0, min0 = dmin * (float)m0;
        const float d1 = d * (float)sc1, min1 = dmin * (float)m1;
        const uint8_t *q = qs + 32 * c;
        for (int l = 0; l < 32; l++) {
            const int lo = (q[l] & 0x0f) | (qh ? ((qh[l] >> (2 * c)) & 1) << 4 : 0);
            const int hi = (q[l] >> 4) | (qh ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0);
            dst[l] = d0 * (float)lo - min0;
            dst[l + 32] = d1 * (float)hi - min1;
        }
    }
}

static void decode_q4_K(const void *row, float *dst, size_t k) {
    const block_q4_K *b = row;
    for (size_t i = 0; i < k / QK_K; i++)
        decode_k4(b[i].scales, b[i].qs, NULL, lq_half_to_float(b[i].d), lq_half_to_float(b[i].dmin), dst + i * QK_K);
}

static void decode_q5_K(const void *row, float *dst, size_t k) {
    const block_q5_K *b = row;
    for (size_t i = 0; i < k / QK_K; i++)
        decode_k4(b[i].scales, b[i].qs, b[i].qh, lq_half_to_float(b[i].d), lq_half_to_float(b[i].dmin),
                  dst + i * QK_K);
}

/* Q6_K, per 128-element half: for l < 32, ql[l] and ql[l+32] give the low nibbles of elements
 * l and l+32 and the high nibbles of l+64 and l+96; the four 2-bit pairs of qh[l] give their
 * top bits, in that order. */
static void decode_q6_K(const void *row, float *dst, size_t k) {
    const block_q6_K *b = row;
    for (size_t i = 0; i < k / QK_K; i++, b++) {
        const float d = lq_half_to_float(b->d);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
            const int8_t *sc = b->scales + 8 * h;
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                dst[l] = d * (float)sc[is] * (float)q1;
                dst[l + 32] = d * (float)sc[is + 2] * (float)q2;
                dst[l + 64] = d * (float)sc[is + 4] * (float)q3;
                dst[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
            dst += 128;
        }
    }
}

/* ---- scalar dot products ----------------------------------------------------------------- */

/* w . x with 8 interleaved partial sums (a layout the compiler can keep in vector registers),
 * added pairwise at the end. */
static float dot_f32(const float *w, const float *x, size_t k) {
    float acc[8] = {0};
    size_t i = 0;
    for (; i + 8 <= k; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += w[i + j] * x[i + j];
    for (int j = 0; i < k; i++, j++) acc[j] += w[i] * x[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static void tile_scalar(const float *w, size_t rows, size_t k, const float *x, size_t ldx, size_t m, float *y,
                        size_t ldy, const float *bias) {
    for (size_t r = 0; r < m; r++)
        for (size_t j = 0; j < rows; j++) {
            const float v = dot_f32(w + j * k, x + r * ldx, k);
            y[r * ldy + j] = bias ? v + bias[j] : v;
        }
}

/* Multiply, then add (the scalar level's arithmetic), in LQ_FMA_CHAINS independent chains. */
static float fma_loop_scalar(size_t rounds) {
    float a[LQ_FMA_CHAINS], s = 0;
    for (int i = 0; i < LQ_FMA_CHAINS; i++) a[i] = (float)i;
    for (size_t r = 0; r < rounds; r++)
        for (int i = 0; i < LQ_FMA_CHAINS; i++) a[i] = a[i] * 0.999f + 1e-3f;
    for (int i = 0; i < LQ_FMA_CHAINS; i++) s += a[i];
    return s;
}

const lq_kernels lq_kernels_scalar = {
    .name = "scalar",
    .decode = LQ_DECODERS,
    .dot = {NULL},
    .dotm = {NULL},
    .tile = tile_scalar,
    .fma_loop = fma_loop_scalar,
    .fma_lanes = 1,
    .dot_rows = 1,
    .dotm_max = 1,
    .tile_rows = 1,
    .tile_align = 1,
};

/* ---- SIMD level -------------------------------------------------------------------------- */

SIMD_CHOICE(lq_kernels, lq_kernels_scalar, lq_kernels_avx2, lq_kernels_avx512) /* kernels(): the level in use */

/* The arithmetic of the block formats: ARITH_F32 (the level's float kernels), ARITH_INT16 or
 * ARITH_INT8 (quant_int.c, where this CPU has the units), chosen at first use: int16 where it
 * runs, unless LLAISYS_QUANT_MATH names another that runs here. */
enum { ARITH_UNSET = -1, ARITH_F32 = 0, ARITH_INT16 = 1, ARITH_INT8 = 2 };
static const char *const ARITH_NAMES[] = {"f32", "int16", "int8"};
static atomic_int arith = ARITH_UNSET;

/* Whether this CPU has integer dot-product units the integer arithmetics run on: AVX512-VNNI
 * (quant_int.c) or AVX-VNNI (quant_int_avx2.c). */
static int int_units(void) { return lq_int_available() || lq_avx_available(); }

/* The arithmetic called `name`, or -1 when unknown or not running on this CPU. */
static int arithmetic_named(const char *name) {
    for (int a = ARITH_F32; name && a <= ARITH_INT8; a++)
        if (strcmp(name, ARITH_NAMES[a]) == 0) return a == ARITH_F32 || int_units() ? a : -1;
    return -1;
}

static int arithmetic(void) {
    int a = atomic_load_explicit(&arith, memory_order_acquire);
    if (a == ARITH_UNSET) {
        a = arithmetic_named(getenv("LLAISYS_QUANT_MATH"));
        if (a < 0) a = int_units() ? ARITH_INT16 : ARITH_F32;
        atomic_store_explicit(&arith, a, memory_order_release);
    }
    return a;
}

/* ---- jobs -------------------------------------------------------------------------------- */

typedef struct {
    const lq_kernels *kern;
    const format_t *fmt;
    const uint8_t *w;              /* n encoded rows of row_bytes */
    const uint8_t *packed;         /* W as lq_int_pack wrote it, or NULL */
    size_t row_bytes, n, k, rows_per_chunk, tile_rows;
    const float *x, *bias;         /* x (m, k) row stride ldx; bias (n) or NULL */
    size_t ldx, m, ldy;
    float *y;                      /* (m, n) row stride ldy */
    float *scratch;                /* one decoded tile (tile_rows, k) per pool thread */
} linear_job;

static void *alloc_floats(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, (n ? n : 1) * sizeof(float)) == 0 ? p : NULL;
}

/* Up to dotm_max rows of X with a fused kernel (each weight decoded in registers, once for all
 * of them): rows [n0, n1) of y, dot_rows rows of W at a time; M = 1 through `dot`. */
static void linear_chunk_fused(void *arg, size_t chunk, int thread) {
    (void)thread;
    const linear_job *j = arg;
    const size_t tile = (size_t)j->kern->dot_rows;
    size_t n0 = chunk * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk;
    if (n1 > j->n) n1 = j->n;
    for (size_t t0 = n0; t0 < n1; t0 += tile) {
        const size_t rows = n1 - t0 < tile ? n1 - t0 : tile;
        const uint8_t *w = j->w + t0 * j->row_bytes;
        const float *bias = j->bias ? j->bias + t0 : NULL;
        if (j->m == 1)
            j->kern->dot[j->fmt->index](w, j->row_bytes, rows, j->x, j->k, j->y + t0, bias);
        else
            j->kern->dotm[j->fmt->index](w, j->row_bytes, rows, j->x, j->ldx, j->m, j->k, j->y + t0, j->ldy, bias);
    }
}

/* dotm_max < M (LQ_FUSED_* in quant.h): rows [n0, n1) of y, fused_rows rows of W at a time, each
 * decoded once (in registers, kept in this thread's scratch for the later rows of X). */
static void linear_chunk_fused_tiles(void *arg, size_t chunk, int thread) {
    const linear_job *j = arg;
    const size_t tile = (size_t)j->kern->fused_rows;
    float *buf = j->scratch + (size_t)thread * tile * j->k; /* (tile, k) */
    size_t n0 = chunk * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk;
    if (n1 > j->n) n1 = j->n;
    for (size_t t0 = n0; t0 < n1; t0 += tile) {
        const size_t rows = n1 - t0 < tile ? n1 - t0 : tile;
        j->kern->fused[j->fmt->index](j->w + t0 * j->row_bytes, j->row_bytes, rows, j->x, j->ldx, j->m, j->k,
                                      j->y + t0, j->ldy, j->bias ? j->bias + t0 : NULL, buf);
    }
}

/* Any M: decode a tile of rows of W once, then multiply it with every row of X. A chunk is
 * a whole number of tiles. The rows of a tile are back to back, so one decode call takes them
 * all (the decoders work block by block: a row ends where a block does). */
static void linear_chunk_tiles(void *arg, size_t chunk, int thread) {
    const linear_job *j = arg;
    const lq_decode_fn decode = j->kern->decode[j->fmt->index];
    const size_t tile = j->tile_rows, align = (size_t)j->kern->tile_align;
    float *buf = j->scratch + (size_t)thread * tile * j->k; /* (tile, k) */
    size_t n0 = chunk * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk;
    if (n1 > j->n) n1 = j->n;
    for (size_t t0 = n0; t0 < n1; t0 += tile) {
        const size_t rows = n1 - t0 < tile ? n1 - t0 : tile;
        decode(j->w + t0 * j->row_bytes, buf, rows * j->k);
        const size_t padded = (rows + align - 1) / align * align < tile ? (rows + align - 1) / align * align : tile;
        if (rows < padded) memset(buf + rows * j->k, 0, (padded - rows) * j->k * sizeof(float));
        j->kern->tile(buf, rows, j->k, j->x, j->ldx, j->m, j->y + t0, j->ldy, j->bias ? j->bias + t0 : NULL);
    }
}

static void dequant_chunk(void *arg, size_t chunk, int thread) {
    (void)thread;
    const linear_job *j = arg;
    const lq_decode_fn decode = j->kern->decode[j->fmt->index];
    size_t n0 = chunk * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk;
    if (n1 > j->n) n1 = j->n;
    for (size_t r = n0; r < n1; r++) decode(j->w + r * j->row_bytes, j->y + r * j->k, j->k);
}

/* Rows per chunk, for rows that cost `row_work` (weight elements times rows of X) each: about
 * 2^17 units per chunk, at least 4 chunks per thread when that leaves 2^15 units or more per
 * chunk (so a thread that loses its core holds up little work, and waking a thread pays off),
 * rounded up to whole tiles of `align` rows. */
static size_t chunk_rows(size_t n, size_t row_work, size_t align, size_t threads) {
    const size_t target = (size_t)1 << 17, floor = (size_t)1 << 15;
    if (row_work == 0) row_work = 1;
    size_t rows = target / row_work;
    const size_t spread = (n + 4 * threads - 1) / (4 * threads);
    if (rows > spread) rows = spread;
    if (rows < floor / row_work) rows = floor / row_work;
    rows = (rows + align - 1) / align * align;
    return rows ? rows : align;
}

typedef struct {
    const linear_job *job;
    int bits;            /* of the activations: 16 or 8 */
    int ymm;             /* on AVX-VNNI (quant_int_avx2.c) rather than AVX512-VNNI */
    const lq_xblock *xq; /* X quantized: m rows of k / QK blocks */
    uint8_t *scratch;    /* lq_int_scratch_bytes(k) per pool thread */
    size_t scratch_bytes;
} int_job;

static void linear_chunk_int(void *arg, size_t chunk, int thread) {
    const int_job *ij = arg;
    const linear_job *j = ij->job;
    size_t n0 = chunk * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk;
    if (n1 > j->n) n1 = j->n;
    void *scratch = ij->scratch + (size_t)thread * ij->scratch_bytes;
    if (ij->ymm && j->packed)
        lq_avx_rows_packed(j->fmt->index, j->packed, n0, n1, j->k, ij->xq, j->m, j->y, j->ldy, j->bias, scratch,
                           ij->bits);
    else if (ij->ymm)
        lq_avx_rows(j->fmt->index, j->w, j->row_bytes, n0, n1, j->k, ij->xq, j->m, j->y, j->ldy, j->bias, scratch,
                    ij->bits);
    else if (j->packed)
        lq_int_rows_packed(j->fmt->index, j->packed, n0, n1, j->k, ij->xq, j->m, j->y, j->ldy, j->bias, scratch,
                           ij->bits);
    else
        lq_int_rows(j->fmt->index, j->w, j->row_bytes, n0, n1, j->k, ij->xq, j->m, j->y, j->ldy, j->bias, scratch,
                    ij->bits);
}

/* Whether the integer arithmetics run on AVX-VNNI: where the CPU lacks AVX512-VNNI, or the
 * float kernels' level was set to AVX2 (LLAISYS_SIMD=avx2) on a CPU with both. */
static int int_on_ymm(void) { return lq_avx_available() && (!lq_int_available() || kernels() == lq_kernels_avx2()); }

/* The int16 or int8 arithmetic (`bits` of the activations) for all M: X quantized once, then
 * groups of 16 rows of W over it. */
static int linear_int(linear_job *j, int threads, int bits) {
    const size_t nb = j->k / QK, x_bytes = (j->m * nb * sizeof(lq_xblock) + 63) / 64 * 64;
    const int ymm = int_on_ymm();
    const size_t scratch = ymm ? lq_avx_scratch_bytes(j->k) : lq_int_scratch_bytes(j->k);
    int_job ij = {.job = j, .bits = bits, .ymm = ymm, .scratch_bytes = (scratch + 63) / 64 * 64};
    const int slots = j->m == 1 && j->n * j->row_bytes < LQ_SERIAL_BYTES ? 1 : threads;
    /* whole groups of 16 rows; for a batch, whole pairs of groups (lq_int_rows_packed) */
    j->rows_per_chunk = chunk_rows(j->n, j->k * j->m, j->m > 8 ? 32 : 16, (size_t)slots);
    const size_t n_chunks = (j->n + j->rows_per_chunk - 1) / j->rows_per_chunk;
    const int used = n_chunks < (size_t)slots ? (int)n_chunks : slots;
    void *mem = NULL;
    if (posix_memalign(&mem, 64, x_bytes + (size_t)used * ij.scratch_bytes) != 0) return LQ_ERR_MEMORY;
    ij.xq = mem;
    ij.scratch = (uint8_t *)mem + x_bytes;
    (ymm ? lq_avx_quantize : lq_int_quantize)(j->x, j->ldx, j->m, j->k, (lq_xblock *)mem, bits);
    lq_pool_run(linear_chunk_int, &ij, n_chunks, used);
    free(mem);
    return 0;
}

/* ---- exported API ------------------------------------------------------------------------ */


LQ_EXPORT int llaisys_quant_block_size(int type) {
    const format_t *f = find_format(type);
    return f ? f->block_elems : LQ_ERR_TYPE;
}

LQ_EXPORT int llaisys_quant_block_bytes(int type) {
    const format_t *f = find_format(type);
    return f ? f->block_bytes : LQ_ERR_TYPE;
}

/* Dequantize n_rows rows of k elements from src (n_rows * row_bytes) into dst (n_rows, k). */
LQ_EXPORT int llaisys_quant_dequantize(int type, const void *src, int64_t n_rows, int64_t k, float *dst) {
    const format_t *f = find_format(type);
    if (!f) return LQ_ERR_TYPE;
    if (k <= 0 || n_rows < 0 || k % f->block_elems) return LQ_ERR_SHAPE;
    linear_job j = {.kern = kernels(), .fmt = f, .w = src, .n = (size_t)n_rows, .k = (size_t)k, .y = dst};
    j.row_bytes = (size_t)k / (size_t)f->block_elems * (size_t)f->block_bytes;
    const int threads = lq_pool_threads();
    j.rows_per_chunk = chunk_rows(j.n, j.k, 1, (size_t)threads);
    lq_pool_run(dequant_chunk, &j, (j.n + j.rows_per_chunk - 1) / j.rows_per_chunk, threads);
    return LQ_OK;
}

/* Floats from the caller's stack area (LQ_LOCAL_FLOATS, shared by one call's buffers) while it
 * lasts, else from the heap (*heap set, for the caller to free). Both 64-byte aligned. */
static float *take_floats(float *local, size_t *used, size_t n, float **heap) {
    n = (n + 15) / 16 * 16;
    if (*used + n <= LQ_LOCAL_FLOATS) {
        float *p = local + *used;
        *used += n;
        return p;
    }
    return *heap = alloc_floats(n);
}

/* Y (m, n) = X (m, k) . W (n, k)^T + bias (n) or no bias when NULL. X rows are ldx floats
 * apart, Y rows ldy floats apart; W is n rows of encoded bytes, back to back. `packed`: W as
 * llaisys_quant_int_pack wrote it (read by the int16 arithmetic instead of W; same results),
 * or NULL. */
static int quant_linear(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t ldx, int64_t m,
                        float *y, int64_t ldy, const float *bias, const void *packed, int arith);

LQ_EXPORT int llaisys_quant_linear(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t ldx,
                                   int64_t m, float *y, int64_t ldy, const float *bias, const void *packed) {
    return quant_linear(type, w, n, k, x, ldx, m, y, ldy, bias, packed, arithmetic());
}

int lq_linear_f32(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t ldx, int64_t m, float *y,
                  int64_t ldy, const float *bias) {
    return quant_linear(type, w, n, k, x, ldx, m, y, ldy, bias, NULL, ARITH_F32);
}

/* llaisys_quant_linear in the f32 arithmetic whichever is in use (what the MoE kernels' NumPy
 * form calls, as their C form does). */
LQ_EXPORT int llaisys_quant_linear_f32(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t ldx,
                                       int64_t m, float *y, int64_t ldy, const float *bias) {
    return lq_linear_f32(type, w, n, k, x, ldx, m, y, ldy, bias);
}

/* Rows of W per decoded tile (linear_chunk_tiles) for m rows of X of k elements. Many rows of
 * X: 4x taller tiles of W (L2-sized), so X streams through the cache 4x less often (measured:
 * up to 20% faster at M = 512). Up to 32 rows: a tile of about LQ_TILE_BYTES, which stays in L1
 * beside the rows of X while it meets all of them (measured: 10-25% faster than 16-row tiles at
 * M = 8..16, K = 576..1536). */
static size_t decoded_tile_rows(const lq_kernels *kern, size_t k, size_t m) {
    const size_t align = (size_t)kern->tile_align;
    size_t tile = (size_t)kern->tile_rows * 4;
    const size_t fits = LQ_TILE_L2_BYTES / (k * sizeof(float)) / align * align;
    if (tile > fits) tile = fits > align ? fits : align;
    if (m <= 32) {
        tile = LQ_TILE_BYTES / (k * sizeof(float)) / align * align;
        if (tile < align) tile = align;
        if (tile > (size_t)kern->tile_rows) tile = (size_t)kern->tile_rows;
    }
    return tile;
}

static int quant_linear(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t ldx, int64_t m,
                        float *y, int64_t ldy, const float *bias, const void *packed, int arith) {
    const format_t *f = find_format(type);
    if (!f) return LQ_ERR_TYPE;
    if (k <= 0 || n < 0 || m < 0 || k % f->block_elems || (m > 1 && ldx < k) || (m > 1 && ldy < n))
        return LQ_ERR_SHAPE;
    if (n == 0 || m == 0) return LQ_OK;
    linear_job j = {.kern = kernels(), .fmt = f, .w = w, .packed = packed, .n = (size_t)n, .k = (size_t)k, .x = x,
                    .bias = bias, .ldx = (size_t)ldx, .m = (size_t)m, .ldy = (size_t)ldy, .y = y};
    j.row_bytes = (size_t)k / (size_t)f->block_elems * (size_t)f->block_bytes;
    const int threads = lq_pool_threads();
    float local[LQ_LOCAL_FLOATS] __attribute__((aligned(64)));
    size_t used = 0;
    float *x_heap = NULL, *tile_heap = NULL;
    /* X rows that do not start on a cache line (NumPy's arrays start 16 bytes or so past one)
     * are copied to rows that do: every vector load of X would otherwise straddle two lines
     * (measured: 10-15% slower at M = 4..16). A copy leaves the values, and so the bits of Y,
     * unchanged. */
    const size_t ldx_a = (j.k + 15) / 16 * 16;
    if ((uintptr_t)x % 64 || (j.m > 1 && j.ldx % 16)) {
        float *xa = take_floats(local, &used, j.m * ldx_a, &x_heap);
        if (!xa) return LQ_ERR_MEMORY;
        for (size_t r = 0; r < j.m; r++) memcpy(xa + r * ldx_a, x + r * j.ldx, j.k * sizeof(float));
        j.x = xa;
        j.ldx = ldx_a;
    }
    int status = LQ_OK;
    if ((arith == ARITH_INT16 || arith == ARITH_INT8) && lq_int_supports(f->index)) {
        status = linear_int(&j, threads, arith == ARITH_INT8 ? 8 : 16);
    } else if (m == 1 && j.kern->dot[f->index]) {
        const int slots = j.n * j.row_bytes < LQ_SERIAL_BYTES ? 1 : threads;
        j.rows_per_chunk = chunk_rows(j.n, j.k, (size_t)j.kern->dot_rows, (size_t)slots);
        lq_pool_run(linear_chunk_fused, &j, (j.n + j.rows_per_chunk - 1) / j.rows_per_chunk, slots);
    } else if (m <= j.kern->dotm_max && j.kern->dotm[f->index]) {
        j.rows_per_chunk = chunk_rows(j.n, j.k * j.m, (size_t)j.kern->dot_rows, (size_t)threads);
        const size_t n_chunks = (j.n + j.rows_per_chunk - 1) / j.rows_per_chunk;
        lq_pool_run(linear_chunk_fused, &j, n_chunks, n_chunks < (size_t)threads ? (int)n_chunks : threads);
    } else {
        /* Tiles of W decoded once each into the thread's scratch: by the fused kernels, or
         * decoded whole, then multiplied (tile). */
        const int fused =
            j.kern->fused[f->index] && (j.m <= LQ_FUSED_MAX_M || j.m * j.k * sizeof(float) <= LQ_FUSED_X_BYTES);
        const size_t tile = fused ? (size_t)j.kern->fused_rows : decoded_tile_rows(j.kern, j.k, j.m);
        j.tile_rows = tile;
        j.rows_per_chunk = chunk_rows(j.n, j.k * j.m, tile, (size_t)threads);
        const size_t n_chunks = (j.n + j.rows_per_chunk - 1) / j.rows_per_chunk;
        const int slots = n_chunks < (size_t)threads ? (int)n_chunks : threads;
        if ((j.scratch = take_floats(local, &used, (size_t)slots * tile * j.k, &tile_heap)))
            lq_pool_run(fused ? linear_chunk_fused_tiles : linear_chunk_tiles, &j, n_chunks, slots);
        else
            status = LQ_ERR_MEMORY;
    }
    free(tile_heap);
    free(x_heap);
    return status;
}

/* 1 when the int16 arithmetic runs 16 rows of X at a time on the AMX tiles here (granted, not
 * turned off with LLAISYS_AMX=0), else 0. */
LQ_EXPORT int llaisys_quant_int_amx(void) { return lq_amx_available() && !int_on_ymm(); }

/* The units the integer arithmetics run on now: "avx512_vnni", "avx_vnni", or "" (none here). */
LQ_EXPORT const char *llaisys_quant_int_level(void) {
    return int_on_ymm() ? "avx_vnni" : lq_int_available() ? "avx512_vnni" : "";
}

/* Bytes of W (n rows of k elements in format `type`) repacked for the int16 arithmetic, or 0
 * where it has no packed kernels (format, or a CPU without the units); negative: bad type or
 * shape. */
LQ_EXPORT int64_t llaisys_quant_int_packed_bytes(int type, int64_t n, int64_t k) {
    const format_t *f = find_format(type);
    if (!f) return LQ_ERR_TYPE;
    if (k <= 0 || n < 0 || k % f->block_elems) return LQ_ERR_SHAPE;
    if (!int_units()) return 0;
    return (int64_t)lq_int_packed_bytes(f->index, (size_t)n, (size_t)k);
}

typedef struct {
    int index;
    const uint8_t *w;
    size_t row_bytes, n, k, groups_per_chunk;
    uint8_t *out;
} pack_job;

static void pack_chunk(void *arg, size_t chunk, int thread) {
    (void)thread;
    const pack_job *p = arg;
    const size_t groups = (p->n + 15) / 16, g0 = chunk * p->groups_per_chunk;
    const size_t g1 = g0 + p->groups_per_chunk < groups ? g0 + p->groups_per_chunk : groups;
    (int_on_ymm() ? lq_avx_pack : lq_int_pack)(p->index, p->w, p->row_bytes, p->n, p->k, g0, g1, p->out);
}

/* Write W (n rows in format `type`) into out (llaisys_quant_int_packed_bytes of it, 64-byte
 * aligned) in the layout of the int16 arithmetic's packed kernels. */
LQ_EXPORT int llaisys_quant_int_pack(int type, const void *w, int64_t n, int64_t k, void *out) {
    const int64_t bytes = llaisys_quant_int_packed_bytes(type, n, k);
    if (bytes < 0) return (int)bytes;
    if (bytes == 0 || (uintptr_t)out % 64) return LQ_ERR_SHAPE;
    const format_t *f = find_format(type);
    pack_job p = {.index = f->index, .w = w, .n = (size_t)n, .k = (size_t)k, .out = out};
    p.row_bytes = (size_t)k / (size_t)f->block_elems * (size_t)f->block_bytes;
    const int threads = lq_pool_threads();
    const size_t groups = (p.n + 15) / 16;
    p.groups_per_chunk = (groups + 4 * (size_t)threads - 1) / (4 * (size_t)threads);
    if (!p.groups_per_chunk) p.groups_per_chunk = 1;
    lq_pool_run(pack_chunk, &p, (groups + p.groups_per_chunk - 1) / p.groups_per_chunk, threads);
    return LQ_OK;
}

/* llaisys_quant_linear with its arguments in one block (lq_linear_call, quant.h). */
LQ_EXPORT int llaisys_quant_linear_call(const void *block) {
    const lq_linear_call *c = block;
    return llaisys_quant_linear((int)c->type, c->w, c->n, c->k, c->x, c->ldx, c->m, c->y, c->ldy, c->bias,
                                c->packed);
}

/* Rows of W gathered by index and dequantized (lq_gather_call, quant.h); every index is checked
 * first. One thread: an embedding's few rows are not worth waking the pool for. */
LQ_EXPORT int llaisys_quant_gather_call(void *block) {
    lq_gather_call *c = block;
    const format_t *f = find_format((int)c->type);
    if (!f) return LQ_ERR_TYPE;
    if (c->k <= 0 || c->rows < 0 || c->k % f->block_elems) return LQ_ERR_SHAPE;
    for (int64_t i = 0; i < c->rows; i++) {
        const int64_t r = c->index[i * c->index_s];
        if (r < 0 || r >= c->n) {
            c->bad[0] = i, c->bad[1] = r;
            return LQ_ERR_SHAPE;
        }
    }
    const lq_decode_fn decode = kernels()->decode[f->index];
    const size_t row_bytes = (size_t)c->k / (size_t)f->block_elems * (size_t)f->block_bytes;
    for (int64_t i = 0; i < c->rows; i++)
        decode((const uint8_t *)c->w + (size_t)c->index[i * c->index_s] * row_bytes, c->out + i * c->out_s,
               (size_t)c->k);
    return LQ_OK;
}

LQ_EXPORT int llaisys_quant_set_threads(int n) { return lq_pool_set_threads(n); }

LQ_EXPORT int llaisys_quant_threads(void) { return lq_pool_threads(); }

/* The pool itself (lq_pool_run), lent to the other native libraries (csrc/ops's attention) so
 * that one set of workers serves every kernel. */
LQ_EXPORT void llaisys_quant_pool_run(lq_task_fn task, void *ctx, size_t n_chunks, int slots) {
    lq_pool_run(task, ctx, n_chunks, slots);
}

typedef struct {
    const lq_kernels *kern;
    size_t rounds;
    float sink[256]; /* one per pool thread: where the loops leave their results */
} peak_job;

static void peak_chunk(void *arg, size_t chunk, int thread) {
    (void)chunk;
    peak_job *p = arg;
    p->sink[thread & 255] += p->kern->fma_loop(p->rounds);
}

/* The machine's multiply-add peak at the SIMD level in use, for benchmarks: `chunks` runs of the
 * level's fma_loop (`rounds` rounds each) on the thread pool. Returns the multiply-adds done
 * (the caller times the call). */
LQ_EXPORT int64_t llaisys_quant_fma_loop(int64_t rounds, int64_t chunks) {
    if (rounds <= 0 || chunks <= 0) return 0;
    peak_job p = {.kern = kernels(), .rounds = (size_t)rounds};
    lq_pool_run(peak_chunk, &p, (size_t)chunks, lq_pool_threads());
    return rounds * chunks * LQ_FMA_CHAINS * p.kern->fma_lanes;
}

/* Name of the SIMD level in use: "scalar", "avx2" or "avx512". */
LQ_EXPORT const char *llaisys_quant_simd_level(void) { return kernels()->name; }

/* Bit l set when SIMD level l (0 scalar, 1 avx2, 2 avx512) runs on this CPU. */
LQ_EXPORT int llaisys_quant_simd_available(void) { return simd_available_mask(table_of); }

/* The arithmetic of the block formats in use: "f32", "int16" or "int8". */
LQ_EXPORT const char *llaisys_quant_math(void) { return ARITH_NAMES[arithmetic()]; }

/* Use arithmetic `name` ("f32", "int16", "int8") from now on; -1 when unknown or it does not run
 * on this CPU. */
LQ_EXPORT int llaisys_quant_set_math(const char *name) {
    const int a = arithmetic_named(name);
    if (a < 0) return LQ_ERR_TYPE;
    atomic_store_explicit(&arith, a, memory_order_release);
    return LQ_OK;
}

/* Use SIMD level `name` from now on; -1 when it does not run on this CPU. */
LQ_EXPORT int llaisys_quant_set_simd_level(const char *name) {
    const int level = simd_level_named(name, table_of);
    if (level < 0) return LQ_ERR_TYPE;
    atomic_store_explicit(&active, level_kernels(level), memory_order_release);
    return LQ_OK;
}
