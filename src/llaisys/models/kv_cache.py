"""The key/value cache: per layer, keys and values of every token seen, preallocated in the
model's device memory."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor


class KVCache:
    """Keys and values for up to ``max_tokens`` positions of each of ``num_layers`` layers.

    ``length`` tokens are held; a forward pass writes the next ones at ``length`` onwards.
    ``owner`` is the model that made the cache (``CausalLM.new_cache``); a model refuses a cache
    made by another, even one of the same layout, whose keys and values mean nothing to it.
    """

    def __init__(self, num_layers: int, max_tokens: int, kv_heads: int, head_dim: int,
                 dtype: DataType, device: Device, owner: Any = None):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.length = 0
        self.spec = (num_layers, kv_heads, head_dim, dtype, device)
        self._owner = weakref.ref(owner) if owner is not None else None  # weak: a cache does not keep a model alive
        # Never zeroed: positions at or past ``length`` are always written before they are read.
        self.k = Tensor.empty((num_layers, max_tokens, kv_heads, head_dim), dtype, device)  # (L, Tmax, KH, Dh)
        self.v = Tensor.empty((num_layers, max_tokens, kv_heads, head_dim), dtype, device)  # (L, Tmax, KH, Dh)
        self.k_layers = [self.k.slice(0, i, i + 1).view(max_tokens, kv_heads, head_dim) for i in range(num_layers)]
        self.v_layers = [self.v.slice(0, i, i + 1).view(max_tokens, kv_heads, head_dim) for i in range(num_layers)]
        self.passes: dict = {}  # the owner's recorded passes over this cache, by token count (see CausalLM)

    @property
    def length(self) -> int:
        """How many positions are filled; the next forward pass writes from here on."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        # checked here: a bad length would otherwise reach the native kernels as a bad row range
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"KVCache.length must be an integer in [0, {self.max_tokens}], "
                            f"got {value!r} ({type(value).__name__})")
        if not 0 <= value <= self.max_tokens:
            raise ValueError(f"KVCache.length must be an integer in [0, {self.max_tokens}], got {value}")
        self._length = int(value)

    def rows(self, layer: int, start: int, end: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Views of ``layer`` for a pass writing positions ``start:end``: keys and values
        written (end - start, KH, Dh), then keys and values read (end, KH, Dh).

        Built directly (bounds are the caller's: 0 <= start <= end <= max_tokens) because a
        decoding step asks for them in every layer."""
        k, v = self.k_layers[layer], self.v_layers[layer]
        row = k.strides[0] * k.dtype.itemsize  # bytes per position
        new, seen = (end - start,) + k.shape[1:], (end,) + k.shape[1:]
        return (Tensor(k.storage, k.offset + start * row, new, k.strides, k.dtype),
                Tensor(v.storage, v.offset + start * row, new, v.strides, v.dtype),
                Tensor(k.storage, k.offset, seen, k.strides, k.dtype),
                Tensor(v.storage, v.offset, seen, v.strides, v.dtype))

    def made_by(self, model: Any) -> bool:
        """Whether ``model`` made this cache."""
        return self._owner is not None and self._owner() is model

    def reset(self) -> None:
        """Forget every token."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (to reuse a shared prompt prefix)."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self.length:
            raise ValueError(f"truncate: length must be an integer in [0, {self.length}], got {length!r}")
        self.length = length

    @property
    def free(self) -> int:
        """Positions still available."""
        return self.max_tokens - self.length

    def __repr__(self) -> str:
        layers, kh, dh, dtype, device = self.spec
        return (f"KVCache(length={self.length}, max_tokens={self.max_tokens}, layers={layers}, "
                f"kv_heads={kh}, head_dim={dh}, dtype={dtype.name}, device={device})")
