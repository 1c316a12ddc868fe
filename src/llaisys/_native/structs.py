"""Every ctypes mirror of a C structure of our native libraries, in one place.

Each class mirrors one C structure field for field, in order, with the C names, and is
registered (``mirror``) with the library that describes it: ``llaisys._native`` compares its
size and each field's offset and size with what the library exports when the library loads
(``layouts.py``). The plugin ABI's structures (``include/llaisys/device_ext.h``,
``kernel_ext.h``) are mirrored in ``backends/plugin/abi.py`` and checked the same way,
against ``_host``. Strides are in elements unless a structure says otherwise.
"""
from __future__ import annotations

import ctypes

from .layouts import mirror

_I64, _PTR, _SIZE = ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t


# ---- csrc/ops (ops.h, plugin_calls.h) ------------------------------------------------------------
@mirror("ops", "lo_norm_args")
class NormArgs(ctypes.Structure):
    """rms_norm (of a, or of total = a + b) with rows of d."""

    _fields_ = [("out", _PTR), ("out_s", _I64), ("total", _PTR), ("total_s", _I64), ("a", _PTR), ("a_s", _I64),
                ("b", _PTR), ("b_s", _I64), ("rows", _I64), ("d", _I64), ("eps", ctypes.c_double)]


@mirror("ops", "lo_swiglu_args")
class SwigluArgs(ctypes.Structure):
    """swiglu (and geglu) over rows of n."""

    _fields_ = [("out", _PTR), ("out_s", _I64), ("gate", _PTR), ("gate_s", _I64), ("up", _PTR), ("up_s", _I64),
                ("rows", _I64), ("n", _I64)]


@mirror("ops", "lo_rope_args")
class RopeArgs(ctypes.Structure):
    """rope of x (S, H, D) into out, the first r dims rotated."""

    _fields_ = [("out", _PTR), ("out_s0", _I64), ("out_s1", _I64), ("x", _PTR), ("x_s0", _I64), ("x_s1", _I64),
                ("s", _I64), ("h", _I64), ("d", _I64), ("r", _I64)]


@mirror("ops", "lo_attention_args")
class AttentionArgs(ctypes.Structure):
    """Causal GQA self-attention; k, v and their length come with each call."""

    _fields_ = [("out", _PTR), ("out_s0", _I64), ("out_s1", _I64), ("q", _PTR), ("q_s0", _I64), ("q_s1", _I64),
                ("k_s0", _I64), ("k_s1", _I64), ("v_s0", _I64), ("v_s1", _I64),
                ("s", _I64), ("h", _I64), ("d", _I64), ("kh", _I64), ("dv", _I64), ("scale", ctypes.c_double)]


@mirror("ops", "lo_scale_args")
class ScaleArgs(ctypes.Structure):
    """out = x * factor over rows of n (factor already float32)."""

    _fields_ = [("out", _PTR), ("out_s", _I64), ("x", _PTR), ("x_s", _I64), ("rows", _I64), ("n", _I64),
                ("factor", ctypes.c_float)]


@mirror("ops", "lo_call")
class Call(ctypes.Structure):
    """One call of a replayed stretch (``llaisys_ops_run``): a function and its block."""

    _fields_ = [("fn", _PTR), ("block", _PTR)]


@mirror("ops", "lo_norm_call")
class NormCall(ctypes.Structure):
    _fields_ = [("a", _PTR), ("w", _PTR)]


@mirror("ops", "lo_swiglu_call")
class SwigluCall(ctypes.Structure):
    _fields_ = [("a", _PTR)]


@mirror("ops", "lo_rope_call")
class RopeCall(ctypes.Structure):
    _fields_ = [("a", _PTR), ("cos", _PTR), ("sin", _PTR)]


@mirror("ops", "lo_attention_call")
class AttentionCall(ctypes.Structure):
    _fields_ = [("a", _PTR), ("k", _PTR), ("v", _PTR), ("t", _I64)]


@mirror("ops", "lo_geglu_call")
class GegluCall(ctypes.Structure):
    _fields_ = [("a", _PTR)]


@mirror("ops", "lo_scale_call")
class ScaleCall(ctypes.Structure):
    _fields_ = [("a", _PTR)]


@mirror("ops", "lo_copy_call")
class CopyCall(ctypes.Structure):
    """A memmove of nbytes (a dense rearrange)."""

    _fields_ = [("dst", _PTR), ("src", _PTR), ("nbytes", _I64)]


@mirror("ops", "lo_add_call")
class AddCall(ctypes.Structure):
    """Dense out = a + b over n floats."""

    _fields_ = [("out", _PTR), ("a", _PTR), ("b", _PTR), ("n", _I64)]


@mirror("ops", "lo_gather_call")
class GatherCall(ctypes.Structure):
    """Rows of a table gathered by index: strides in bytes, the index's in elements."""

    _fields_ = [("out", _PTR), ("out_s", _I64), ("index", _PTR), ("index_s", _I64), ("weight", _PTR),
                ("weight_s", _I64), ("rows", _I64), ("row_bytes", _I64), ("v", _I64), ("bad", _I64 * 2),
                ("widen", _I64)]


@mirror("ops", "lo_plugin_kernel_call")
class PluginKernelCall(ctypes.Structure):
    """A plugin kernel (``kernel_ext.h``) with its device and descriptor arrays."""

    _fields_ = [("fn", _PTR), ("device", _PTR), ("outputs", _PTR), ("num_outputs", _SIZE), ("inputs", _PTR),
                ("num_inputs", _SIZE), ("attrs", _PTR), ("num_attrs", _SIZE)]


@mirror("ops", "lo_plugin_copy_call")
class PluginCopyCall(ctypes.Structure):
    """A plugin's synchronous memory_copy_h2d or memory_copy_d2h."""

    _fields_ = [("fn", _PTR), ("device", _PTR), ("dst", _PTR), ("src", _PTR), ("nbytes", _SIZE)]


@mirror("ops", "lo_row_field")
class RowField(ctypes.Structure):
    """*field = base + per_start * start + per_end * end (``llaisys_ops_move_rows``)."""

    _fields_ = [("field", _PTR), ("base", _I64), ("per_start", _I64), ("per_end", _I64)]


# ---- csrc/kernels (quant.h, paged_attention.h, moe.h) ---------------------------------------------
@mirror("kernels", "lq_linear_call")
class LinearCall(ctypes.Structure):
    """``llaisys_quant_linear``'s arguments in one block."""

    _fields_ = [("type", _I64), ("w", _PTR), ("n", _I64), ("k", _I64), ("x", _PTR), ("ldx", _I64), ("m", _I64),
                ("y", _PTR), ("ldy", _I64), ("bias", _PTR), ("packed", _PTR)]


@mirror("kernels", "lq_gather_call")
class QuantGatherCall(ctypes.Structure):
    """``llaisys_quant_gather_call``: rows of an encoded table by index, dequantized; ``bad`` is written back."""

    _fields_ = [("type", _I64), ("n", _I64), ("k", _I64), ("index_s", _I64), ("rows", _I64), ("out_s", _I64),
                ("w", _PTR), ("index", _PTR), ("out", _PTR), ("bad", _I64 * 2)]


@mirror("kernels", "lp_attention_args")
class PagedAttentionArgs(ctypes.Structure):
    """``llaisys_paged_attention``: pointers, then strides in elements; ``bad`` is written back."""

    _fields_ = [("out", _PTR), ("out_s0", _I64), ("out_s1", _I64),
                ("q", _PTR), ("q_s0", _I64), ("q_s1", _I64),
                ("k_cache", _PTR), ("k_s0", _I64), ("k_s1", _I64), ("k_s2", _I64),
                ("v_cache", _PTR), ("v_s0", _I64), ("v_s1", _I64), ("v_s2", _I64),
                ("block_tables", _PTR), ("bt_s0", _I64), ("bt_s1", _I64),
                ("query_starts", _PTR), ("qs_s0", _I64),
                ("context_lens", _PTR), ("cl_s0", _I64),
                ("n", _I64), ("h", _I64), ("kh", _I64), ("d", _I64), ("dv", _I64), ("nb", _I64), ("bs", _I64),
                ("b", _I64), ("mb", _I64), ("scale", ctypes.c_double), ("bad", _I64 * 2), ("window", _I64),
                ("key_ends", _PTR), ("ke_s0", _I64),
                ("k_scale", _PTR), ("ks_s0", _I64), ("ks_s1", _I64), ("ks_s2", _I64),  # an int8 cache's scales
                ("v_scale", _PTR), ("vs_s0", _I64), ("vs_s1", _I64), ("vs_s2", _I64)]


@mirror("kernels", "lp_write_args")
class PagedWriteArgs(ctypes.Structure):
    """``llaisys_paged_kv_write``: strides in elements of ``itemsize`` bytes (with scales: F32
    rows quantized into int8 caches, whose strides count bytes)."""

    _fields_ = [("k_cache", _PTR), ("kc_s0", _I64), ("kc_s1", _I64), ("kc_s2", _I64),
                ("v_cache", _PTR), ("vc_s0", _I64), ("vc_s1", _I64), ("vc_s2", _I64),
                ("k", _PTR), ("k_s0", _I64), ("k_s1", _I64),
                ("v", _PTR), ("v_s0", _I64), ("v_s1", _I64),
                ("slots", _PTR), ("sl_s0", _I64),
                ("n", _I64), ("kh", _I64), ("d", _I64), ("dv", _I64), ("nb", _I64), ("bs", _I64),
                ("itemsize", _I64), ("bad", _I64 * 2),
                ("k_scale", _PTR), ("ksc_s0", _I64), ("ksc_s1", _I64), ("ksc_s2", _I64),  # an int8 cache's scales
                ("v_scale", _PTR), ("vsc_s0", _I64), ("vsc_s1", _I64), ("vsc_s2", _I64)]


@mirror("kernels", "lm_moe_args")
class MoeArgs(ctypes.Structure):
    """``llaisys_moe_mlp``: row strides in floats, GGML type ids, the ops library's swiglu."""

    _fields_ = [("out", _PTR), ("ldo", _I64), ("h", _PTR), ("ldh", _I64), ("logits", _PTR), ("ldl", _I64),
                ("gate", _PTR), ("up", _PTR), ("down", _PTR), ("gate_type", _I64), ("up_type", _I64),
                ("down_type", _I64), ("n", _I64), ("d", _I64), ("e", _I64), ("inter", _I64), ("top_k", _I64),
                ("norm", _I64), ("swiglu", _PTR)]


# ---- the C library (described by csrc/host where it is glibc 2.33 or later) ----------------------
@mirror("host", "glibc_mallinfo2", optional=True)
class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (heap statistics; the grammar sandbox reads uordblks + hblkhd)."""

    _fields_ = [(name, _SIZE) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                            "uordblks", "fordblks", "keepcost")]
