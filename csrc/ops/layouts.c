/* The layouts of this library's argument blocks, for the ctypes mirrors of
 * src/llaisys/_native/structs.py, which llaisys._native checks against them at load
 * (common/layout.h). A structure added to ops.h or plugin_calls.h gets its entries here. */
#include "common/layout.h"
#include "plugin_calls.h"

static const layout_entry LAYOUTS[] = {
    LAYOUT(lo_norm_args, out, out_s, total, total_s, a, a_s, b, b_s, rows, d, eps),
    LAYOUT(lo_swiglu_args, out, out_s, gate, gate_s, up, up_s, rows, n),
    LAYOUT(lo_rope_args, out, out_s0, out_s1, x, x_s0, x_s1, s, h, d, r),
    LAYOUT(lo_attention_args, out, out_s0, out_s1, q, q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, s, h, d, kh, dv, scale),
    LAYOUT(lo_scale_args, out, out_s, x, x_s, rows, n, factor),
    LAYOUT(lo_call, fn, block),
    LAYOUT(lo_norm_call, a, w),
    LAYOUT(lo_swiglu_call, a),
    LAYOUT(lo_rope_call, a, cos, sin),
    LAYOUT(lo_attention_call, a, k, v, t),
    LAYOUT(lo_geglu_call, a),
    LAYOUT(lo_scale_call, a),
    LAYOUT(lo_copy_call, dst, src, nbytes),
    LAYOUT(lo_add_call, out, a, b, n),
    LAYOUT(lo_gather_call, out, out_s, index, index_s, weight, weight_s, rows, row_bytes, v, bad, widen),
    LAYOUT(lo_plugin_kernel_call, fn, device, outputs, num_outputs, inputs, num_inputs, attrs, num_attrs),
    LAYOUT(lo_plugin_copy_call, fn, device, dst, src, nbytes),
    LAYOUT(lo_row_field, field, base, per_start, per_end),
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LO_EXPORT int64_t llaisys_ops_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
