"""Argument checks shared by the public ops. Each raises ValueError/TypeError naming the op,
the argument, what it got and what was expected.

The ops run a few dozen times per generated token, so the checks that pass are kept cheap:
identity comparisons first, and the error text is only built when something is wrong.
"""
from __future__ import annotations

import numbers
from typing import Sequence

from ..runtime.dtypes import DataType
from ..tensor import Tensor

FLOAT_TYPES = frozenset((DataType.F16, DataType.F32, DataType.BF16))
INDEX_TYPES = frozenset((DataType.I64,))
QUANTIZED_TYPES = frozenset(t for t in DataType if t.is_quantized)
MIXED_WEIGHT_TYPES = frozenset((DataType.F16, DataType.BF16))  # weights an F32 linear may take as stored


def tensors_match(op: str, names: Sequence[str], tensors: Sequence["Tensor | None"], dtypes: int | None = None) -> None:
    """Check that each of ``tensors`` (None where optional) is a Tensor and that all are on
    one device; the first ``dtypes`` of them (all when None) must also share a data type."""
    ref = tensors[0]
    try:
        runtime, dtype = ref.storage.runtime, ref.dtype
        n_same = len(tensors) if dtypes is None else dtypes
        for i, t in enumerate(tensors):
            if t is not None and (t.storage.runtime is not runtime or (i < n_same and t.dtype is not dtype)):
                break
        else:
            return
    except AttributeError:  # not a Tensor: described below
        pass
    _explain_mismatch(op, names, tensors, dtypes)


def _explain_mismatch(op: str, names: Sequence[str], tensors: Sequence["Tensor | None"], dtypes: int | None) -> None:
    for name, t in zip(names, tensors):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a llaisys Tensor, got {type(t).__name__}")
    if tensors[0] is None:
        raise TypeError(f"{op}: {names[0]} must be a llaisys Tensor, got None")
    ref_name, ref = names[0], tensors[0]
    for name, t in zip(names, tensors):
        if t is not None and t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; all must share a device")
    n_same = len(tensors) if dtypes is None else dtypes
    for name, t in list(zip(names, tensors))[:n_same]:
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{op}: {name} has data type {t.dtype.name} but {ref_name} has {ref.dtype.name}; they must match")


def dtype_in(op: str, name: str, t: Tensor, allowed: frozenset) -> None:
    """Check that ``t``'s data type is one of ``allowed``."""
    if t.dtype not in allowed:
        names = ", ".join(sorted(a.name for a in allowed))
        raise TypeError(f"{op}: {name} has data type {t.dtype.name}; expected one of {names}")


def shape_is(op: str, name: str, t: Tensor, expected: tuple[int, ...]) -> None:
    """Check that ``t`` has exactly the shape ``expected``."""
    if t.shape != expected:
        raise ValueError(f"{op}: {name} has shape {t.shape}; expected {tuple(expected)}")


def ndim_is(op: str, name: str, t: Tensor, ndim: int, what: str) -> None:
    """Check that ``t`` has ``ndim`` dimensions (``what`` says what they mean)."""
    if len(t.shape) != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {what}; got shape {t.shape}")


def number(op: str, name: str, value: object, condition: str = "") -> float:
    """``value`` as a float; TypeError when it is not a real number, ValueError when it
    breaks ``condition`` ("> 0" or ">= 0")."""
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
        value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{op}: {name} must be finite, got {value}")
    if (condition == "> 0" and not value > 0) or (condition == ">= 0" and not value >= 0):
        raise ValueError(f"{op}: {name} must be {condition}, got {value}")
    return value


def weight_type_fits(op: str, name: str, act: Tensor, weight: Tensor, mixed: bool = False) -> None:
    """Check ``weight``'s type against the activations ``act`` (named ``name``): the same type,
    a block-quantized type, or (``mixed``) F16/BF16 with F32 activations."""
    wt = weight.dtype
    if wt is act.dtype or wt in QUANTIZED_TYPES or (mixed and wt in MIXED_WEIGHT_TYPES and act.dtype is DataType.F32):
        return
    also = ", or F16/BF16 with F32 activations" if mixed else ""
    raise TypeError(f"{op}: {name} has data type {act.dtype.name} but weight has {wt.name}; expected the weight "
                    f"in {act.dtype.name}, in a block-quantized type ({', '.join(sorted(t.name for t in QUANTIZED_TYPES))})"
                    f"{also}")
