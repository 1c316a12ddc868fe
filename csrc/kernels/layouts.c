/* The layouts of this library's argument blocks, for the ctypes mirrors of
 * src/llaisys/_native/structs.py, which llaisys._native checks against them at load
 * (common/layout.h). A structure the Python side builds gets its entries here. */
#include "common/layout.h"
#include "moe.h"
#include "paged_attention.h"
#include "quant.h"

static const layout_entry LAYOUTS[] = {
    LAYOUT(lq_linear_call, type, w, n, k, x, ldx, m, y, ldy, bias, packed),
    LAYOUT(lq_gather_call, type, n, k, index_s, rows, out_s, w, index, out, bad),
    LAYOUT(lp_attention_args, out, out_s0, out_s1, q, q_s0, q_s1, k_cache, k_s0, k_s1, k_s2, v_cache, v_s0, v_s1, v_s2,
                              block_tables, bt_s0, bt_s1, query_starts, qs_s0, context_lens, cl_s0, n, h, kh, d, dv, nb,
                              bs, b, mb, scale, bad, window, key_ends, ke_s0, k_scale, ks_s0, ks_s1, ks_s2, v_scale,
                              vs_s0, vs_s1, vs_s2),
    LAYOUT(lp_write_args, k_cache, kc_s0, kc_s1, kc_s2, v_cache, vc_s0, vc_s1, vc_s2, k, k_s0, k_s1, v, v_s0, v_s1,
                          slots, sl_s0, n, kh, d, dv, nb, bs, itemsize, bad, k_scale, ksc_s0, ksc_s1, ksc_s2, v_scale,
                          vsc_s0, vsc_s1, vsc_s2),
    LAYOUT(lm_moe_args, out, ldo, h, ldh, logits, ldl, gate, up, down, gate_type, up_type, down_type, n, d, e, inter,
                        top_k, norm, swiglu),
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LQ_EXPORT int64_t llaisys_kernels_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
