"""CPU kernels in NumPy (BLAS for matrix products), F16 and BF16 computed in F32; linear and
embedding on weights kept as stored (block-quantized, F16/BF16) through the native kernels;
paged attention and the KV slot writes through the native kernels (paged_native); the routed
experts' MLP (moe) through the linear kernels; rms_norm, add_rms_norm, rope, swiglu, geglu,
scale and self_attention in F32 through csrc/ops (native_ops)."""
from . import attention, elementwise, linear, misc, moe, norm_rope, paged, paged_native, quantized  # noqa: F401  (each registers itself)
from . import native_ops  # noqa: F401,E402  (after the NumPy kernels: it replaces their F32 ones)
