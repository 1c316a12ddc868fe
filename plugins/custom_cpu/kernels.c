/*
 * Kernels registered through kernel_ext.h: the nine llaisys ops in float32 (rearrange in
 * every type), the paged KV-cache ops (kv_cache_write, paged_attention and its sliding-window
 * form) in float32, plus blas_axpby of the device interface. They accept strided tensors. A
 * kernel given a stream first waits for it, then runs on the calling thread, so it has
 * finished when it returns either way.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "custom_cpu.h"

typedef const LlaisysTensorDesc *Desc;

static int64_t numel(Desc t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}

static int is_contiguous(Desc t) {
  int64_t expected = 1;
  for (int32_t d = t->ndim - 1; d >= 0; --d) {
    if (t->shape[d] != 1 && t->strides[d] != expected) return 0;
    expected *= t->shape[d];
  }
  return 1;
}

/* Element offset (in elements) of row-major index `i` over the first `ndim` dims of `t`. */
static int64_t offset_of(Desc t, int32_t ndim, int64_t i) {
  int64_t off = 0;
  for (int32_t d = ndim - 1; d >= 0; --d) {
    off += (i % t->shape[d]) * t->strides[d];
    i /= t->shape[d];
  }
  return off;
}

/* Element offset in `t` of the element at row-major index `i` of `shape_of`. */
static int64_t offset_like(Desc t, Desc shape_of, int64_t i) {
  int64_t off = 0;
  for (int32_t d = shape_of->ndim - 1; d >= 0; --d) {
    off += (i % shape_of->shape[d]) * t->strides[d];
    i /= shape_of->shape[d];
  }
  return off;
}

static int all_f32(Desc const *ts, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (ts[i] && ts[i]->dtype != FLOAT32) return 0;
  return 1;
}

#define KERNEL(name)                                                                        \
  static C_Status name(const C_Device device, C_Stream stream, Desc const *outs, size_t nout, \
                       Desc const *ins, size_t nin, const LlaisysKernelAttr *attrs,          \
                       size_t nattr)

/* Checks shared by every kernel: the device, the arity and (for f32 kernels) the dtypes. */
#define PROLOGUE(n_out, n_in, f32_only)                                            \
  (void)attrs, (void)nattr;                                                        \
  if (!cc_valid_device(device) || nout != (n_out) || nin != (n_in)) return C_ERROR; \
  if ((f32_only) && (!all_f32(outs, nout) || !all_f32(ins, nin))) return C_ERROR;  \
  if (stream) cc_synchronize_stream(device, stream)

KERNEL(k_add) {
  PROLOGUE(1, 2, 1);
  Desc c = outs[0], a = ins[0], b = ins[1];
  float *pc = (float *)c->data;
  const float *pa = (const float *)a->data, *pb = (const float *)b->data;
  int64_t n = numel(c);
  if (is_contiguous(c) && is_contiguous(a) && is_contiguous(b)) {
    for (int64_t i = 0; i < n; ++i) pc[i] = pa[i] + pb[i];
  } else {
    for (int64_t i = 0; i < n; ++i)
      pc[offset_like(c, c, i)] = pa[offset_like(a, c, i)] + pb[offset_like(b, c, i)];
  }
  return C_SUCCESS;
}

KERNEL(k_swiglu) {
  PROLOGUE(1, 2, 1);
  Desc out = outs[0], gate = ins[0], up = ins[1];
  float *po = (float *)out->data;
  const float *pg = (const float *)gate->data, *pu = (const float *)up->data;
  int64_t n = numel(out);
  if (is_contiguous(out) && is_contiguous(gate) && is_contiguous(up)) {
    for (int64_t i = 0; i < n; ++i) po[i] = pu[i] * (pg[i] / (1.0f + expf(-pg[i])));
    return C_SUCCESS;
  }
  for (int64_t i = 0; i < n; ++i) {
    float g = pg[offset_like(gate, out, i)];
    po[offset_like(out, out, i)] = pu[offset_like(up, out, i)] * (g / (1.0f + expf(-g)));
  }
  return C_SUCCESS;
}

KERNEL(k_rms_norm) {
  PROLOGUE(1, 2, 1);
  Desc out = outs[0], x = ins[0], w = ins[1];
  if (x->ndim < 1) return C_ERROR;
  float eps = (float)llaisys_kernel_attr(attrs, nattr, "eps", 1e-6);
  int32_t last = x->ndim - 1;
  int64_t dim = x->shape[last], rows = dim ? numel(x) / dim : 0;
  const float *px = (const float *)x->data, *pw = (const float *)w->data;
  float *po = (float *)out->data;
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = px + offset_of(x, last, r);
    float *orow = po + offset_of(out, last, r);
    double ss = 0.0;
    for (int64_t j = 0; j < dim; ++j) {
      double v = xr[j * x->strides[last]];
      ss += v * v;
    }
    float inv = (float)(1.0 / sqrt(ss / (double)dim + eps));
    for (int64_t j = 0; j < dim; ++j)
      orow[j * out->strides[last]] = xr[j * x->strides[last]] * inv * pw[j * w->strides[0]];
  }
  return C_SUCCESS;
}

KERNEL(k_rearrange) {
  PROLOGUE(1, 1, 0);
  Desc out = outs[0], in = ins[0];
  size_t item = cc_dtype_size(out->dtype);
  if (!item || in->dtype != out->dtype) return C_ERROR;
  int64_t n = numel(out);
  char *po = (char *)out->data;
  const char *pi = (const char *)in->data;
  if (is_contiguous(out) && is_contiguous(in)) {
    memmove(po, pi, (size_t)n * item);
    return C_SUCCESS;
  }
  for (int64_t i = 0; i < n; ++i)
    memcpy(po + offset_like(out, out, i) * (int64_t)item, pi + offset_like(in, out, i) * (int64_t)item,
           item);
  return C_SUCCESS;
}

KERNEL(k_embedding) {
  PROLOGUE(1, 2, 0);
  Desc out = outs[0], index = ins[0], weight = ins[1];
  if (out->dtype != FLOAT32 || weight->dtype != FLOAT32 || index->dtype != INT64) return C_ERROR;
  const int64_t *pi = (const int64_t *)index->data;
  const float *pw = (const float *)weight->data;
  float *po = (float *)out->data;
  int64_t rows = weight->shape[0], dim = weight->shape[1];
  for (int64_t s = 0; s < index->shape[0]; ++s) {
    int64_t id = pi[s * index->strides[0]];
    if (id < 0 || id >= rows) return C_ERROR;
    for (int64_t j = 0; j < dim; ++j)
      po[s * out->strides[0] + j * out->strides[1]] =
          pw[id * weight->strides[0] + j * weight->strides[1]];
  }
  return C_SUCCESS;
}

KERNEL(k_argmax) {
  PROLOGUE(2, 1, 0);
  Desc idx = outs[0], val = outs[1], vals = ins[0];
  if (idx->dtype != INT64 || val->dtype != FLOAT32 || vals->dtype != FLOAT32 || vals->ndim < 1)
    return C_ERROR;
  int32_t last = vals->ndim - 1;
  int64_t n = vals->shape[last], rows = n ? numel(vals) / n : 0;
  const float *pv = (const float *)vals->data;
  for (int64_t r = 0; r < rows; ++r) {
    const float *row = pv + offset_of(vals, last, r);
    int64_t best = 0;
    float best_v = row[0];
    for (int64_t j = 1; j < n && !isnan(best_v); ++j) {
      float v = row[j * vals->strides[last]];
      if (v > best_v || isnan(v)) best = j, best_v = v; /* NaN wins, as in NumPy */
    }
    ((int64_t *)idx->data)[offset_of(idx, idx->ndim, r)] = best;
    ((float *)val->data)[offset_of(val, val->ndim, r)] = best_v;
  }
  return C_SUCCESS;
}

KERNEL(k_linear) {
  PROLOGUE(1, 3, 1);
  Desc out = outs[0], x = ins[0], w = ins[1], bias = ins[2];
  int32_t xl = x->ndim - 1, ol = out->ndim - 1;
  int64_t k_dim = w->shape[1], n_dim = w->shape[0];
  int64_t m_dim = k_dim ? numel(x) / k_dim : numel(out) / (n_dim ? n_dim : 1);
  const float *px = (const float *)x->data, *pw = (const float *)w->data;
  const float *pb = bias ? (const float *)bias->data : NULL;
  float *po = (float *)out->data;
  for (int64_t m = 0; m < m_dim; ++m) {
    const float *xr = px + offset_of(x, xl, m);
    float *orow = po + offset_of(out, ol, m);
    for (int64_t n = 0; n < n_dim; ++n) {
      const float *wr = pw + n * w->strides[0];
      double acc = pb ? pb[n * bias->strides[0]] : 0.0;
      for (int64_t k = 0; k < k_dim; ++k)
        acc += (double)xr[k * x->strides[xl]] * wr[k * w->strides[1]];
      orow[n * out->strides[ol]] = (float)acc;
    }
  }
  return C_SUCCESS;
}

KERNEL(k_rope) {
  PROLOGUE(1, 2, 0);
  Desc out = outs[0], x = ins[0], pos = ins[1];
  if (out->dtype != FLOAT32 || x->dtype != FLOAT32 || pos->dtype != INT64 || x->ndim != 3)
    return C_ERROR;
  double theta = llaisys_kernel_attr(attrs, nattr, "theta", 10000.0);
  int64_t seq = x->shape[0], heads = x->shape[1], dim = x->shape[2], half = dim / 2;
  const float *px = (const float *)x->data;
  const int64_t *pp = (const int64_t *)pos->data;
  float *po = (float *)out->data;
  for (int64_t s = 0; s < seq; ++s) {
    double p = (double)pp[s * pos->strides[0]];
    for (int64_t j = 0; j < half; ++j) {
      double angle = p * pow(theta, -(double)(2 * j) / (double)dim);
      float c = (float)cos(angle), sn = (float)sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        const float *xv = px + s * x->strides[0] + h * x->strides[1];
        float *ov = po + s * out->strides[0] + h * out->strides[1];
        float a = xv[j * x->strides[2]], b = xv[(j + half) * x->strides[2]];
        ov[j * out->strides[2]] = a * c - b * sn;
        ov[(j + half) * out->strides[2]] = b * c + a * sn;
      }
    }
  }
  return C_SUCCESS;
}

/* a . b over n elements in double: four interleaved partial sums (four independent chains of
   additions instead of one; a fixed order, so every call gives the same bits), then
   (s0 + s1) + (s2 + s3). */
static double dot_f64(const float *a, int64_t a_stride, const float *b, int64_t b_stride, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t d = 0;
  for (; d + 4 <= n; d += 4)
    for (int j = 0; j < 4; ++j) s[j] += (double)a[(d + j) * a_stride] * b[(d + j) * b_stride];
  for (; d < n; ++d) s[d % 4] += (double)a[d * a_stride] * b[d * b_stride];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

KERNEL(k_self_attention) {
  PROLOGUE(1, 3, 1);
  Desc out = outs[0], q = ins[0], k = ins[1], v = ins[2];
  float scale = (float)llaisys_kernel_attr(attrs, nattr, "scale", 1.0);
  int64_t seq = q->shape[0], heads = q->shape[1], dim = q->shape[2];
  int64_t total = k->shape[0], kv_heads = k->shape[1], dim_v = v->shape[2];
  if (kv_heads == 0 || heads % kv_heads || total < seq) return C_ERROR;
  int64_t group = heads / kv_heads;
  /* scores (total), then the output row's sums (dim_v) */
  double *p = (double *)malloc((size_t)(total + dim_v + 1) * sizeof *p), *acc = p + total;
  if (!p) return C_FAILED;
  const float *pq = (const float *)q->data, *pk = (const float *)k->data,
              *pv = (const float *)v->data;
  float *po = (float *)out->data;
  for (int64_t s = 0; s < seq; ++s) {
    int64_t visible = total - seq + s + 1; /* causal: keys 0 .. T - S + s */
    for (int64_t h = 0; h < heads; ++h) {
      int64_t kh = h / group;
      const float *qv = pq + s * q->strides[0] + h * q->strides[1];
      double top = -INFINITY, sum = 0.0;
      for (int64_t t = 0; t < visible; ++t) {
        const float *kv = pk + t * k->strides[0] + kh * k->strides[1];
        p[t] = dot_f64(qv, q->strides[2], kv, k->strides[2], dim) * scale;
        if (p[t] > top) top = p[t];
      }
      for (int64_t t = 0; t < visible; ++t) sum += p[t] = exp(p[t] - top);
      float *ov = po + s * out->strides[0] + h * out->strides[1];
      /* row by row of v (its memory order); each acc[d] still sums over t in order */
      for (int64_t d = 0; d < dim_v; ++d) acc[d] = 0.0;
      for (int64_t t = 0; t < visible; ++t) {
        const float *vr = pv + t * v->strides[0] + kh * v->strides[1];
        const double pt = p[t];
        if (v->strides[2] == 1)
          for (int64_t d = 0; d < dim_v; ++d) acc[d] += pt * vr[d];
        else
          for (int64_t d = 0; d < dim_v; ++d) acc[d] += pt * vr[d * v->strides[2]];
      }
      for (int64_t d = 0; d < dim_v; ++d) ov[d * out->strides[2]] = (float)(acc[d] / sum);
    }
  }
  free(p);
  return C_SUCCESS;
}

/* ---- the paged KV cache ------------------------------------------------------------------
 * One layer's pool holds NB blocks of BS token slots: k_cache (NB, BS, KH, D), v_cache
 * (NB, BS, KH, Dv). A call serves a flat batch of N query tokens from B sequences, sequence b
 * owning rows query_starts[b]:query_starts[b + 1], having context_lens[b] keys and finding
 * key p in block block_tables[b, p / BS], slot p % BS. Index tensors are INT64. */

static int is_i64(Desc t, int32_t ndim) { return t->dtype == INT64 && t->ndim == ndim; }

static int is_f32(Desc t, int32_t ndim) { return t->dtype == FLOAT32 && t->ndim == ndim; }

/* 1 when v_cache (NB, BS, KH, Dv) pairs with k_cache (NB, BS, KH, D). */
static int same_pool(Desc k_cache, Desc v_cache) {
  for (int32_t d = 0; d < 3; ++d)
    if (k_cache->shape[d] != v_cache->shape[d]) return 0;
  return 1;
}

/* outputs (k_cache, v_cache), inputs (k (N, KH, D), v (N, KH, Dv), slots (N,)): the row of
   token i goes to slot s = slots[i], block s / BS, offset s % BS. Every slot is checked
   before anything is written. */
KERNEL(k_kv_cache_write) {
  PROLOGUE(2, 3, 0);
  Desc kc = outs[0], vc = outs[1], k = ins[0], v = ins[1], slots = ins[2];
  if (!is_f32(kc, 4) || !is_f32(vc, 4) || !is_f32(k, 3) || !is_f32(v, 3) || !is_i64(slots, 1) ||
      !same_pool(kc, vc))
    return C_ERROR;
  int64_t nb = kc->shape[0], bs = kc->shape[1], kh = kc->shape[2], d = kc->shape[3];
  int64_t dv = vc->shape[3], n = slots->shape[0];
  if (k->shape[0] != n || k->shape[1] != kh || k->shape[2] != d || v->shape[0] != n ||
      v->shape[1] != kh || v->shape[2] != dv)
    return C_ERROR;
  const int64_t *ps = (const int64_t *)slots->data;
  for (int64_t i = 0; i < n; ++i)
    if (ps[i * slots->strides[0]] < 0 || ps[i * slots->strides[0]] >= nb * bs) return C_ERROR;
  const float *pk = (const float *)k->data, *pv = (const float *)v->data;
  float *pkc = (float *)kc->data, *pvc = (float *)vc->data;
  for (int64_t i = 0; i < n; ++i) {
    int64_t s = ps[i * slots->strides[0]], blk = s / bs, off = s % bs;
    for (int64_t h = 0; h < kh; ++h) {
      float *kd = pkc + blk * kc->strides[0] + off * kc->strides[1] + h * kc->strides[2];
      float *vd = pvc + blk * vc->strides[0] + off * vc->strides[1] + h * vc->strides[2];
      const float *ks = pk + i * k->strides[0] + h * k->strides[1];
      const float *vs = pv + i * v->strides[0] + h * v->strides[1];
      for (int64_t e = 0; e < d; ++e) kd[e * kc->strides[3]] = ks[e * k->strides[2]];
      for (int64_t e = 0; e < dv; ++e) vd[e * vc->strides[3]] = vs[e * v->strides[2]];
    }
  }
  return C_SUCCESS;
}

/* The operands of one paged attention call. */
typedef struct {
  Desc out, q, kc, vc, bt, qs, cl;
  int64_t n, h, kh, d, dv, nb, bs, b, mb;
} paged_args;

static int64_t at1(Desc t, int64_t i) { return ((const int64_t *)t->data)[i * t->strides[0]]; }

/* Fill `a` from the descriptors; 0 when a type, rank or shape does not fit the op. */
static int paged_shapes(paged_args *a, Desc const *outs, Desc const *ins) {
  a->out = outs[0], a->q = ins[0], a->kc = ins[1], a->vc = ins[2];
  a->bt = ins[3], a->qs = ins[4], a->cl = ins[5];
  if (!is_f32(a->out, 3) || !is_f32(a->q, 3) || !is_f32(a->kc, 4) || !is_f32(a->vc, 4) ||
      !is_i64(a->bt, 2) || !is_i64(a->qs, 1) || !is_i64(a->cl, 1) || !same_pool(a->kc, a->vc))
    return 0;
  a->n = a->q->shape[0], a->h = a->q->shape[1], a->d = a->q->shape[2];
  a->nb = a->kc->shape[0], a->bs = a->kc->shape[1], a->kh = a->kc->shape[2], a->dv = a->vc->shape[3];
  a->b = a->bt->shape[0], a->mb = a->bt->shape[1];
  return a->kc->shape[3] == a->d && a->kh > 0 && a->h % a->kh == 0 && a->bs > 0 &&
         a->out->shape[0] == a->n && a->out->shape[1] == a->h && a->out->shape[2] == a->dv &&
         a->qs->shape[0] == a->b + 1 && a->cl->shape[0] == a->b;
}

/* 1 when query_starts runs from 0 to N without going down, q_len <= context_lens[b] <=
   MB * BS, and every block a sequence with queries holds lies in [0, NB); *most_keys is the
   largest context length. */
static int paged_indices(const paged_args *a, int64_t *most_keys) {
  if (at1(a->qs, 0) != 0 || at1(a->qs, a->b) != a->n) return 0;
  *most_keys = 0;
  for (int64_t b = 0; b < a->b; ++b) {
    int64_t q_len = at1(a->qs, b + 1) - at1(a->qs, b), c = at1(a->cl, b);
    if (q_len < 0 || at1(a->qs, b + 1) > a->n || c < q_len || c > a->mb * a->bs) return 0;
    if (q_len == 0) continue;
    for (int64_t i = 0; i < (c + a->bs - 1) / a->bs; ++i) {
      int64_t blk = ((const int64_t *)a->bt->data)[b * a->bt->strides[0] + i * a->bt->strides[1]];
      if (blk < 0 || blk >= a->nb) return 0;
    }
    if (c > *most_keys) *most_keys = c;
  }
  return 1;
}

/* The row of KV head `kvh` at key position p of sequence b in pool `cache`. */
static const float *paged_row(const paged_args *a, Desc cache, int64_t b, int64_t p, int64_t kvh) {
  int64_t blk = ((const int64_t *)a->bt->data)[b * a->bt->strides[0] + (p / a->bs) * a->bt->strides[1]];
  return (const float *)cache->data + blk * cache->strides[0] + (p % a->bs) * cache->strides[1] +
         kvh * cache->strides[2];
}

/* out[i, h] for query row i of sequence b at position `pos`, over keys lo..pos: softmax of
   q . k * scale, then the weighted sum of v, in double; p holds (pos - lo + 1) + Dv doubles. */
static void paged_row_attention(const paged_args *a, int64_t b, int64_t i, int64_t h, int64_t lo,
                                int64_t pos, double scale, double *p) {
  int64_t kvh = h / (a->h / a->kh), count = pos - lo + 1;
  double *acc = p + count, top = -INFINITY, sum = 0.0;
  const float *qv = (const float *)a->q->data + i * a->q->strides[0] + h * a->q->strides[1];
  for (int64_t t = 0; t < count; ++t) {
    const float *kv = paged_row(a, a->kc, b, lo + t, kvh);
    p[t] = dot_f64(qv, a->q->strides[2], kv, a->kc->strides[3], a->d) * scale;
    if (p[t] > top) top = p[t];
  }
  for (int64_t t = 0; t < count; ++t) sum += p[t] = exp(p[t] - top);
  for (int64_t e = 0; e < a->dv; ++e) acc[e] = 0.0;
  for (int64_t t = 0; t < count; ++t) {
    const float *vr = paged_row(a, a->vc, b, lo + t, kvh);
    for (int64_t e = 0; e < a->dv; ++e) acc[e] += p[t] * vr[e * a->vc->strides[3]];
  }
  float *ov = (float *)a->out->data + i * a->out->strides[0] + h * a->out->strides[1];
  for (int64_t e = 0; e < a->dv; ++e) ov[e * a->out->strides[2]] = (float)(acc[e] / sum);
}

/* outputs (out (N, H, Dv)), inputs (q (N, H, D), k_cache, v_cache, block_tables (B, MB),
   query_starts (B+1,), context_lens (B,)): query j of sequence b (q_len queries, C keys) sits
   at position C - q_len + j and sees keys from max(0, position - window + 1) (0 without a
   window) to its position; query head h reads KV head h / (H / KH). */
static C_Status paged_attention(Desc const *outs, Desc const *ins, double scale, int64_t window) {
  paged_args a;
  int64_t most_keys;
  if (!paged_shapes(&a, outs, ins) || !paged_indices(&a, &most_keys)) return C_ERROR;
  double *p = (double *)malloc((size_t)(most_keys + a.dv + 1) * sizeof *p);
  if (!p) return C_FAILED;
  for (int64_t b = 0; b < a.b; ++b) {
    int64_t q0 = at1(a.qs, b), q1 = at1(a.qs, b + 1), c = at1(a.cl, b);
    for (int64_t i = q0; i < q1; ++i) {
      int64_t pos = c - (q1 - q0) + (i - q0), lo = window && pos - window + 1 > 0 ? pos - window + 1 : 0;
      for (int64_t h = 0; h < a.h; ++h) paged_row_attention(&a, b, i, h, lo, pos, scale, p);
    }
  }
  free(p);
  return C_SUCCESS;
}

KERNEL(k_paged_attention) {
  PROLOGUE(1, 6, 0);
  return paged_attention(outs, ins, llaisys_kernel_attr(attrs, nattr, "scale", 1.0), 0);
}

/* attrs scale and window (> 0: each query sees its last `window` keys, its own included). */
KERNEL(k_paged_attention_window) {
  PROLOGUE(1, 6, 0);
  double window = llaisys_kernel_attr(attrs, nattr, "window", 0.0);
  if (!(window >= 1.0)) return C_ERROR;
  return paged_attention(outs, ins, llaisys_kernel_attr(attrs, nattr, "scale", 1.0), (int64_t)window);
}

/* ---- blas_axpby of the device interface: y = alpha * x + beta * y (float32) ---------- */

typedef struct {
  size_t numel;
  float alpha, beta;
  const float *x;
  float *y;
} axpby_args;

static void run_axpby(void *p) {
  axpby_args *a = (axpby_args *)p;
  for (size_t i = 0; i < a->numel; ++i) a->y[i] = a->alpha * a->x[i] + a->beta * a->y[i];
}

C_Status cc_blas_axpby(const C_Device device, C_Stream stream, C_DataType dtype, size_t numel,
                       float alpha, void *x, float beta, void *y) {
  if (!cc_valid_device(device) || dtype != FLOAT32 || ((!x || !y) && numel)) return C_ERROR;
  axpby_args *a = (axpby_args *)malloc(sizeof *a);
  if (!a) return C_FAILED;
  a->numel = numel;
  a->alpha = alpha;
  a->beta = beta;
  a->x = (const float *)x;
  a->y = (float *)y;
  C_Status st = cc_stream_submit(stream, run_axpby, a);
  if (st != C_SUCCESS) free(a);
  return st;
}

/* ---- registration ---------------------------------------------------------------------- */

LLAISYS_PLUGIN_EXPORT C_Status InitPluginKernels(LlaisysKernelRegistrar *registrar) {
  if (!registrar || registrar->size < sizeof(LlaisysKernelRegistrar) ||
      registrar->abi_version != LLAISYS_KERNEL_ABI_VERSION)
    return C_ERROR;
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, add, custom_cpu, ALL_LAYOUT, k_add, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, swiglu, custom_cpu, ALL_LAYOUT, k_swiglu, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, rms_norm, custom_cpu, ALL_LAYOUT, k_rms_norm, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, embedding, custom_cpu, ALL_LAYOUT, k_embedding, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, argmax, custom_cpu, ALL_LAYOUT, k_argmax, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, linear, custom_cpu, ALL_LAYOUT, k_linear, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, rope, custom_cpu, ALL_LAYOUT, k_rope, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, self_attention, custom_cpu, ALL_LAYOUT,
                                 k_self_attention, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, kv_cache_write, custom_cpu, ALL_LAYOUT,
                                 k_kv_cache_write, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, paged_attention, custom_cpu, ALL_LAYOUT,
                                 k_paged_attention, FLOAT32);
  LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, paged_attention_window, custom_cpu, ALL_LAYOUT,
                                 k_paged_attention_window, FLOAT32);
  static const C_DataType every_type[] = {BOOL,    UINT8,   UINT16,  UINT32,    UINT64,
                                          INT8,    INT16,   INT32,   INT64,     FLOAT16,
                                          FLOAT32, FLOAT64, BFLOAT16, COMPLEX64, COMPLEX128};
  for (size_t i = 0; i < sizeof every_type / sizeof every_type[0]; ++i)
    LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, rearrange, custom_cpu, ALL_LAYOUT, k_rearrange,
                                   every_type[i]);
  return C_SUCCESS;
}
