/* Calls into a device plugin from a replayed stretch of kernel calls (llaisys_ops_run): a
 * kernel registered through kernel_ext.h, and a synchronous host <-> device copy of the
 * plugin's C_DeviceInterface (the CPU fallback's copies of an op the plugin lacks).
 *
 * A plugin kernel has one signature, so one trampoline serves them all: its block holds the
 * function, the device and the descriptor arrays the binding (src/llaisys/plugins/kernels.py)
 * built when the plan was recorded. The status comes back as the plugin gave it (C_SUCCESS
 * is 0; C_WARNING, 1, stops the stretch so the binding can log it once and go on).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <string.h>
#include <time.h>

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

LO_EXPORT int llaisys_ops_plugin_kernel_call(const void *block) {
    const lo_plugin_kernel_call *c = block;
    return (int)c->fn(c->device, NULL, c->outputs, c->num_outputs, c->inputs, c->num_inputs, c->attrs, c->num_attrs);
}

LO_EXPORT int llaisys_ops_plugin_copy_call(const void *block) {
    const lo_plugin_copy_call *c = block;
    if (!c->nbytes) return LO_OK;
    return (int)c->fn(c->device, c->dst, c->src, c->nbytes);
}

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

LO_EXPORT void llaisys_ops_move_rows(const lo_row_field *fields, int64_t n, int64_t start, int64_t end) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t value = fields[i].base + fields[i].per_start * start + fields[i].per_end * end;
        memcpy(fields[i].field, &value, sizeof value); /* the field is an int64_t or a pointer */
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* llaisys_ops_run that also adds each call's time, in nanoseconds, to ns[i] (profiling). */
LO_EXPORT int llaisys_ops_run_timed(const lo_call *calls, int64_t n, int64_t *failed, int64_t *ns) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t t0 = now_ns();
        const int status = calls[i].fn(calls[i].block);
        ns[i] += now_ns() - t0;
        if (status) {
            *failed = i;
            return status;
        }
    }
    return LO_OK;
}
