/* The routed experts of a mixture-of-experts MLP (Qwen3-MoE's sparse layers) in one call, for
 * float32 activations and expert weights in any format of quant.c:
 *
 *   out (N, D) = sum over token t's k chosen experts e, ascending, of w_e * down_e(silu(gate_e h) * up_e h)
 *
 * Routing follows kernels/cpu/moe.py's NumPy `route` bit for bit: softmax of the router logits
 * in float32 (NumPy's float32 exp, its pairwise sum), the top k by probability (ties to the
 * lower index), ascending, their weights divided by their sum when asked. Tokens are grouped by
 * expert, so each chosen expert's rows are read once per call. Groups of a few tokens (decoding)
 * run all experts' gate and up products as one job of the thread pool and their down products
 * as another, through the level's dot kernels; larger groups one llaisys_quant_linear per
 * product. Both follow quant.h's one arithmetic per output (a row's result does not depend on
 * the other rows). The SwiGLU is the ops library's function, handed in with the call (the one
 * the NumPy path calls), and each token adds its experts' weighted outputs in ascending expert
 * order. So a token's result has the same bits alone or in a batch, and the same as the NumPy
 * path's.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"
#include "quant.h"

enum { LM_OK = 0, LM_ERR_TYPE = -1, LM_ERR_SHAPE = -2, LM_ERR_MEMORY = -3 };

/* NumPy's float32 exp (its AVX2/AVX-512 kernel, scalar here): x = q ln2 + r (Cody-Waite, fused
 * multiply-adds), a (5, 2) rational approximation of e^r, scaled by 2^q with one rounding. */
static float numpy_expf(float x) {
    if (x != x) return x;
    if (x > 88.72283935546875f) return INFINITY;
    if (x < -103.97208404541015625f) return 0.0f;
    const float magic = 0x1.8p+23f; /* adding and subtracting it rounds to an integer */
    float q = x * 1.442695040888963407359924681001892137f;
    q = (q + magic) - magic;
    float r = fmaf(q, -6.93145752e-1f, x);
    r = fmaf(q, -1.42860677e-6f, r);
    float num = fmaf(5.082762527590693718096e-04f, r, 6.757896990527504603057e-03f);
    num = fmaf(num, r, 5.114512081637298353406e-02f);
    num = fmaf(num, r, 2.473615434895520810817e-01f);
    num = fmaf(num, r, 7.257664613233124478488e-01f);
    num = fmaf(num, r, 9.999999999980870924916e-01f);
    float den = fmaf(2.159509375685829852307e-02f, r, -2.742335390411667452936e-01f);
    den = fmaf(den, r, 1.0f);
    return ldexpf(num / den, (int)q);
}

/* NumPy's pairwise sum of n floats (what np.sum does along a contiguous axis), its identity
 * 0 added first. */
static float pairwise(const float *a, int64_t n) {
    if (n < 8) {
        float s = -0.0f;
        for (int64_t i = 0; i < n; i++) s += a[i];
        return s;
    }
    if (n <= 128) {
        float r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        int64_t i = 8;
        for (; i < n - n % 8; i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) s += a[i];
        return s;
    }
    int64_t half = n / 2;
    half -= half % 8;
    return pairwise(a, half) + pairwise(a + half, n - half);
}

static float numpy_sum(const float *a, int64_t n) { return 0.0f + pairwise(a, n); }

/* Token t's experts chosen[k] (ascending) and weights[k] from its logits (E): route() of moe.py.
 * probs (E) and taken (E) are scratch. */
static void route(const float *logits, int64_t e, int64_t k, int norm, float *probs, unsigned char *taken,
                  int64_t *chosen, float *weights) {
    float top = logits[0];
    for (int64_t i = 1; i < e; i++)
        if (logits[i] > top || logits[i] != logits[i]) top = logits[i];
    for (int64_t i = 0; i < e; i++) probs[i] = numpy_expf(logits[i] - top);
    const float total = numpy_sum(probs, e);
    for (int64_t i = 0; i < e; i++) probs[i] /= total;
    /* the k largest, ties to the lower index (a stable sort of -probs), then in ascending order */
    memset(taken, 0, (size_t)e);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++)
            if (!taken[i] && (best < 0 || -probs[i] < -probs[best])) best = i;
        chosen[j] = best;
        taken[best] = 1;
    }
    for (int64_t j = 1; j < k; j++) /* insertion sort: k is small */
        for (int64_t l = j; l > 0 && chosen[l - 1] > chosen[l]; l--) {
            const int64_t c = chosen[l];
            chosen[l] = chosen[l - 1];
            chosen[l - 1] = c;
        }
    for (int64_t j = 0; j < k; j++) weights[j] = probs[chosen[j]];
    if (norm) {
        const float s = numpy_sum(weights, k);
        for (int64_t j = 0; j < k; j++) weights[j] /= s;
    }
}

static int64_t row_bytes(int64_t type, int64_t k) {
    const int elems = llaisys_quant_block_size((int)type), bytes = llaisys_quant_block_bytes((int)type);
    if (elems <= 0 || bytes <= 0) return LM_ERR_TYPE;
    return k % elems ? LM_ERR_SHAPE : k / elems * bytes;
}

/* The index of GGML type `type` in the kernel tables. */
static int table_index(int64_t type) {
    switch (type) {
    case LQ_F32: return IX_F32;
    case LQ_F16: return IX_F16;
    case LQ_BF16: return IX_BF16;
    case LQ_Q4_0: return IX_Q4_0;
    case LQ_Q4_1: return IX_Q4_1;
    case LQ_Q5_0: return IX_Q5_0;
    case LQ_Q5_1: return IX_Q5_1;
    case LQ_Q8_0: return IX_Q8_0;
    case LQ_Q4_K: return IX_Q4_K;
    case LQ_Q5_K: return IX_Q5_K;
    default: return IX_Q6_K;
    }
}

/* The kernel table quant.c uses now (its SIMD level, by name). */
static const lq_kernels *active_kernels(void) {
    const char *name = llaisys_quant_simd_level();
    const lq_kernels *k = strcmp(name, "avx512") == 0 ? lq_kernels_avx512()
                          : strcmp(name, "avx2") == 0 ? lq_kernels_avx2() : NULL;
    return k ? k : &lq_kernels_scalar;
}

/* The products of all chosen experts as one job of the thread pool (two: gate and up, then
 * down), for groups of at most dotm_max tokens (decoding): each chunk is a range of rows of
 * one expert's matrix through the level's dot / dotm kernels, what llaisys_quant_linear runs
 * for such calls, so the same bits (rows are never split along K), with one wake of the pool
 * rather than one per product. */
typedef struct {
    const lq_kernels *kern;
    const uint8_t *w[3];      /* gate, up, down: all experts' encoded rows */
    int64_t rb[3];            /* their row bytes */
    int ix[3];                /* their kernel table index */
    const int64_t *expert, *rows, *first; /* per group: the expert, its tokens, its first buffer row */
    int64_t groups, d, inter, ldd, ldi;   /* ldd, ldi: buffer row strides for D and I wide rows */
    const float *x;           /* (R, ldd) the groups' tokens */
    float *g, *u;             /* (R, ldi) gate and up products */
    const float *act;         /* (R, ldi) their SwiGLU */
    float *y;                 /* (R, ldd) down products */
    int down;                 /* 0: gate and up; 1: down */
    int64_t per_chunk, blocks; /* rows of W per chunk, chunks per (group, matrix) */
} products_job;

static void products_chunk(void *arg, size_t chunk, int thread) {
    (void)thread;
    const products_job *p = arg;
    const int64_t pair = (int64_t)chunk / p->blocks, block = (int64_t)chunk % p->blocks;
    const int64_t grp = p->down ? pair : pair / 2;
    const int mat = p->down ? 2 : (int)(pair % 2);
    const int64_t n = mat == 2 ? p->d : p->inter, k = mat == 2 ? p->inter : p->d;
    const int64_t r0 = block * p->per_chunk, r1 = r0 + p->per_chunk < n ? r0 + p->per_chunk : n;
    const int64_t m = p->rows[grp], row = p->first[grp];
    const float *x = mat == 2 ? p->act + row * p->ldi : p->x + row * p->ldd;
    const int64_t ldx = mat == 2 ? p->ldi : p->ldd, ldy = mat == 2 ? p->ldd : p->ldi;
    float *y = (mat == 0 ? p->g : mat == 1 ? p->u : p->y) + row * ldy;
    const uint8_t *w = p->w[mat] + p->expert[grp] * n * p->rb[mat];
    const int64_t tile = p->kern->dot_rows;
    for (int64_t t0 = r0; t0 < r1; t0 += tile) {
        const size_t rows = (size_t)(r1 - t0 < tile ? r1 - t0 : tile);
        if (m == 1)
            p->kern->dot[p->ix[mat]](w + t0 * p->rb[mat], (size_t)p->rb[mat], rows, x, (size_t)k, y + t0, NULL);
        else
            p->kern->dotm[p->ix[mat]](w + t0 * p->rb[mat], (size_t)p->rb[mat], rows, x, (size_t)ldx, (size_t)m,
                                      (size_t)k, y + t0, (size_t)ldy, NULL);
    }
}

/* Run one stage of the job on the pool: rows of W per chunk as quant.c sizes them (about 2^17
 * multiply-adds), on one thread while the weights read are few (LQ_SERIAL_BYTES). */
static void run_products(products_job *p, int down, int64_t max_rows) {
    const int64_t n = down ? p->d : p->inter, k = down ? p->inter : p->d, tile = p->kern->dot_rows;
    int64_t per = ((int64_t)1 << 17) / (k * max_rows);
    per = (per + tile - 1) / tile * tile;
    if (per < tile) per = tile;
    if (per > n) per = n;
    p->down = down;
    p->per_chunk = per;
    p->blocks = (n + per - 1) / per;
    const int mats = down ? 1 : 2;
    size_t bytes = 0;
    for (int mat = down ? 2 : 0; mat < (down ? 3 : 2); mat++) bytes += (size_t)(p->groups * n * p->rb[mat]);
    const int slots = bytes < LQ_SERIAL_BYTES ? 1 : lq_pool_threads();
    lq_pool_run(products_chunk, p, (size_t)(p->groups * mats * p->blocks), slots);
}

static void *alloc_aligned(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) == 0 ? p : NULL;
}

LQ_EXPORT int llaisys_moe_mlp(const lm_moe_args *a) {
    const int64_t n = a->n, d = a->d, e = a->e, inter = a->inter, k = a->top_k;
    if (n <= 0) return LM_OK;
    if (d <= 0 || e <= 0 || inter <= 0 || k < 1 || k > e || !a->swiglu) return LM_ERR_SHAPE;
    const int64_t types[3] = {a->gate_type, a->up_type, a->down_type};
    int64_t rb[3];
    for (int i = 0; i < 3; i++)
        if ((rb[i] = row_bytes(types[i], i == 2 ? inter : d)) < 0) return (int)rb[i];
    /* integers: chosen (N*k), the grouped slots (N*k), per group expert, rows, first row (E each) */
    const int64_t nk = n * k, ldd = (d + 15) / 16 * 16, ldi = (inter + 15) / 16 * 16;
    int64_t *ints = malloc((size_t)(2 * nk + 3 * e) * sizeof(int64_t));
    float *small = malloc((size_t)(nk + e) * sizeof(float) + (size_t)e); /* weights (N*k), probs, taken (E) */
    if (!ints || !small) {
        free(ints);
        free(small);
        return LM_ERR_MEMORY;
    }
    int64_t *chosen = ints, *slots = ints + nk, *expert = slots + nk, *rows = expert + e, *first = rows + e;
    float *weights = small, *probs = small + nk;
    unsigned char *taken = (unsigned char *)(probs + e);
    for (int64_t t = 0; t < n; t++)
        route(a->logits + t * a->ldl, e, k, (int)a->norm, probs, taken, chosen + t * k, weights + t * k);
    /* groups: the experts chosen, ascending, each with its slots t*k + j, tokens ascending (a
     * counting sort; `first` counts, then where each expert's run begins, then its end) */
    memset(first, 0, (size_t)e * sizeof(int64_t));
    for (int64_t s = 0; s < nk; s++) first[chosen[s]]++;
    int64_t groups = 0, most = 0;
    for (int64_t ex = 0, start = 0; ex < e; ex++) {
        const int64_t m = first[ex];
        first[ex] = start;
        start += m;
        most = m > most ? m : most;
    }
    for (int64_t s = 0; s < nk; s++) slots[first[chosen[s]]++] = s;
    for (int64_t ex = 0, start = 0; ex < e; ex++) { /* first[ex] is now where run ex ends */
        const int64_t m = first[ex] - start;
        if (m) {
            expert[groups] = ex, rows[groups] = m, first[groups] = start;
            groups++;
        }
        start += m;
    }
    const lq_kernels *kern = active_kernels();
    int together = most <= kern->dotm_max;
    for (int i = 0; i < 3; i++) {
        const int ix = table_index(types[i]);
        together &= kern->dot[ix] != NULL && (most < 2 || kern->dotm[ix] != NULL);
    }
    /* buffers: total (N, D); x, y rows of D and g, u, act rows of I, for every slot when the
     * products run together, else for the largest group */
    const int64_t held = together ? nk : most;
    float *total = alloc_aligned((size_t)(n * d + held * (2 * ldd + 3 * ldi)) * sizeof(float));
    if (!total) {
        free(ints);
        free(small);
        return LM_ERR_MEMORY;
    }
    float *x = total + n * d, *y = x + held * ldd, *g = y + held * ldd, *u = g + held * ldi, *act = u + held * ldi;
    memset(total, 0, (size_t)(n * d) * sizeof(float));
    int status = LM_OK;
    if (together) {
        for (int64_t r = 0; r < nk; r++)
            memcpy(x + r * ldd, a->h + slots[r] / k * a->ldh, (size_t)d * sizeof(float));
        products_job p = {.kern = kern, .w = {a->gate, a->up, a->down}, .rb = {rb[0], rb[1], rb[2]},
                          .expert = expert, .rows = rows, .first = first, .groups = groups, .d = d,
                          .inter = inter, .ldd = ldd, .ldi = ldi, .x = x, .g = g, .u = u, .act = act, .y = y};
        for (int i = 0; i < 3; i++) p.ix[i] = table_index(types[i]);
        run_products(&p, 0, most);
        const lo_swiglu_args sa = {act, ldi, g, ldi, u, ldi, nk, inter};
        status = a->swiglu(&sa);
        if (status == LM_OK) run_products(&p, 1, most);
    }
    for (int64_t grp = 0; grp < groups && status == LM_OK; grp++) {
        const int64_t m = rows[grp], ex = expert[grp], *gs = slots + first[grp];
        float *gy = together ? y + first[grp] * ldd : y;
        if (!together) { /* one group at a time through the f32 linear */
            for (int64_t r = 0; r < m; r++) memcpy(x + r * ldd, a->h + gs[r] / k * a->ldh, (size_t)d * sizeof(float));
            const uint8_t *gw = (const uint8_t *)a->gate + ex * inter * rb[0];
            const uint8_t *uw = (const uint8_t *)a->up + ex * inter * rb[1];
            const uint8_t *dw = (const uint8_t *)a->down + ex * d * rb[2];
            status = lq_linear_f32((int)types[0], gw, inter, d, x, ldd, m, g, ldi, NULL);
            if (status == LM_OK)
                status = lq_linear_f32((int)types[1], uw, inter, d, x, ldd, m, u, ldi, NULL);
            if (status != LM_OK) break;
            const lo_swiglu_args sa = {act, ldi, g, ldi, u, ldi, m, inter};
            if ((status = a->swiglu(&sa)) != LM_OK) break;
            if ((status = lq_linear_f32((int)types[2], dw, d, inter, act, ldi, m, y, ldd, NULL)) != LM_OK) break;
        }
        for (int64_t r = 0; r < m; r++) { /* each token adds its experts in ascending order */
            float *dst = total + gs[r] / k * d;
            const float w = weights[gs[r]], *src = gy + r * ldd;
            for (int64_t j = 0; j < d; j++) dst[j] += src[j] * w;
        }
    }
    if (status == LM_OK)
        for (int64_t t = 0; t < n; t++) memcpy(a->out + t * a->ldo, total + t * d, (size_t)d * sizeof(float));
    free(total);
    free(small);
    free(ints);
    return status;
}

/* llaisys_moe_mlp for a replayed list of calls (csrc/ops: llaisys_ops_run): the block is the
 * argument struct itself. */
LQ_EXPORT int llaisys_moe_mlp_call(const void *block) { return llaisys_moe_mlp(block); }
