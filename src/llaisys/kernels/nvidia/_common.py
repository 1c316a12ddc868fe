"""What the NVIDIA kernels share: torch views of llaisys tensors, the dtype tables, the
launcher (which can record launches instead, for ahead-of-time compilation) and the switch of
the index checks."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import torch
import triton

from ...backends.nvidia import NvidiaBackend
from ...runtime.dtypes import DataType

if TYPE_CHECKING:
    from ...tensor import Tensor

FLOATS = (DataType.F32, DataType.F16, DataType.BF16)
CHECK_ENV = "LLAISYS_NVIDIA_CHECK"

TORCH_DTYPES = {
    DataType.F32: torch.float32, DataType.F16: torch.float16, DataType.BF16: torch.bfloat16,
    DataType.F64: torch.float64, DataType.I8: torch.int8, DataType.I16: torch.int16, DataType.I32: torch.int32,
    DataType.I64: torch.int64, DataType.U8: torch.uint8, DataType.BYTE: torch.uint8,
}

next_pow2 = triton.next_power_of_2


def backend_of(t: "Tensor") -> NvidiaBackend:
    """The nvidia backend holding ``t``."""
    return t.storage.runtime.backend  # type: ignore[return-value]


def _make_view(t: "Tensor") -> torch.Tensor:
    if t.dtype.is_quantized:  # its raw blocks, uint8 (N, row_bytes)
        rows, row_bytes = t.raw_shape
        return backend_of(t).torch_view(t.data_ptr, torch.uint8, (rows, row_bytes), (row_bytes, 1))
    return backend_of(t).torch_view(t.data_ptr, TORCH_DTYPES[t.dtype], t.shape, t.strides)


def tv(t: "Tensor") -> torch.Tensor:
    """A torch tensor over ``t``'s device memory (same shape, strides, dtype; a block format
    gives its raw bytes uint8 (N, row_bytes)), made once per tensor and kept with it."""
    return t.derived("nvidia.view", _make_view)


def checks_enabled(t: "Tensor") -> bool:
    """Whether kernels check index values (token ids, slots, block tables) on the host: a copy
    and a sync per call, so only in the simulated mode or with ``LLAISYS_NVIDIA_CHECK=1``
    (``=0``: not even simulated), and never while a CUDA graph is captured. Unchecked, bad
    indices are masked: nothing is read (zeros) or written there."""
    backend = backend_of(t)
    if _recording is not None or backend.is_capturing():
        return False
    value = os.environ.get(CHECK_ENV, "")
    return value == "1" if value else bool(backend.simulate)


def interpreted() -> bool:
    """True when Triton interprets kernels on the CPU (the backend's simulated mode)."""
    return bool(triton.knobs.runtime.interpret)


# A launch is (kernel, grid, args, constexprs, options); recording keeps them for ``aot``.
Launch = tuple
_recording: list[Launch] | None = None


def launch(kernel: Any, grid: tuple, args: tuple, consts: dict[str, Any], num_warps: int = 4,
           exact: bool = False) -> None:
    """Run Triton ``kernel`` over ``grid`` with ``args`` and constexprs ``consts`` (or record
    the launch while ``recording`` is on). ``exact``: no fused multiply-adds (F32 kernels, so
    that each operation rounds as the CPU kernels' do)."""
    if _recording is not None:
        _recording.append((kernel, grid, args, consts, {"num_warps": num_warps, "enable_fp_fusion": not exact}))
        return
    device = args[0].device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device
            kernel[grid](*args, **consts, num_warps=num_warps, enable_fp_fusion=not exact)
        return
    kernel[grid](*args, **consts, num_warps=num_warps, enable_fp_fusion=not exact)


class recording:
    """Context manager: launches are recorded into ``self.launches`` instead of run."""

    def __enter__(self) -> "recording":
        global _recording
        self.launches: list[Launch] = []
        self._previous = _recording
        _recording = self.launches
        return self

    def __exit__(self, *exc: Any) -> None:
        global _recording
        _recording = self._previous


def run_rows(out: torch.Tensor, width: int, compute: Callable[[torch.Tensor], None]) -> None:
    """``compute(out2)`` on ``out`` viewed as rows (M, width); through a contiguous temporary
    copied back when its rows do not share one stride."""
    try:
        out2 = out.view(-1, width)
    except RuntimeError:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        compute(tmp.view(-1, width))
        out.copy_(tmp)
        return
    compute(out2)


def rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """An input as rows (M, width) with a unit last stride (a view when it can be)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 or width == 1 else t2.contiguous()
