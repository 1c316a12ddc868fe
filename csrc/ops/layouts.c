/* The layouts of this library's argument blocks, for the ctypes mirrors of
 * src/llaisys/_native/structs.py, which llaisys._native checks against them at load
 * (common/layout.h). A structure added to ops.h or plugin_calls.h gets its entries here. */
#include "common/layout.h"
#include "plugin_calls.h"

static const layout_entry LAYOUTS[] = {
    LAYOUT_TYPE(lo_norm_args),
    LAYOUT_FIELD(lo_norm_args, out), LAYOUT_FIELD(lo_norm_args, out_s), LAYOUT_FIELD(lo_norm_args, total),
    LAYOUT_FIELD(lo_norm_args, total_s), LAYOUT_FIELD(lo_norm_args, a), LAYOUT_FIELD(lo_norm_args, a_s),
    LAYOUT_FIELD(lo_norm_args, b), LAYOUT_FIELD(lo_norm_args, b_s), LAYOUT_FIELD(lo_norm_args, rows),
    LAYOUT_FIELD(lo_norm_args, d), LAYOUT_FIELD(lo_norm_args, eps),

    LAYOUT_TYPE(lo_swiglu_args),
    LAYOUT_FIELD(lo_swiglu_args, out), LAYOUT_FIELD(lo_swiglu_args, out_s), LAYOUT_FIELD(lo_swiglu_args, gate),
    LAYOUT_FIELD(lo_swiglu_args, gate_s), LAYOUT_FIELD(lo_swiglu_args, up), LAYOUT_FIELD(lo_swiglu_args, up_s),
    LAYOUT_FIELD(lo_swiglu_args, rows), LAYOUT_FIELD(lo_swiglu_args, n),

    LAYOUT_TYPE(lo_rope_args),
    LAYOUT_FIELD(lo_rope_args, out), LAYOUT_FIELD(lo_rope_args, out_s0), LAYOUT_FIELD(lo_rope_args, out_s1),
    LAYOUT_FIELD(lo_rope_args, x), LAYOUT_FIELD(lo_rope_args, x_s0), LAYOUT_FIELD(lo_rope_args, x_s1),
    LAYOUT_FIELD(lo_rope_args, s), LAYOUT_FIELD(lo_rope_args, h), LAYOUT_FIELD(lo_rope_args, d),
    LAYOUT_FIELD(lo_rope_args, r),

    LAYOUT_TYPE(lo_attention_args),
    LAYOUT_FIELD(lo_attention_args, out), LAYOUT_FIELD(lo_attention_args, out_s0),
    LAYOUT_FIELD(lo_attention_args, out_s1), LAYOUT_FIELD(lo_attention_args, q), LAYOUT_FIELD(lo_attention_args, q_s0),
    LAYOUT_FIELD(lo_attention_args, q_s1), LAYOUT_FIELD(lo_attention_args, k_s0), LAYOUT_FIELD(lo_attention_args, k_s1),
    LAYOUT_FIELD(lo_attention_args, v_s0), LAYOUT_FIELD(lo_attention_args, v_s1), LAYOUT_FIELD(lo_attention_args, s),
    LAYOUT_FIELD(lo_attention_args, h), LAYOUT_FIELD(lo_attention_args, d), LAYOUT_FIELD(lo_attention_args, kh),
    LAYOUT_FIELD(lo_attention_args, dv), LAYOUT_FIELD(lo_attention_args, scale),

    LAYOUT_TYPE(lo_scale_args),
    LAYOUT_FIELD(lo_scale_args, out), LAYOUT_FIELD(lo_scale_args, out_s), LAYOUT_FIELD(lo_scale_args, x),
    LAYOUT_FIELD(lo_scale_args, x_s), LAYOUT_FIELD(lo_scale_args, rows), LAYOUT_FIELD(lo_scale_args, n),
    LAYOUT_FIELD(lo_scale_args, factor),

    LAYOUT_TYPE(lo_call), LAYOUT_FIELD(lo_call, fn), LAYOUT_FIELD(lo_call, block),

    LAYOUT_TYPE(lo_norm_call), LAYOUT_FIELD(lo_norm_call, a), LAYOUT_FIELD(lo_norm_call, w),
    LAYOUT_TYPE(lo_swiglu_call), LAYOUT_FIELD(lo_swiglu_call, a),
    LAYOUT_TYPE(lo_rope_call), LAYOUT_FIELD(lo_rope_call, a), LAYOUT_FIELD(lo_rope_call, cos),
    LAYOUT_FIELD(lo_rope_call, sin),
    LAYOUT_TYPE(lo_attention_call), LAYOUT_FIELD(lo_attention_call, a), LAYOUT_FIELD(lo_attention_call, k),
    LAYOUT_FIELD(lo_attention_call, v), LAYOUT_FIELD(lo_attention_call, t),
    LAYOUT_TYPE(lo_geglu_call), LAYOUT_FIELD(lo_geglu_call, a),
    LAYOUT_TYPE(lo_scale_call), LAYOUT_FIELD(lo_scale_call, a),
    LAYOUT_TYPE(lo_copy_call), LAYOUT_FIELD(lo_copy_call, dst), LAYOUT_FIELD(lo_copy_call, src),
    LAYOUT_FIELD(lo_copy_call, nbytes),
    LAYOUT_TYPE(lo_add_call), LAYOUT_FIELD(lo_add_call, out), LAYOUT_FIELD(lo_add_call, a),
    LAYOUT_FIELD(lo_add_call, b), LAYOUT_FIELD(lo_add_call, n),

    LAYOUT_TYPE(lo_gather_call),
    LAYOUT_FIELD(lo_gather_call, out), LAYOUT_FIELD(lo_gather_call, out_s), LAYOUT_FIELD(lo_gather_call, index),
    LAYOUT_FIELD(lo_gather_call, index_s), LAYOUT_FIELD(lo_gather_call, weight),
    LAYOUT_FIELD(lo_gather_call, weight_s), LAYOUT_FIELD(lo_gather_call, rows),
    LAYOUT_FIELD(lo_gather_call, row_bytes), LAYOUT_FIELD(lo_gather_call, v), LAYOUT_FIELD(lo_gather_call, bad),
    LAYOUT_FIELD(lo_gather_call, widen),

    LAYOUT_TYPE(lo_plugin_kernel_call),
    LAYOUT_FIELD(lo_plugin_kernel_call, fn), LAYOUT_FIELD(lo_plugin_kernel_call, device),
    LAYOUT_FIELD(lo_plugin_kernel_call, outputs), LAYOUT_FIELD(lo_plugin_kernel_call, num_outputs),
    LAYOUT_FIELD(lo_plugin_kernel_call, inputs), LAYOUT_FIELD(lo_plugin_kernel_call, num_inputs),
    LAYOUT_FIELD(lo_plugin_kernel_call, attrs), LAYOUT_FIELD(lo_plugin_kernel_call, num_attrs),

    LAYOUT_TYPE(lo_plugin_copy_call),
    LAYOUT_FIELD(lo_plugin_copy_call, fn), LAYOUT_FIELD(lo_plugin_copy_call, device),
    LAYOUT_FIELD(lo_plugin_copy_call, dst), LAYOUT_FIELD(lo_plugin_copy_call, src),
    LAYOUT_FIELD(lo_plugin_copy_call, nbytes),

    LAYOUT_TYPE(lo_row_field),
    LAYOUT_FIELD(lo_row_field, field), LAYOUT_FIELD(lo_row_field, base), LAYOUT_FIELD(lo_row_field, per_start),
    LAYOUT_FIELD(lo_row_field, per_end),
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LO_EXPORT int64_t llaisys_ops_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
