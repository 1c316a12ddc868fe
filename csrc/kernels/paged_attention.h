/* What the SIMD levels of paged attention share (paged_attention.c: the portable level, the
 * tasks and the exported API; paged_attention_avx2.c, paged_attention_avx512.c: the vector
 * levels): the chunk geometry, the per-chunk steps every level implements with the same float32
 * operations in the same order, and the scalar helpers they all use. */
#ifndef LLAISYS_PAGED_ATTENTION_H
#define LLAISYS_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LP_LANES 16    /* partial sums per dot product */
#define LP_CHUNK 64    /* keys per online-softmax step (a multiple of LP_LANES) */
#define LP_SEGMENT 256 /* keys per softmax segment (a multiple of LP_CHUNK) */
#define LP_TOKENS 8    /* query tokens per task at most */

/* ---- the exported calls' arguments ------------------------------------------------------ */

/* Arguments of llaisys_paged_attention; strides in elements, the last dimension of every
 * float tensor contiguous. Mirrored by a ctypes Structure in src/llaisys/_native/structs.py.
 * With k_scale set the caches hold int8 codes: key p of KV head kv is k_cache[..] * k_scale[..],
 * one scale per slot and head (v likewise). */
typedef struct {
    float *out;                 /* (N, H, Dv) */
    int64_t out_s0, out_s1;
    const float *q;             /* (N, H, D) */
    int64_t q_s0, q_s1;
    const void *k_cache;        /* (NB, BS, KH, D) float, or int8 with k_scale */
    int64_t k_s0, k_s1, k_s2;
    const void *v_cache;        /* (NB, BS, KH, Dv) float, or int8 with v_scale */
    int64_t v_s0, v_s1, v_s2;
    const int64_t *block_tables; /* (B, MB) */
    int64_t bt_s0, bt_s1;
    const int64_t *query_starts; /* (B + 1,) */
    int64_t qs_s0;
    const int64_t *context_lens; /* (B,) */
    int64_t cl_s0;
    int64_t n, h, kh, d, dv, nb, bs, b, mb;
    double scale;
    int64_t bad[2];             /* out: see the status codes */
    int64_t window;             /* > 0: a query sees only its last `window` keys (a sliding window) */
    const int64_t *key_ends;    /* (N,) or NULL: row i sees keys before key_ends[i], not only up to its own */
    int64_t ke_s0;
    const float *k_scale;       /* (NB, BS, KH) or NULL (float caches) */
    int64_t ks_s0, ks_s1, ks_s2;
    const float *v_scale;       /* (NB, BS, KH), with k_scale */
    int64_t vs_s0, vs_s1, vs_s2;
} lp_attention_args;

/* Arguments of llaisys_paged_kv_write: strides in elements of `itemsize` bytes. With k_scale
 * set, k and v are float32 (itemsize 4) and each head of each token is stored quantized: int8
 * codes in the caches (strides in bytes), its scale in k_scale / v_scale. */
typedef struct {
    char *k_cache;              /* (NB, BS, KH, D) */
    int64_t kc_s0, kc_s1, kc_s2;
    char *v_cache;              /* (NB, BS, KH, Dv) */
    int64_t vc_s0, vc_s1, vc_s2;
    const char *k;              /* (N, KH, D) */
    int64_t k_s0, k_s1;
    const char *v;              /* (N, KH, Dv) */
    int64_t v_s0, v_s1;
    const int64_t *slots;       /* (N,) */
    int64_t sl_s0;
    int64_t n, kh, d, dv, nb, bs, itemsize;
    int64_t bad[2];
    float *k_scale;             /* (NB, BS, KH) or NULL (float caches) */
    int64_t ksc_s0, ksc_s1, ksc_s2;
    float *v_scale;             /* (NB, BS, KH), with k_scale */
    int64_t vsc_s0, vsc_s1, vsc_s2;
} lp_write_args;

/* ---- attention: the per-chunk steps of each SIMD level ---------------------------------- */

/* The steps of one chunk of len <= LP_CHUNK keys; every level computes them with the same
 * float32 operations in the same order, so they give the same bits.
 *   scores: s[r][p] = (q[r] . k[p]) * scale for rows r < rows (q[r] a row of D floats) and the
 *           chunk's key rows p < len: LP_LANES interleaved partial sums over D (lane l takes
 *           elements l, l + 16, ..., by fused multiply-adds), folded by fold16().
 *   softmax: the online softmax step of rows r < rows that see the chunk's first n keys, with
 *           max[r], sum[r] (LP_LANES partial sums) and acc[r] what came before in the segment
 *           (fresh: nothing yet): m = the larger of max[r] and s[r][p < n]; where m > max[r]
 *           (and not fresh), acc[r] and sum[r] times exp_neg(max[r] - m); s[r][p] =
 *           exp_neg(s[r][p] - m) for p < n, 0 up to LP_CHUNK; sum[r][l] += s[r][l], then
 *           s[r][l + 16], ...; max[r] = m. The segment's sum is fold16(sum[r]).
 *   axpy:   acc[r][e] = fmaf(w[r][p], v[p][e], acc[r][e]) for p = 0 .. len-1 in order, e < Dv,
 *           rows r < rows.
 * Rows of s and w are LP_CHUNK floats apart, rows of acc Dv. */
/* Over an int8 cache, with each key row's scale ks[p] and each value row's vs[p]:
 *   scores_q8: s[r][p] = (fold16 of the partial sums of q[r][i] * (float)k[p][i]) * ks[p] * scale,
 *           the same lanes and fold as scores, the code converted to float in a register;
 *   axpy_q8: acc[r][e] = fmaf(w[r][p] * vs[p], (float)v[p][e], acc[r][e]), p in order. */
typedef struct {
    void (*scores)(const float *const *q, int64_t rows, int64_t d, const float *const *krow, int64_t len,
                   float scale, float *s);
    void (*softmax)(float *s, int64_t rows, int64_t n, float *max, float *sum, float *acc, int64_t dv, int fresh);
    void (*axpy)(float *acc, const float *w, int64_t rows, const float *const *vrow, int64_t len, int64_t dv);
    void (*scores_q8)(const float *const *q, int64_t rows, int64_t d, const int8_t *const *krow, const float *ks,
                      int64_t len, float scale, float *s);
    void (*axpy_q8)(float *acc, const float *w, int64_t rows, const int8_t *const *vrow, const float *vs,
                    int64_t len, int64_t dv);
} lp_steps;

#define INLINE static inline __attribute__((always_inline))

/* The sum of 16 partial sums by halving: lane l + lane l+8, then l+4, l+2, l+1. */
INLINE float fold16(const float a[LP_LANES]) {
    float h[8];
    for (int l = 0; l < 8; l++) h[l] = a[l] + a[l + 8];
    return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
}

/* e^x for x <= 0 in plain float arithmetic, so that the vector levels can do the same 8 or 16
 * at a time (glibc's expf differs from any vector version): Cephes' expf, x = n ln2 + r with a
 * degree-6 polynomial in r, about 1 ulp. Below -87 it gives e^-87 (~1.6e-38) rather than 0,
 * which leaves a softmax unchanged. exp_neg(0) is exactly 1. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_ROUND 12582912.0f /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

INLINE float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * EXP_LOG2E + EXP_ROUND) - EXP_ROUND;
    float r = x - n * EXP_C1;
    r = r - n * EXP_C2;
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23; /* 2^n, n >= -126 */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

/* exp_neg on a vector of `bits` bits (256 or 512: the intrinsics are named after it), as
 * `attr name`: the same float32 operations lane by lane (GCC's vector operators for + - *,
 * fmadd for fmaf). */
#define LP_EXP_NEG_VECTOR(attr, name, bits)                                                                        \
    attr __m##bits name(__m##bits x) {                                                                             \
        x = _mm##bits##_max_ps(x, _mm##bits##_set1_ps(-87.0f));                                                    \
        const __m##bits n = (x * EXP_LOG2E + EXP_ROUND) - EXP_ROUND;                                               \
        __m##bits r = x - n * EXP_C1;                                                                              \
        r = r - n * EXP_C2;                                                                                        \
        __m##bits p = _mm##bits##_set1_ps(EXP_P0);                                                                 \
        p = _mm##bits##_fmadd_ps(p, r, _mm##bits##_set1_ps(EXP_P1));                                               \
        p = _mm##bits##_fmadd_ps(p, r, _mm##bits##_set1_ps(EXP_P2));                                               \
        p = _mm##bits##_fmadd_ps(p, r, _mm##bits##_set1_ps(EXP_P3));                                               \
        p = _mm##bits##_fmadd_ps(p, r, _mm##bits##_set1_ps(EXP_P4));                                               \
        p = _mm##bits##_fmadd_ps(p, r, _mm##bits##_set1_ps(EXP_P5));                                               \
        const __m##bits y = _mm##bits##_fmadd_ps(p, r * r, r) + 1.0f;                                              \
        const __m##bits##i n_int = _mm##bits##_add_epi32(_mm##bits##_cvttps_epi32(n), _mm##bits##_set1_epi32(127)); \
        return y * _mm##bits##_castsi##bits##_ps(_mm##bits##_slli_epi32(n_int, 23)); /* times 2^n */               \
    }

/* A row's acc and partial sums rescaled from maximum `old` to m (the same elementwise products
 * at every level). */
INLINE void rescale(float *acc, int64_t dv, float *sum, float old, float m) {
    const float alpha = exp_neg(old - m);
    for (int64_t e = 0; e < dv; e++) acc[e] *= alpha;
    for (int l = 0; l < LP_LANES; l++) sum[l] *= alpha;
}

/* The steps of the vector levels (NULL where the build has no x86 SIMD). */
const lp_steps *lp_steps_avx2(void);
const lp_steps *lp_steps_avx512(void);

#endif
