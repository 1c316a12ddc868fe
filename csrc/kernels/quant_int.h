/* What the int16 arithmetic's kernels share (quant_int.c: the AVX512-VNNI level, the weights'
 * layouts; quant_int_amx.c: the AMX tiles). */
#ifndef LLAISYS_QUANT_INT_H
#define LLAISYS_QUANT_INT_H

#include <stddef.h>
#include <stdint.h>

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

/* The first rows of X, 16 at a time, through a group of 16 rows of W (wg: nb blocks) on the AMX
 * tiles, with block_rows's arithmetic (the same bits; parts 2: hi and lo, 1: lo alone): y[r][j] for r < the returned count (a
 * multiple of 16, 0 where AMX is absent, refused, turned off or the format has no tile kernel). */
size_t lq_amx_group_rows(const w16_block *wg, int kind, int offset, int parts, const lq_xblock *x, size_t nb,
                         size_t m, size_t rows, float *y, size_t ldy, const float *bias);
int lq_amx_available(void); /* the tiles granted to this process and not turned off (LLAISYS_AMX=0) */

#endif
