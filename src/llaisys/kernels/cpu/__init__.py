"""CPU kernels in NumPy (BLAS for matrix products). F16 and BF16 compute in F32."""
from . import attention, elementwise, linear, misc, norm_rope  # noqa: F401  (each registers itself)
