/* The int16 arithmetic on the AMX tiles: 16 rows of X against 16 rows of W per block.
 *
 * Per 32-element block, one tdpbsud multiplies the 16 x 32 high bytes of the activations' codes
 * (signed; an A tile read straight from the quantized rows, lq_xblock apart) by the weights'
 * codes (unsigned; w16_block's bytes are a B tile as they stand) into 16 x 16 exact int32 sums,
 * a second one the low bytes (the int8 arithmetic's only part); the sums then take the float steps of block_rows (quant_int.c) in
 * the same order, so every row has the bits of the AVX512-VNNI kernels and of the reference.
 * Q6_K (two scales a block) stays on those kernels.
 *
 * The tile state must be granted by Linux (arch_prctl, asked once by peak.c's unit probe), and
 * the tile configuration is per thread: each call loads it and releases it.
 *
 * Built with -DLLAISYS_AMX_EMULATE, the tile instructions are C functions over an array of
 * tiles that compute what the instruction set reference defines (tests build the library that
 * way to run this kernel on a CPU without AMX; the bits must equal the reference's either way).
 */
#include <stdlib.h>
#include <string.h>

#include "quant_int.h"

int llaisys_peak_int8_units(void); /* peak.c: bit 2 when amx_int8 runs here (tile state granted) */

#if defined(__x86_64__) && (defined(LLAISYS_AMX_EMULATE) || (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11))
#include <immintrin.h>
#include <stdatomic.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of each tile */
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

#ifdef LLAISYS_AMX_EMULATE
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* The tiles of this thread and their shapes (the loaded configuration). */
static _Thread_local struct {
    uint8_t data[8][16][64];
    int rows[8], colsb[8];
} emu;

static void emu_loadconfig(const tile_config *c) {
    memset(&emu, 0, sizeof emu);
    for (int t = 0; t < 8; t++) emu.rows[t] = c->rows[t], emu.colsb[t] = c->colsb[t];
}
static void emu_zero(int t) { memset(emu.data[t], 0, sizeof emu.data[t]); }
static void emu_loadd(int t, const void *base, size_t stride) {
    for (int r = 0; r < emu.rows[t]; r++) memcpy(emu.data[t][r], (const char *)base + r * stride, (size_t)emu.colsb[t]);
}
static void emu_stored(int t, void *base, size_t stride) {
    for (int r = 0; r < emu.rows[t]; r++) memcpy((char *)base + r * stride, emu.data[t][r], (size_t)emu.colsb[t]);
}
/* TDPBSUD: C[m][n] (int32) += sum over k, i of signed A[m][4k + i] times unsigned B[k][4n + i]. */
static void emu_dpbsud(int c, int a, int b) {
    for (int m = 0; m < emu.rows[c]; m++)
        for (int n = 0; n < emu.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, emu.data[c][m] + 4 * n, 4);
            for (int k = 0; k < emu.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    acc += (int32_t)(int8_t)emu.data[a][m][4 * k + i] * (int32_t)emu.data[b][k][4 * n + i];
            memcpy(emu.data[c][m] + 4 * n, &acc, 4);
        }
}
#define tile_loadconfig(c) emu_loadconfig(c)
#define tile_zero(t) emu_zero(t)
#define tile_loadd(t, p, s) emu_loadd(t, p, s)
#define tile_stored(t, p, s) emu_stored(t, p, s)
#define tile_dpbsud(c, a, b) emu_dpbsud(c, a, b)
#define tile_release() ((void)0)
#define TILES_GRANTED() 1
#else
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))
#define tile_loadconfig(c) _tile_loadconfig(c)
#define tile_zero(t) _tile_zero(t)
#define tile_loadd(t, p, s) _tile_loadd(t, p, s)
#define tile_stored(t, p, s) _tile_stored(t, p, s)
#define tile_dpbsud(c, a, b) _tile_dpbsud(c, a, b)
#define tile_release() _tile_release()
#define TILES_GRANTED() (llaisys_peak_int8_units() >> 2 & 1)
#endif

/* Tiles (literal numbers: the intrinsics paste them into register names): the two sums, the
 * two activation parts, W. */
#define T_HI 0
#define T_LO 1
#define T_XHI 2
#define T_XLO 3
#define T_W 4

int lq_amx_available(void) {
    static atomic_int known = -1;
    int a = atomic_load_explicit(&known, memory_order_relaxed);
    if (a < 0) {
        const char *off = getenv("LLAISYS_AMX");
        a = !(off && strcmp(off, "0") == 0) && TILES_GRANTED();
        atomic_store_explicit(&known, a, memory_order_relaxed);
    }
    return a;
}

AMX size_t lq_amx_group_rows(const w16_block *wg, int kind, int offset, int parts, const lq_xblock *x, size_t nb,
                             size_t m, size_t rows, float *y, size_t ldy, const float *bias) {
    if (kind == KIND_Q6 || m < 16 || !lq_amx_available()) return 0;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[T_HI] = cfg.rows[T_LO] = 16, cfg.colsb[T_HI] = cfg.colsb[T_LO] = 64;
    cfg.rows[T_XHI] = cfg.rows[T_XLO] = 16, cfg.colsb[T_XHI] = cfg.colsb[T_XLO] = 32;
    cfg.rows[T_W] = 8, cfg.colsb[T_W] = 64;
    tile_loadconfig(&cfg);
    const size_t stride = nb * sizeof(lq_xblock);
    int32_t hi[16][16] __attribute__((aligned(64))), lo[16][16] __attribute__((aligned(64)));
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    size_t m0 = 0;
    for (; m0 + 16 <= m; m0 += 16) {
        const lq_xblock *xr = x + m0 * nb;
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (size_t bi = 0; bi < nb; bi++) {
            tile_zero(T_LO);
            tile_loadd(T_XLO, xr[bi].lo, stride);
            tile_loadd(T_W, wg[bi].codes, 64);
            tile_dpbsud(T_LO, T_XLO, T_W);
            tile_stored(T_LO, lo, 64);
            if (parts == 2) {
                tile_zero(T_HI);
                tile_loadd(T_XHI, xr[bi].hi, stride);
                tile_dpbsud(T_HI, T_XHI, T_W);
                tile_stored(T_HI, hi, 64);
            }
            const __m512 scale = _mm512_loadu_ps(wg[bi].scale);
            const __m512 mn = kind == KIND_MIN ? _mm512_loadu_ps(wg[bi].min) : _mm512_setzero_ps();
            for (int r = 0; r < 16; r++) {
                const lq_xblock *xb = xr + (size_t)r * nb + bi;
                __m512i i = _mm512_load_si512(lo[r]);
                if (parts == 2) i = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi[r]), 8), i);
                if (kind == KIND_OFFSET) i = _mm512_sub_epi32(i, _mm512_set1_epi32(offset * xb->sum));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(scale, _mm512_set1_ps(xb->s))));
                if (kind == KIND_MIN) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mn, _mm512_set1_ps(xb->s_sum)));
            }
        }
        for (int r = 0; r < 16; r++)
            _mm512_mask_storeu_ps(y + (m0 + (size_t)r) * ldy, keep, bias ? _mm512_add_ps(acc[r], b) : acc[r]);
    }
    tile_release();
    return m0;
}

#else /* no AMX compiler support, or not x86-64 */
int lq_amx_available(void) { return 0; }
size_t lq_amx_group_rows(const w16_block *wg, int kind, int offset, int parts, const lq_xblock *x, size_t nb,
                         size_t m, size_t rows, float *y, size_t ldy, const float *bias) {
    (void)parts, (void)wg, (void)kind, (void)offset, (void)x, (void)nb, (void)m, (void)rows, (void)y, (void)ldy, (void)bias;
    return 0;
}
#endif
