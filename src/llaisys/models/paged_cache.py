"""The paged KV cache of a serving engine: per layer, a pool of fixed-size blocks of key and
value slots in the model's device memory, shared by many sequences through block tables.

Which blocks a sequence holds is the engine's business (``llaisys.engine.blocks``); a
``TokenBatch`` carries the result to the model as index arrays: the slot each new token's keys
and values go to, and each sequence's block table for attention.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime.device import Device
from ..runtime.dtypes import DataType, MemcpyKind
from ..tensor import Tensor


@dataclass(slots=True)
class TokenBatch:
    """A flat batch of N tokens from B sequences for one forward pass (host int64 arrays).

    Sequence b's tokens are rows ``query_starts[b]:query_starts[b+1]``, in position order.
    token_ids (N,), positions (N,): each token and its position in its sequence.
    slots (N,): where each token's K/V go, ``block * block_size + offset``.
    block_tables (B, MB): sequence b's blocks in order (unused entries -1).
    query_starts (B+1,): row offsets; context_lens (B,): keys each sequence has after the pass.
    logit_rows (R,): the rows whose logits are returned, in the order wanted.
    input_rows: None, or (rows (K,), values (K, D) float32): rows of the batch whose input is
    given instead of their token's embedding (an image's rows in a prompt).
    key_ends: None, or (N,): the keys each row sees end there rather than at its own position
    (the tokens of a Gemma 3 image see the whole image: ``ops.paged_attention``'s key_ends).
    rope_positions: None, or (3, N): each row's rope positions (time, height, width) under
    multimodal rope (Qwen2-VL), where they differ from ``positions``.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    query_starts: np.ndarray
    context_lens: np.ndarray
    logit_rows: np.ndarray
    input_rows: "tuple[np.ndarray, np.ndarray] | None" = None
    key_ends: "np.ndarray | None" = None
    rope_positions: "np.ndarray | None" = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @classmethod
    def build(cls, chunks: "list[tuple[list[int], int, list[int], bool]]", block_size: int,
              max_blocks: int) -> "TokenBatch":
        """A batch from ``chunks``, one per sequence: (token ids to run, position of the first,
        block table, whether its last row's logits are wanted)."""
        # Python lists for the per-token arrays: a step is mostly sequences of one token each,
        # where a handful of list appends beat numpy's per-call cost
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables = np.full((len(chunks), max_blocks), -1, np.int64)
        starts = [0]
        lens = []
        rows = []
        for b, (chunk_ids, start, table, wants_logits) in enumerate(chunks):
            k = len(chunk_ids)
            ids.extend(chunk_ids)
            if k == 1:
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                pos = np.arange(start, start + k)  # (k,)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table, np.int64)[pos // block_size] * block_size + pos % block_size).tolist())
            tables[b, :len(table)] = table
            starts.append(starts[-1] + k)
            lens.append(start + k)
            if wants_logits:
                rows.append(starts[-1] - 1)
        per_token = np.array((ids, positions, slots), np.int64)  # (3, N) in one conversion
        return cls(per_token[0], per_token[1], per_token[2], tables, np.array(starts, np.int64),
                   np.array(lens, np.int64), np.array(rows, np.int64))


KV_CACHE_DTYPES = ("auto", "int8", "q8_0")  # what LLMEngine's kv_cache_dtype takes ("q8_0": llama.cpp's name)


def parse_kv_cache_dtype(value: "str | DataType") -> "DataType | None":
    """The cache dtype a ``kv_cache_dtype`` names: None for "auto" (the model's own type),
    DataType.I8 for "int8" / "q8_0"; a DataType passes through. ValueError naming the accepted
    values otherwise."""
    if isinstance(value, DataType):
        return value
    name = value.lower() if isinstance(value, str) else value
    if name == "auto":
        return None
    if name in ("int8", "q8_0"):
        return DataType.I8
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))} (the model's own type, "
                     f"or keys and values in 8 bits), got {value!r}")


class PagedKVCache:
    """Keys and values in ``num_blocks`` blocks of ``block_size`` token slots for each of the
    model's layers: k and v of shape (L, NB, BS, KH, Dh). ``max_blocks`` is the width of a
    block table (blocks of the longest sequence the model takes).

    ``dtype`` I8 makes the 8-bit layout: k and v hold int8 codes, and k_scale, v_scale (L, NB,
    BS, KH) float32 one scale per head of each token slot (symmetric: amax / 127, codes rounded
    half to even; ``ops.kv_cache_write``). Per slot, not per block: a block's earlier slots must
    never change when later tokens (or a speculative draft that is then rejected) are written
    into it, or a sequence's keys would depend on what else ran, and batch invariance and
    speculative decoding's identical output would break."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: DataType, device: Device, max_blocks: int, owner: Any = None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_blocks", max_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive integer, got {value!r}")
        self.num_blocks, self.block_size, self.max_blocks = num_blocks, block_size, max_blocks
        self.spec = (num_layers, kv_heads, head_dim, dtype, device)
        self._owner = weakref.ref(owner) if owner is not None else None
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = Tensor.empty(shape, dtype, device)  # (L, NB, BS, KH, Dh); slots are written before read
        self.v = Tensor.empty(shape, dtype, device)
        self.k_layers = [self.k.slice(0, i, i + 1).view(*shape[1:]) for i in range(num_layers)]
        self.v_layers = [self.v.slice(0, i, i + 1).view(*shape[1:]) for i in range(num_layers)]
        # the 8-bit layout's scales (L, NB, BS, KH) and their per-layer views; None for a float cache
        self.k_scale = self.v_scale = self.k_scale_layers = self.v_scale_layers = None
        if dtype is DataType.I8:
            self.k_scale = Tensor.empty(shape[:4], DataType.F32, device)  # (L, NB, BS, KH)
            self.v_scale = Tensor.empty(shape[:4], DataType.F32, device)
            self.k_scale_layers = [self.k_scale.slice(0, i, i + 1).view(*shape[1:4]) for i in range(num_layers)]
            self.v_scale_layers = [self.v_scale.slice(0, i, i + 1).view(*shape[1:4]) for i in range(num_layers)]
        self.passes: OrderedDict = OrderedDict()  # the owner's recorded passes, by batch shape
        self.workspaces: OrderedDict = OrderedDict()  # the owner's work buffers, by token count

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: DataType) -> int:
        """Bytes of keys and values one token takes in all layers (in the 8-bit layout, dtype
        I8, a float32 scale per head of K and of V included)."""
        per_head = head_dim + 4 if dtype is DataType.I8 else head_dim * dtype.itemsize
        return 2 * num_layers * kv_heads * per_head

    def pool(self, layer: int) -> "tuple[Tensor, ...]":
        """Layer ``layer``'s pool as the paged ops take it: (K, V) blocks (NB, BS, KH, Dh), and
        in the 8-bit layout their scales (NB, BS, KH) after them."""
        if self.k_scale_layers is None:
            return self.k_layers[layer], self.v_layers[layer]
        return self.k_layers[layer], self.v_layers[layer], self.k_scale_layers[layer], self.v_scale_layers[layer]

    def stores(self) -> list[Tensor]:
        """Every tensor holding the pool's contents, block axis second: k and v (L, NB, BS, ...),
        then in the 8-bit layout k_scale and v_scale (L, NB, BS, KH)."""
        if self.k_scale is None:
            return [self.k, self.v]
        return [self.k, self.v, self.k_scale, self.v_scale]

    def read_blocks(self, blocks: "Sequence[int]") -> list[np.ndarray]:
        """Host copies of the contents of ``blocks``: one array per store (``stores()``), of
        shape (L, len(blocks), ...) and the store's dtype, blocks in the order given. A device
        store is copied through its runtime, one copy per layer and run of consecutive blocks."""
        index = self._block_index(blocks)
        out = []
        for t in self.stores():
            if t.device.is_cpu:
                out.append(np.ascontiguousarray(t.host_array()[:, index]))  # (L, n, ...) a copy
                continue
            host = np.empty((t.shape[0], len(index), *t.shape[2:]), t.dtype.numpy)  # (L, n, ...)
            for layer, at, first, count in _layer_runs(t, index):
                part = t.slice(0, layer, layer + 1).slice(1, first, first + count)  # contiguous
                dst = host[layer, at:at + count]
                t.storage.runtime.memcpy(dst.ctypes.data, part.data_ptr, part.nbytes, MemcpyKind.D2H)
            out.append(host)
        return out

    def write_blocks(self, blocks: "Sequence[int]", arrays: "Sequence[np.ndarray]") -> None:
        """Store ``arrays`` (what ``read_blocks`` returns: one per store, (L, len(blocks), ...)
        in the store's dtype) as the contents of ``blocks``. Raises ValueError when the count,
        a shape or a dtype does not match the stores, or a block id is out of range or repeated."""
        index = self._block_index(blocks)
        stores = self.stores()
        if len(arrays) != len(stores):
            raise ValueError(f"write_blocks: {len(arrays)} arrays for the cache's {len(stores)} stores")
        for i, (t, a) in enumerate(zip(stores, arrays)):
            want = (t.shape[0], len(index), *t.shape[2:])
            if not isinstance(a, np.ndarray) or a.shape != want or a.dtype != t.dtype.numpy:
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"write_blocks: store {i} takes {t.dtype.name} {want}, got {got}")
            t.check_writable("write_blocks")
        for t, a in zip(stores, arrays):
            if t.device.is_cpu:
                t.host_array()[:, index] = a
                continue
            for layer, at, first, count in _layer_runs(t, index):
                part = t.slice(0, layer, layer + 1).slice(1, first, first + count)  # contiguous
                src = np.ascontiguousarray(a[layer, at:at + count])
                t.storage.runtime.memcpy(part.data_ptr, src.ctypes.data, part.nbytes, MemcpyKind.H2D)

    def _block_index(self, blocks: "Sequence[int]") -> np.ndarray:
        """``blocks`` as an int64 index (n,), checked: ids in range, none repeated."""
        index = np.asarray(blocks, dtype=np.int64).reshape(-1)  # (n,)
        if index.size and (index.min() < 0 or index.max() >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks}), got {list(blocks)!r:.200}")
        if len(np.unique(index)) != len(index):
            raise ValueError(f"block ids must not repeat, got {list(blocks)!r:.200}")
        return index

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.stores())

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def made_by(self, model: Any) -> bool:
        """Whether ``model`` made this cache."""
        return self._owner is not None and self._owner() is model

    def __repr__(self) -> str:
        layers, kh, dh, dtype, device = self.spec
        return (f"PagedKVCache(blocks={self.num_blocks}x{self.block_size}, layers={layers}, kv_heads={kh}, "
                f"head_dim={dh}, dtype={dtype.name}, device={device}, {self.nbytes / 2**20:.0f} MiB)")


def _layer_runs(store: Tensor, index: np.ndarray) -> "list[tuple[int, int, int, int]]":
    """(layer, position in ``index``, first block, count) for each layer of ``store`` and each
    run of consecutive ascending block ids in ``index``: the contiguous pieces a device copy
    moves (a store must be contiguous: (L, NB, ...) row-major)."""
    if not store.is_contiguous():
        raise ValueError(f"a cache store must be contiguous to copy blocks, got strides {store.strides}")
    runs: list[tuple[int, int, int]] = []
    for at, block in enumerate(index.tolist()):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, block, 1))
    return [(layer, at, first, count) for layer in range(store.shape[0]) for at, first, count in runs]
