/* The machine's limits, for benchmarks: the int8 dot-product peak of each integer unit the
 * processor has, and the rate the thread pool's threads read memory at.
 *
 * Peaks are measured as fma_loop measures the float32 one (quant.h): independent accumulator
 * chains in registers, no memory traffic, so what no kernel on that unit can exceed. Units:
 *   0 avx512_vnni  vpdpbusd on zmm: 16 lanes x 4 int8 products = 64 multiply-adds;
 *   1 avx_vnni     the VEX vpdpbusd on ymm: 32;
 *   2 amx_int8     tdpbssd on 16 x 64-byte tiles: 16 x 16 x 64 = 16384; only where cpuid says
 *                  amx-tile and amx-int8 and Linux grants the tile data state to this process
 *                  (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
 * Compiled without -march: each loop carries its target attribute and runs only after the
 * checks of units(); a compiler too old for a unit's intrinsics leaves that unit out.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

enum { UNIT_VNNI512, UNIT_VNNI256, UNIT_AMX, UNIT_COUNT };
static const char *const UNIT_NAMES[UNIT_COUNT] = {"avx512_vnni", "avx_vnni", "amx_int8"};

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 6 : __GNUC__ >= 8)
#define HAVE_VNNI512 1
#endif
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define HAVE_VNNI256 1
#define HAVE_AMX 1
#endif

/* Accumulator chains: 16 zmm ones cover two units of up to 8 cycles' latency; VEX reaches 16
 * ymm registers only, so 12 beside the two operands. Each is a variable of its own, and each step
 * inline assembly, because compilers shuffle an array of vpdpbusd accumulators through memory.
 * CHAINSn(X, bits) writes X(n, bits) for each chain n. */
#define CHAINS16(X, bits) CHAINS12(X, bits) X(12, bits) X(13, bits) X(14, bits) X(15, bits)
#define CHAINS12(X, bits)                                                                                          \
    X(0, bits) X(1, bits) X(2, bits) X(3, bits) X(4, bits) X(5, bits) X(6, bits) X(7, bits) X(8, bits) X(9, bits) \
    X(10, bits) X(11, bits)
#define AMX_MACS (16 * 16 * 64)

/* ---- the loops: `rounds` rounds of every chain; each returns a sum of its accumulators ---- */

/* The body of a vpdpbusd loop on __m<bits>i registers (bits 512 or 256, the intrinsics are named
 * after it): chains c0, c1, ... (`chains` CHAINS16 or CHAINS12) of `rounds` steps (`step`:
 * VNNI_EVEX or VNNI_VEX), leaving the sum of the chains in s. */
#define VNNI_CHAIN_INIT(n, bits) __m##bits##i c##n = _mm##bits##_set1_epi32(n);
#define VNNI_CHAIN_ADD(n, bits) s = _mm##bits##_add_epi32(s, c##n);
#define VNNI_EVEX(n, bits) __asm__("vpdpbusd %2, %1, %0" : "+v"(c##n) : "v"(a), "v"(b));
#define VNNI_VEX(n, bits) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(c##n) : "x"(a), "x"(b));
#define VNNI_LOOP(bits, chains, step)                                                                              \
    const __m##bits##i a = _mm##bits##_set1_epi32((int)(rounds | 0x01010101)), b = _mm##bits##_set1_epi32(0x01fe02fd); \
    chains(VNNI_CHAIN_INIT, bits)                                                                                  \
    for (size_t r = 0; r < rounds; r++) {                                                                          \
        chains(step, bits)                                                                                         \
    }                                                                                                              \
    __m##bits##i s = _mm##bits##_setzero_si##bits();                                                               \
    chains(VNNI_CHAIN_ADD, bits)

#ifdef HAVE_VNNI512
static __attribute__((target("avx512f,avx512vnni"))) int32_t vnni512_loop(size_t rounds) {
    VNNI_LOOP(512, CHAINS16, VNNI_EVEX)
    return _mm512_reduce_add_epi32(s);
}
#endif

#ifdef HAVE_VNNI256
static __attribute__((target("avx2,avxvnni"))) int32_t vnni256_loop(size_t rounds) {
    VNNI_LOOP(256, CHAINS12, VNNI_VEX)
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return _mm_cvtsi128_si32(h) + _mm_extract_epi32(h, 1) + _mm_extract_epi32(h, 2) + _mm_extract_epi32(h, 3);
}
#endif

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of each tile */
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* Four accumulator tiles (tmm0-3) fed by two A tiles (tmm4, 5) and two B tiles (tmm6, 7): four
 * independent chains. The tile configuration is per thread, so each call loads and releases it. */
static __attribute__((target("amx-tile,amx-int8"))) int32_t amx_loop(size_t rounds) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    static const int8_t src[16 * 64] __attribute__((aligned(64))) = {1, 2, 3, -4, 5};
    int32_t out[16 * 16] __attribute__((aligned(64)));
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    _tile_loadd(6, src, 64);
    _tile_loadd(7, src, 64);
    for (size_t r = 0; r < rounds; r++) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    int32_t sum = 0;
    _tile_stored(0, out, 64);
    sum += out[0];
    _tile_stored(1, out, 64);
    sum += out[0];
    _tile_stored(2, out, 64);
    sum += out[0];
    _tile_stored(3, out, 64);
    sum += out[0];
    _tile_release();
    return sum;
}
#endif

/* ---- which units run here ---------------------------------------------------------------- */

#if defined(__x86_64__)
static int cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
    unsigned r[4];
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return 0;
    return (int)(r[reg] >> bit & 1);
}

/* Linux hands out the AMX tile data state on request only; refused (an older kernel, a virtual
 * machine that does not pass it through): the unit is absent. */
static int amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}
#endif

static int units(void) {
    static atomic_int mask = -1; /* two threads asking at once both find the same answer */
    const int known = atomic_load_explicit(&mask, memory_order_relaxed);
    if (known >= 0) return known;
    int m = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    /* __builtin_cpu_supports checks that the OS saves the vector state too */
    if (__builtin_cpu_supports("avx512f") && cpuid_bit(7, 0, 2, 11)) m |= 1 << UNIT_VNNI512;
    if (__builtin_cpu_supports("avx2") && cpuid_bit(7, 1, 0, 4)) m |= 1 << UNIT_VNNI256;
    if (cpuid_bit(7, 0, 3, 24) && cpuid_bit(7, 0, 3, 25) && amx_granted()) m |= 1 << UNIT_AMX;
#endif
#ifndef HAVE_VNNI512
    m &= ~(1 << UNIT_VNNI512);
#endif
#ifndef HAVE_VNNI256
    m &= ~(1 << UNIT_VNNI256);
#endif
#ifndef HAVE_AMX
    m &= ~(1 << UNIT_AMX);
#endif
    atomic_store_explicit(&mask, m, memory_order_relaxed);
    return m;
}

/* Bit u set when int8 unit u (0 avx512_vnni, 1 avx_vnni, 2 amx_int8) runs here. */
LQ_EXPORT int llaisys_peak_int8_units(void) { return units(); }

/* The name of unit u, or NULL past the last. */
LQ_EXPORT const char *llaisys_peak_int8_unit_name(int unit) {
    return unit >= 0 && unit < UNIT_COUNT ? UNIT_NAMES[unit] : NULL;
}

typedef struct {
    int unit;
    size_t rounds;
    volatile int32_t sink[256];
} int8_job;

static void int8_chunk(void *ctx, size_t chunk, int thread) {
    int8_job *p = ctx;
    int32_t s = 0;
    (void)chunk;
    switch (p->unit) {
#ifdef HAVE_VNNI512
    case UNIT_VNNI512: s = vnni512_loop(p->rounds); break;
#endif
#ifdef HAVE_VNNI256
    case UNIT_VNNI256: s = vnni256_loop(p->rounds); break;
#endif
#ifdef HAVE_AMX
    case UNIT_AMX: s = amx_loop(p->rounds); break;
#endif
    default: break;
    }
    p->sink[thread & 255] += s;
}

/* `chunks` runs of unit `unit`'s loop (`rounds` rounds each) on the thread pool. Returns the
 * int8 multiply-adds done (the caller times the call), or -1 when the unit does not run here. */
LQ_EXPORT int64_t llaisys_peak_int8_loop(int unit, int64_t rounds, int64_t chunks) {
    if (unit < 0 || unit >= UNIT_COUNT || !(units() >> unit & 1)) return -1;
    if (rounds <= 0 || chunks <= 0) return 0;
    static const int64_t per_round[UNIT_COUNT] = {16 * 64, 12 * 32, 4 * AMX_MACS};
    int8_job p = {.unit = unit, .rounds = (size_t)rounds};
    lq_pool_run(int8_chunk, &p, (size_t)chunks, lq_pool_threads());
    return rounds * chunks * per_round[unit];
}

/* ---- read bandwidth ------------------------------------------------------------------------ */

/* The sum of n bytes (n a multiple of 8) as 64-bit words, wrapping: every byte read once. */
static uint64_t sum_words(const uint8_t *p, size_t n) {
    uint64_t s[4] = {0, 0, 0, 0};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * j, 8);
            s[j] += w;
        }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        s[0] += w;
    }
    return s[0] + s[1] + s[2] + s[3];
}

#if defined(__x86_64__)
/* The same sum with 32-byte loads and four accumulators, so one core's loads are never the limit. */
static __attribute__((target("avx2"))) uint64_t sum_words_avx2(const uint8_t *p, size_t n) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_words(p + i, n - i);
}
#endif

typedef struct {
    const uint8_t *buf;
    size_t n, span; /* bytes in all, bytes per chunk (a multiple of 128) */
    int avx2;
    _Atomic uint64_t sum;
} read_job;

static void read_chunk(void *ctx, size_t chunk, int thread) {
    read_job *p = ctx;
    const size_t start = chunk * p->span, end = start + p->span < p->n ? start + p->span : p->n;
    uint64_t s;
    (void)thread;
#if defined(__x86_64__)
    if (p->avx2)
        s = sum_words_avx2(p->buf + start, end - start);
    else
#endif
        s = sum_words(p->buf + start, end - start);
    atomic_fetch_add_explicit(&p->sum, s, memory_order_relaxed);
}

/* Read `n` bytes at `buf` (n a multiple of 8) on the thread pool, in `chunks` pieces handed out
 * as threads come free. Returns their sum as 64-bit words (wrapping), so nothing is skipped; the
 * caller times the call. */
LQ_EXPORT uint64_t llaisys_peak_read(const void *buf, int64_t n, int64_t chunks) {
    if (n <= 0 || chunks <= 0) return 0;
    size_t span = ((size_t)n / (size_t)chunks + 127) / 128 * 128;
    read_job p = {.buf = buf, .n = (size_t)n, .span = span};
#if defined(__x86_64__)
    p.avx2 = __builtin_cpu_supports("avx2");
#endif
    const size_t pieces = ((size_t)n + span - 1) / span;
    lq_pool_run(read_chunk, &p, pieces, lq_pool_threads());
    return atomic_load(&p.sum);
}
