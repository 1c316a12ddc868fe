"""Token sampling on the device: only the chosen ids (P int64) cross to the host, not P x V
logits. Greedy rows use the Triton ``argmax``; sampled rows temperature, top-k and top-p in
torch on the device, drawing with device ``torch.Generator``s (seeded: reproducible on one
device and torch version, not equal to the host sampler's draws). The serving engine calls
``sample`` once per step for the rows it serves here, and ``rows_to_host`` for the others.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...runtime.device import Device
from ...runtime.dtypes import DataType
from ...tensor import Tensor
from ._common import tv
from .misc import argmax

def _per_row(value: "float | int | Sequence", rows: int, name: str) -> list:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * rows
    if len(values) != rows:
        raise ValueError(f"sample: {name} has {len(values)} entries for {rows} rows")
    return values


def new_generator(device: Device, seed: int | None = None) -> torch.Generator:
    """A torch generator on ``device`` (an nvidia device) seeded with ``seed`` (None: a
    nondeterministic seed)."""
    from ...runtime import get_runtime

    g = torch.Generator(device=get_runtime(device).backend.torch_device(device.index))
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def _to_host(values: torch.Tensor, like: Tensor) -> np.ndarray:
    """A host copy of ``values`` (a torch tensor on ``like``'s device), through the runtime's
    device-to-host copy (the one every llaisys tensor takes)."""
    out = Tensor.empty(tuple(values.shape), DataType.I64 if values.dtype == torch.int64 else like.dtype, like.device)
    tv(out).copy_(values)
    return out.numpy()


def rows_to_host(logits: Tensor, rows: Sequence[int]) -> np.ndarray:
    """Float32 host logits (P, V) of ``rows`` (P,) of ``logits`` (R, V) on an nvidia device:
    the rows are gathered on the device, so only P x V values cross."""
    r = logits.shape[0]
    if list(rows) == list(range(r)):
        host = logits.numpy()  # (R, V)
    else:
        index = torch.tensor(list(rows), dtype=torch.int64, device=tv(logits).device)  # (P,)
        host = _to_host(tv(logits).index_select(0, index), logits)  # (P, V)
    return host.astype(np.float32, copy=False)


def sample(logits: Tensor, temperature: "float | Sequence[float]" = 0.0, top_k: "int | Sequence[int]" = 0,
           top_p: "float | Sequence[float]" = 1.0,
           generator: "torch.Generator | Sequence[torch.Generator | None] | None" = None,
           rows: "Sequence[int] | None" = None) -> np.ndarray:
    """Next token ids (P,) int64 on the host for ``rows`` (P,) of logits (R, V) on an nvidia
    device (default: every row, P = R): per row, argmax where temperature is 0, else a draw
    from softmax(logits / temperature) restricted to the top_k most likely tokens (0: all;
    ties with the k-th kept) and the smallest set of them whose probability reaches top_p.
    ``temperature``, ``top_k``, ``top_p`` are one value or one per picked row; ``generator``
    one generator for every draw (drawn in row order), or one per picked row (None there: the
    device's default generator)."""
    if logits.ndim != 2 or logits.device.is_cpu:
        raise ValueError(f"sample: logits must be (R, V) on an nvidia device, got {logits.shape} on {logits.device}")
    r, v = logits.shape
    rows = list(range(r)) if rows is None else [int(i) for i in rows]
    if any(not 0 <= i < r for i in rows):
        raise ValueError(f"sample: rows must lie in [0, {r})")
    n = len(rows)
    temps, ks, ps = _per_row(temperature, n, "temperature"), _per_row(top_k, n, "top_k"), _per_row(top_p, n, "top_p")
    gens = list(generator) if isinstance(generator, (list, tuple)) else [generator] * n
    if len(gens) != n:
        raise ValueError(f"sample: {len(gens)} generators for {n} rows")
    if any(t < 0 for t in temps) or any(not 0 < p <= 1 for p in ps) or any(k < 0 for k in ks):
        raise ValueError("sample: temperature must be >= 0, top_p in (0, 1] and top_k >= 0")
    idx = Tensor.empty((r,), DataType.I64, logits.device)
    val = Tensor.empty((r,), logits.dtype, logits.device)
    argmax((idx, val), (logits,), {})  # (R,) every row's greedy choice
    dev = tv(logits).device
    pick = torch.tensor(rows, dtype=torch.int64, device=dev)  # (P,)
    ids = tv(idx).index_select(0, pick)  # (P,)
    sampled = [i for i, t in enumerate(temps) if t > 0]
    if sampled:
        ids[sampled] = _draw(tv(logits).index_select(0, pick[sampled]).float(), [temps[i] for i in sampled],
                             [ks[i] for i in sampled], [ps[i] for i in sampled], [gens[i] for i in sampled])
    return _to_host(ids, logits)


def _draw(x: torch.Tensor, temps: list[float], ks: list[int], ps: list[float],
          gens: "list[torch.Generator | None]") -> torch.Tensor:
    """One draw (S,) int64 per row of x (S, V) float32 (a copy, changed in place)."""
    v = x.shape[1]
    x /= torch.tensor(temps, device=x.device)[:, None]
    cut = [i for i, k in enumerate(ks) if 0 < k < v]
    if cut:  # the k-th largest value of each such row, from one top-k over the largest k
        top = torch.topk(x[cut], max(ks[i] for i in cut), dim=-1).values  # (C, Kmax)
        kth = top.gather(1, torch.tensor([ks[i] - 1 for i in cut], device=x.device)[:, None])  # (C, 1)
        x[cut] = torch.where(x[cut] < kth, float("-inf"), x[cut])
    probs = torch.softmax(x, dim=-1)  # (S, V)
    if any(p < 1 for p in ps):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # probability of the tokens ranked above
        limit = torch.tensor(ps, device=x.device)[:, None]
        sorted_p = torch.where(before >= limit, 0.0, sorted_p)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    # One uniform number per row from its own generator, inverted through the cdf (the host
    # sampler's rule: the first id whose cdf exceeds it, never a zero-weight one).
    u = torch.stack([torch.rand((), generator=g, device=x.device) for g in gens])  # (S,)
    cdf = torch.cumsum(probs, dim=-1)  # (S, V)
    ids = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # (S,)
    last = v - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int32), dim=-1)  # (S,) the last kept id
    return torch.minimum(ids, last)  # past it only if the draw rounds up to the total
