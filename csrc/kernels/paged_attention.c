/* Paged KV cache: writing one step's keys/values into a pool of fixed-size blocks, and causal
 * grouped-query attention of a flat batch of queries from several sequences over that pool.
 *
 *   k_cache (NB, BS, KH, D), v_cache (NB, BS, KH, Dv)   one layer's pool: NB blocks of BS slots
 *   block_tables (B, MB)   sequence b's i-th block of keys; query_starts (B+1,); context_lens (B,)
 *
 * Query j of sequence b (q_len queries, C = context_lens[b] keys) sits at position
 * C - q_len + j and sees keys 0..that position. Work is split over (query token, KV head)
 * tasks; each task runs one fixed sequence of float32 operations over the keys in order (dot
 * products with 8 interleaved partial sums, an online softmax over chunks of LP_CHUNK keys
 * whose boundaries sit at fixed positions), so a row's result does not depend on the other
 * rows of the call, the thread count, the block size or how the sequence was split into
 * calls: batch invariance. The AVX2 steps do the same float32 operations in the same order
 * as the portable ones (multiply, then add: no FMA), so both levels give the same bits too.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

#define LP_CHUNK 32    /* keys per online-softmax step (a multiple of LP_LANES) */
#define LP_LANES 8     /* partial sums per dot product */
/* Calls that read fewer K/V bytes than this run on the calling thread alone: waking the pool
 * costs about what it saves there (measured on 2 cores: one and two threads equal at 96 KB,
 * two 1.6x faster at 192 KB, with a dozen tasks or more). */
#define LP_SERIAL_BYTES ((int64_t)96 << 10)

/* Status codes; `bad` holds what they are about (see the Python binding for the messages). */
enum {
    LP_OK = 0,
    LP_ERR_START0 = -1,    /* bad[0] = 0, bad[1] = query_starts[0] (must be 0) */
    LP_ERR_ORDER = -2,     /* bad[0] = b, bad[1] = query_starts[b + 1] < query_starts[b] */
    LP_ERR_END = -3,       /* bad[0] = B, bad[1] = query_starts[B] (must be N) */
    LP_ERR_SHORT = -4,     /* bad[0] = b, bad[1] = context_lens[b] < q_len */
    LP_ERR_LONG = -5,      /* bad[0] = b, bad[1] = context_lens[b] > MB * BS */
    LP_ERR_BLOCK = -6,     /* bad[0] = b * MB + i, bad[1] = block_tables[b, i] outside [0, NB) */
    LP_ERR_MEMORY = -7,
    LP_ERR_SLOT = -8,      /* bad[0] = i, bad[1] = slots[i] outside [0, NB * BS) */
    LP_ERR_SHAPE = -9,
    LP_ERR_PAST_N = -10,   /* bad[0] = b + 1, bad[1] = query_starts[b + 1] > N */
};

/* Arguments of llaisys_paged_attention; strides in elements, the last dimension of every
 * float tensor contiguous. Mirrored by a ctypes Structure in kernels/cpu/paged_native.py. */
typedef struct {
    float *out;                 /* (N, H, Dv) */
    int64_t out_s0, out_s1;
    const float *q;             /* (N, H, D) */
    int64_t q_s0, q_s1;
    const float *k_cache;       /* (NB, BS, KH, D) */
    int64_t k_s0, k_s1, k_s2;
    const float *v_cache;       /* (NB, BS, KH, Dv) */
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
} lp_attention_args;

/* Arguments of llaisys_paged_kv_write: strides in elements of `itemsize` bytes. */
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
} lp_write_args;

/* ---- attention: the per-chunk steps of each SIMD level ---------------------------------- */

/* The steps of one chunk of len <= LP_CHUNK keys; both levels compute them with the same
 * float32 operations in the same order (multiply, then add: no FMA), so they give the same
 * bits.
 *   scores: s[h][p] = (q[h] . k[p]) * scale for the G heads q (G, D) and the chunk's key rows:
 *           LP_LANES interleaved partial sums over D, folded by fold(), then the tail in order.
 *   exps:   s[p] = exp_neg(s[p] - m) for p < len, 0 up to LP_CHUNK; returns their sum as
 *           LP_LANES partial sums folded by fold().
 *   axpy:   acc[e] += w[p] * v[p][e] for p = 0 .. len-1 in order, e < Dv. */
typedef struct {
    void (*scores)(const float *q, int64_t g, int64_t d, const float *const *krow, int64_t len, float scale,
                   float *s);
    float (*exps)(float *s, int64_t len, float m);
    void (*axpy)(float *acc, const float *w, const float *const *vrow, int64_t len, int64_t dv);
} lp_steps;

#define INLINE static inline __attribute__((always_inline))

INLINE float fold(const float a[LP_LANES]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* e^x for x <= 0 in plain float arithmetic, so that exps_avx2 can do the same 8 at a time
 * (glibc's expf differs from any vector version): Cephes' expf, x = n ln2 + r with a degree-6
 * polynomial in r, about 1 ulp. Below -87 it gives e^-87 (~1.6e-38) rather than 0, which leaves
 * a softmax unchanged. */
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
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    const float y = p * (r * r) + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23; /* 2^n, n >= -126 */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

static void scores_portable(const float *q, int64_t g, int64_t d, const float *const *krow, int64_t len, float scale,
                            float *s) {
    for (int64_t h = 0; h < g; h++, q += d)
        for (int64_t p = 0; p < len; p++) {
            const float *k = krow[p];
            float a[LP_LANES] = {0};
            int64_t i = 0;
            for (; i + LP_LANES <= d; i += LP_LANES)
                for (int l = 0; l < LP_LANES; l++) a[l] += q[i + l] * k[i + l];
            float dot = fold(a);
            for (; i < d; i++) dot += q[i] * k[i];
            s[h * LP_CHUNK + p] = dot * scale;
        }
}

static float exps_portable(float *s, int64_t len, float m) {
    for (int64_t p = 0; p < LP_CHUNK; p++) s[p] = p < len ? exp_neg(s[p] - m) : 0.0f;
    float a[LP_LANES] = {0};
    for (int64_t p = 0; p < LP_CHUNK; p += LP_LANES)
        for (int l = 0; l < LP_LANES; l++) a[l] += s[p + l];
    return fold(a);
}

static void axpy_portable(float *acc, const float *w, const float *const *vrow, int64_t len, int64_t dv) {
    for (int64_t p = 0; p < len; p++) {
        const float *v = vrow[p], wp = w[p];
        for (int64_t e = 0; e < dv; e++) acc[e] += wp * v[e];
    }
}

static const lp_steps steps_portable = {scores_portable, exps_portable, axpy_portable};

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))

/* fold() of the 8 lanes of each of a[0..3], as the 4 lanes of one vector. */
AVX2_INLINE __m128 fold4(const __m256 a[4]) {
    __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(a[0]), _mm256_extractf128_ps(a[0], 1)); /* a_l + a_{l+4} */
    __m128 t1 = _mm_add_ps(_mm256_castps256_ps128(a[1]), _mm256_extractf128_ps(a[1], 1));
    __m128 t2 = _mm_add_ps(_mm256_castps256_ps128(a[2]), _mm256_extractf128_ps(a[2], 1));
    __m128 t3 = _mm_add_ps(_mm256_castps256_ps128(a[3]), _mm256_extractf128_ps(a[3], 1));
    _MM_TRANSPOSE4_PS(t0, t1, t2, t3); /* t_l = lane l of the four */
    return _mm_add_ps(_mm_add_ps(t0, t2), _mm_add_ps(t1, t3));
}

AVX2_INLINE float fold1(__m256 a) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t)); /* (t0 + t2, t1 + t3) */
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

AVX2 static void scores_avx2(const float *q, int64_t g, int64_t d, const float *const *krow, int64_t len, float scale,
                             float *s) {
    const int64_t d8 = d / LP_LANES * LP_LANES;
    int64_t p = 0;
    for (; p + 4 <= len; p += 4) { /* four keys at a time: four independent chains */
        const float *k[4] = {krow[p], krow[p + 1], krow[p + 2], krow[p + 3]};
        for (int64_t h = 0; h < g; h++) {
            const float *qh = q + h * d;
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t i = 0; i < d8; i += LP_LANES) {
                const __m256 x = _mm256_loadu_ps(qh + i);
                for (int j = 0; j < 4; j++) a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(x, _mm256_loadu_ps(k[j] + i)));
            }
            float dot[4];
            _mm_storeu_ps(dot, fold4(a));
            for (int j = 0; j < 4; j++) {
                for (int64_t i = d8; i < d; i++) dot[j] += qh[i] * k[j][i];
                s[h * LP_CHUNK + p + j] = dot[j] * scale;
            }
        }
    }
    for (; p < len; p++) {
        const float *k = krow[p];
        for (int64_t h = 0; h < g; h++) {
            const float *qh = q + h * d;
            __m256 a = _mm256_setzero_ps();
            for (int64_t i = 0; i < d8; i += LP_LANES)
                a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i)));
            float dot = fold1(a);
            for (int64_t i = d8; i < d; i++) dot += qh[i] * k[i];
            s[h * LP_CHUNK + p] = dot * scale;
        }
    }
}

AVX2_INLINE __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 round = _mm256_set1_ps(EXP_ROUND);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), round), round);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C1)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C2)));
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P5));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX2 static float exps_avx2(float *s, int64_t len, float m) {
    const __m256 mv = _mm256_set1_ps(m), lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t p = 0; p < LP_CHUNK; p += LP_LANES) {
        const __m256 keep = _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps((float)p)), _mm256_set1_ps((float)len),
                                          _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + p), mv)), keep);
        _mm256_storeu_ps(s + p, e);
        sum = _mm256_add_ps(sum, e);
    }
    return fold1(sum);
}

AVX2 static void axpy_avx2(float *acc, const float *w, const float *const *vrow, int64_t len, int64_t dv) {
    int64_t e0 = 0;
    for (; e0 + 32 <= dv; e0 += 32) { /* 32 accumulators in registers across the keys */
        __m256 a0 = _mm256_loadu_ps(acc + e0), a1 = _mm256_loadu_ps(acc + e0 + 8);
        __m256 a2 = _mm256_loadu_ps(acc + e0 + 16), a3 = _mm256_loadu_ps(acc + e0 + 24);
        for (int64_t p = 0; p < len; p++) {
            const float *v = vrow[p] + e0;
            const __m256 wp = _mm256_set1_ps(w[p]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(wp, _mm256_loadu_ps(v)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(wp, _mm256_loadu_ps(v + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(wp, _mm256_loadu_ps(v + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(wp, _mm256_loadu_ps(v + 24)));
        }
        _mm256_storeu_ps(acc + e0, a0), _mm256_storeu_ps(acc + e0 + 8, a1);
        _mm256_storeu_ps(acc + e0 + 16, a2), _mm256_storeu_ps(acc + e0 + 24, a3);
    }
    for (; e0 + 8 <= dv; e0 += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + e0);
        for (int64_t p = 0; p < len; p++)
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_set1_ps(w[p]), _mm256_loadu_ps(vrow[p] + e0)));
        _mm256_storeu_ps(acc + e0, a0);
    }
    for (; e0 < dv; e0++)
        for (int64_t p = 0; p < len; p++) acc[e0] += w[p] * vrow[p][e0];
}

static const lp_steps steps_avx2 = {scores_avx2, exps_avx2, axpy_avx2};
#endif

/* ---- attention: the tasks ------------------------------------------------------------------ */

typedef struct {
    const lp_attention_args *a;
    const lp_steps *steps;
    const int64_t *seq_of;      /* (N,) the sequence of each query token */
    float *scratch;             /* per thread: scratch_floats floats */
    size_t scratch_floats;
    float scale;
    int64_t g;                  /* query heads per KV head */
} attention_job;

/* The key and value rows of KV head kv for the chunk of keys from position c0 (up to LP_CHUNK,
 * fewer than n_keys), found through the sequence's block table. With `fetch`, their bytes are
 * also asked for now: the next chunk's rows are found while this one is computed, and the
 * blocks lie anywhere in the pool, where the hardware prefetcher cannot guess them. */
static void chunk_rows(const lp_attention_args *a, const int64_t *table, int64_t kv, int64_t c0, int64_t n_keys,
                       const float *rows[2][LP_CHUNK], int fetch) {
    const int64_t bs = a->bs, len = n_keys - c0 < LP_CHUNK ? n_keys - c0 : LP_CHUNK;
    const int64_t k_bytes = a->d * (int64_t)sizeof(float), v_bytes = a->dv * (int64_t)sizeof(float);
    int64_t blk = c0 / bs, off = c0 % bs;
    for (int64_t p = 0; p < len; p++) {
        const int64_t id = table[blk * a->bt_s1];
        rows[0][p] = a->k_cache + id * a->k_s0 + off * a->k_s1 + kv * a->k_s2;
        rows[1][p] = a->v_cache + id * a->v_s0 + off * a->v_s1 + kv * a->v_s2;
        if (++off == bs) off = 0, blk++;
        if (fetch) {
            for (int64_t l = 0; l < k_bytes; l += 64) __builtin_prefetch((const char *)rows[0][p] + l);
            for (int64_t l = 0; l < v_bytes; l += 64) __builtin_prefetch((const char *)rows[1][p] + l);
        }
    }
}

/* One task: query token i, KV head kv, with its G query heads. Scratch: q (G, D), scores
 * (G, LP_CHUNK), acc (G, Dv), running max and sum (G each). Keys go in chunks of LP_CHUNK
 * from position 0: scores, then the online softmax (what came before rescaled to the new
 * maximum), then acc += p v key by key. */
static void attend(void *ctx, size_t task, int thread) {
    const attention_job *job = ctx;
    const lp_attention_args *a = job->a;
    const lp_steps *steps = job->steps;
    const int64_t kh = a->kh, d = a->d, dv = a->dv, g = job->g;
    /* Later tokens see more keys: hand them out first, so the last tasks are the short ones. */
    const int64_t i = a->n - 1 - (int64_t)task / kh, kv = (int64_t)task % kh;
    const int64_t b = job->seq_of[i];
    const int64_t q0 = a->query_starts[b * a->qs_s0], q1 = a->query_starts[(b + 1) * a->qs_s0];
    const int64_t n_keys = a->context_lens[b * a->cl_s0] - (q1 - q0) + (i - q0) + 1;
    const int64_t *table = a->block_tables + b * a->bt_s0;

    float *qh = job->scratch + (size_t)thread * job->scratch_floats;
    float *scores = qh + g * d, *acc = scores + g * LP_CHUNK, *mx = acc + g * dv, *sum = mx + g;
    const float *rows[2][2][LP_CHUNK]; /* [chunk parity][key, value][key of the chunk] */
    for (int64_t h = 0; h < g; h++) {
        memcpy(qh + h * d, a->q + i * a->q_s0 + (kv * g + h) * a->q_s1, (size_t)d * sizeof(float));
        mx[h] = -INFINITY;
        sum[h] = 0.0f;
    }
    memset(acc, 0, (size_t)(g * dv) * sizeof(float));
    memset(scores, 0, (size_t)(g * LP_CHUNK) * sizeof(float)); /* exps_avx2 reads (and drops) past len */

    chunk_rows(a, table, kv, 0, n_keys, rows[0], 0);
    for (int64_t c0 = 0, parity = 0; c0 < n_keys; c0 += LP_CHUNK, parity ^= 1) {
        const int64_t len = n_keys - c0 < LP_CHUNK ? n_keys - c0 : LP_CHUNK;
        if (c0 + LP_CHUNK < n_keys) chunk_rows(a, table, kv, c0 + LP_CHUNK, n_keys, rows[parity ^ 1], 1);
        const float *const *krow = rows[parity][0], *const *vrow = rows[parity][1];
        steps->scores(qh, g, d, krow, len, job->scale, scores);
        for (int64_t h = 0; h < g; h++) {
            float *s = scores + h * LP_CHUNK, *ah = acc + h * dv, m = mx[h];
            for (int64_t p = 0; p < len; p++) m = s[p] > m ? s[p] : m;
            if (m > mx[h]) {
                if (c0 > 0) { /* rescale what came before to the new maximum */
                    const float alpha = exp_neg(mx[h] - m);
                    for (int64_t e = 0; e < dv; e++) ah[e] *= alpha;
                    sum[h] *= alpha;
                }
                mx[h] = m;
            }
            sum[h] += steps->exps(s, len, m);
            steps->axpy(ah, s, vrow, len, dv);
        }
    }
    for (int64_t h = 0; h < g; h++) {
        float *o = a->out + i * a->out_s0 + (kv * g + h) * a->out_s1;
        const float *ah = acc + h * dv;
        for (int64_t e = 0; e < dv; e++) o[e] = ah[e] / sum[h];
    }
}

static atomic_int use_avx2 = -1; /* -1 until first use */

/* The steps of the level in use: AVX2 where the CPU has it, unless LLAISYS_SIMD=scalar. */
static const lp_steps *attention_steps(void) {
    int level = atomic_load_explicit(&use_avx2, memory_order_relaxed);
    if (level < 0) {
        level = 0;
#if defined(__x86_64__) || defined(__i386__)
        const char *want = getenv("LLAISYS_SIMD");
        level = __builtin_cpu_supports("avx2") && !(want && strcmp(want, "scalar") == 0);
#endif
        atomic_store_explicit(&use_avx2, level, memory_order_relaxed);
    }
#if defined(__x86_64__) || defined(__i386__)
    if (level) return &steps_avx2;
#endif
    return &steps_portable;
}

/* Check the index tensors, fill seq_of (N,) and count the K/V bytes the call reads. */
static int check_indices(lp_attention_args *a, int64_t *seq_of, int64_t *kv_bytes) {
    const int64_t *qs = a->query_starts, *cl = a->context_lens;
    if (qs[0] != 0) return a->bad[0] = 0, a->bad[1] = qs[0], LP_ERR_START0;
    int64_t keys = 0;
    for (int64_t b = 0; b < a->b; b++) {
        const int64_t q0 = qs[b * a->qs_s0], q1 = qs[(b + 1) * a->qs_s0], c = cl[b * a->cl_s0];
        if (q1 < q0) return a->bad[0] = b, a->bad[1] = q1, LP_ERR_ORDER;
        if (q1 > a->n) return a->bad[0] = b + 1, a->bad[1] = q1, LP_ERR_PAST_N;
        const int64_t q_len = q1 - q0;
        if (c < q_len) return a->bad[0] = b, a->bad[1] = c, LP_ERR_SHORT;
        if (c > a->mb * a->bs) return a->bad[0] = b, a->bad[1] = c, LP_ERR_LONG;
        if (q_len == 0) continue;
        const int64_t *table = a->block_tables + b * a->bt_s0;
        for (int64_t k = 0; k < (c + a->bs - 1) / a->bs; k++) {
            const int64_t blk = table[k * a->bt_s1];
            if (blk < 0 || blk >= a->nb) return a->bad[0] = b * a->mb + k, a->bad[1] = blk, LP_ERR_BLOCK;
        }
        for (int64_t i = q0; i < q1; i++) seq_of[i] = b;
        keys += q_len * (c - q_len) + q_len * (q_len + 1) / 2;
    }
    if (qs[a->b * a->qs_s0] != a->n) return a->bad[0] = a->b, a->bad[1] = qs[a->b * a->qs_s0], LP_ERR_END;
    *kv_bytes = keys * a->kh * (a->d + a->dv) * (int64_t)sizeof(float);
    return LP_OK;
}

/* out = softmax(q k^T * scale + causal mask) v per sequence and head (see the top). */
LQ_EXPORT int llaisys_paged_attention(lp_attention_args *a) {
    if (a->n < 0 || a->b < 0 || a->kh <= 0 || a->h % a->kh || a->d < 0 || a->dv <= 0 || a->bs <= 0)
        return LP_ERR_SHAPE;
    if (a->n == 0) return LP_OK;
    int64_t seq_small[256], *seq_of = a->n <= 256 ? seq_small : malloc((size_t)a->n * sizeof(int64_t));
    if (!seq_of) return LP_ERR_MEMORY;
    int64_t kv_bytes = 0;
    int status = check_indices(a, seq_of, &kv_bytes);
    if (status == LP_OK) {
        attention_job job = {.a = a, .steps = attention_steps(), .seq_of = seq_of, .scale = (float)a->scale,
                             .g = a->h / a->kh};
        job.scratch_floats = (size_t)(job.g * (a->d + LP_CHUNK + a->dv + 2) + 15) / 16 * 16; /* whole cache lines */
        const size_t tasks = (size_t)(a->n * a->kh);
        int slots = kv_bytes < LP_SERIAL_BYTES ? 1 : lq_pool_threads();
        if ((size_t)slots > tasks) slots = (int)tasks;
        void *p = NULL;
        if (posix_memalign(&p, 64, (size_t)slots * job.scratch_floats * sizeof(float)) != 0) {
            status = LP_ERR_MEMORY;
        } else {
            job.scratch = p;
            lq_pool_run(attend, &job, tasks, slots);
            free(p);
        }
    }
    if (seq_of != seq_small) free(seq_of);
    return status;
}

/* 1 when the AVX2 path is in use. `level` 0 forces the portable path, 1 the AVX2 one where the
 * CPU has it (for tests; the two give the same bits); -1 only asks. */
LQ_EXPORT int llaisys_paged_simd(int level) {
    attention_steps();
#if defined(__x86_64__) || defined(__i386__)
    if (level >= 0) atomic_store_explicit(&use_avx2, level > 0 && __builtin_cpu_supports("avx2"), memory_order_relaxed);
#else
    (void)level;
#endif
    return atomic_load_explicit(&use_avx2, memory_order_relaxed);
}

/* ---- cache write ------------------------------------------------------------------------- */

/* k_cache[slot // BS, slot % BS] = k[i], v likewise, for each token i; every slot is checked
 * before anything is written. */
LQ_EXPORT int llaisys_paged_kv_write(lp_write_args *a) {
    const int64_t cap = a->nb * a->bs, z = a->itemsize;
    for (int64_t i = 0; i < a->n; i++) {
        const int64_t s = a->slots[i * a->sl_s0];
        if (s < 0 || s >= cap) return a->bad[0] = i, a->bad[1] = s, LP_ERR_SLOT;
    }
    const size_t k_row = (size_t)(a->d * z), v_row = (size_t)(a->dv * z);
    const int k_whole = a->k_s1 == a->d && a->kc_s2 == a->d, v_whole = a->v_s1 == a->dv && a->vc_s2 == a->dv;
    for (int64_t i = 0; i < a->n; i++) {
        const int64_t s = a->slots[i * a->sl_s0], blk = s / a->bs, off = s % a->bs;
        char *kc = a->k_cache + (blk * a->kc_s0 + off * a->kc_s1) * z;
        char *vc = a->v_cache + (blk * a->vc_s0 + off * a->vc_s1) * z;
        const char *k = a->k + i * a->k_s0 * z, *v = a->v + i * a->v_s0 * z;
        if (k_whole) {
            memcpy(kc, k, k_row * (size_t)a->kh);
        } else {
            for (int64_t h = 0; h < a->kh; h++) memcpy(kc + h * a->kc_s2 * z, k + h * a->k_s1 * z, k_row);
        }
        if (v_whole) {
            memcpy(vc, v, v_row * (size_t)a->kh);
        } else {
            for (int64_t h = 0; h < a->kh; h++) memcpy(vc + h * a->vc_s2 * z, v + h * a->v_s1 * z, v_row);
        }
    }
    return LP_OK;
}

/* ---- as calls of a replayed stretch (llaisys_ops_run: int f(const void *block)) ---------- */

/* The block is the argument struct itself, owned by the Python binding and writable (the
 * kernels report what went wrong in its `bad`): a serving step's paged calls then run inside
 * the same native stretch as the rest of its layers. */
LQ_EXPORT int llaisys_paged_attention_call(const void *block) {
    return llaisys_paged_attention((lp_attention_args *)block);
}

LQ_EXPORT int llaisys_paged_kv_write_call(const void *block) { return llaisys_paged_kv_write((lp_write_args *)block); }
