/* The argument blocks of plugin_calls.c: a plugin kernel's call and a plugin's synchronous
 * copy inside a replayed stretch, and the descriptor fields a pass moves with the position.
 * Mirrored by ctypes Structures in src/llaisys/_native/structs.py (checked against layouts.c). */
#ifndef LLAISYS_OPS_PLUGIN_CALLS_H
#define LLAISYS_OPS_PLUGIN_CALLS_H

#include "llaisys/kernel_ext.h"

#include "ops.h"

typedef struct {
    LlaisysKernelFn fn;
    C_Device device;
    const LlaisysTensorDesc *const *outputs;
    size_t num_outputs;
    const LlaisysTensorDesc *const *inputs;
    size_t num_inputs;
    const LlaisysKernelAttr *attrs;
    size_t num_attrs;
} lo_plugin_kernel_call;

typedef C_Status (*lo_plugin_copy_fn)(const C_Device device, void *dst, const void *src, size_t size);

typedef struct {
    lo_plugin_copy_fn fn; /* memory_copy_h2d or memory_copy_d2h */
    C_Device device;
    void *dst;
    const void *src;
    size_t nbytes;
} lo_plugin_copy_call;

/* One 8-byte field of a recorded call's descriptors (a data pointer or a dimension) that
 * depends on where in the sequence a pass runs: base + per_start * start + per_end * end.
 * A decoding step over a contiguous cache moves its cache rows this way every token; one
 * call rewrites them all instead of a rebind per call from Python. */
typedef struct {
    void *field;
    int64_t base;
    int64_t per_start;
    int64_t per_end;
} lo_row_field;

#endif
