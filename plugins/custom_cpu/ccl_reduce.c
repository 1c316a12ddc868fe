/*
 * Element-wise reductions of the ranks' staged buffers. Elements go through an accumulator
 * block: double for the floating types (FLOAT16, BFLOAT16 and FLOAT32 are rounded back once,
 * at the end), 64-bit two's complement for the integers (signed ones sign-extended), so that
 * one loop per operation serves every type.
 */
#include <math.h>
#include <string.h>

#include "custom_cpu.h"

#define BLOCK 256 /* elements per accumulator block */

static int is_float(C_DataType t) {
  return t == FLOAT16 || t == BFLOAT16 || t == FLOAT32 || t == FLOAT64;
}

static int is_signed_int(C_DataType t) {
  return t == INT8 || t == INT16 || t == INT32 || t == INT64;
}

static int is_unsigned_int(C_DataType t) {
  return t == UINT8 || t == UINT16 || t == UINT32 || t == UINT64;
}

int cc_reducible(C_DataType dtype, C_CCLReduceOp op) {
  return op >= SUM && op <= PRODUCT &&
         (is_float(dtype) || is_signed_int(dtype) || is_unsigned_int(dtype));
}

/* ---- 16-bit floating types ------------------------------------------------------------------ */

static float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
  if (exp) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  float sub = ldexpf((float)man, -24); /* zero or subnormal */
  return sign ? -sub : sub;
}

static float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

/* The bits of `x` rounded (to nearest, ties to even) to a 16-bit binary format with `man`
   mantissa and `exp` exponent bits: FLOAT16 is (10, 5), BFLOAT16 (7, 8). Rounding straight
   from double, not through float, as a sum's low bits may decide a tie. */
static uint16_t round_to_16(double x, int man, int exp) {
  int bias = (1 << (exp - 1)) - 1, drop = 52 - man;
  uint16_t sign = signbit(x) ? 0x8000u : 0, inf = (uint16_t)(((1u << exp) - 1) << man);
  double a = fabs(x);
  if (isnan(a)) return sign | inf | (uint16_t)(1u << (man - 1));
  if (a >= ldexp(2.0 - ldexp(1.0, -man - 1), bias)) return sign | inf; /* max + half an ulp */
  if (a < ldexp(1.0, 1 - bias)) /* subnormal: a count of the smallest step */
    return sign | (uint16_t)nearbyint(ldexp(a, bias - 1 + man));
  uint64_t u;
  memcpy(&u, &a, sizeof u);
  u += ((uint64_t)1 << (drop - 1)) - 1 + ((u >> drop) & 1);
  return sign | (uint16_t)((u - ((uint64_t)(1023 - bias) << 52)) >> drop);
}

/* ---- loading into and storing from accumulators ------------------------------------------- */

static void load_float(C_DataType t, const void *p, size_t n, double *out) {
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case FLOAT16: out[i] = half_to_float(((const uint16_t *)p)[i]); break;
      case BFLOAT16: out[i] = bf16_to_float(((const uint16_t *)p)[i]); break;
      case FLOAT32: out[i] = ((const float *)p)[i]; break;
      default: out[i] = ((const double *)p)[i]; break;
    }
  }
}

static void store_float(C_DataType t, void *p, size_t n, const double *in) {
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case FLOAT16: ((uint16_t *)p)[i] = round_to_16(in[i], 10, 5); break;
      case BFLOAT16: ((uint16_t *)p)[i] = round_to_16(in[i], 7, 8); break;
      case FLOAT32: ((float *)p)[i] = (float)in[i]; break;
      default: ((double *)p)[i] = in[i]; break;
    }
  }
}

static void load_int(C_DataType t, const void *p, size_t n, uint64_t *out) {
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case INT8: out[i] = (uint64_t)(int64_t)((const int8_t *)p)[i]; break;
      case INT16: out[i] = (uint64_t)(int64_t)((const int16_t *)p)[i]; break;
      case INT32: out[i] = (uint64_t)(int64_t)((const int32_t *)p)[i]; break;
      case UINT8: out[i] = ((const uint8_t *)p)[i]; break;
      case UINT16: out[i] = ((const uint16_t *)p)[i]; break;
      case UINT32: out[i] = ((const uint32_t *)p)[i]; break;
      default: out[i] = ((const uint64_t *)p)[i]; break; /* INT64, UINT64 */
    }
  }
}

static void store_int(C_DataType t, void *p, size_t n, const uint64_t *in) {
  size_t item = cc_dtype_size(t);
  for (size_t i = 0; i < n; ++i) {
    switch (item) { /* truncation keeps the low bits: the wrapped result */
      case 1: ((uint8_t *)p)[i] = (uint8_t)in[i]; break;
      case 2: ((uint16_t *)p)[i] = (uint16_t)in[i]; break;
      case 4: ((uint32_t *)p)[i] = (uint32_t)in[i]; break;
      default: ((uint64_t *)p)[i] = in[i]; break;
    }
  }
}

/* ---- combining -------------------------------------------------------------------------- */

static void combine_float(C_CCLReduceOp op, double *acc, const double *x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case SUM: case AVG: acc[i] += x[i]; break;
      case PRODUCT: acc[i] *= x[i]; break;
      case MAX: if (x[i] > acc[i] || isnan(x[i])) acc[i] = x[i]; break; /* NaN wins */
      case MIN: if (x[i] < acc[i] || isnan(x[i])) acc[i] = x[i]; break;
    }
  }
}

static int int_less(int is_signed, uint64_t a, uint64_t b) {
  return is_signed ? (int64_t)a < (int64_t)b : a < b;
}

static void combine_int(C_CCLReduceOp op, int is_signed, uint64_t *acc, const uint64_t *x,
                        size_t n) {
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case SUM: case AVG: acc[i] += x[i]; break;
      case PRODUCT: acc[i] *= x[i]; break;
      case MAX: if (int_less(is_signed, acc[i], x[i])) acc[i] = x[i]; break;
      case MIN: if (int_less(is_signed, x[i], acc[i])) acc[i] = x[i]; break;
    }
  }
}

static void reduce_float(C_DataType t, C_CCLReduceOp op, unsigned char *dst,
                         const void *const *src, size_t nsrc, size_t n) {
  size_t item = cc_dtype_size(t);
  double acc[BLOCK], x[BLOCK];
  for (size_t i = 0; i < n; i += BLOCK) {
    size_t m = n - i < BLOCK ? n - i : BLOCK;
    load_float(t, (const unsigned char *)src[0] + i * item, m, acc);
    for (size_t s = 1; s < nsrc; ++s) {
      load_float(t, (const unsigned char *)src[s] + i * item, m, x);
      combine_float(op, acc, x, m);
    }
    if (op == AVG)
      for (size_t j = 0; j < m; ++j) acc[j] /= (double)nsrc;
    store_float(t, dst + i * item, m, acc);
  }
}

static void reduce_int(C_DataType t, C_CCLReduceOp op, unsigned char *dst, const void *const *src,
                       size_t nsrc, size_t n) {
  size_t item = cc_dtype_size(t);
  int is_signed = is_signed_int(t);
  uint64_t acc[BLOCK], x[BLOCK];
  for (size_t i = 0; i < n; i += BLOCK) {
    size_t m = n - i < BLOCK ? n - i : BLOCK;
    load_int(t, (const unsigned char *)src[0] + i * item, m, acc);
    for (size_t s = 1; s < nsrc; ++s) {
      load_int(t, (const unsigned char *)src[s] + i * item, m, x);
      combine_int(op, is_signed, acc, x, m);
    }
    if (op == AVG)
      for (size_t j = 0; j < m; ++j)
        acc[j] = is_signed ? (uint64_t)((int64_t)acc[j] / (int64_t)nsrc) : acc[j] / nsrc;
    store_int(t, dst + i * item, m, acc);
  }
}

void cc_reduce(C_DataType dtype, C_CCLReduceOp op, void *dst, const void *const *src, size_t nsrc,
               size_t n) {
  if (is_float(dtype))
    reduce_float(dtype, op, (unsigned char *)dst, src, nsrc, n);
  else
    reduce_int(dtype, op, (unsigned char *)dst, src, nsrc, n);
}
