/*
 * Kernels registered through kernel_ext.h: the nine llaisys ops in float32 (rearrange in
 * every type), plus blas_axpby of the device interface. They accept strided tensors. A
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
  static const C_DataType every_type[] = {BOOL,    UINT8,   UINT16,  UINT32,    UINT64,
                                          INT8,    INT16,   INT32,   INT64,     FLOAT16,
                                          FLOAT32, FLOAT64, BFLOAT16, COMPLEX64, COMPLEX128};
  for (size_t i = 0; i < sizeof every_type / sizeof every_type[0]; ++i)
    LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, rearrange, custom_cpu, ALL_LAYOUT, k_rearrange,
                                   every_type[i]);
  return C_SUCCESS;
}
