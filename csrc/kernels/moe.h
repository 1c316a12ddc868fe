/* The argument block of llaisys_moe_mlp (moe.c), mirrored by MoeArgs in
 * src/llaisys/_native/structs.py (checked against layouts.c at load). */
#ifndef LLAISYS_KERNELS_MOE_H
#define LLAISYS_KERNELS_MOE_H

#include <stdint.h>

#include "ops/ops.h" /* lo_swiglu_args: the ops library's swiglu, called through a pointer */

typedef int (*lm_swiglu_fn)(const lo_swiglu_args *a);

/* One call's arguments. Row strides in floats. */
typedef struct {
    float *out;                       /* (N, D), rows ldo apart */
    int64_t ldo;
    const float *h;                   /* (N, D), rows ldh apart */
    int64_t ldh;
    const float *logits;              /* (N, E), rows ldl apart */
    int64_t ldl;
    const void *gate, *up, *down;     /* (E*I, D), (E*I, D), (E*D, I): encoded rows, back to back */
    int64_t gate_type, up_type, down_type; /* GGML type ids */
    int64_t n, d, e, inter, top_k, norm;
    lm_swiglu_fn swiglu;
} lm_moe_args;

#endif
