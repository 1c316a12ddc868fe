/* The exported API of the small float32 kernels (see ops.h), the portable level and the choice
 * of SIMD level: the best this CPU runs, chosen at first use (LLAISYS_SIMD=scalar|avx2|avx512
 * forces one). All levels give the same bits (ops_body.h).
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/simd_level.h"

#include "ops_body.h"

/* ---- the portable level (whatever vectors the baseline ISA has) --------------------------- */

static void norm_scalar(const lo_norm_args *a, const float *w) { lo_norm_body(a, w); }
static void swiglu_scalar(const lo_swiglu_args *a) { lo_swiglu_body(a); }
static void rope_scalar(const lo_rope_args *a, const float *cos, const float *sin) { lo_rope_body(a, cos, sin); }
static void attention_scalar(const lo_attention_args *a, const float *k, const float *v, int64_t t, float *scratch) {
    lo_attention_body(a, k, v, t, scratch, lo_scores, lo_values);
}

const lo_kernels lo_kernels_scalar = {"scalar", norm_scalar, swiglu_scalar, rope_scalar, attention_scalar};

/* ---- choice of level ------------------------------------------------------------------------ */

static const lo_kernels *level_kernels(int level) {
    switch (level) {
    case SIMD_SCALAR: return &lo_kernels_scalar;
    case SIMD_AVX2: return lo_kernels_avx2();
    case SIMD_AVX512: return lo_kernels_avx512();
    default: return NULL;
    }
}

static _Atomic(const lo_kernels *) active; /* NULL until first use */

static const void *table_of(int level) { return level_kernels(level); }

static const lo_kernels *initial_kernels(void) { return level_kernels(simd_initial_level(table_of)); }

static const lo_kernels *kernels(void) {
    const lo_kernels *k = atomic_load_explicit(&active, memory_order_acquire);
    if (!k) {
        k = initial_kernels();
        atomic_store_explicit(&active, k, memory_order_release);
    }
    return k;
}

/* Name of the SIMD level in use: "scalar", "avx2" or "avx512". */
LO_EXPORT const char *llaisys_ops_simd_level(void) { return kernels()->name; }

/* Bit l set when SIMD level l (0 scalar, 1 avx2, 2 avx512) runs on this CPU. */
LO_EXPORT int llaisys_ops_simd_available(void) { return simd_available_mask(table_of); }

/* Use SIMD level `name` from now on; -1 when it does not run on this CPU. */
LO_EXPORT int llaisys_ops_set_simd_level(const char *name) {
    const int level = simd_level_named(name, table_of);
    if (level < 0) return LO_ERR_SHAPE;
    atomic_store_explicit(&active, level_kernels(level), memory_order_release);
    return LO_OK;
}

/* ---- the kernels ---------------------------------------------------------------------------- */

/* rms_norm of a (or of total = a + b) with the weight w (d,). */
LO_EXPORT int llaisys_ops_rms_norm(const lo_norm_args *a, const float *w) {
    if (a->rows < 0 || a->d <= 0 || (a->b && !a->total)) return LO_ERR_SHAPE;
    kernels()->norm(a, w);
    return LO_OK;
}

LO_EXPORT int llaisys_ops_swiglu(const lo_swiglu_args *a) {
    if (a->rows < 0 || a->n < 0) return LO_ERR_SHAPE;
    kernels()->swiglu(a);
    return LO_OK;
}

/* cos, sin (S, D/2): the rotation of each position, as the NumPy kernel tabulates them. */
LO_EXPORT int llaisys_ops_rope(const lo_rope_args *a, const float *cos, const float *sin) {
    if (a->s < 0 || a->h < 0 || a->d < 0 || a->d % 2) return LO_ERR_SHAPE;
    kernels()->rope(a, cos, sin);
    return LO_OK;
}

/* k (T, KH, D) and v (T, KH, Dv) at the strides of `a`. */
LO_EXPORT int llaisys_ops_self_attention(const lo_attention_args *a, const float *k, const float *v, int64_t t) {
    if (a->s < 0 || t < a->s || a->kh <= 0 || a->h % a->kh || a->d <= 0 || a->dv <= 0) return LO_ERR_SHAPE;
    if (a->s == 0) return LO_OK;
    void *scratch = NULL;
    if (posix_memalign(&scratch, 64, (size_t)(a->h * (t + a->dv + 1)) * sizeof(float)) != 0) return LO_ERR_MEMORY;
    kernels()->attention(a, k, v, t, scratch);
    free(scratch);
    return LO_OK;
}
