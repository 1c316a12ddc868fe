/* Paged KV cache: writing one step's keys/values into a pool of fixed-size blocks, and causal
 * grouped-query attention of a flat batch of queries from several sequences over that pool.
 *
 *   k_cache (NB, BS, KH, D), v_cache (NB, BS, KH, Dv)   one layer's pool: NB blocks of BS slots
 *   block_tables (B, MB)   sequence b's i-th block of keys; query_starts (B+1,); context_lens (B,)
 *
 * Query j of sequence b (q_len queries, C = context_lens[b] keys) sits at position C - q_len + j
 * and sees keys 0..that position, or with key_ends, row i sees keys 0..key_ends[i] - 1 (at least
 * up to its own position, at most C: the tokens of an image that see each other both ways). Each
 * row (query token, head) runs one fixed sequence of float32 operations over its keys: dot
 * products with 16 interleaved partial sums folded by a fixed tree; the keys cut into segments
 * of LP_SEGMENT at fixed positions, each with an online softmax over chunks of LP_CHUNK keys
 * (boundaries at fixed positions too); the segments' (max, sum, weighted values) merged in
 * order. So a row's result does not depend on the other rows of the call, the thread count, the
 * block size or how the sequence was split into calls: batch invariance. Work goes out as tasks
 * of (a few query tokens of one sequence, KV head), which share each key and value row they
 * load; with few tasks (decoding) a task takes some of the segments and leaves its partial
 * results to the merge, the same merge a whole task does. A sequence with a row whose key end is
 * not its natural one goes out as tasks of one token (grouped tokens' key counts must rise by
 * one): the same steps over the same keys, so the same bits. The AVX2 and AVX-512 steps do the
 * same float32 operations in the same order as the portable ones (dot products and value sums by
 * fused multiply-adds, fmaf in the portable C, everything else multiply, then add), so every
 * level gives the same bits too.
 *
 * An 8-bit pool (k_scale set): k_cache and v_cache hold int8 codes and k_scale, v_scale
 * (NB, BS, KH) a float32 scale per slot and head. The write quantizes each head of each token on
 * its own (amax / 127, rounded half to even), so a slot never changes when later tokens or
 * rejected drafts land in its block. Attention runs the same tasks and chunks, reading the codes
 * in place: the int8 steps widen them to float in registers (a dot product's sum times its key's
 * scale; each value's weight times its scale), so there is never a dequantized copy of the cache,
 * and the same invariances hold.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/simd_level.h"
#include "paged_attention.h"
#include "quant.h"

/* Calls that read fewer K/V bytes than this run on the calling thread alone: waking the pool
 * costs about what it saves there (measured on 2 cores, decoding one sequence: two threads
 * 1.05x faster than one at 96 KB, 1.25x at 192 KB). */
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
    LP_ERR_KEY_END = -11,  /* bad[0] = i, bad[1] = key_ends[i] outside [its position + 1, context_lens[b]] */
};

/* lp_attention_args and lp_write_args: paged_attention.h. */

static void scores_portable(const float *const *q, int64_t rows, int64_t d, const float *const *krow, int64_t len,
                            float scale, float *s) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < len; p++) {
            const float *qr = q[r], *k = krow[p];
            float a[LP_LANES] = {0};
            int64_t i = 0;
            for (; i + LP_LANES <= d; i += LP_LANES)
                for (int l = 0; l < LP_LANES; l++) a[l] = fmaf(qr[i + l], k[i + l], a[l]);
            for (int l = 0; i + l < d; l++) a[l] = fmaf(qr[i + l], k[i + l], a[l]);
            s[r * LP_CHUNK + p] = fold16(a) * scale;
        }
}

INLINE void exps_portable(float *s, int64_t len, float m, float *sum) {
    for (int64_t p = 0; p < LP_CHUNK; p++) s[p] = p < len ? exp_neg(s[p] - m) : 0.0f;
    for (int64_t p = 0; p < LP_CHUNK; p += LP_LANES)
        for (int l = 0; l < LP_LANES; l++) sum[l] += s[p + l];
}

static void softmax_portable(float *s, int64_t rows, int64_t n, float *max, float *sum, float *acc, int64_t dv,
                             int fresh) {
    for (int64_t r = 0; r < rows; r++) {
        float *sr = s + r * LP_CHUNK, m = max[r];
        for (int64_t p = 0; p < n; p++) m = sr[p] > m ? sr[p] : m;
        if (m > max[r] && !fresh) rescale(acc + r * dv, dv, sum + r * LP_LANES, max[r], m);
        max[r] = m;
        exps_portable(sr, n, m, sum + r * LP_LANES);
    }
}

static void axpy_portable(float *acc, const float *w, int64_t rows, const float *const *vrow, int64_t len,
                          int64_t dv) {
    for (int64_t r = 0; r < rows; r++, acc += dv, w += LP_CHUNK)
        for (int64_t p = 0; p < len; p++) {
            const float *v = vrow[p], wp = w[p];
            for (int64_t e = 0; e < dv; e++) acc[e] = fmaf(wp, v[e], acc[e]);
        }
}

static void scores_q8_portable(const float *const *q, int64_t rows, int64_t d, const int8_t *const *krow,
                               const float *ks, int64_t len, float scale, float *s) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < len; p++) {
            const float *qr = q[r];
            const int8_t *k = krow[p];
            float a[LP_LANES] = {0};
            int64_t i = 0;
            for (; i + LP_LANES <= d; i += LP_LANES)
                for (int l = 0; l < LP_LANES; l++) a[l] = fmaf(qr[i + l], (float)k[i + l], a[l]);
            for (int l = 0; i + l < d; l++) a[l] = fmaf(qr[i + l], (float)k[i + l], a[l]);
            s[r * LP_CHUNK + p] = fold16(a) * ks[p] * scale;
        }
}

static void axpy_q8_portable(float *acc, const float *w, int64_t rows, const int8_t *const *vrow, const float *vs,
                             int64_t len, int64_t dv) {
    for (int64_t r = 0; r < rows; r++, acc += dv, w += LP_CHUNK)
        for (int64_t p = 0; p < len; p++) {
            const int8_t *v = vrow[p];
            const float wp = w[p] * vs[p];
            for (int64_t e = 0; e < dv; e++) acc[e] = fmaf(wp, (float)v[e], acc[e]);
        }
}

static const lp_steps steps_portable = {scores_portable, softmax_portable, axpy_portable, scores_q8_portable,
                                        axpy_q8_portable};



/* The steps of SIMD level `level` (common/simd_level.h), NULL where this CPU lacks it. */
static const void *steps_of(int level) {
    if (level == SIMD_SCALAR) return &steps_portable;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NULL;
    if (level == SIMD_AVX2) return lp_steps_avx2();
    if (level == SIMD_AVX512 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl"))
        return lp_steps_avx512();
#endif
    return NULL;
}

static atomic_int simd_level = -1; /* -1 until first use */

/* The steps of the level in use: the best one, unless LLAISYS_SIMD names another. */
static const lp_steps *attention_steps(void) {
    int level = atomic_load_explicit(&simd_level, memory_order_relaxed);
    if (level < 0) {
        level = simd_initial_level(steps_of);
        atomic_store_explicit(&simd_level, level, memory_order_relaxed);
    }
    return steps_of(level);
}

/* ---- attention: the tasks ------------------------------------------------------------------ */

/* A task: query tokens [i0, i1) of sequence b (consecutive, at most LP_TOKENS), KV head kv, the
 * segments [s0, s1) of their keys. A task with every segment (s0 = 0, s1 = n_seg) writes its
 * rows of out; one with some of them (part >= 0) leaves each segment's (max, sum, acc) of
 * each row at partials + part + (row * n_seg + segment) * (Dv + 2), merged after the pool. */
typedef struct {
    int64_t b, kv, i0, i1;
    int64_t s0, s1, n_seg; /* n_seg: the segments of the last token's keys */
    int64_t part;
    int64_t work;          /* keys times rows, to hand the longest out first */
} lp_task;

typedef struct {
    const lp_attention_args *a;
    const lp_steps *steps;
    const lp_task *tasks;
    float *partials;
    char *scratch;              /* per thread: scratch_bytes */
    size_t scratch_bytes;
    float scale;
    int64_t g;                  /* query heads per KV head */
    int64_t rows;               /* rows per task at most: tokens times g */
} attention_job;

/* Keys of query token i of sequence b (0-based within the flat batch) under the causal mask:
 * its position + 1. */
static int64_t keys_of(const lp_attention_args *a, int64_t b, int64_t i) {
    const int64_t q0 = a->query_starts[b * a->qs_s0], q1 = a->query_starts[(b + 1) * a->qs_s0];
    return a->context_lens[b * a->cl_s0] - (q1 - q0) + (i - q0) + 1;
}

/* The end of the keys token i of sequence b sees: key_ends[i], or keys_of without them. */
static int64_t key_end(const lp_attention_args *a, int64_t b, int64_t i) {
    return a->key_ends ? a->key_ends[i * a->ke_s0] : keys_of(a, b, i);
}

/* Whether a row of sequence b, tokens [q0, q1), has a key end other than its natural one. */
static int overridden(const lp_attention_args *a, int64_t b, int64_t q0, int64_t q1) {
    if (!a->key_ends) return 0;
    for (int64_t i = q0; i < q1; i++)
        if (a->key_ends[i * a->ke_s0] != keys_of(a, b, i)) return 1;
    return 0;
}

/* The rows of a chunk of keys: float rows, or int8 rows (an int8 cache; `any` for prefetching). */
typedef union {
    const float *f[LP_CHUNK];
    const int8_t *q[LP_CHUNK];
    const void *any[LP_CHUNK];
} lp_rows;

/* A chunk's key and value rows, with each int8 row's scale (0 past the chunk's keys). */
typedef struct {
    lp_rows k, v;
    float ks[LP_CHUNK], vs[LP_CHUNK];
} lp_chunk;

/* The key and value rows of KV head kv for the chunk of keys from position c0 (up to LP_CHUNK,
 * before `end`), found through the sequence's block table; returns how many. */
static int64_t chunk_rows(const lp_attention_args *a, const int64_t *table, int64_t kv, int64_t c0, int64_t end,
                          lp_chunk *c) {
    const int64_t bs = a->bs, len = end - c0 < LP_CHUNK ? end - c0 : LP_CHUNK;
    for (int64_t p = 0, blk = c0 / bs, off = c0 % bs; p < len; blk++, off = 0) { /* a run of keys in one block */
        const int64_t id = table[blk * a->bt_s1], run = bs - off < len - p ? bs - off : len - p;
        if (a->k_scale) {
            const int8_t *k = (const int8_t *)a->k_cache + id * a->k_s0 + off * a->k_s1 + kv * a->k_s2;
            const int8_t *v = (const int8_t *)a->v_cache + id * a->v_s0 + off * a->v_s1 + kv * a->v_s2;
            const float *ks = a->k_scale + id * a->ks_s0 + off * a->ks_s1 + kv * a->ks_s2;
            const float *vs = a->v_scale + id * a->vs_s0 + off * a->vs_s1 + kv * a->vs_s2;
            for (int64_t j = 0; j < run; j++, p++, k += a->k_s1, v += a->v_s1, ks += a->ks_s1, vs += a->vs_s1)
                c->k.q[p] = k, c->v.q[p] = v, c->ks[p] = *ks, c->vs[p] = *vs;
        } else {
            const float *k = (const float *)a->k_cache + id * a->k_s0 + off * a->k_s1 + kv * a->k_s2;
            const float *v = (const float *)a->v_cache + id * a->v_s0 + off * a->v_s1 + kv * a->v_s2;
            for (int64_t j = 0; j < run; j++, p++, k += a->k_s1, v += a->v_s1) c->k.f[p] = k, c->v.f[p] = v;
        }
    }
    if (a->k_scale) /* the vector steps read whole groups of scales */
        for (int64_t p = len; p < LP_CHUNK; p++) c->ks[p] = c->vs[p] = 0.0f;
    return len;
}

/* The chunk's scores (see lp_steps), over float or int8 keys. */
INLINE void chunk_scores(const attention_job *job, const float *const *q, int64_t rows, const lp_chunk *c,
                         int64_t len, float *s) {
    if (job->a->k_scale)
        job->steps->scores_q8(q, rows, job->a->d, c->k.q, c->ks, len, job->scale, s);
    else
        job->steps->scores(q, rows, job->a->d, c->k.f, len, job->scale, s);
}

/* acc += w v over the chunk's first len values, float or int8. */
INLINE void chunk_axpy(const attention_job *job, float *acc, const float *w, int64_t rows, const lp_chunk *c,
                       int64_t len) {
    if (job->a->k_scale)
        job->steps->axpy_q8(acc, w, rows, c->v.q, c->vs, len, job->a->dv);
    else
        job->steps->axpy(acc, w, rows, c->v.f, len, job->a->dv);
}

/* Bytes of one key and value row (an int8 row and its scale, or float32 ones). */
static int64_t kv_row_bytes(const lp_attention_args *a) {
    return a->k_scale ? a->d + a->dv + 2 * (int64_t)sizeof(float) : (a->d + a->dv) * (int64_t)sizeof(float);
}

/* Ask for the bytes of `len` rows of `bytes` each now: the next chunk's keys while this one's
 * scores are computed, its values while this one's are summed. The blocks lie anywhere in the
 * pool, where the hardware prefetcher cannot guess them. */
static void fetch_rows(const void *const *rows, int64_t len, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64)
#pragma GCC unroll 8
        for (int64_t p = 0; p < len; p++) __builtin_prefetch((const char *)rows[p] + l, 0, 2);
}

/* (m, l, acc) becomes the softmax state of its keys followed by those of (m2, l2, acc2): both
 * rescaled to the larger maximum. Every merge of segments goes through here, in order. */
static void merge_state(float *m, float *l, float *acc, float m2, float l2, const float *acc2, int64_t dv) {
    const float mx = *m > m2 ? *m : m2, a1 = exp_neg(*m - mx), a2 = exp_neg(m2 - mx);
    *l = *l * a1 + l2 * a2;
    for (int64_t e = 0; e < dv; e++) acc[e] = acc[e] * a1 + acc2[e] * a2;
    *m = mx;
}

static void write_row(const lp_attention_args *a, int64_t i, int64_t head, const float *acc, float l) {
    float *o = a->out + i * a->out_s0 + head * a->out_s1;
    for (int64_t e = 0; e < a->dv; e++) o[e] = acc[e] / l;
}

/* One task (see lp_task); row r is head kv * G + r % G of token i0 + r / G. Scratch: row
 * pointers (rows), scores (rows, LP_CHUNK), the segment in hand (acc (rows, Dv), max (rows),
 * partial sums (rows, LP_LANES)), the merged state (acc (rows, Dv), max, sum (rows each)).
 * Keys go in chunks of LP_CHUNK: the scores of every row that sees the chunk (the tokens share
 * each key row they load), then per token its rows' online softmax step and acc += p v (the
 * heads share each value row). */
static void attend(void *ctx, size_t index, int thread) {
    const attention_job *job = ctx;
    const lp_attention_args *a = job->a;
    const lp_steps *steps = job->steps;
    const lp_task *t = job->tasks + index;
    const int64_t d = a->d, dv = a->dv, g = job->g, kv = t->kv, nt = t->i1 - t->i0, rows = nt * g;
    const int64_t first = key_end(a, t->b, t->i0), last = first + nt - 1; /* keys of the first, last token */
    const int64_t *table = a->block_tables + t->b * a->bt_s0;
    const int whole = t->part < 0;

    const float **qp = (const float **)(job->scratch + (size_t)thread * job->scratch_bytes);
    float *scores = (float *)(qp + job->rows);
    float *w_acc = scores + job->rows * LP_CHUNK, *w_max = w_acc + job->rows * dv, *w_sum = w_max + job->rows;
    float *m_acc = w_sum + job->rows * LP_LANES, *m_max = m_acc + job->rows * dv, *m_sum = m_max + job->rows;
    for (int64_t r = 0; r < rows; r++)
        qp[r] = a->q + (t->i0 + r / g) * a->q_s0 + (kv * g + r % g) * a->q_s1;
    memset(scores, 0, (size_t)(rows * LP_CHUNK) * sizeof(float)); /* softmax reads (and drops) past n */

    const int64_t end = last < t->s1 * LP_SEGMENT ? last : t->s1 * LP_SEGMENT;
    lp_chunk chunk[2]; /* [chunk parity] */
    const int64_t item = a->k_scale ? 1 : (int64_t)sizeof(float), k_bytes = d * item, v_bytes = dv * item;
    int parity = 0;
    chunk_rows(a, table, kv, t->s0 * LP_SEGMENT, end, &chunk[0]);
    for (int64_t s = t->s0; s < t->s1; s++) {
        const int64_t lo = s * LP_SEGMENT, hi = end < lo + LP_SEGMENT ? end : lo + LP_SEGMENT;
        const int64_t ta = lo - first + 1 > 0 ? lo - first + 1 : 0; /* the first token that sees key lo */
        /* a whole task's first segment goes straight into the merged state */
        float *acc = whole && s == 0 ? m_acc : w_acc, *mx = whole && s == 0 ? m_max : w_max, *sum = w_sum;
        for (int64_t r = ta * g; r < rows; r++) mx[r] = -INFINITY;
        memset(sum + ta * g * LP_LANES, 0, (size_t)((rows - ta * g) * LP_LANES) * sizeof(float));
        memset(acc + ta * g * dv, 0, (size_t)((rows - ta * g) * dv) * sizeof(float));
        for (int64_t c0 = lo; c0 < hi; c0 += LP_CHUNK, parity ^= 1) {
            const int64_t len = hi - c0 < LP_CHUNK ? hi - c0 : LP_CHUNK;
            const int64_t tc = c0 - first + 1 > 0 ? c0 - first + 1 : 0; /* the first token that sees key c0 */
            const int64_t next =
                c0 + LP_CHUNK < end ? chunk_rows(a, table, kv, c0 + LP_CHUNK, end, &chunk[parity ^ 1]) : 0;
            const lp_chunk *here = &chunk[parity];
            fetch_rows(chunk[parity ^ 1].k.any, next, k_bytes);
            chunk_scores(job, qp + tc * g, rows - tc * g, here, len, scores + tc * g * LP_CHUNK);
            fetch_rows(chunk[parity ^ 1].v.any, next, v_bytes);
            for (int64_t tok = tc; tok < nt; tok++) {
                const int64_t n = first + tok - c0 < len ? first + tok - c0 : len; /* keys it sees here */
                steps->softmax(scores + tok * g * LP_CHUNK, g, n, mx + tok * g, sum + tok * g * LP_LANES,
                               acc + tok * g * dv, dv, c0 == lo);
                chunk_axpy(job, acc + tok * g * dv, scores + tok * g * LP_CHUNK, g, here, n);
            }
        }
        for (int64_t r = ta * g; r < rows; r++) {
            const float total = fold16(sum + r * LP_LANES);
            if (!whole) {
                float *part = job->partials + t->part + (r * t->n_seg + s) * (dv + 2);
                part[0] = mx[r], part[1] = total;
                memcpy(part + 2, acc + r * dv, (size_t)dv * sizeof(float));
            } else if (s > 0) {
                merge_state(m_max + r, m_sum + r, m_acc + r * dv, mx[r], total, acc + r * dv, dv);
            } else {
                m_sum[r] = total;
            }
        }
    }
    if (whole)
        for (int64_t r = 0; r < rows; r++) write_row(a, t->i0 + r / g, kv * g + r % g, m_acc + r * dv, m_sum[r]);
}

/* The rows of a task split over segments: each segment's state merged in order, as a whole
 * task merges them. */
static void merge_partials(const attention_job *job, const lp_task *t) {
    const lp_attention_args *a = job->a;
    const int64_t g = job->g, dv = a->dv, first = key_end(a, t->b, t->i0);
    for (int64_t r = 0; r < (t->i1 - t->i0) * g; r++) {
        const int64_t n_seg = (first + r / g + LP_SEGMENT - 1) / LP_SEGMENT;
        float *state = job->partials + t->part + r * t->n_seg * (dv + 2);
        for (int64_t s = 1; s < n_seg; s++) {
            const float *p = state + s * (dv + 2);
            merge_state(state, state + 1, state + 2, p[0], p[1], p + 2, dv);
        }
        write_row(a, t->i0 + r / g, t->kv * g + r % g, state + 2, state[1]);
    }
}

static int longest_first(const void *x, const void *y) {
    const lp_task *a = x, *b = y;
    if (a->work != b->work) return a->work > b->work ? -1 : 1;
    if (a->b != b->b) return a->b < b->b ? -1 : 1;
    if (a->i0 != b->i0) return a->i0 < b->i0 ? -1 : 1;
    if (a->kv != b->kv) return a->kv < b->kv ? -1 : 1;
    return (a->s0 > b->s0) - (a->s0 < b->s0);
}

/* Check the index tensors and count the K/V bytes the call reads. */
static int check_indices(lp_attention_args *a, int64_t *kv_bytes) {
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
        keys += q_len * (c - q_len) + q_len * (q_len + 1) / 2;
    }
    if (qs[a->b * a->qs_s0] != a->n) return a->bad[0] = a->b, a->bad[1] = qs[a->b * a->qs_s0], LP_ERR_END;
    if (a->key_ends) {
        keys = 0;
        for (int64_t b = 0; b < a->b; b++) {
            const int64_t c = cl[b * a->cl_s0];
            for (int64_t i = qs[b * a->qs_s0]; i < qs[(b + 1) * a->qs_s0]; i++) {
                const int64_t e = a->key_ends[i * a->ke_s0];
                if (e < keys_of(a, b, i) || e > c) return a->bad[0] = i, a->bad[1] = e, LP_ERR_KEY_END;
                keys += e;
            }
        }
    }
    *kv_bytes = keys * a->kh * kv_row_bytes(a);
    return LP_OK;
}

/* The tasks of the call (see lp_task) into `tasks` (NULL: only count them), `tokens` query
 * tokens each at most (one in a sequence with an overridden key end), the segments of each cut
 * into `pieces` at most; returns how many, and the partial-state floats they need in
 * *partial_floats. */
static int64_t plan_tasks(const lp_attention_args *a, int64_t g, int64_t tokens, int64_t pieces, lp_task *tasks,
                          int64_t *partial_floats) {
    int64_t count = 0, floats = 0;
    for (int64_t b = 0; b < a->b; b++) {
        const int64_t q0 = a->query_starts[b * a->qs_s0], q1 = a->query_starts[(b + 1) * a->qs_s0];
        const int64_t per = overridden(a, b, q0, q1) ? 1 : tokens, blocks = (q1 - q0 + per - 1) / per;
        for (int64_t j = 0; j < blocks; j++) {
            const int64_t i0 = q0 + j * (q1 - q0) / blocks, i1 = q0 + (j + 1) * (q1 - q0) / blocks;
            const int64_t last = key_end(a, b, i1 - 1), n_seg = (last + LP_SEGMENT - 1) / LP_SEGMENT;
            const int64_t cut = pieces < n_seg ? pieces : n_seg;
            for (int64_t kv = 0; kv < a->kh; kv++, floats += cut > 1 ? (i1 - i0) * g * n_seg * (a->dv + 2) : 0)
                for (int64_t piece = 0; piece < cut; piece++, count++) {
                    if (!tasks) continue;
                    const int64_t s0 = piece * n_seg / cut, s1 = (piece + 1) * n_seg / cut;
                    const int64_t hi = last < s1 * LP_SEGMENT ? last : s1 * LP_SEGMENT;
                    tasks[count] = (lp_task){.b = b, .kv = kv, .i0 = i0, .i1 = i1, .s0 = s0, .s1 = s1,
                                             .n_seg = n_seg, .part = cut > 1 ? floats : -1,
                                             .work = (i1 - i0) * (hi - s0 * LP_SEGMENT)};
                }
        }
    }
    *partial_floats = floats;
    return count;
}

/* ---- attention with a sliding window ------------------------------------------------------- */

/* One task of a windowed call: query token i of sequence b, KV head kv, its G rows. Its keys
 * are [start, end) with start = its position + 1 - window (at least 0) and end its key end
 * (key_ends[i], else its position + 1): the first chunk runs from start to the next multiple
 * of LP_CHUNK, the others are the fixed chunks, one online softmax over them all (the same
 * steps as whole-context attention). A row's arithmetic depends on its own key range only,
 * so it is batch invariant as the whole-context kernel is. Scratch: row pointers (G), scores
 * (G, LP_CHUNK), acc (G, Dv), max (G), partial sums (G, LP_LANES). */
static void attend_window(void *ctx, size_t index, int thread) {
    const attention_job *job = ctx;
    const lp_attention_args *a = job->a;
    const lp_steps *steps = job->steps;
    const lp_task *t = job->tasks + index;
    const int64_t dv = a->dv, g = job->g, kv = t->kv, i = t->i0;
    const int64_t own = keys_of(a, t->b, i), start = own - a->window > 0 ? own - a->window : 0;
    const int64_t keys = key_end(a, t->b, i);
    const int64_t *table = a->block_tables + t->b * a->bt_s0;
    const float **qp = (const float **)(job->scratch + (size_t)thread * job->scratch_bytes);
    float *scores = (float *)(qp + g), *acc = scores + g * LP_CHUNK, *mx = acc + g * dv, *sum = mx + g;
    for (int64_t r = 0; r < g; r++) qp[r] = a->q + i * a->q_s0 + (kv * g + r) * a->q_s1, mx[r] = -INFINITY;
    memset(scores, 0, (size_t)(g * LP_CHUNK) * sizeof(float));
    memset(acc, 0, (size_t)(g * dv) * sizeof(float));
    memset(sum, 0, (size_t)(g * LP_LANES) * sizeof(float));
    lp_chunk chunk;
    for (int64_t c0 = start; c0 < keys;) {
        const int64_t next = (c0 / LP_CHUNK + 1) * LP_CHUNK < keys ? (c0 / LP_CHUNK + 1) * LP_CHUNK : keys;
        const int64_t len = chunk_rows(a, table, kv, c0, next, &chunk);
        chunk_scores(job, qp, g, &chunk, len, scores);
        steps->softmax(scores, g, len, mx, sum, acc, dv, c0 == start);
        chunk_axpy(job, acc, scores, g, &chunk, len);
        c0 = next;
    }
    for (int64_t r = 0; r < g; r++) write_row(a, i, kv * g + r, acc + r * dv, fold16(sum + r * LP_LANES));
}

/* ``llaisys_paged_attention`` with a->window > 0: a task per (query token, KV head). */
static int paged_attention_window(lp_attention_args *a) {
    const int64_t g = a->h / a->kh;
    int64_t keys = 0, count = a->n * a->kh;
    for (int64_t b = 0; b < a->b; b++) {
        const int64_t q0 = a->query_starts[b * a->qs_s0], q1 = a->query_starts[(b + 1) * a->qs_s0];
        for (int64_t i = q0; i < q1; i++) {
            const int64_t own = keys_of(a, b, i), start = own - a->window > 0 ? own - a->window : 0;
            keys += key_end(a, b, i) - start;
        }
    }
    const int64_t kv_bytes = keys * a->kh * kv_row_bytes(a);
    const int threads = kv_bytes < LP_SERIAL_BYTES ? 1 : lq_pool_threads();
    attention_job job = {.a = a, .steps = attention_steps(), .scale = (float)a->scale, .g = g, .rows = g};
    job.scratch_bytes = ((size_t)g * sizeof(float *) + (size_t)(g * (LP_CHUNK + a->dv + 1 + LP_LANES)) * sizeof(float)
                         + 63) / 64 * 64;
    const int slots = (int64_t)threads > count ? (int)count : threads;
    lp_task *tasks = malloc((size_t)count * sizeof(lp_task));
    void *scratch = NULL;
    int status = LP_OK;
    if (!tasks || posix_memalign(&scratch, 64, (size_t)slots * job.scratch_bytes) != 0) {
        status = LP_ERR_MEMORY;
    } else {
        int64_t at = 0;
        for (int64_t b = 0; b < a->b; b++) {
            const int64_t q0 = a->query_starts[b * a->qs_s0], q1 = a->query_starts[(b + 1) * a->qs_s0];
            for (int64_t i = q0; i < q1; i++)
                for (int64_t kv = 0; kv < a->kh; kv++)
                    tasks[at++] = (lp_task){.b = b, .kv = kv, .i0 = i, .i1 = i + 1, .part = -1};
        }
        job.tasks = tasks, job.scratch = scratch;
        lq_pool_run(attend_window, &job, (size_t)count, slots);
    }
    free(scratch);
    free(tasks);
    return status;
}

/* out = softmax(q k^T * scale + causal mask) v per sequence and head (see the top). */
LQ_EXPORT int llaisys_paged_attention(lp_attention_args *a) {
    if (a->n < 0 || a->b < 0 || a->kh <= 0 || a->h % a->kh || a->d < 0 || a->dv <= 0 || a->bs <= 0 || a->window < 0)
        return LP_ERR_SHAPE;
    if (a->n == 0) return LP_OK;
    int64_t kv_bytes = 0, partial_floats = 0;
    int status = check_indices(a, &kv_bytes);
    if (status != LP_OK) return status;
    if (a->window > 0) return paged_attention_window(a);
    const int64_t g = a->h / a->kh;
    const int threads = kv_bytes < LP_SERIAL_BYTES ? 1 : lq_pool_threads();
    /* Enough tasks to keep every thread busy to the end: fewer tokens per task, and where
     * that is not enough (decoding), the segments of each cut into pieces. */
    const int64_t want = threads > 1 ? 4 * (int64_t)threads : 1;
    int64_t tokens = LP_TOKENS, pieces = 1, dummy;
    while (tokens > 1 && plan_tasks(a, g, tokens, 1, NULL, &dummy) < want) tokens /= 2;
    const int64_t whole_tasks = plan_tasks(a, g, tokens, 1, NULL, &dummy);
    if (whole_tasks < want) pieces = (want + whole_tasks - 1) / whole_tasks;
    const int64_t count = plan_tasks(a, g, tokens, pieces, NULL, &partial_floats);
    if (count == 0) return LP_OK;

    attention_job job = {.a = a, .steps = attention_steps(), .scale = (float)a->scale, .g = g, .rows = tokens * g};
    job.scratch_bytes = ((size_t)job.rows * sizeof(float *) +
                         (size_t)(job.rows * (LP_CHUNK + 2 * a->dv + LP_LANES + 3)) * sizeof(float) + 63) / 64 * 64;
    const int slots = (int64_t)threads > count ? (int)count : threads;
    lp_task *tasks = malloc((size_t)count * sizeof(lp_task));
    float *partials = partial_floats ? malloc((size_t)partial_floats * sizeof(float)) : NULL;
    void *scratch = NULL;
    if (!tasks || (partial_floats && !partials) ||
        posix_memalign(&scratch, 64, (size_t)slots * job.scratch_bytes) != 0) {
        status = LP_ERR_MEMORY;
    } else {
        plan_tasks(a, g, tokens, pieces, tasks, &partial_floats);
        qsort(tasks, (size_t)count, sizeof(lp_task), longest_first);
        job.tasks = tasks, job.partials = partials, job.scratch = scratch;
        lq_pool_run(attend, &job, (size_t)count, slots);
        for (int64_t i = 0; i < count; i++) /* each split task once: at its first piece */
            if (tasks[i].part >= 0 && tasks[i].s0 == 0) merge_partials(&job, tasks + i);
    }
    free(scratch);
    free(partials);
    free(tasks);
    return status;
}

/* The SIMD level in use (0 portable, 1 AVX2, 2 AVX-512). `level` >= 0 picks that level, or the
 * best one below it that this CPU runs (for tests and benchmarks: every level gives the same
 * bits); -1 only asks. */
LQ_EXPORT int llaisys_paged_simd(int level) {
    attention_steps();
    if (level >= 0) {
        if (level >= SIMD_LEVEL_COUNT) level = SIMD_LEVEL_COUNT - 1;
        while (level > SIMD_SCALAR && !steps_of(level)) level--;
        atomic_store_explicit(&simd_level, level, memory_order_relaxed);
    }
    return atomic_load_explicit(&simd_level, memory_order_relaxed);
}

/* ---- cache write ------------------------------------------------------------------------- */

/* The row x (n floats) as int8 codes: scale = amax / 127 and code = x / scale rounded half to
 * even (rintf in the default rounding mode), within [-127, 127]; a row of zeros gets scale 0 and
 * codes 0. Returns the scale. */
static float quantize_row(const float *x, int64_t n, int8_t *code) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float scale = amax / 127.0f;
    if (scale == 0.0f) {
        memset(code, 0, (size_t)n);
        return 0.0f;
    }
    for (int64_t i = 0; i < n; i++) {
        const float c = rintf(x[i] / scale);
        code[i] = (int8_t)(c > 127.0f ? 127.0f : c >= -127.0f ? c : -127.0f);
    }
    return scale;
}

/* The int8 form of llaisys_paged_kv_write (slots already checked): each head of each token
 * quantized on its own into its slot, so a slot's codes and scale depend on its own row only. */
static int paged_kv_write_q8(lp_write_args *a) {
    for (int64_t i = 0; i < a->n; i++) {
        const int64_t s = a->slots[i * a->sl_s0], blk = s / a->bs, off = s % a->bs;
        const float *k = (const float *)a->k + i * a->k_s0, *v = (const float *)a->v + i * a->v_s0;
        for (int64_t h = 0; h < a->kh; h++) {
            int8_t *kc = (int8_t *)a->k_cache + blk * a->kc_s0 + off * a->kc_s1 + h * a->kc_s2;
            int8_t *vc = (int8_t *)a->v_cache + blk * a->vc_s0 + off * a->vc_s1 + h * a->vc_s2;
            a->k_scale[blk * a->ksc_s0 + off * a->ksc_s1 + h * a->ksc_s2] = quantize_row(k + h * a->k_s1, a->d, kc);
            a->v_scale[blk * a->vsc_s0 + off * a->vsc_s1 + h * a->vsc_s2] = quantize_row(v + h * a->v_s1, a->dv, vc);
        }
    }
    return LP_OK;
}

/* k_cache[slot // BS, slot % BS] = k[i], v likewise, for each token i (quantized where k_scale is
 * set); every slot is checked before anything is written. */
LQ_EXPORT int llaisys_paged_kv_write(lp_write_args *a) {
    const int64_t cap = a->nb * a->bs, z = a->itemsize;
    for (int64_t i = 0; i < a->n; i++) {
        const int64_t s = a->slots[i * a->sl_s0];
        if (s < 0 || s >= cap) return a->bad[0] = i, a->bad[1] = s, LP_ERR_SLOT;
    }
    if (a->k_scale) return z == (int64_t)sizeof(float) ? paged_kv_write_q8(a) : LP_ERR_SHAPE;
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
