/* Quantized linear: GGUF block formats, the per-SIMD-level kernel tables, the thread pool.
 *
 * The block structs mirror the GGUF (ggml) layout byte for byte, so a tensor's bytes from a
 * GGUF file are an array of these structs, one row of K elements after another. Scales are
 * IEEE half floats stored as uint16_t. Activations and accumulation stay float32 throughout.
 */
#ifndef LLAISYS_KERNELS_QUANT_H
#define LLAISYS_KERNELS_QUANT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LQ_EXPORT __attribute__((visibility("default")))

/* GGML type ids (the numbers stored in GGUF files). */
enum {
    LQ_F32 = 0, LQ_F16 = 1, LQ_Q4_0 = 2, LQ_Q4_1 = 3, LQ_Q5_0 = 6, LQ_Q5_1 = 7, LQ_Q8_0 = 8,
    LQ_Q4_K = 12, LQ_Q5_K = 13, LQ_Q6_K = 14, LQ_BF16 = 30,
};

/* Dense index of the handled types, for the kernel tables. */
enum { IX_F32, IX_F16, IX_BF16, IX_Q4_0, IX_Q4_1, IX_Q5_0, IX_Q5_1, IX_Q8_0, IX_Q4_K, IX_Q5_K, IX_Q6_K, IX_COUNT };

#define QK 32    /* elements per block of the 32-element formats */
#define QK_K 256 /* elements per K-quant super-block */

/* How far ahead the M = 1 kernels prefetch weights (measured on SmolLM2's 30 MB output head,
 * now that 4 rows are read side by side: 8192 up to 4% faster than 4096, nowhere slower). */
#define LQ_PREFETCH_BYTES 8192

/* M = 1 with fewer weight bytes than this runs on the calling thread alone: waking a second
 * thread costs a few microseconds. (At 1 MB, SmolLM2-135M's q/k/v (345 KB), attention output
 * (207 KB) and down (553 KB) projections ran on one thread; on two, q/k/v took 36 us instead
 * of 71, and a 2-thread decode step ran about 10% faster, measured.) */
#define LQ_SERIAL_BYTES ((size_t)64 << 10)

/* dotm_max < M <= 32: decoded tiles of W of about this many bytes (they stay in L1 while they
 * meet all the rows of X), within the level's tile_align .. tile_rows rows. */
#define LQ_TILE_BYTES ((size_t)16 << 10)

/* More rows of X: taller tiles of W, up to this many bytes decoded (they stay in L2 while every
 * row of X meets them; a wide K makes them shorter). */
#ifndef LQ_TILE_L2_BYTES
#define LQ_TILE_L2_BYTES ((size_t)512 << 10)
#endif

/* dotm_max < M <= LQ_FUSED_MAX_M, or more rows while X takes at most LQ_FUSED_X_BYTES (it is
 * read once per 4 rows of W, from L2): the fused kernels, each weight decoded once, between
 * multiply-adds. (Measured, Q4_1, 1 thread, against decode + tile: 4-5% faster up to M = 192
 * of K = 576 (X 442 KB), level at M = 256 (590 KB), 10-25% slower at M = 256 .. 512 of
 * K = 1536 (1.5 .. 3 MB).) */
#define LQ_FUSED_MAX_M 64
#define LQ_FUSED_X_BYTES ((size_t)512 << 10)

/* Independent multiply-add chains of fma_loop: enough to fill two FMA pipes of 4 cycles' latency. */
#define LQ_FMA_CHAINS 12

/* One call's scratch (aligned rows of X, decoded tiles for all threads) lives on the caller's
 * stack up to this many floats, on the heap beyond. */
#define LQ_LOCAL_FLOATS ((size_t)16 << 10)

typedef uint16_t lq_half; /* IEEE binary16 bits */

typedef struct {
    lq_half d;           /* scale: value = d * (q - 8) */
    uint8_t qs[QK / 2];  /* element j in the low nibble of qs[j], element j+16 in the high nibble */
} block_q4_0;

typedef struct {
    lq_half d, m;        /* scale and minimum: value = d * q + m */
    uint8_t qs[QK / 2];  /* nibbles as in q4_0 */
} block_q4_1;

typedef struct {
    lq_half d;           /* value = d * (q - 16), q of 5 bits */
    uint8_t qh[4];       /* bit j (little-endian 32-bit word) is bit 4 of element j */
    uint8_t qs[QK / 2];  /* low 4 bits, nibbles as in q4_0 */
} block_q5_0;

typedef struct {
    lq_half d, m;        /* value = d * q + m */
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_1;

typedef struct {
    lq_half d;           /* value = d * q */
    int8_t qs[QK];
} block_q8_0;

/* K-quants: a 256-element super-block of 8 sub-blocks of 32, each with a 6-bit scale and a
 * 6-bit min packed into 12 bytes (see unpack_scales_k4). */
typedef struct {
    lq_half d, dmin;        /* super-block scale for the sub-block scales and mins */
    uint8_t scales[12];     /* 8 x (6-bit scale, 6-bit min) */
    uint8_t qs[QK_K / 2];   /* 32-byte chunk c: low nibbles = sub-block 2c, high = 2c+1 */
} block_q4_K;

typedef struct {
    lq_half d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];   /* bit j of qh[l] is bit 4 of element l of sub-block j */
    uint8_t qs[QK_K / 2];   /* low 4 bits, as in q4_K */
} block_q5_K;

typedef struct {
    uint8_t ql[QK_K / 2];   /* low 4 bits; see the Q6_K decoders for the order */
    uint8_t qh[QK_K / 4];   /* high 2 bits */
    int8_t scales[QK_K / 16]; /* one signed 8-bit scale per 16 elements */
    lq_half d;              /* value = d * scale * (q - 32) */
} block_q6_K;

_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must match GGUF");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must match GGUF");
_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0 must match GGUF");
_Static_assert(sizeof(block_q5_1) == 24, "block_q5_1 must match GGUF");
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must match GGUF");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K must match GGUF");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K must match GGUF");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K must match GGUF");

/* Portable half -> float, exact for every input (subnormals, inf, nan). */
static inline float lq_half_to_float(lq_half h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float lq_bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 6-bit scale and min of sub-block j of a q4_K / q5_K super-block. */
static inline void unpack_scales_k4(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* All 8 scales and mins of a q4_K / q5_K super-block at once, one byte each, from the 12
 * bytes read as three little-endian words (the x86 kernels' form of unpack_scales_k4). */
static inline void unpack_scales_k4_le(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x30303030u;
    const uint32_t s[2] = {a & low6, (c & low4) | ((a >> 2) & top2)};
    const uint32_t m[2] = {b & low6, ((c >> 4) & low4) | ((b >> 2) & top2)};
    memcpy(sc, s, 8);
    memcpy(mn, m, 8);
}

/* Kernels of one SIMD level. Each level fixes one arithmetic per output element, which every
 * path below follows exactly, so an output has the same bits whatever M is, wherever its row
 * sits in X and however rows are split among threads (levels differ from each other):
 *   1. each weight decoded to f32 exactly, with the reference's operations (d * q, then + m or
 *      - m: two roundings); where the product is exact (a half scale, or a half times a 6-bit
 *      sub-block scale, times a code of at most 5 bits: 22 significant bits or fewer) a level
 *      may compute d * q + m with one fma, whose single rounding gives the same bits;
 *   2. one accumulator of `lanes` floats per output: element i goes to lane i % lanes, the
 *      chunks of `lanes` elements added in order (fma at the SIMD levels; a multiply, then an
 *      add, in scalar C), a last partial chunk zero-padded;
 *   3. the lanes summed by one fixed tree, then the bias added.
 *   decode: one row of k elements -> k floats, bit-exact with the NumPy reference.
 *   dot:    M = 1: y[j] = row j . x (+ bias[j]) for j < rows <= dot_rows, straight from the
 *           encoded rows (row_bytes apart), decoded in registers. NULL: decode + tile.
 *   dotm:   dot for 2 <= m <= dotm_max rows of X (ldx apart) at once, into y rows ldy apart:
 *           each weight decoded once for the m rows. NULL: decode + tile.
 *   fused:  m > dotm_max (LQ_FUSED_*): y[r][j] = row j . x[r] (+ bias[j]) for r < m, j < rows
 *           <= fused_rows: the rows decoded in registers while they meet the first rows of X
 *           and kept in buf (fused_rows x k floats) for the other rows. NULL: decode + tile.
 *   tile:   y[r][j] = w[j] . x[r] (+ bias[j]) for r < m, j < rows, where w holds `rows`
 *           decoded rows of k floats, then zero rows up to a multiple of tile_align (or of
 *           the tile).
 *   fma_loop: the level's multiply-add peak, for benchmarks: `rounds` rounds of LQ_FMA_CHAINS
 *           independent chains of fma_lanes lanes; returns a sum that depends on all of them. */
typedef void (*lq_decode_fn)(const void *row, float *dst, size_t k);
typedef void (*lq_dot_fn)(const void *w, size_t row_bytes, size_t rows, const float *x, size_t k, float *y,
                          const float *bias);
typedef void (*lq_dotm_fn)(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx, size_t m,
                           size_t k, float *y, size_t ldy, const float *bias);
typedef void (*lq_fused_fn)(const void *w, size_t row_bytes, size_t rows, const float *x, size_t ldx, size_t m,
                            size_t k, float *y, size_t ldy, const float *bias, float *buf);
typedef float (*lq_fma_loop_fn)(size_t rounds);
typedef void (*lq_tile_fn)(const float *w, size_t rows, size_t k, const float *x, size_t ldx, size_t m, float *y,
                           size_t ldy, const float *bias);

typedef struct {
    const char *name;
    lq_decode_fn decode[IX_COUNT];
    lq_dot_fn dot[IX_COUNT];
    lq_dotm_fn dotm[IX_COUNT];
    lq_fused_fn fused[IX_COUNT];
    lq_tile_fn tile;
    lq_fma_loop_fn fma_loop;
    int fma_lanes;  /* multiply-adds per chain and round of fma_loop */
    int dot_rows;   /* rows of W per dot (and dotm) call */
    int dotm_max;   /* most rows of X per dotm call */
    int fused_rows; /* rows of W per fused call */
    int tile_rows;  /* rows of W decoded at a time for tile (quant.c takes 4x for many rows of X) */
    int tile_align; /* tile's rows of W come in groups of this many (the decoded tile is padded to it) */
} lq_kernels;

extern const lq_kernels lq_kernels_scalar;
void lq_decode_f32(const void *row, float *dst, size_t k); /* a copy: shared by every level */
const lq_kernels *lq_kernels_avx2(void);   /* NULL unless this CPU (and build) has the level */
const lq_kernels *lq_kernels_avx512(void);

/* Designated initializers of a per-format table (decode, dot, ...) whose entry for format X is
 * the including file's function <p>_<x><s> (decode_q4_0, dot_q6_K_m): the block formats; f16,
 * bf16 and the block formats; all formats. LQ_DECODERS: a level's decode table (f32 is a copy
 * at every level). */
#define LQ_BLOCK_ENTRIES(p, s)                                                                              \
    [IX_Q4_0] = p##_q4_0##s, [IX_Q4_1] = p##_q4_1##s, [IX_Q5_0] = p##_q5_0##s, [IX_Q5_1] = p##_q5_1##s,  \
    [IX_Q8_0] = p##_q8_0##s, [IX_Q4_K] = p##_q4_K##s, [IX_Q5_K] = p##_q5_K##s, [IX_Q6_K] = p##_q6_K##s
#define LQ_NON_F32_ENTRIES(p, s) [IX_F16] = p##_f16##s, [IX_BF16] = p##_bf16##s, LQ_BLOCK_ENTRIES(p, s)
#define LQ_ALL_ENTRIES(p, s) [IX_F32] = p##_f32##s, LQ_NON_F32_ENTRIES(p, s)
#define LQ_DECODERS {[IX_F32] = lq_decode_f32, LQ_NON_F32_ENTRIES(decode, )}

/* The entries of a SIMD level's table (quant_avx2.c, quant_avx512.c) that every level fills
 * alike, from its decode_* and dot_* of every format, tile, fma_loop, DOT_ROWS, TILE_ROWS and
 * MAX_MX; `lanes` and `align` are its fma_lanes and tile_align. */
#define LQ_SIMD_LEVEL(level_name, lanes, align)                                                           \
    .name = level_name, .decode = LQ_DECODERS, .dot = {LQ_ALL_ENTRIES(dot, )}, .dotm_max = MAX_MX,        \
    .tile = tile, .fma_loop = fma_loop, .fma_lanes = lanes, .dot_rows = DOT_ROWS, .tile_rows = TILE_ROWS, \
    .tile_align = align

/* The int16 arithmetic (quant_int.c): activations as 16-bit integers per 32-element block, in
 * two signed 8-bit parts, meeting the weights' integer codes on the integer dot-product units;
 * and the int8 arithmetic, the same with 8-bit activations (one part: hi = 0). `bits` below
 * (16 or 8) says which. */
#define LQ_XQ_MAX 32639 /* largest |code| of an activation: 256 hi + lo with hi, lo in int8 */
#define LQ_XQ8_MAX 127  /* the int8 arithmetic's */

typedef struct {
    int8_t hi[QK], lo[QK]; /* code q = 256 * hi + lo */
    float s;               /* x ~= s * q */
    float s_sum;           /* s * (float)sum */
    int32_t sum, sum_lo;   /* sum of the block's codes; of its first 16 */
} lq_xblock;

int lq_int_available(void);   /* whether this CPU has the units (AVX512-VNNI) */
int lq_int_supports(int index); /* whether format `index` (IX_*) has int16 kernels */
/* Rows m of X (ldx floats apart, k a multiple of QK) as k / QK blocks each, back to back. */
void lq_int_quantize(const float *x, size_t ldx, size_t m, size_t k, lq_xblock *out, int bits);
size_t lq_int_scratch_bytes(size_t k); /* one thread's scratch for lq_int_rows */
/* y[r][j] = row j of W . x[r] (+ bias[j]) for r < m, n0 <= j < n1, from X quantized by
 * lq_int_quantize; n0 a multiple of 16. */
void lq_int_rows(int index, const uint8_t *w, size_t row_bytes, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                 size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits);
/* W repacked once for lq_int_rows_packed (the layout: quant_int.c): its bytes (0: format not
 * supported), and groups g0 <= g < g1 of 16 rows written into out (n rows, row_bytes each). */
size_t lq_int_packed_bytes(int index, size_t n, size_t k);
void lq_int_pack(int index, const uint8_t *w, size_t row_bytes, size_t n, size_t k, size_t g0, size_t g1,
                 uint8_t *out);
/* lq_int_rows on W as lq_int_pack wrote it: the same bits. */
void lq_int_rows_packed(int index, const uint8_t *packed, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                        size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits);
/* The same on AVX2 + AVX-VNNI (quant_int_avx2.c), for CPUs without AVX512-VNNI: the same
 * bits and the same packed layout (lq_avx_pack writes lq_int_pack's bytes in plain C). */
int lq_avx_available(void);
void lq_avx_quantize(const float *x, size_t ldx, size_t m, size_t k, lq_xblock *out, int bits);
size_t lq_avx_scratch_bytes(size_t k);
void lq_avx_rows(int index, const uint8_t *w, size_t row_bytes, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                 size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits);
void lq_avx_rows_packed(int index, const uint8_t *packed, size_t n0, size_t n1, size_t k, const lq_xblock *x,
                        size_t m, float *y, size_t ldy, const float *bias, void *scratch, int bits);
void lq_avx_pack(int index, const uint8_t *w, size_t row_bytes, size_t n, size_t k, size_t g0, size_t g1,
                 uint8_t *out);

/* Thread pool (threadpool.c): runs task(ctx, i, thread) for i in [0, n_chunks), handing chunks
 * out one at a time to the calling thread (thread 0) and the workers (1, 2, ...); threads
 * numbered `slots` or more sit the job out, so a task may index per-thread scratch by `thread`.
 * Returns when all chunks have run. */
typedef void (*lq_task_fn)(void *ctx, size_t chunk, int thread);
void lq_pool_run(lq_task_fn task, void *ctx, size_t n_chunks, int slots);
int lq_pool_set_threads(int n);
int lq_pool_threads(void);

/* The exported entry points of quant.c that moe.c builds on. */
int llaisys_quant_block_size(int type);
int llaisys_quant_block_bytes(int type);
int llaisys_quant_linear(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t ldx, int64_t m,
                         float *y, int64_t ldy, const float *bias, const void *packed);
/* llaisys_quant_linear in the f32 arithmetic whatever is in use (the MoE kernels' groups, which
 * must agree with their other paths and with NumPy bit for bit). */
int lq_linear_f32(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t ldx, int64_t m, float *y,
                  int64_t ldy, const float *bias);
const char *llaisys_quant_simd_level(void);

/* llaisys_quant_linear with its arguments in one block, for a replayed list of calls
 * (csrc/ops: llaisys_ops_run); mirrored by LinearCall in src/llaisys/_native/structs.py. */
typedef struct {
    int64_t type;
    const void *w;
    int64_t n, k;
    const float *x;
    int64_t ldx, m;
    float *y;
    int64_t ldy;
    const float *bias;
    const void *packed;
} lq_linear_call;

/* out[i] (k floats, out_s floats apart) = row index[i] (index_s elements apart) of W (n rows of
 * k elements in format `type`, back to back), dequantized: an embedding lookup of `rows` ids.
 * An index outside [0, n) stops it before anything is written, with bad = (i, index[i]). */
typedef struct {
    int64_t type, n, k, index_s, rows, out_s;
    const void *w;
    const int64_t *index;
    float *out;
    int64_t bad[2];
} lq_gather_call;

#endif
