"""Token sampling on the device: only the chosen ids (R int64) cross to the host, not R x V
logits. Greedy rows use the Triton ``argmax``; sampled rows temperature, top-k and top-p in
torch on the device, drawing with a device ``torch.Generator`` (seeded: reproducible on one
device and torch version, not equal to the host sampler's draws).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...runtime.dtypes import DataType
from ...tensor import Tensor
from ._common import tv
from .misc import argmax


def _per_row(value: "float | int | Sequence", rows: int, name: str) -> list:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * rows
    if len(values) != rows:
        raise ValueError(f"sample: {name} has {len(values)} entries for {rows} rows of logits")
    return values


def sample(logits: Tensor, temperature: "float | Sequence[float]" = 0.0, top_k: "int | Sequence[int]" = 0,
           top_p: "float | Sequence[float]" = 1.0, generator: "torch.Generator | None" = None) -> np.ndarray:
    """Next token ids (R,) int64 on the host for logits (R, V) on an nvidia device: per row,
    argmax where temperature is 0, else a draw from softmax(logits / temperature) restricted
    to the top_k most likely tokens (0: all) and the smallest set of them whose probability
    reaches top_p."""
    if logits.ndim != 2 or logits.device.is_cpu:
        raise ValueError(f"sample: logits must be (R, V) on an nvidia device, got {logits.shape} on {logits.device}")
    r, v = logits.shape
    temps, ks, ps = _per_row(temperature, r, "temperature"), _per_row(top_k, r, "top_k"), _per_row(top_p, r, "top_p")
    if any(t < 0 for t in temps) or any(not 0 < p <= 1 for p in ps) or any(k < 0 for k in ks):
        raise ValueError("sample: temperature must be >= 0, top_p in (0, 1] and top_k >= 0")
    idx = Tensor.empty((r,), DataType.I64, logits.device)
    val = Tensor.empty((r,), logits.dtype, logits.device)
    argmax((idx, val), (logits,), {})  # (R,) every row's greedy choice
    ids = tv(idx).clone()
    sampled = [i for i, t in enumerate(temps) if t > 0]
    if sampled:
        x = tv(logits)[sampled].float()  # (S, V)
        x /= torch.tensor([temps[i] for i in sampled], device=x.device)[:, None]
        for row, i in enumerate(sampled):
            if 0 < ks[i] < v:
                kth = torch.topk(x[row], ks[i]).values[-1]
                x[row] = torch.where(x[row] < kth, float("-inf"), x[row])
        probs = torch.softmax(x, dim=-1)  # (S, V)
        if any(ps[i] < 1 for i in sampled):
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # probability of the tokens ranked above
            limit = torch.tensor([ps[i] for i in sampled], device=x.device)[:, None]
            sorted_p = torch.where(before >= limit, 0.0, sorted_p)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        ids[sampled] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return ids.cpu().numpy()

