"""CPU kernels in NumPy (BLAS for matrix products), F16 and BF16 computed in F32; linear and
embedding on weights kept as stored (block-quantized, F16/BF16) through the native kernels."""
from . import attention, elementwise, linear, misc, norm_rope, quantized  # noqa: F401  (each registers itself)
