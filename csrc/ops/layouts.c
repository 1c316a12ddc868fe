/* The layouts of this library's argument blocks, for the ctypes mirrors of
 * src/llaisys/_native/structs.py, which llaisys._native checks against them at load
 * (common/layout.h). A structure added to ops.h or plugin_calls.h gets its entries here. */
#include "common/layout.h"
#include "plugin_calls.h"

static const layout_entry LAYOUTS[] = {
#define F(f) LAYOUT_FIELD(T, f) /* a field of the structure T the lines below name */
#define T lo_norm_args
    LAYOUT_TYPE(T), F(out), F(out_s), F(total), F(total_s), F(a), F(a_s), F(b), F(b_s), F(rows), F(d), F(eps),
#undef T
#define T lo_swiglu_args
    LAYOUT_TYPE(T), F(out), F(out_s), F(gate), F(gate_s), F(up), F(up_s), F(rows), F(n),
#undef T
#define T lo_rope_args
    LAYOUT_TYPE(T), F(out), F(out_s0), F(out_s1), F(x), F(x_s0), F(x_s1), F(s), F(h), F(d), F(r),
#undef T
#define T lo_attention_args
    LAYOUT_TYPE(T), F(out), F(out_s0), F(out_s1), F(q), F(q_s0), F(q_s1), F(k_s0), F(k_s1), F(v_s0), F(v_s1), F(s),
    F(h), F(d), F(kh), F(dv), F(scale),
#undef T
#define T lo_scale_args
    LAYOUT_TYPE(T), F(out), F(out_s), F(x), F(x_s), F(rows), F(n), F(factor),
#undef T
#define T lo_call
    LAYOUT_TYPE(T), F(fn), F(block),
#undef T
#define T lo_norm_call
    LAYOUT_TYPE(T), F(a), F(w),
#undef T
#define T lo_swiglu_call
    LAYOUT_TYPE(T), F(a),
#undef T
#define T lo_rope_call
    LAYOUT_TYPE(T), F(a), F(cos), F(sin),
#undef T
#define T lo_attention_call
    LAYOUT_TYPE(T), F(a), F(k), F(v), F(t),
#undef T
#define T lo_geglu_call
    LAYOUT_TYPE(T), F(a),
#undef T
#define T lo_scale_call
    LAYOUT_TYPE(T), F(a),
#undef T
#define T lo_copy_call
    LAYOUT_TYPE(T), F(dst), F(src), F(nbytes),
#undef T
#define T lo_add_call
    LAYOUT_TYPE(T), F(out), F(a), F(b), F(n),
#undef T
#define T lo_gather_call
    LAYOUT_TYPE(T), F(out), F(out_s), F(index), F(index_s), F(weight), F(weight_s), F(rows), F(row_bytes), F(v), F(bad),
    F(widen),
#undef T
#define T lo_plugin_kernel_call
    LAYOUT_TYPE(T), F(fn), F(device), F(outputs), F(num_outputs), F(inputs), F(num_inputs), F(attrs), F(num_attrs),
#undef T
#define T lo_plugin_copy_call
    LAYOUT_TYPE(T), F(fn), F(device), F(dst), F(src), F(nbytes),
#undef T
#define T lo_row_field
    LAYOUT_TYPE(T), F(field), F(base), F(per_start), F(per_end),
#undef T
#undef F
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LO_EXPORT int64_t llaisys_ops_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
