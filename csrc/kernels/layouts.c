/* The layouts of this library's argument blocks, for the ctypes mirrors of
 * src/llaisys/_native/structs.py, which llaisys._native checks against them at load
 * (common/layout.h). A structure the Python side builds gets its entries here. */
#include "common/layout.h"
#include "moe.h"
#include "paged_attention.h"
#include "quant.h"

static const layout_entry LAYOUTS[] = {
    LAYOUT_TYPE(lq_linear_call),
    LAYOUT_FIELD(lq_linear_call, type), LAYOUT_FIELD(lq_linear_call, w), LAYOUT_FIELD(lq_linear_call, n),
    LAYOUT_FIELD(lq_linear_call, k), LAYOUT_FIELD(lq_linear_call, x), LAYOUT_FIELD(lq_linear_call, ldx),
    LAYOUT_FIELD(lq_linear_call, m), LAYOUT_FIELD(lq_linear_call, y), LAYOUT_FIELD(lq_linear_call, ldy),
    LAYOUT_FIELD(lq_linear_call, bias), LAYOUT_FIELD(lq_linear_call, packed),

    LAYOUT_TYPE(lp_attention_args),
    LAYOUT_FIELD(lp_attention_args, out), LAYOUT_FIELD(lp_attention_args, out_s0),
    LAYOUT_FIELD(lp_attention_args, out_s1), LAYOUT_FIELD(lp_attention_args, q), LAYOUT_FIELD(lp_attention_args, q_s0),
    LAYOUT_FIELD(lp_attention_args, q_s1), LAYOUT_FIELD(lp_attention_args, k_cache),
    LAYOUT_FIELD(lp_attention_args, k_s0), LAYOUT_FIELD(lp_attention_args, k_s1), LAYOUT_FIELD(lp_attention_args, k_s2),
    LAYOUT_FIELD(lp_attention_args, v_cache), LAYOUT_FIELD(lp_attention_args, v_s0),
    LAYOUT_FIELD(lp_attention_args, v_s1), LAYOUT_FIELD(lp_attention_args, v_s2),
    LAYOUT_FIELD(lp_attention_args, block_tables), LAYOUT_FIELD(lp_attention_args, bt_s0),
    LAYOUT_FIELD(lp_attention_args, bt_s1), LAYOUT_FIELD(lp_attention_args, query_starts),
    LAYOUT_FIELD(lp_attention_args, qs_s0), LAYOUT_FIELD(lp_attention_args, context_lens),
    LAYOUT_FIELD(lp_attention_args, cl_s0), LAYOUT_FIELD(lp_attention_args, n), LAYOUT_FIELD(lp_attention_args, h),
    LAYOUT_FIELD(lp_attention_args, kh), LAYOUT_FIELD(lp_attention_args, d), LAYOUT_FIELD(lp_attention_args, dv),
    LAYOUT_FIELD(lp_attention_args, nb), LAYOUT_FIELD(lp_attention_args, bs), LAYOUT_FIELD(lp_attention_args, b),
    LAYOUT_FIELD(lp_attention_args, mb), LAYOUT_FIELD(lp_attention_args, scale), LAYOUT_FIELD(lp_attention_args, bad),
    LAYOUT_FIELD(lp_attention_args, window),

    LAYOUT_TYPE(lp_write_args),
    LAYOUT_FIELD(lp_write_args, k_cache), LAYOUT_FIELD(lp_write_args, kc_s0), LAYOUT_FIELD(lp_write_args, kc_s1),
    LAYOUT_FIELD(lp_write_args, kc_s2), LAYOUT_FIELD(lp_write_args, v_cache), LAYOUT_FIELD(lp_write_args, vc_s0),
    LAYOUT_FIELD(lp_write_args, vc_s1), LAYOUT_FIELD(lp_write_args, vc_s2), LAYOUT_FIELD(lp_write_args, k),
    LAYOUT_FIELD(lp_write_args, k_s0), LAYOUT_FIELD(lp_write_args, k_s1), LAYOUT_FIELD(lp_write_args, v),
    LAYOUT_FIELD(lp_write_args, v_s0), LAYOUT_FIELD(lp_write_args, v_s1), LAYOUT_FIELD(lp_write_args, slots),
    LAYOUT_FIELD(lp_write_args, sl_s0), LAYOUT_FIELD(lp_write_args, n), LAYOUT_FIELD(lp_write_args, kh),
    LAYOUT_FIELD(lp_write_args, d), LAYOUT_FIELD(lp_write_args, dv), LAYOUT_FIELD(lp_write_args, nb),
    LAYOUT_FIELD(lp_write_args, bs), LAYOUT_FIELD(lp_write_args, itemsize), LAYOUT_FIELD(lp_write_args, bad),

    LAYOUT_TYPE(lm_moe_args),
    LAYOUT_FIELD(lm_moe_args, out), LAYOUT_FIELD(lm_moe_args, ldo), LAYOUT_FIELD(lm_moe_args, h),
    LAYOUT_FIELD(lm_moe_args, ldh), LAYOUT_FIELD(lm_moe_args, logits), LAYOUT_FIELD(lm_moe_args, ldl),
    LAYOUT_FIELD(lm_moe_args, gate), LAYOUT_FIELD(lm_moe_args, up), LAYOUT_FIELD(lm_moe_args, down),
    LAYOUT_FIELD(lm_moe_args, gate_type), LAYOUT_FIELD(lm_moe_args, up_type), LAYOUT_FIELD(lm_moe_args, down_type),
    LAYOUT_FIELD(lm_moe_args, n), LAYOUT_FIELD(lm_moe_args, d), LAYOUT_FIELD(lm_moe_args, e),
    LAYOUT_FIELD(lm_moe_args, inter), LAYOUT_FIELD(lm_moe_args, top_k), LAYOUT_FIELD(lm_moe_args, norm),
    LAYOUT_FIELD(lm_moe_args, swiglu),
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LQ_EXPORT int64_t llaisys_kernels_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
