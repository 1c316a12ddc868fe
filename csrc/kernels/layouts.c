/* The layouts of this library's argument blocks, for the ctypes mirrors of
 * src/llaisys/_native/structs.py, which llaisys._native checks against them at load
 * (common/layout.h). A structure the Python side builds gets its entries here. */
#include "common/layout.h"
#include "moe.h"
#include "paged_attention.h"
#include "quant.h"

static const layout_entry LAYOUTS[] = {
#define F(f) LAYOUT_FIELD(T, f) /* a field of the structure T the lines below name */
#define T lq_linear_call
    LAYOUT_TYPE(T), F(type), F(w), F(n), F(k), F(x), F(ldx), F(m), F(y), F(ldy), F(bias), F(packed),
#undef T
#define T lq_gather_call
    LAYOUT_TYPE(T), F(type), F(n), F(k), F(index_s), F(rows), F(out_s), F(w), F(index), F(out), F(bad),
#undef T
#define T lp_attention_args
    LAYOUT_TYPE(T), F(out), F(out_s0), F(out_s1), F(q), F(q_s0), F(q_s1), F(k_cache), F(k_s0), F(k_s1), F(k_s2),
    F(v_cache), F(v_s0), F(v_s1), F(v_s2), F(block_tables), F(bt_s0), F(bt_s1), F(query_starts), F(qs_s0),
    F(context_lens), F(cl_s0), F(n), F(h), F(kh), F(d), F(dv), F(nb), F(bs), F(b), F(mb), F(scale), F(bad), F(window),
#undef T
#define T lp_write_args
    LAYOUT_TYPE(T), F(k_cache), F(kc_s0), F(kc_s1), F(kc_s2), F(v_cache), F(vc_s0), F(vc_s1), F(vc_s2), F(k), F(k_s0),
    F(k_s1), F(v), F(v_s0), F(v_s1), F(slots), F(sl_s0), F(n), F(kh), F(d), F(dv), F(nb), F(bs), F(itemsize), F(bad),
#undef T
#define T lm_moe_args
    LAYOUT_TYPE(T), F(out), F(ldo), F(h), F(ldh), F(logits), F(ldl), F(gate), F(up), F(down), F(gate_type), F(up_type),
    F(down_type), F(n), F(d), F(e), F(inter), F(top_k), F(norm), F(swiglu),
#undef T
#undef F
};

/* common/layout.h: the size of `type` (i < 0) or the offset, name and size of its i-th field. */
LQ_EXPORT int64_t llaisys_kernels_layout(const char *type, int64_t i, const char **field, int64_t *size) {
    return layout_lookup(LAYOUTS, sizeof LAYOUTS / sizeof LAYOUTS[0], type, i, field, size);
}
