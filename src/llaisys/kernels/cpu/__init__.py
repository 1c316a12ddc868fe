"""CPU kernels in NumPy (BLAS for matrix products), F16 and BF16 computed in F32; linear and
embedding on weights kept as stored (block-quantized, F16/BF16) through the native kernels;
paged attention and the KV slot writes through the native kernels (paged_native)."""
from . import attention, elementwise, linear, misc, norm_rope, paged, paged_native, quantized  # noqa: F401  (each registers itself)
