"""The C functions of each native library as Python calls them: one table per library,
function name -> (argument types, result type), declared on the library once when
``llaisys._native`` loads it. A function a library lacks (built from older sources) is left
out there, so callers that can do without it test ``hasattr`` first.

Blocks and buffers pass as ``c_void_p`` (an address, a ctypes array or ``byref``); a ``*_call``
function takes one argument block and is mostly used by its address, inside a replayed stretch
(``llaisys_ops_run``).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_int64, c_size_t, c_uint64, c_void_p

from .structs import MallInfo2

Signatures = dict[str, tuple[list, "type | None"]]

_LAYOUT = ([c_char_p, c_int64, POINTER(c_char_p), POINTER(c_int64)], c_int64)  # csrc/common/layout.h
_BLOCK = ([c_void_p], c_int)  # int f(const void *block)

OPS: Signatures = {  # csrc/ops
    "llaisys_ops_layout": _LAYOUT,
    "llaisys_ops_simd_level": ([], c_char_p),
    "llaisys_ops_simd_available": ([], c_int),
    "llaisys_ops_set_simd_level": ([c_char_p], c_int),
    "llaisys_ops_use_pool": ([c_void_p, c_void_p], None),
    "llaisys_ops_rms_norm": ([c_void_p, c_void_p], c_int),
    "llaisys_ops_swiglu": ([c_void_p], c_int),
    "llaisys_ops_geglu": ([c_void_p], c_int),
    "llaisys_ops_scale": ([c_void_p], c_int),
    "llaisys_ops_rope": ([c_void_p, c_void_p, c_void_p], c_int),
    "llaisys_ops_self_attention": ([c_void_p, c_void_p, c_void_p, c_int64], c_int),
    "llaisys_ops_self_attention_full": ([c_void_p, c_void_p, c_void_p, c_int64], c_int),
    "llaisys_ops_run": ([c_void_p, c_int64, POINTER(c_int64)], c_int),
    "llaisys_ops_run_timed": ([c_void_p, c_int64, POINTER(c_int64), c_void_p], c_int),
    "llaisys_ops_move_rows": ([c_void_p, c_int64, c_int64, c_int64], None),
    **{f"llaisys_ops_{name}_call": _BLOCK for name in (
        "rms_norm", "swiglu", "geglu", "scale", "rope", "self_attention", "self_attention_full", "copy", "add",
        "gather", "plugin_kernel", "plugin_copy")},
}

KERNELS: Signatures = {  # csrc/kernels
    "llaisys_kernels_layout": _LAYOUT,
    "llaisys_quant_block_size": ([c_int], c_int),
    "llaisys_quant_block_bytes": ([c_int], c_int),
    "llaisys_quant_dequantize": ([c_int, c_void_p, c_int64, c_int64, c_void_p], c_int),
    "llaisys_quant_linear": ([c_int, c_void_p, c_int64, c_int64, c_void_p, c_int64, c_int64, c_void_p, c_int64,
                              c_void_p, c_void_p], c_int),
    "llaisys_quant_linear_f32": ([c_int, c_void_p, c_int64, c_int64, c_void_p, c_int64, c_int64, c_void_p, c_int64,
                                  c_void_p], c_int),
    "llaisys_quant_linear_call": _BLOCK,
    "llaisys_quant_gather_call": _BLOCK,
    "llaisys_quant_int_packed_bytes": ([c_int, c_int64, c_int64], c_int64),
    "llaisys_quant_int_pack": ([c_int, c_void_p, c_int64, c_int64, c_void_p], c_int),
    "llaisys_quant_int_amx": ([], c_int),
    "llaisys_quant_int_level": ([], c_char_p),
    "llaisys_quant_set_threads": ([c_int], c_int),
    "llaisys_quant_threads": ([], c_int),
    "llaisys_quant_pool_run": ([c_void_p, c_void_p, c_size_t, c_int], None),
    "llaisys_quant_fma_loop": ([c_int64, c_int64], c_int64),
    "llaisys_quant_simd_level": ([], c_char_p),
    "llaisys_quant_simd_available": ([], c_int),
    "llaisys_quant_set_simd_level": ([c_char_p], c_int),
    "llaisys_quant_math": ([], c_char_p),
    "llaisys_quant_set_math": ([c_char_p], c_int),
    "llaisys_peak_int8_units": ([], c_int),
    "llaisys_peak_int8_unit_name": ([c_int], c_char_p),
    "llaisys_peak_int8_loop": ([c_int, c_int64, c_int64], c_int64),
    "llaisys_peak_read": ([c_void_p, c_int64, c_int64], c_uint64),
    "llaisys_paged_attention": ([c_void_p], c_int),
    "llaisys_paged_kv_write": ([c_void_p], c_int),
    "llaisys_paged_simd": ([c_int], c_int),
    "llaisys_paged_attention_call": _BLOCK,
    "llaisys_paged_kv_write_call": _BLOCK,
    "llaisys_moe_mlp": ([c_void_p], c_int),
    "llaisys_moe_mlp_call": _BLOCK,
}

HOST: Signatures = {  # csrc/host
    "llaisys_host_layout": _LAYOUT,
    "llaisys_trace_event_counts": ([POINTER(c_uint64), POINTER(c_uint64)], None),
    "profiler_add_runtime_trace_event": ([c_void_p, c_void_p], None),  # called by plugins
    "profiler_add_device_trace_event": ([c_void_p, c_void_p], None),
}

GGUF: Signatures = {  # csrc/gguf
    "llaisys_gguf_strings": ([c_void_p, c_int64, c_int64, c_int64, c_int, c_void_p, POINTER(c_int64)], c_int64),
}

LIBC: Signatures = {  # glibc, for the grammar sandbox's heap counts (llaisys._native.libc)
    "mallinfo2": ([], MallInfo2),
    "malloc_trim": ([c_size_t], c_int),
}

SIGNATURES: dict[str, Signatures] = {"ops": OPS, "kernels": KERNELS, "host": HOST, "gguf": GGUF, "libc": LIBC}


def declare(lib: ctypes.CDLL, signatures: Signatures) -> None:
    """Give each function of ``signatures`` that ``lib`` exports its argument and result types."""
    for function, (argtypes, restype) in signatures.items():
        fn = getattr(lib, function, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
