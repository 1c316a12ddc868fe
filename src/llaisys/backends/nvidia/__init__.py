"""The NVIDIA backend: the device interface over torch's CUDA runtime (``llaisys[cuda]``).

Imported lazily by the runtime when a device of type ``nvidia`` is first named, so a machine
without torch or without a GPU never touches it. Its kernels (Triton, cuBLAS through
``torch.matmul``) live in ``llaisys.kernels.nvidia``.

``LLAISYS_NVIDIA_SIMULATE=1`` (tests only) runs the same backend over torch CPU tensors, its
Triton kernels through Triton's interpreter: see ``backend.simulated``.
"""
from __future__ import annotations

from .backend import SIMULATE_ENV, NvidiaBackend, create_backend, prepare_triton, simulated

__all__ = ["SIMULATE_ENV", "NvidiaBackend", "create_backend", "prepare_triton", "simulated"]
