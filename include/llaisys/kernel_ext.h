/*
 * kernel_ext.h: kernels a device plugin provides to llaisys (the C side of registering a
 * kernel by op name, backend, layout and data type).
 *
 * A plugin that has kernels exports, besides InitPlugin,
 *
 *     C_Status InitPluginKernels(LlaisysKernelRegistrar *registrar);
 *
 * which llaisys calls once, right after InitPlugin succeeded. It registers each kernel with
 * LLAISYS_REGISTER_PLUGIN_KERNEL (or registrar->register_kernel). Ops without a kernel on
 * the plugin's device run on the CPU with copies, so every kernel is optional.
 *
 * Every kernel has one signature: the device, a stream, the outputs, the inputs and the
 * scalar attributes. Tensors arrive in the order of the llaisys ops API (outputs first):
 *
 *   op              outputs              inputs                      attributes
 *   add             c                    a, b                        -
 *   argmax          max_idx (INT64), max_val   vals                  -
 *   embedding       out (S, D)           index (S,) INT64, weight (V, D)   -
 *   linear          out (..., N)         in (..., K), weight (N, K), bias (N,) or NULL   -
 *   rearrange       out                  in (same shape, any strides)      -
 *   rms_norm        out (..., D)         in (..., D), weight (D,)    eps
 *   rope            out (S, H, D)        in (S, H, D), pos_ids (S,) INT64  theta
 *   self_attention  attn_val (S, H, Dv)  q (S, H, D), k (T, KH, D), v (T, KH, Dv)   scale
 *   swiglu          out                  gate, up                    -
 *
 * The semantics are those of the llaisys ops (docs/plugins.md): llaisys has checked shapes
 * and dtypes before the call, so a kernel may trust them. Tensors may be strided views
 * (strides in elements, possibly 0 for broadcast dimensions); outputs do not overlap inputs
 * unless the op is elementwise and they are the same tensor. When `stream` is NULL the
 * kernel must have finished when it returns.
 *
 * A model's recorded passes call kernels from C, one after another with no Python between
 * them: the descriptors and attributes are built once and reused (rewritten in place when
 * the tensors of a call move), on the thread that replays the pass, with a NULL stream, as
 * a call from Python is. Register kernels under ALL_LAYOUT (or STRIDED): llaisys asks for
 * no other layout, so a kernel registered under NHWC, NCHW, NCDHW or NDHWC is refused.
 */
#ifndef LLAISYS_KERNEL_EXT_H
#define LLAISYS_KERNEL_EXT_H

#include "device_ext.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLAISYS_KERNEL_ABI_VERSION 1

/* One tensor as a kernel sees it. */
typedef struct LlaisysTensorDesc {
  void *data;             /* device pointer of element (0, ..., 0) */
  C_DataType dtype;       /* element type */
  int32_t ndim;           /* number of dimensions (0 for a scalar) */
  const int64_t *shape;   /* ndim sizes */
  const int64_t *strides; /* ndim strides, in elements */
} LlaisysTensorDesc;

/* One scalar attribute of an op, e.g. {"eps", 1e-6}. */
typedef struct LlaisysKernelAttr {
  const char *name;
  double value;
} LlaisysKernelAttr;

/* The uniform kernel signature. An absent optional input (linear's bias) is a NULL entry. */
typedef C_Status (*LlaisysKernelFn)(const C_Device device, C_Stream stream,
                                    const LlaisysTensorDesc *const *outputs, size_t num_outputs,
                                    const LlaisysTensorDesc *const *inputs, size_t num_inputs,
                                    const LlaisysKernelAttr *attrs, size_t num_attrs);

/* What llaisys hands InitPluginKernels. */
typedef struct LlaisysKernelRegistrar {
  size_t size;          /* sizeof(LlaisysKernelRegistrar) as llaisys compiled it */
  size_t abi_version;   /* LLAISYS_KERNEL_ABI_VERSION of llaisys */
  void *context;        /* opaque; pass it back to register_kernel */
  /* Register `fn` for (op_name, backend, layout, dtype); `backend` must be the plugin's
     device type. Returns C_ERROR for an unknown op, a foreign backend or a duplicate. */
  C_Status (*register_kernel)(void *context, const char *op_name, const char *backend,
                              C_DataLayout layout, C_DataType dtype, LlaisysKernelFn fn);
} LlaisysKernelRegistrar;

#if UINTPTR_MAX == 0xFFFFFFFFFFFFFFFFu && SIZE_MAX == 0xFFFFFFFFFFFFFFFFu
#ifdef __cplusplus
static_assert(sizeof(LlaisysTensorDesc) == 32, "LlaisysTensorDesc must be 32 bytes");
static_assert(sizeof(LlaisysKernelAttr) == 16, "LlaisysKernelAttr must be 16 bytes");
static_assert(sizeof(LlaisysKernelRegistrar) == 32, "LlaisysKernelRegistrar must be 32 bytes");
#else
_Static_assert(sizeof(LlaisysTensorDesc) == 32, "LlaisysTensorDesc must be 32 bytes");
_Static_assert(sizeof(LlaisysKernelAttr) == 16, "LlaisysKernelAttr must be 16 bytes");
_Static_assert(sizeof(LlaisysKernelRegistrar) == 32, "LlaisysKernelRegistrar must be 32 bytes");
#endif
#endif

/*
 * Register a kernel from inside InitPluginKernels, returning from it on failure, e.g.
 *     LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, rms_norm, custom_cpu, ALL_LAYOUT, my_rms_norm, FLOAT32);
 * op_name and backend are bare words, as in PD_REGISTER_PLUGIN_KERNEL.
 */
#define LLAISYS_REGISTER_PLUGIN_KERNEL(registrar, op_name, backend, layout, fn, dtype)      \
  do {                                                                                     \
    C_Status llaisys_status_ = (registrar)->register_kernel((registrar)->context, #op_name, \
                                                           #backend, layout, dtype, fn);   \
    if (llaisys_status_ != C_SUCCESS) return llaisys_status_;                              \
  } while (0)

/* The value of attribute `name`, or `fallback` when the call has none. */
static inline double llaisys_kernel_attr(const LlaisysKernelAttr *attrs, size_t num_attrs,
                                         const char *name, double fallback) {
  for (size_t i = 0; i < num_attrs; ++i) {
    const char *a = attrs[i].name, *b = name;
    while (*a && *a == *b) ++a, ++b;
    if (*a == *b) return attrs[i].value;
  }
  return fallback;
}

/* The optional kernel entry point a plugin exports. */
LLAISYS_PLUGIN_EXPORT C_Status InitPluginKernels(LlaisysKernelRegistrar *registrar);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LLAISYS_KERNEL_EXT_H */
