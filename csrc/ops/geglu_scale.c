/* geglu (out = gelu_tanh(gate) * up) and scale (out = x * factor) in float32, the C forms of
 * the NumPy kernels in src/llaisys/kernels/cpu/elementwise.py.
 *
 * gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in PyTorch's order of
 * operations (gelu(approximate="tanh")); geglu's body is swiglu's (ops_body.h: lo_gated_body).
 * Each element is one fixed sequence of float operations; the SIMD levels compile the same
 * bodies for wider vectors (no FMA: -ffp-contract=off), so every level gives the same bits. The
 * level is the one the rest of the library uses (llaisys_ops_simd_level), which ops.c only
 * picks when this CPU runs it.
 * Strides are in elements; the last dimension is contiguous.
 */
#include <string.h>

#include "ops_body.h"

const char *llaisys_ops_simd_level(void); /* ops.c */

LO_INLINE void lo_scale_body(const lo_scale_args *a) {
    const float f = a->factor;
    const int64_t n = a->n;
    for (int64_t r = 0; r < a->rows; r++) {
        const float *x = a->x + r * a->x_s;
        float *o = a->out + r * a->out_s;
        for (int64_t j = 0; j < n; j++) o[j] = x[j] * f;
    }
}

static void geglu_scalar(const lo_swiglu_args *a) { lo_gated_body(a, 1); }
static void scale_scalar(const lo_scale_args *a) { lo_scale_body(a); }

#if defined(__x86_64__)
#define TARGET_AVX2 __attribute__((target("avx2")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx2")))
static TARGET_AVX2 void geglu_avx2(const lo_swiglu_args *a) { lo_gated_body(a, 1); }
static TARGET_AVX2 void scale_avx2(const lo_scale_args *a) { lo_scale_body(a); }
static TARGET_AVX512 void geglu_avx512(const lo_swiglu_args *a) { lo_gated_body(a, 1); }
static TARGET_AVX512 void scale_avx512(const lo_scale_args *a) { lo_scale_body(a); }
#endif

typedef struct {
    void (*geglu)(const lo_swiglu_args *a);
    void (*scale)(const lo_scale_args *a);
} act_kernels;

/* The kernels of the level in use ("avx2"/"avx512" only where ops.c found the CPU runs them). */
static act_kernels level_kernels(void) {
#if defined(__x86_64__)
    const char *level = llaisys_ops_simd_level();
    if (strcmp(level, "avx512") == 0) return (act_kernels){geglu_avx512, scale_avx512};
    if (strcmp(level, "avx2") == 0) return (act_kernels){geglu_avx2, scale_avx2};
#endif
    return (act_kernels){geglu_scalar, scale_scalar};
}

LO_EXPORT int llaisys_ops_geglu(const lo_swiglu_args *a) {
    if (a->rows < 0 || a->n < 0) return LO_ERR_SHAPE;
    level_kernels().geglu(a);
    return LO_OK;
}

LO_EXPORT int llaisys_ops_scale(const lo_scale_args *a) {
    if (a->rows < 0 || a->n < 0) return LO_ERR_SHAPE;
    level_kernels().scale(a);
    return LO_OK;
}

/* ---- replay: argument blocks of a stretch (llaisys_ops_run) ------------------------------- */

LO_EXPORT int llaisys_ops_geglu_call(const void *block) { return llaisys_ops_geglu(((const lo_geglu_call *)block)->a); }

LO_EXPORT int llaisys_ops_scale_call(const void *block) { return llaisys_ops_scale(((const lo_scale_call *)block)->a); }
