"""The paged KV cache of a serving engine: per layer, a pool of fixed-size blocks of key and
value slots in the model's device memory, shared by many sequences through block tables.

Which blocks a sequence holds is the engine's business (``llaisys.engine.blocks``); a
``TokenBatch`` carries the result to the model as index arrays: the slot each new token's keys
and values go to, and each sequence's block table for attention.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime.device import Device
from ..runtime.dtypes import DataType
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


class PagedKVCache:
    """Keys and values in ``num_blocks`` blocks of ``block_size`` token slots for each of the
    model's layers: k and v of shape (L, NB, BS, KH, Dh). ``max_blocks`` is the width of a
    block table (blocks of the longest sequence the model takes)."""

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
        self.passes: OrderedDict = OrderedDict()  # the owner's recorded passes, by batch shape
        self.workspaces: OrderedDict = OrderedDict()  # the owner's work buffers, by token count

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: DataType) -> int:
        """Bytes of keys and values one token takes in all layers."""
        return 2 * num_layers * kv_heads * head_dim * dtype.itemsize

    def stores(self) -> list[Tensor]:
        """Every tensor holding the pool's contents, block axis second: k and v (L, NB, BS, ...)."""
        return [self.k, self.v]

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
