"""The key/value cache of one sequence: per layer, keys and values of every token seen,
preallocated in the model's device memory. It is a paged cache of one block whose slot i holds
position i, so the model runs it with the same paged pass as a serving batch
(``models.runner``)."""
from __future__ import annotations

import numpy as np

from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .paged_cache import PagedKVCache


class KVCache(PagedKVCache):
    """Keys and values for up to ``max_tokens`` positions of each of ``num_layers`` layers:
    a ``PagedKVCache`` of one block of ``max_tokens`` slots, k and v (L, 1, Tmax, KH, Dh).

    ``length`` tokens are held; a forward pass writes the next ones at ``length`` onwards.
    ``owner`` is the model that made the cache (``CausalLM.new_cache``); a model refuses a cache
    made by another, even one of the same layout, whose keys and values mean nothing to it.
    """

    def __init__(self, num_layers: int, max_tokens: int, kv_heads: int, head_dim: int,
                 dtype: DataType, device: Device, owner: Any = None):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        # Never zeroed: positions at or past ``length`` are always written before they are read.
        super().__init__(num_layers, 1, max_tokens, kv_heads, head_dim, dtype, device, 1, owner=owner)
        self.max_tokens = max_tokens
        self.length = 0

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
        k, v = self.k_layers[layer], self.v_layers[layer]  # (1, Tmax, KH, Dh)
        row = k.strides[1] * k.dtype.itemsize  # bytes per position
        new, seen = (end - start,) + k.shape[2:], (end,) + k.shape[2:]
        return (Tensor(k.storage, k.offset + start * row, new, k.strides[1:], k.dtype),
                Tensor(v.storage, v.offset + start * row, new, v.strides[1:], v.dtype),
                Tensor(k.storage, k.offset, seen, k.strides[1:], k.dtype),
                Tensor(v.storage, v.offset, seen, v.strides[1:], v.dtype))

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
