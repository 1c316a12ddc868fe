/* The kernels of ops.h as portable C, written so that a compiler can vectorize them: each SIMD
 * level (ops.c, ops_avx2.c, ops_avx512.c) includes this file and wraps these bodies in
 * functions carrying its target attribute. There is no FMA and no reassociation (the build
 * uses -ffp-contract=off, and sums run over a fixed number of interleaved lanes added in a
 * fixed tree), so every level computes the same bits, only with wider vectors.
 */
#ifndef LLAISYS_OPS_BODY_H
#define LLAISYS_OPS_BODY_H

#include <math.h>
#include <string.h>

#include "ops.h"

#define LO_INLINE static inline __attribute__((always_inline))
#define LO_LANES 16 /* partial sums of a dot product: one AVX-512 vector, two AVX2 ones */
/* Keys a SIMD level's values loop runs for a few score rows before the next few: the sums stay
 * in registers for that long, the keys' V rows in cache for every row; any count gives the same bits. */
#define LO_VALUE_KEYS 32

LO_INLINE float lo_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

LO_INLINE uint32_t lo_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* c ? a : b through bit masks: a conditional expression on floats would keep the loop around
 * it from vectorizing (the compiler may not evaluate a float comparison it might skip). */
LO_INLINE float lo_select(int c, float a, float b) {
    const uint32_t m = 0u - (uint32_t)(c != 0);
    return lo_from_bits((lo_bits(a) & m) | (lo_bits(b) & ~m));
}

/* e^x in float32 within about 1 ulp (Cephes expf): x = n ln2 + r with |r| <= ln2 / 2, e^r by
 * a degree-7 polynomial, times 2^n applied in two halves (2^128 is not a float). Large x gives
 * inf, NaN stays NaN, and x below -87 gives 0 rather than a result near or below the least
 * normal float (< 1.7e-38): subnormal arithmetic is slow, and a softmax weight or an addend of
 * 1 that small changes nothing. Branch-free, so it vectorizes. */
LO_INLINE float lo_exp(float x) {
    const float hi = 88.8f, lo = -87.0f;
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float xc = lo_select(x < lo, lo, x);
    xc = lo_select(xc > hi, hi, xc);
    const float t = xc * 1.44269504088896341f + round;
    const float n = t - round;
    const int32_t ni = (int32_t)(lo_bits(t) - lo_bits(round)); /* n as an integer, in [-126, 128] */
    float r = xc - n * 0.693359375f;  /* ln2 in two parts: n * the first is exact */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t n1 = ni / 2, n2 = ni - n1; /* each in [-63, 64] */
    const float y = p * lo_from_bits((uint32_t)(n1 + 127) << 23) * lo_from_bits((uint32_t)(n2 + 127) << 23);
    return lo_select(x < lo, 0.0f, y);
}

/* Sum of LO_LANES partial sums in a fixed tree. */
LO_INLINE float lo_tree(const float *p) {
    const float a = ((p[0] + p[8]) + (p[4] + p[12])) + ((p[2] + p[10]) + (p[6] + p[14]));
    const float b = ((p[1] + p[9]) + (p[5] + p[13])) + ((p[3] + p[11]) + (p[7] + p[15]));
    return a + b;
}

/* x . y (n floats) through LO_LANES interleaved partial sums; the tail goes to the first lanes. */
LO_INLINE float lo_dot(const float *x, const float *y, int64_t n) {
    float acc[LO_LANES] = {0};
    int64_t i = 0;
    for (; i + LO_LANES <= n; i += LO_LANES)
        for (int l = 0; l < LO_LANES; l++) acc[l] += x[i + l] * y[i + l];
    for (int l = 0; i + l < n; l++) acc[l] += x[i + l] * y[i + l];
    return lo_tree(acc);
}

/* ---- rms_norm ------------------------------------------------------------------------------ */

/* Each row: total = a + b (if b), then the mean of squares in float64 (products of floats are
 * exact there; 8 partial sums), 1 / sqrt(mean + eps) rounded once to float32, out = x * that * w. */
LO_INLINE void lo_norm_body(const lo_norm_args *a, const float *w) {
    const int64_t d = a->d;
    for (int64_t r = 0; r < a->rows; r++) {
        const float *x = a->a + r * a->a_s;
        if (a->b) {
            const float *b = a->b + r * a->b_s;
            float *t = a->total + r * a->total_s;
            for (int64_t j = 0; j < d; j++) t[j] = x[j] + b[j];
            x = t;
        }
        double acc[8] = {0};
        int64_t j = 0;
        for (; j + 8 <= d; j += 8)
            for (int l = 0; l < 8; l++) acc[l] += (double)x[j + l] * (double)x[j + l];
        for (int l = 0; j + l < d; l++) acc[l] += (double)x[j + l] * (double)x[j + l];
        const double ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        const float rstd = (float)(1.0 / sqrt(ss / (double)d + a->eps));
        float *o = a->out + r * a->out_s;
        for (j = 0; j < d; j++) o[j] = x[j] * rstd * w[j];
    }
}

/* ---- swiglu, geglu ------------------------------------------------------------------------- */

/* tanh in float32 within about 2 ulp (Cephes tanhf): an odd polynomial below |x| = 0.625, else
 * 1 - 2 / (e^2|x| + 1) with x's sign, which has no cancellation there (the result is >= 0.55).
 * Large |x| gives +-1 (e^2|x| overflows to inf), NaN stays NaN. Branch-free, so it vectorizes. */
LO_INLINE float lo_tanh(float x) {
    const uint32_t sign = lo_bits(x) & 0x80000000u;
    const float ax = lo_from_bits(lo_bits(x) & 0x7fffffffu);
    const float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * x + x;
    const float big = 1.0f - 2.0f / (lo_exp(2.0f * ax) + 1.0f);
    return lo_select(ax < 0.625f, small, lo_from_bits(lo_bits(big) | sign));
}

/* The gate's activation: silu(g) = g / (1 + e^-g) (swiglu), or with gelu gelu_tanh(g) =
 * 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (geglu, geglu_scale.c), in PyTorch's order of
 * operations (gelu(approximate="tanh")). */
LO_INLINE float lo_gate(float g, const int gelu) {
    if (!gelu) return g / (lo_exp(-g) + 1.0f);
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2/pi) rounded to float, as torch has it */
    return 0.5f * g * (1.0f + lo_tanh(beta * (g + kappa * (g * g * g))));
}

/* out = lo_gate(gate, gelu) * up over `rows` rows of n, the NumPy kernels' order of operations. */
LO_INLINE void lo_gated_body(const lo_swiglu_args *a, const int gelu) {
    const int64_t n = a->n;
    for (int64_t r = 0; r < a->rows; r++) {
        const float *g = a->gate + r * a->gate_s, *u = a->up + r * a->up_s;
        float *o = a->out + r * a->out_s;
        for (int64_t j = 0; j < n; j++) {
            const float gj = g[j], uj = u[j];
            o[j] = lo_gate(gj, gelu) * uj;
        }
    }
}

/* ---- rope ---------------------------------------------------------------------------------- */

/* With a, b the halves of a head's first r dims: a cos - b sin, b cos + a sin (each product
 * rounded, as NumPy computes it); both halves are read before either is written, so out may be
 * x. Dims r.. are copied (none when r = d, the plain rope). */
LO_INLINE void lo_rope_body(const lo_rope_args *a, const float *cos, const float *sin) {
    const int64_t half = a->r / 2;
    for (int64_t s = 0; s < a->s; s++) {
        const float *c = cos + s * half, *sn = sin + s * half;
        for (int64_t h = 0; h < a->h; h++) {
            const float *x = a->x + s * a->x_s0 + h * a->x_s1;
            float *o = a->out + s * a->out_s0 + h * a->out_s1;
            for (int64_t j = 0; j < half; j++) {
                const float xa = x[j], xb = x[j + half];
                const float ra = xa * c[j] - xb * sn[j], rb = xb * c[j] + xa * sn[j];
                o[j] = ra;
                o[j + half] = rb;
            }
            if (o != x)
                for (int64_t j = a->r; j < a->d; j++)
                    o[j] = x[j];
        }
    }
}

/* ---- self-attention ------------------------------------------------------------------------ */

/* An int32 with the order of the float f (-0 < +0; NaN above inf), and back: the maximum of
 * floats is then an integer maximum, which vectorizes. */
LO_INLINE int32_t lo_order_key(float f) {
    const int32_t b = (int32_t)lo_bits(f);
    return b ^ (int32_t)((uint32_t)(b >> 31) >> 1);
}

LO_INLINE float lo_from_order_key(int32_t k) {
    return lo_from_bits((uint32_t)(k ^ (int32_t)((uint32_t)(k >> 31) >> 1)));
}

/* s[0..n) = e^(s - max s), n >= 1; returns their sum (LO_LANES partial sums, fixed tree). */
LO_INLINE float lo_softmax_exp(float *s, int64_t n) {
    int32_t mk = INT32_MIN;
    for (int64_t j = 0; j < n; j++) {
        const int32_t key = lo_order_key(s[j]);
        mk = key > mk ? key : mk;
    }
    const float m = lo_from_order_key(mk);
    int64_t j;
    float acc[LO_LANES] = {0};
    for (j = 0; j + LO_LANES <= n; j += LO_LANES)
        for (int l = 0; l < LO_LANES; l++) {
            const float e = lo_exp(s[j + l] - m);
            s[j + l] = e;
            acc[l] += e;
        }
    for (int l = 0; j + l < n; l++) {
        const float e = lo_exp(s[j + l] - m);
        s[j + l] = e;
        acc[l] += e;
    }
    return lo_tree(acc);
}

/* Attention's two inner loops, for `rows` query rows (a->q_s0 apart, each (H, D) at a->q_s1) that
 * all see keys j < n; row i's head h is score row r = i * H + h:
 *   scores: scores[r * t + j] = (q_i,h . k_j,kv) * scale, each dot product through lo_dot;
 *   values: acc[r * dv + e] = the sum over j < n, in order, of scores[r * t + j] * v_j,kv[e];
 * for every head h, kv = h / G its KV head. K and V rows are read whole, one after another; a
 * block of keys serves every row before the next, so it is read from cache for all but the first. */
typedef void (*lo_scores_fn)(const lo_attention_args *a, const float *q, const float *k, int64_t n, int64_t t,
                             int64_t rows, float *scores);
typedef void (*lo_values_fn)(const lo_attention_args *a, const float *scores, const float *v, int64_t n, int64_t t,
                             int64_t rows, float *acc);

LO_INLINE void lo_scores(const lo_attention_args *a, const float *q, const float *k, int64_t n, int64_t t,
                         int64_t rows, float *scores) {
    const int64_t g = a->h / a->kh;
    const float scale = (float)a->scale;
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t h = 0; h < a->h; h++)
                scores[(i * a->h + h) * t + j] =
                    lo_dot(q + i * a->q_s0 + h * a->q_s1, k + j * a->k_s0 + h / g * a->k_s1, a->d) * scale;
}

LO_INLINE void lo_values(const lo_attention_args *a, const float *scores, const float *v, int64_t n, int64_t t,
                         int64_t rows, float *acc) {
    const int64_t g = a->h / a->kh, dv = a->dv;
    memset(acc, 0, (size_t)(rows * a->h * dv) * sizeof(float));
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < rows * a->h; r++) {
            const float p = scores[r * t + j], *val = v + j * a->v_s0 + r % a->h / g * a->v_s1;
            float *ar = acc + r * dv;
            for (int64_t e = 0; e < dv; e++) ar[e] += p * val[e];
        }
}

/* For each query i (causal: n = its position + 1 keys; else all T): the scores of every head,
 * softmax, then the weighted sum of values key by key in order, divided by the sum of the
 * weights. Full attention takes LO_ROW_BLOCK queries at a time (they see the same keys), causal
 * one. A SIMD level passes its own `scores` and `values`, which must compute what lo_scores and
 * lo_values do, bit for bit. Scratch (ops.h): scores (rows, H, T), accumulators (rows, H, Dv),
 * sums (rows, H). */
LO_INLINE void lo_attention_body(const lo_attention_args *a, const float *k, const float *v, int64_t t, int causal,
                                 float *scratch, lo_scores_fn scores_fn, lo_values_fn values_fn) {
    const int64_t h = a->h, dv = a->dv, block = causal ? 1 : LO_ROW_BLOCK;
    float *scores = scratch, *acc = scores + block * h * t, *sum = acc + block * h * dv;
    for (int64_t i = 0; i < a->s; i += block) {
        const int64_t rows = a->s - i < block ? a->s - i : block, n = causal ? t - a->s + i + 1 : t;
        scores_fn(a, a->q + i * a->q_s0, k, n, t, rows, scores);
        for (int64_t r = 0; r < rows * h; r++) sum[r] = lo_softmax_exp(scores + r * t, n);
        values_fn(a, scores, v, n, t, rows, acc);
        for (int64_t r = 0; r < rows * h; r++) {
            float *o = a->out + (i + r / h) * a->out_s0 + r % h * a->out_s1;
            const float *ar = acc + r * dv;
            for (int64_t e = 0; e < dv; e++) o[e] = ar[e] / sum[r];
        }
    }
}

#endif
