"""Linear on GGUF block-quantized (and F16/BF16) weights with float32 activations.

``formats``: the handled GGML types and their block geometry. ``reference``: readable NumPy
dequantization, the reference for the tests. ``native``: the C kernels (runtime SIMD dispatch,
own thread pool) behind a NumPy API: ``prepare`` a weight once, then ``QuantWeight.linear``;
or the one-shot ``linear`` and ``dequantize``; ``set_threads``, ``simd_level``.
"""
from . import reference
from .formats import FORMATS, BlockFormat, get_format
from .native import (QuantWeight, available, available_simd_levels, dequantize, linear, prepare, set_simd_level,
                     set_threads, simd_level, threads)

__all__ = ["FORMATS", "BlockFormat", "QuantWeight", "get_format", "reference", "available", "available_simd_levels",
           "dequantize", "linear", "prepare", "set_simd_level", "set_threads", "simd_level", "threads"]
