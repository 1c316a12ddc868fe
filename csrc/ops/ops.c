/* The exported API of the small float32 kernels (see ops.h), the portable level and the choice
 * of SIMD level: the best this CPU runs, chosen at first use (LLAISYS_SIMD=scalar|avx2|avx512
 * forces one). All levels give the same bits (ops_body.h).
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/simd_choice.h"
#include "kernels/quant.h" /* lq_half_to_float, lq_bf16_to_float */

#include "ops_body.h"

/* ---- the portable level (whatever vectors the baseline ISA has) --------------------------- */

static void norm_scalar(const lo_norm_args *a, const float *w) { lo_norm_body(a, w); }
static void swiglu_scalar(const lo_swiglu_args *a) { lo_gated_body(a, 0); }
static void rope_scalar(const lo_rope_args *a, const float *cos, const float *sin) { lo_rope_body(a, cos, sin); }
static void attention_scalar(const lo_attention_args *a, const float *k, const float *v, int64_t t, int causal,
                             float *scratch) {
    lo_attention_body(a, k, v, t, causal, scratch, lo_scores, lo_values);
}

const lo_kernels lo_kernels_scalar = {"scalar", norm_scalar, swiglu_scalar, rope_scalar, attention_scalar};

/* ---- choice of level ------------------------------------------------------------------------ */

SIMD_CHOICE(lo_kernels, lo_kernels_scalar, lo_kernels_avx2, lo_kernels_avx512) /* kernels(): the level in use */

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

/* cos, sin (S, R/2): the rotation of each position, as the NumPy kernel tabulates them. */
LO_EXPORT int llaisys_ops_rope(const lo_rope_args *a, const float *cos, const float *sin) {
    if (a->s < 0 || a->h < 0 || a->d < 0 || a->d % 2 || a->r < 0 || a->r > a->d || a->r % 2) return LO_ERR_SHAPE;
    kernels()->rope(a, cos, sin);
    return LO_OK;
}

/* ---- threads: the kernels library's pool, lent at load time ------------------------------ */

/* The pool of csrc/kernels (lq_pool_run and its thread count), handed over by the Python
 * binding when both libraries are built, so the two share one set of workers instead of each
 * keeping its own. Without it everything runs on the calling thread. */
typedef void (*lo_task_fn)(void *ctx, size_t chunk, int thread);
typedef void (*lo_pool_run_fn)(lo_task_fn task, void *ctx, size_t n_chunks, int slots);
typedef int (*lo_pool_threads_fn)(void);

static _Atomic(lo_pool_run_fn) pool_run;
static _Atomic(lo_pool_threads_fn) pool_threads;

/* Use `run` (run task(ctx, i, thread) for i < n_chunks on up to `slots` threads numbered from 0,
 * returning when all have run) and `threads` (how many threads it has) from now on; NULL, NULL
 * goes back to the calling thread alone. */
LO_EXPORT void llaisys_ops_use_pool(lo_pool_run_fn run, lo_pool_threads_fn threads) {
    atomic_store(&pool_threads, run && threads ? threads : NULL);
    atomic_store(&pool_run, run && threads ? run : NULL);
}

/* ---- self-attention: rows and heads as parallel tasks ------------------------------------- */

/* Calls that read fewer K/V bytes than this run on the calling thread: waking a worker costs
 * about what it saves there (csrc/kernels/paged_attention.c measured the same break-even). */
#define LO_SERIAL_BYTES ((int64_t)96 << 10)

typedef struct {
    const lo_attention_args *a;
    const float *k, *v;
    int64_t t;
    int causal;
    int64_t row_chunks, rows_per_chunk, head_parts;
    float *scratch;
    size_t scratch_floats; /* per thread */
    const lo_kernels *kern;
} attention_job;

/* One task: rows [i0, i1) of q and heads [h0, h1), run as one kernel call per KV head those
 * heads share (a sub-problem with KH = 1): each row and head is computed exactly as in a call
 * over everything, so the split leaves every bit of the output as it was. Causal: later rows
 * see more keys, so row chunks go out last first: the short ones finish the job; the rows of
 * a chunk see the first T - S + i1 keys. */
static void attention_task(void *ctx, size_t chunk, int thread) {
    const attention_job *job = ctx;
    const lo_attention_args *a = job->a;
    const int64_t rc = job->row_chunks - 1 - (int64_t)chunk / job->head_parts, hp = (int64_t)chunk % job->head_parts;
    const int64_t i0 = rc * job->rows_per_chunk, i1 = i0 + job->rows_per_chunk < a->s ? i0 + job->rows_per_chunk : a->s;
    const int64_t h0 = hp * a->h / job->head_parts, h1 = (hp + 1) * a->h / job->head_parts, g = a->h / a->kh;
    const int64_t t = job->causal ? job->t - a->s + i1 : job->t;
    float *scratch = job->scratch + (size_t)thread * job->scratch_floats;
    if (h0 == 0 && h1 == a->h) { /* every head: one call */
        lo_attention_args sub = *a;
        sub.out = a->out + i0 * a->out_s0;
        sub.q = a->q + i0 * a->q_s0;
        sub.s = i1 - i0;
        job->kern->attention(&sub, job->k, job->v, t, job->causal, scratch);
        return;
    }
    for (int64_t hs = h0; hs < h1;) {
        const int64_t kv = hs / g, he = (kv + 1) * g < h1 ? (kv + 1) * g : h1;
        lo_attention_args sub = *a;
        sub.out = a->out + i0 * a->out_s0 + hs * a->out_s1;
        sub.q = a->q + i0 * a->q_s0 + hs * a->q_s1;
        sub.s = i1 - i0;
        sub.h = he - hs;
        sub.kh = 1;
        job->kern->attention(&sub, job->k + kv * a->k_s1, job->v + kv * a->v_s1, t, job->causal, scratch);
        hs = he;
    }
}

/* Run `job` (its partition set) on `threads` threads, each with its own scratch. */
static int attention_run(attention_job *job, int64_t threads, lo_pool_run_fn run) {
    const lo_attention_args *a = job->a;
    const size_t tasks = (size_t)(job->row_chunks * job->head_parts);
    if (threads > (int64_t)tasks) threads = (int64_t)tasks;
    const int64_t rows = job->causal ? 1 : LO_ROW_BLOCK;
    job->scratch_floats = ((size_t)(rows * a->h * (job->t + a->dv + 1)) + 15) / 16 * 16; /* whole cache lines */
    void *scratch = NULL;
    if (posix_memalign(&scratch, 64, (size_t)threads * job->scratch_floats * sizeof(float)) != 0) return LO_ERR_MEMORY;
    job->scratch = scratch;
    job->kern = kernels();
    if (threads > 1)
        run(attention_task, job, tasks, (int)threads);
    else
        for (size_t i = 0; i < tasks; i++) attention_task(job, i, 0);
    free(scratch);
    return LO_OK;
}

/* How many threads a call that reads `kv_bytes` of K and V rows in all gets (1 without the pool). */
static int64_t attention_threads(int64_t kv_bytes, lo_pool_run_fn run) {
    const lo_pool_threads_fn threads_of = atomic_load(&pool_threads);
    return run && threads_of && kv_bytes >= LO_SERIAL_BYTES ? threads_of() : 1;
}

/* k (T, KH, D) and v (T, KH, Dv) at the strides of `a`. Many rows (prefill) are split into
 * chunks of rows; a few (decoding) into ranges of heads. */
LO_EXPORT int llaisys_ops_self_attention(const lo_attention_args *a, const float *k, const float *v, int64_t t) {
    if (a->s < 0 || t < a->s || a->kh <= 0 || a->h % a->kh || a->d <= 0 || a->dv <= 0) return LO_ERR_SHAPE;
    if (a->s == 0) return LO_OK;
    const lo_pool_run_fn run = atomic_load(&pool_run);
    const int64_t keys = a->s * (t - a->s) + a->s * (a->s + 1) / 2;
    const int64_t threads = attention_threads(keys * a->kh * (a->d + a->dv) * (int64_t)sizeof(float), run);
    attention_job job = {.a = a, .k = k, .v = v, .t = t, .causal = 1, .row_chunks = 1, .rows_per_chunk = a->s,
                         .head_parts = 1};
    if (threads > 1 && a->s >= 2 * threads) {
        job.row_chunks = a->s < 4 * threads ? a->s : 4 * threads;
        job.rows_per_chunk = (a->s + job.row_chunks - 1) / job.row_chunks;
        job.row_chunks = (a->s + job.rows_per_chunk - 1) / job.rows_per_chunk;
    } else if (threads > 1) {
        job.row_chunks = a->s;
        job.rows_per_chunk = 1;
        job.head_parts = threads < a->h ? threads : a->h;
    }
    return attention_run(&job, threads, run);
}

/* Rows a task of full attention takes at most: tasks small enough that a stalled thread (on a
 * shared machine) holds up little of the job, large enough that a task reads its KV head's rows
 * from cache for all but its first block of rows. */
#define LO_FULL_ROWS 64

/* Full (non-causal) attention: every query sees all t >= 1 keys of k (T, KH, D) and v (T, KH, Dv).
 * Each task takes one KV head (its G query heads) and a chunk of rows, so that head's K and V
 * rows, read once for every query row, stay in cache for the whole chunk; with fewer KV heads
 * and rows than threads, heads of one group are split among them. */
LO_EXPORT int llaisys_ops_self_attention_full(const lo_attention_args *a, const float *k, const float *v,
                                              int64_t t) {
    if (a->s < 0 || t < 1 || a->kh <= 0 || a->h % a->kh || a->d <= 0 || a->dv <= 0) return LO_ERR_SHAPE;
    if (a->s == 0) return LO_OK;
    const lo_pool_run_fn run = atomic_load(&pool_run);
    const int64_t threads = attention_threads(a->s * t * a->kh * (a->d + a->dv) * (int64_t)sizeof(float), run);
    attention_job job = {.a = a, .k = k, .v = v, .t = t, .causal = 0, .head_parts = a->kh};
    const int64_t want = threads > 1 ? 4 * threads : 1; /* tasks */
    job.row_chunks = (want + job.head_parts - 1) / job.head_parts;
    if (job.row_chunks > a->s) job.row_chunks = a->s;
    if (job.row_chunks * job.head_parts < threads) job.head_parts = threads < a->h ? threads : a->h;
    job.rows_per_chunk = (a->s + job.row_chunks - 1) / job.row_chunks;
    if (job.rows_per_chunk > LO_FULL_ROWS) job.rows_per_chunk = LO_FULL_ROWS;
    job.row_chunks = (a->s + job.rows_per_chunk - 1) / job.rows_per_chunk;
    return attention_run(&job, threads, run);
}

/* ---- replay: a list of calls in one native call ------------------------------------------- */

LO_EXPORT int llaisys_ops_rms_norm_call(const void *block) {
    const lo_norm_call *c = block;
    return llaisys_ops_rms_norm(c->a, c->w);
}

LO_EXPORT int llaisys_ops_swiglu_call(const void *block) { return llaisys_ops_swiglu(((const lo_swiglu_call *)block)->a); }

LO_EXPORT int llaisys_ops_rope_call(const void *block) {
    const lo_rope_call *c = block;
    return llaisys_ops_rope(c->a, c->cos, c->sin);
}

LO_EXPORT int llaisys_ops_self_attention_call(const void *block) {
    const lo_attention_call *c = block;
    return llaisys_ops_self_attention(c->a, c->k, c->v, c->t);
}

LO_EXPORT int llaisys_ops_self_attention_full_call(const void *block) {
    const lo_attention_call *c = block;
    return llaisys_ops_self_attention_full(c->a, c->k, c->v, c->t);
}

LO_EXPORT int llaisys_ops_copy_call(const void *block) {
    const lo_copy_call *c = block;
    if (c->nbytes < 0) return LO_ERR_SHAPE;
    memmove(c->dst, c->src, (size_t)c->nbytes);
    return LO_OK;
}

/* out = a + b over n dense floats; out may be a or b (each element is read before it is written). */
LO_EXPORT int llaisys_ops_add_call(const void *block) {
    const lo_add_call *c = block;
    if (c->n < 0) return LO_ERR_SHAPE;
    for (int64_t i = 0; i < c->n; i++) c->out[i] = c->a[i] + c->b[i];
    return LO_OK;
}

/* Rows of a table gathered by index (lo_gather_call); every index is checked first. */
LO_EXPORT int llaisys_ops_gather_call(const void *block) {
    lo_gather_call *c = (lo_gather_call *)block; /* the binding's block: `bad` is written */
    if (c->rows < 0 || c->row_bytes < 0) return LO_ERR_SHAPE;
    for (int64_t i = 0; i < c->rows; i++) {
        const int64_t r = c->index[i * c->index_s];
        if (r < 0 || r >= c->v) {
            c->bad[0] = i, c->bad[1] = r;
            return LO_ERR_SHAPE;
        }
    }
    for (int64_t i = 0; i < c->rows; i++) {
        const char *row = c->weight + c->index[i * c->index_s] * c->weight_s;
        char *dst = c->out + i * c->out_s;
        if (c->widen == LO_GATHER_COPY) {
            memcpy(dst, row, (size_t)c->row_bytes);
            continue;
        }
        const int64_t n = c->row_bytes / (int64_t)sizeof(float);
        for (int64_t e = 0; e < n; e++) {
            uint16_t h;
            memcpy(&h, row + 2 * e, 2);
            const float f = c->widen == LO_GATHER_BF16 ? lq_bf16_to_float(h) : lq_half_to_float(h);
            memcpy(dst + 4 * e, &f, 4);
        }
    }
    return LO_OK;
}

/* Run calls[0 .. n) in order; stop at the first that returns a nonzero status, returning it
 * with its index in *failed. */
LO_EXPORT int llaisys_ops_run(const lo_call *calls, int64_t n, int64_t *failed) {
    for (int64_t i = 0; i < n; i++) {
        const int status = calls[i].fn(calls[i].block);
        if (status) {
            *failed = i;
            return status;
        }
    }
    return LO_OK;
}
