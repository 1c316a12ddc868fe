/* The small float32 kernels of a decoder layer: rms_norm (alone or after a residual add), rope,
 * swiglu and grouped-query self-attention (causal, or full for a vision encoder).
 *
 * Each is the C form of its NumPy kernel in src/llaisys/kernels/cpu/ (the readable reference it
 * is tested against). Every row of a result (a token, or a token's head) is computed by one
 * fixed sequence of float operations that depends only on that row's inputs, never on how many
 * rows the call has: batch invariance. The SIMD levels compile the same C code for wider
 * vectors (ops_body.h), attention's inner loops as intrinsics that repeat its operations in
 * its order; there is no FMA, so every level gives the same bits.
 *
 * Arguments come in a struct built once per call site by the Python binding (mirrored by a
 * ctypes Structure in src/llaisys/_native/structs.py, checked against layouts.c at load); the
 * pointers that change from call to call (weights, rope tables, the K/V rows of a layer) are
 * passed beside it.
 * Strides are in elements; the last dimension of every tensor is contiguous.
 */
#ifndef LLAISYS_OPS_H
#define LLAISYS_OPS_H

#include <stdint.h>

#define LO_EXPORT __attribute__((visibility("default")))

enum { LO_OK = 0, LO_ERR_SHAPE = -1, LO_ERR_MEMORY = -2 };

/* rms_norm of `rows` rows of d: out = x / sqrt(mean(x^2) + eps) * w, with x = a, or
 * x = total = a + b (stored in total) when b is given. */
typedef struct {
    float *out;
    int64_t out_s;
    float *total;       /* NULL when b is NULL */
    int64_t total_s;
    const float *a;
    int64_t a_s;
    const float *b;     /* NULL: plain rms_norm of a */
    int64_t b_s;
    int64_t rows, d;
    double eps;
} lo_norm_args;

/* out = up * gate / (1 + exp(-gate)) over `rows` rows of n. */
typedef struct {
    float *out;
    int64_t out_s;
    const float *gate;
    int64_t gate_s;
    const float *up;
    int64_t up_s;
    int64_t rows, n;
} lo_swiglu_args;

/* Rotary embedding of x (S, H, D) into out: the halves of the first r dims (r even, <= d) are
 * rotated, dims r.. copied; the tables cos, sin (S, r/2) come with the call. */
typedef struct {
    float *out;
    int64_t out_s0, out_s1;
    const float *x;
    int64_t x_s0, x_s1;
    int64_t s, h, d, r;
} lo_rope_args;

/* GQA: q (S, H, D), k (T, KH, D), v (T, KH, Dv) -> out (S, H, Dv). Causal
 * (llaisys_ops_self_attention): query i sits at position T - S + i; full
 * (llaisys_ops_self_attention_full, a vision encoder's): every query sees all T keys. k, v and
 * T come with the call (a layer's cache rows). */
typedef struct {
    float *out;
    int64_t out_s0, out_s1;
    const float *q;
    int64_t q_s0, q_s1;
    int64_t k_s0, k_s1, v_s0, v_s1;
    int64_t s, h, d, kh, dv;
    double scale;
} lo_attention_args;

/* out = x * factor over `rows` rows of n; out may be x (each element is read before it is
 * written). geglu (geglu_scale.c) takes lo_swiglu_args. */
typedef struct {
    float *out;
    int64_t out_s;
    const float *x;
    int64_t x_s;
    int64_t rows, n;
    float factor; /* already float32: the binding rounds it once */
} lo_scale_args;

/* A recorded list of kernel calls replayed in one native call (llaisys_ops_run): each call is a
 * function taking one argument block. The blocks of the kernels here carry the argument struct
 * (built once) and the pointers that change from call to call; csrc/kernels adds quantized
 * linear (llaisys_quant_linear_call). */
typedef int (*lo_call_fn)(const void *block);
typedef struct {
    lo_call_fn fn;
    const void *block;
} lo_call;

typedef struct { const lo_norm_args *a; const float *w; } lo_norm_call;
typedef struct { const lo_swiglu_args *a; } lo_swiglu_call;
typedef struct { const lo_rope_args *a; const float *cos, *sin; } lo_rope_call;
typedef struct { const lo_attention_args *a; const float *k, *v; int64_t t; } lo_attention_call;
typedef struct { const lo_swiglu_args *a; } lo_geglu_call; /* geglu takes swiglu's arguments */
typedef struct { const lo_scale_args *a; } lo_scale_call;
typedef struct { void *dst; const void *src; int64_t nbytes; } lo_copy_call; /* memmove */
typedef struct { float *out; const float *a, *b; int64_t n; } lo_add_call;  /* dense out = a + b */
/* out[i] = weight[index[i]] for i < rows: rows of row_bytes bytes of out at strides in bytes
 * (an embedding, or the gather of the rows whose logits a pass wants), copied as they are, or
 * (widen) float32 from a table of F16 or BF16 rows, each value exactly. An index outside
 * [0, v) stops it before anything is written, with bad = (i, index[i]). */
enum { LO_GATHER_COPY = 0, LO_GATHER_F16 = 1, LO_GATHER_BF16 = 2 };
typedef struct {
    char *out;
    int64_t out_s;
    const int64_t *index;
    int64_t index_s; /* in elements */
    const char *weight;
    int64_t weight_s;
    int64_t rows, row_bytes, v;
    int64_t bad[2];
    int64_t widen; /* LO_GATHER_* */
} lo_gather_call;

/* Queries full attention computes at once (causal: one): each block of keys is read once for all. */
#define LO_ROW_BLOCK 8

/* Kernels of one SIMD level. attention's scratch holds rows * H * (T + Dv + 1) floats, rows 1
 * (causal) or LO_ROW_BLOCK (`causal` 0: every query sees all t keys). */
typedef struct {
    const char *name;
    void (*norm)(const lo_norm_args *a, const float *w);
    void (*swiglu)(const lo_swiglu_args *a);
    void (*rope)(const lo_rope_args *a, const float *cos, const float *sin);
    void (*attention)(const lo_attention_args *a, const float *k, const float *v, int64_t t, int causal,
                      float *scratch);
} lo_kernels;

extern const lo_kernels lo_kernels_scalar;
const lo_kernels *lo_kernels_avx2(void);   /* NULL unless this CPU (and build) has the level */
const lo_kernels *lo_kernels_avx512(void);

#endif
