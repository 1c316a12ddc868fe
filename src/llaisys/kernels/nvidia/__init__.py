"""NVIDIA kernels: Triton for every op but ``linear`` (cuBLAS through ``torch.matmul``),
registered for device type ``nvidia`` in F32, F16 and BF16.

Imported by the kernel registry the first time an op runs on an nvidia device (never on a
machine that uses only the CPU). The same Triton source runs on a GPU, through Triton's
interpreter on the CPU (the backend's simulated mode, for CI), and compiles for GPUs that are
not present (``aot``).
"""
from ...backends.nvidia import prepare_triton

prepare_triton()  # before any kernel module imports triton
from . import attention, elementwise, linear, misc, moe, norm_rope  # noqa: F401  (each registers itself)  # isort: skip
