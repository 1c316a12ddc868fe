"""Helpers shared by the CPU kernels."""
from __future__ import annotations

import numpy as np

from ...runtime.dtypes import DataType

FLOATS = (DataType.F32, DataType.F16, DataType.BF16)


def f32(a: np.ndarray) -> np.ndarray:
    """``a`` as float32 (no copy when it is already)."""
    return a if a.dtype == np.float32 else a.astype(np.float32)
