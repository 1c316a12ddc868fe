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

#include "plugin_calls.h"

LO_EXPORT int llaisys_ops_plugin_kernel_call(const void *block) {
    const lo_plugin_kernel_call *c = block;
    return (int)c->fn(c->device, NULL, c->outputs, c->num_outputs, c->inputs, c->num_inputs, c->attrs, c->num_attrs);
}

LO_EXPORT int llaisys_ops_plugin_copy_call(const void *block) {
    const lo_plugin_copy_call *c = block;
    if (!c->nbytes) return LO_OK;
    return (int)c->fn(c->device, c->dst, c->src, c->nbytes);
}

/* Rewrite the n fields of lo_row_field (plugin_calls.h) for rows start:end. */
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
