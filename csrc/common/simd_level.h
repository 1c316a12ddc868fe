/* Choosing a SIMD level at run time, shared by the native libraries (each has its own kernel
 * table per level): the best level this CPU runs, unless LLAISYS_SIMD names another it runs.
 * Header only: every library is built on its own, and this is a few lines. */
#ifndef LLAISYS_SIMD_LEVEL_H
#define LLAISYS_SIMD_LEVEL_H

#include <stdlib.h>
#include <string.h>

enum { SIMD_SCALAR, SIMD_AVX2, SIMD_AVX512, SIMD_LEVEL_COUNT };
static const char *const SIMD_LEVEL_NAMES[SIMD_LEVEL_COUNT] = {"scalar", "avx2", "avx512"};

/* A library's kernel table of level `level`, or NULL when this CPU (or the build) lacks it. */
typedef const void *(*simd_table_fn)(int level);

/* The level called `name` when it runs here, else -1. */
static inline int simd_level_named(const char *name, simd_table_fn table) {
    for (int l = 0; name && l < SIMD_LEVEL_COUNT; l++)
        if (strcmp(name, SIMD_LEVEL_NAMES[l]) == 0 && table(l)) return l;
    return -1;
}

/* The level to start with: the one LLAISYS_SIMD names if it runs here, else the best one. */
static inline int simd_initial_level(simd_table_fn table) {
    const char *want = getenv("LLAISYS_SIMD");
    const int named = want && *want ? simd_level_named(want, table) : -1;
    if (named >= 0) return named;
    for (int l = SIMD_LEVEL_COUNT - 1; l > SIMD_SCALAR; l--)
        if (table(l)) return l;
    return SIMD_SCALAR;
}

/* Bit l set when level l runs here. */
static inline int simd_available_mask(simd_table_fn table) {
    int mask = 0;
    for (int l = 0; l < SIMD_LEVEL_COUNT; l++)
        if (table(l)) mask |= 1 << l;
    return mask;
}

#endif
