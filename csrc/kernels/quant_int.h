/* What the int16 arithmetic's kernels share (quant_int.c: the AVX512-VNNI level, the weights'
 * layouts; quant_int_amx.c: the AMX tiles). */
#ifndef LLAISYS_QUANT_INT_H
#define LLAISYS_QUANT_INT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

/* How a block's integer sum becomes float (quant_int.c, step 3). */
enum { KIND_OFFSET, KIND_MIN, KIND_Q6 };

/* The weights of 16 rows of W over one 32-element block, laid out for vpdpbusd: vector j holds,
 * in lane c, the codes of elements 4j .. 4j+3 of row c. The same bytes are an AMX B tile of 8
 * rows of 64 bytes (K / 4 rows, 4 bytes of each of 16 columns). */
typedef struct {
    uint8_t codes[8][16][4];
    float scale[16];  /* weight = scale * (code - offset), or scale * code + min */
    float scale2[16]; /* Q6_K: the scale of elements 16 .. 31 (scale: of 0 .. 15) */
    float min[16];    /* the min formats' added term (Q4_K, Q5_K: -dmin * m) */
} w16_block;

typedef struct {
    int kind, offset;
} int_format;

/* The weights packed once at load (quant_int.c's lq_int_pack, quant_int_avx2.c's lq_avx_pack): each group of 16 rows of W (zero rows past
 * N) is a stream of units, one per 32-element block (per 256-element super-block for the K
 * formats); a unit is a header (the K formats' super-block scales) and, per block, the codes of
 * w16_block in 4 bits each (vector j < 4 in the low nibbles, j + 4 in the high), bit planes for
 * the 5th and 6th bits (bit i of plane j: byte i of vector j) and the rows' scale fields as
 * stored. About the bytes of the format itself, so a decoding step reads no more; the scales
 * become float32 by the same operations as in unpack_rows, so results keep their bits. */
typedef struct {
    size_t unit_blocks, head_bytes, block_bytes; /* blocks per unit; bytes of a header, of a block */
    size_t nib, planes, d, m;                    /* byte offsets in a block (d, m: the 16 rows' fields) */
    size_t src_block;                            /* bytes of one block (super-block) of the format */
} pk_layout;

static inline pk_layout layout_of(int index) {
    switch (index) {
    case IX_Q4_0: return (pk_layout){1, 0, 288, 0, 0, 256, 0, sizeof(block_q4_0)};
    case IX_Q4_1: return (pk_layout){1, 0, 320, 0, 0, 256, 288, sizeof(block_q4_1)};
    case IX_Q5_0: return (pk_layout){1, 0, 352, 0, 256, 320, 0, sizeof(block_q5_0)};
    case IX_Q5_1: return (pk_layout){1, 0, 384, 0, 256, 320, 352, sizeof(block_q5_1)};
    case IX_Q8_0: return (pk_layout){1, 0, 544, 0, 0, 512, 0, sizeof(block_q8_0)};
    case IX_Q4_K: return (pk_layout){8, 64, 288, 0, 0, 256, 272, sizeof(block_q4_K)};   /* d: sc, m: mn */
    case IX_Q5_K: return (pk_layout){8, 64, 352, 0, 256, 320, 336, sizeof(block_q5_K)};
    default: return (pk_layout){8, 32, 416, 0, 256, 384, 400, sizeof(block_q6_K)};      /* d: s1, m: s2 */
    }
}

static inline size_t group_bytes(int index, size_t nb) {
    const pk_layout L = layout_of(index);
    return nb / L.unit_blocks * (L.head_bytes + L.unit_blocks * L.block_bytes);
}

/* Row r of a group's scale fields for block bi, from `src` (the row's block, or its super-block
 * for the K formats) into the packed unit: its header `head` and the block's bytes `b`. */
static inline void pack_row_scales(int index, const uint8_t *src, size_t r, size_t bi, uint8_t *head, uint8_t *b) {
    const pk_layout L = layout_of(index);
    switch (index) {
    case IX_Q4_0: case IX_Q5_0: case IX_Q8_0: memcpy(b + L.d + 2 * r, src, 2); break;
    case IX_Q4_1: case IX_Q5_1: memcpy(b + L.d + 2 * r, src, 2), memcpy(b + L.m + 2 * r, src + 2, 2); break;
    case IX_Q4_K: case IX_Q5_K:
        if (bi % 8 == 0) memcpy(head + 2 * r, src, 2), memcpy(head + 32 + 2 * r, src + 2, 2);
        unpack_scales_k4(src + 4, (int)(bi % 8), b + L.d + r, b + L.m + r);
        break;
    default: { /* Q6_K */
        const block_q6_K *q = (const block_q6_K *)src;
        if (bi % 8 == 0) memcpy(head + 2 * r, &q->d, 2);
        b[L.d + r] = (uint8_t)q->scales[2 * (bi % 8)], b[L.m + r] = (uint8_t)q->scales[2 * (bi % 8) + 1];
    }
    }
}

/* Writes the codes (and bit planes) of block bi of a group's `rows` rows (wg, row_bytes apart)
 * into the block's packed bytes b, zeroed before. */
typedef void pack_codes_fn(int index, const uint8_t *wg, size_t row_bytes, size_t rows, size_t bi, uint8_t *b);

/* Pack groups g0 <= g < g1 of W (n rows of k elements) into `out` in pk_layout: each block's
 * codes by `codes`, the rows' scale fields by pack_row_scales. */
static inline void pack_groups(int index, const uint8_t *w, size_t row_bytes, size_t n, size_t k, size_t g0, size_t g1,
                               uint8_t *out, pack_codes_fn *codes) {
    const pk_layout L = layout_of(index);
    const size_t nb = k / QK, gb = group_bytes(index, nb), unit = L.head_bytes + L.unit_blocks * L.block_bytes;
    for (size_t g = g0; g < g1; g++) {
        const size_t rows = n - 16 * g < 16 ? n - 16 * g : 16;
        const uint8_t *wg = w + 16 * g * row_bytes;
        uint8_t *o = out + g * gb;
        memset(o, 0, gb);
        for (size_t bi = 0; bi < nb; bi++) {
            const size_t sb = bi / L.unit_blocks;
            uint8_t *head = o + sb * unit, *b = head + L.head_bytes + bi % L.unit_blocks * L.block_bytes;
            codes(index, wg, row_bytes, rows, bi, b);
            for (size_t r = 0; r < rows; r++)
                pack_row_scales(index, wg + r * row_bytes + (L.unit_blocks == 1 ? bi : sb) * L.src_block, r, bi, head, b);
        }
    }
}

/* The first rows of X, 16 at a time, through a group of 16 rows of W (wg: nb blocks) on the AMX
 * tiles, with block_rows's arithmetic (the same bits; parts 2: hi and lo, 1: lo alone): y[r][j] for r < the returned count (a
 * multiple of 16, 0 where AMX is absent, refused, turned off or the format has no tile kernel). */
size_t lq_amx_group_rows(const w16_block *wg, int kind, int offset, int parts, const lq_xblock *x, size_t nb,
                         size_t m, size_t rows, float *y, size_t ldy, const float *bias);
int lq_amx_available(void); /* the tiles granted to this process and not turned off (LLAISYS_AMX=0) */

#endif
