/* The kernel table of the SIMD level a library uses (csrc/kernels' quant.c, csrc/ops' ops.c):
 * chosen at first use by simd_initial_level (the best level this CPU runs, unless LLAISYS_SIMD
 * names another) and kept until the library's set_simd_level stores another in `active`.
 * SIMD_CHOICE(type, scalar, avx2, avx512), for tables of `type` (&scalar always; avx2() and
 * avx512() return their level's table, or NULL where this CPU or the build lacks it), defines
 *   level_kernels(level)  the table of a level (simd_level.h's numbering), or NULL;
 *   table_of(level)       the same as a simd_table_fn, for simd_level.h's functions;
 *   active                the table in use, NULL until first use;
 *   kernels()             the table in use.
 * Header only: every library is built on its own. */
#ifndef LLAISYS_SIMD_CHOICE_H
#define LLAISYS_SIMD_CHOICE_H

#include <stdatomic.h>

#include "common/simd_level.h"

#define SIMD_CHOICE(type, scalar, avx2, avx512)                                                                    \
    static const type *level_kernels(int level) {                                                                  \
        switch (level) {                                                                                           \
        case SIMD_SCALAR: return &(scalar);                                                                        \
        case SIMD_AVX2: return avx2();                                                                             \
        case SIMD_AVX512: return avx512();                                                                         \
        default: return NULL;                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    static const void *table_of(int level) { return level_kernels(level); }                                        \
    static _Atomic(const type *) active;                                                                           \
    static const type *kernels(void) {                                                                             \
        const type *k = atomic_load_explicit(&active, memory_order_acquire);                                       \
        if (!k) {                                                                                                  \
            k = level_kernels(simd_initial_level(table_of));                                                       \
            atomic_store_explicit(&active, k, memory_order_release);                                               \
        }                                                                                                          \
        return k;                                                                                                  \
    }

#endif
