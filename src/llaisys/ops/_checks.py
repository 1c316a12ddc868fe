"""Argument checks shared by the public ops. Each raises ValueError/TypeError naming the op,
the argument, what it got and what was expected."""
from __future__ import annotations

from typing import Iterable

from ..runtime.dtypes import DataType
from ..tensor import Tensor

FLOAT_TYPES = (DataType.F16, DataType.F32, DataType.BF16)


def tensor_arg(op: str, name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a llaisys Tensor, got {type(t).__name__}")
    return t


def same_device(op: str, **tensors: Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}; all must share a device")


def dtype_in(op: str, name: str, t: Tensor, allowed: Iterable[DataType]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise TypeError(f"{op}: {name} has data type {t.dtype.name}; expected one of {', '.join(a.name for a in allowed)}")


def same_dtype(op: str, ref_name: str, ref: Tensor, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{op}: {name} has data type {t.dtype.name} but {ref_name} has {ref.dtype.name}; they must match")


def shape_is(op: str, name: str, t: Tensor, expected: tuple[int, ...]) -> None:
    if t.shape != tuple(expected):
        raise ValueError(f"{op}: {name} has shape {t.shape}; expected {tuple(expected)}")


def ndim_is(op: str, name: str, t: Tensor, ndim: int, what: str) -> None:
    if t.ndim != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {what}; got shape {t.shape}")


def contiguous(op: str, name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (shape {t.shape}, strides {t.strides}); call .contiguous() first")
