"""The recorded passes a ``ModelRunner`` replays: the op calls of one pass shape, recorded once
into an ``ops.Plan`` over static buffers, then run again and again with new index arrays.

``BatchPass``: N tokens of B sequences over a paged cache's block pools (the paged ops), the
head of R rows included: every pass on a device with paged kernels, a single sequence too
(``sequence_batch``: a contiguous ``KVCache`` is a paged cache of one block). ``RowsPass``: one
sequence over a ``KVCache`` with a device's contiguous ops (a device plugin without paged
kernels); its cache calls move to the rows of each new position (``RowFields``: one C call).
``pad_decode_batch`` grows a decoding batch to a captured graph's bucket.

Shapes: N tokens in a pass, B sequences, MB block-table width, R logit rows, S tokens of one
sequence, D hidden, V vocabulary (V or c: this rank's slice under tensor parallelism).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .. import _native, ops
from .._native import structs
from ..parallel.comm import record_all_reduce
from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .kv_cache import KVCache
from .layers import Workspace, attention, paged_attention
from .paged_cache import TokenBatch
from .params import LayerParams

if TYPE_CHECKING:
    from .decoder import CausalLM


def record_layers(model: "CausalLM", ws: Workspace, plan: ops.Plan,
                  attend: Callable[[int, LayerParams], None], embed_plan: ops.Plan | None = None) -> None:
    """Record embedding, every layer (``attend(i, lp)`` records layer i's attention block) and
    the final norm into ``plan``: afterwards ws.h holds the finally normalised rows. With
    ``embed_plan``, the embedding goes there instead (its rows may be replaced before ``plan``
    runs: ``BatchPass.run``)."""
    p, layer, c = model.params, model.architecture.decoder_layer, model.config
    first = embed_plan if embed_plan is not None else plan
    ops.embedding(ws.x, ws.ids, p.embed, plan=first)  # (N, D)
    if ws.comm is not None:  # each rank looked up the ids of its vocabulary range, zeros for the rest
        record_all_reduce(first, ws.comm, ws.x)
    if c.arch_args.embedding_scale() != 1.0:
        ops.scale(ws.x, ws.x, c.arch_args.embedding_scale(), plan=first)  # (N, D)
    ops.rms_norm(ws.h, ws.x, p.layers[0].attn_norm, model.config.rms_norm_eps, plan=plan)  # (N, D)
    next_norms = [lp.attn_norm for lp in p.layers[1:]] + [p.norm]
    for i, (lp, next_norm) in enumerate(zip(p.layers, next_norms)):
        layer(ws, lp, next_norm, lambda: attend(i, lp), model.config, plan)


class BatchIndex:
    """Device index tensors of a batched pass over a paged cache (see ``TokenBatch``): N
    tokens, B sequences, block tables MB wide, R rows of logits."""

    def __init__(self, n: int, b: int, mb: int, r: int, device: Device, key_ends: bool = False):
        new = lambda *shape: Tensor.empty(shape, DataType.I64, device)  # noqa: E731
        self.slots = new(n)  # (N,)
        self.block_tables = new(b, mb)  # (B, MB)
        self.query_starts = new(b + 1)  # (B+1,)
        self.context_lens = new(b)  # (B,)
        self.logit_rows = new(r)  # (R,)
        self.key_ends = new(n) if key_ends else None  # (N,) the passes of two-way spans only

    def load(self, batch: TokenBatch) -> None:
        self.slots.load(batch.slots)
        self.block_tables.load(batch.block_tables)
        self.query_starts.load(batch.query_starts)
        self.context_lens.load(batch.context_lens)
        self.logit_rows.load(batch.logit_rows)
        if self.key_ends is not None:
            self.key_ends.load(batch.key_ends)


class BatchPass:
    """The recorded op calls of a batched pass of one shape (N, B, R) over paged block pools
    (per layer (K, V), each (NB, BS, KH, Dh), and an 8-bit pool's (K scales, V scales) (NB, BS,
    KH) after them: ``PagedKVCache.pool``; block tables ``max_blocks`` wide), the head
    included: the rows whose logits are wanted are gathered, normalised, then projected. Its
    inputs are static device buffers (``ws.ids``, ``ws.pos``, ``idx``) loaded before each run,
    so a run can be replayed from a graph. A pass made ``with_inputs`` records the embedding
    in a plan of its own, so that given rows can replace its output (``run``); one made
    ``with_key_ends`` attends with per-row key ends (``TokenBatch.key_ends``)."""

    def __init__(self, model: "CausalLM", ws: Workspace, pools: "Sequence[tuple[Tensor, ...]]", max_blocks: int,
                 n: int, b: int, r: int, with_inputs: bool = False, with_key_ends: bool = False):
        self.ws = ws
        self.idx = BatchIndex(n, b, max_blocks, r, model.device, with_key_ends)
        self.plan = plan = ops.Plan()
        self.embed = ops.Plan() if with_inputs else None
        self.h_rows = Tensor.empty((r, model.config.hidden_size), model.dtype, model.device)  # (R, D)
        self.logits = Tensor.empty((r, model.local_config.vocab_size), model.dtype, model.device)  # (R, V or c)

        def attend(i: int, lp: LayerParams) -> None:
            paged_attention(ws, lp, pools[i], self.idx, model.config, plan)

        record_layers(model, ws, plan, attend, self.embed)
        if r:
            ops.embedding(self.h_rows, self.idx.logit_rows, ws.h, plan=plan)  # (R, D): gather the rows
            ops.linear(self.logits, self.h_rows, model.params.lm_head, plan=plan)  # (R, V)

    def run(self, input_rows: "tuple[np.ndarray, np.ndarray] | None" = None) -> None:
        """Run the pass; ``input_rows`` (rows (K,) ascending, values (K, D)) replace those rows
        of the embedded input first (a pass made ``with_inputs`` only)."""
        if self.embed is None:
            assert input_rows is None, "a pass given input rows must be made with_inputs"
            self.plan.run()
            return
        self.embed.run()
        if input_rows is not None:
            rows, values = input_rows
            x = self.ws.x  # (N, D)
            # one copy per run of consecutive rows (an image's rows are consecutive)
            breaks = np.flatnonzero(np.diff(rows) != 1) + 1
            for begin, end in zip([0, *breaks.tolist()], [*breaks.tolist(), len(rows)]):
                first = int(rows[begin])
                x.slice(0, first, first + end - begin).load(values[begin:end])
        self.plan.run()


class RowsPass:
    """A pass of S tokens of one sequence over a ``KVCache`` with contiguous ops (for devices
    without paged kernels), recorded once and replayed.

    Everything but the cache rows stays put between passes of one size, so only the three
    calls per layer that touch the cache move to the rows of each new position (``move``):
    where all of them run as native calls with descriptors of their own (a plugin's kernels),
    one C call rewrites the descriptors' data pointers and lengths; otherwise each call is
    rebound from Python. ``head`` is the output head of the last row, a plan of its own."""

    def __init__(self, model: "CausalLM", ws: Workspace, cache: KVCache, start: int, end: int):
        self.ws = ws
        self.plan = plan = ops.Plan()
        self.kv_at: list[int] = []  # per layer: index of its first call that touches the cache

        def attend(i: int, lp: LayerParams) -> None:
            self.kv_at.append(attention(ws, lp, cache.rows(i, start, end), model.config, plan))

        record_layers(model, ws, plan, attend)
        self.span = (start, end)  # the rows the cache calls point at
        self.recorded_span = self.span  # the rows the plan's recorded tensors name
        self._fields: Any = None  # the C rewrite of the cache rows (RowFields), False where there is none
        self._compiled_for: Any = None  # the plan's compiled replay the rewrite's addresses belong to
        self.head = ops.Plan()  # (1, V or c) logits of the last row
        ops.linear(ws.logits, ws.h_last, model.params.lm_head, plan=self.head)

    def move(self, cache: KVCache, start: int, end: int) -> None:
        """Point the cache calls at positions ``start:end`` (end - start = S)."""
        if self.span == (start, end):
            return
        plan = self.plan
        if self._fields is None and plan.compiled is not None:
            self._fields = RowFields.of(plan, cache, self.kv_at, *self.span) or False
            self._compiled_for = plan.compiled
        if self._fields and plan.compiled is self._compiled_for:
            self._fields.move(start, end)
        else:
            if self._fields:  # compiled again: the new descriptors were made from the recorded tensors
                self.span, self._fields = self.recorded_span, None
            self._rebind(cache, start, end)
        self.span = (start, end)

    def _rebind(self, cache: KVCache, start: int, end: int) -> None:
        plan, q = self.plan, self.ws.q
        for layer, at in enumerate(self.kv_at):
            k_new, v_new, k_seen, v_seen = cache.rows(layer, start, end)
            plan.rebind(at, outputs=(k_new,))
            plan.rebind(at + 1, outputs=(v_new,))
            plan.rebind(at + 2, inputs=(q, k_seen, v_seen))
        self.recorded_span = (start, end)


_RowField = structs.RowField  # lo_row_field: *field = base + per_start * start + per_end * end


class RowFields:
    """The descriptor fields of a ``RowsPass``'s cache calls that change with the position,
    rewritten by one C call (``llaisys_ops_move_rows``): each layer's K and V writes start at
    row ``start`` (data pointer), its attention reads rows ``0:end`` (first dimension)."""

    def __init__(self, fields: list[tuple[int, int, int, int]], keep: list[Any], fn: Any):
        self.array = (_RowField * len(fields))(*(_RowField(*f) for f in fields))
        self.keep, self.fn = keep, fn  # the native calls own the memory the fields point into

    @classmethod
    def of(cls, plan: ops.Plan, cache: KVCache, kv_at: list[int], start: int, end: int) -> "RowFields | None":
        """The fields of ``plan``'s cache calls (compiled, pointing at rows ``start:end``), or
        None unless every one of them is a native call that exposes its descriptors."""
        lib = _native.load("ops")
        fn = getattr(lib, "llaisys_ops_move_rows", None) if lib is not None else None
        if fn is None:
            return None
        fields, keep = [], []
        for layer, at in enumerate(kv_at):
            k, v = cache.k_layers[layer], cache.v_layers[layer]  # (1, Tmax, KH, Dh)
            row = k.strides[1] * k.dtype.itemsize  # bytes per position
            calls = [plan.native(at), plan.native(at + 1), plan.native(at + 2)]
            if not all(c is not None and c.fields is not None for c in calls):
                return None
            where = [calls[0].fields("outputs", 0), calls[1].fields("outputs", 0),
                     calls[2].fields("inputs", 1), calls[2].fields("inputs", 2)]
            if any(w is None for w in where):
                return None
            (k_data, _), (v_data, _), (_, k_len), (_, v_len) = where
            fields += [(k_data, k.data_ptr, row, 0), (v_data, v.data_ptr, row, 0), (k_len, 0, 0, 1), (v_len, 0, 0, 1)]
            keep += calls
        return cls(fields, keep, fn)

    def move(self, start: int, end: int) -> None:
        """Point the fields at rows ``start:end``."""
        self.fn(self.array, ctypes.c_int64(len(self.array)), ctypes.c_int64(start), ctypes.c_int64(end))


def pad_decode_batch(batch: TokenBatch, size: int) -> TokenBatch:
    """A decoding batch (one token per sequence, B of them) grown to ``size`` sequences and
    ``size`` logit rows, for a graph captured at that bucket. The extra sequences repeat the
    first one (its token, position, slot and block table), so every index stays valid and the
    extra K/V writes put the same values in the same slot; extra logit rows repeat row 0.
    The caller keeps the first R rows of the logits."""
    b, r = batch.num_seqs, int(batch.logit_rows.shape[0])
    if b == size and r == size:
        return batch
    more = lambda a: np.concatenate([a, np.repeat(a[:1], size - b, axis=0)])  # noqa: E731
    rows = np.concatenate([batch.logit_rows, np.zeros(size - r, np.int64)]).astype(np.int64)
    rope = None if batch.rope_positions is None else np.concatenate(
        [batch.rope_positions, np.repeat(batch.rope_positions[:, :1], size - b, axis=1)], axis=1)  # (3, size)
    return TokenBatch(more(batch.token_ids), more(batch.positions), more(batch.slots), more(batch.block_tables),
                      np.arange(size + 1, dtype=np.int64), more(batch.context_lens), rows, rope_positions=rope)


def sequence_batch(ids: np.ndarray, start: int, logit_rows: str) -> TokenBatch:
    """The batch of one sequence's tokens ``ids`` (S,) at positions ``start:start+S`` of a
    ``KVCache`` (one block whose slot i holds position i); ``logit_rows`` is "all", "last"
    or "none"."""
    s = len(ids)
    end = start + s
    positions = np.arange(start, end, dtype=np.int64)  # (S,) also the slots
    rows = {"all": np.arange(s, dtype=np.int64), "last": np.array([s - 1], np.int64),
            "none": np.empty(0, np.int64)}[logit_rows]
    return TokenBatch(ids, positions, positions, np.zeros((1, 1), np.int64), np.array([0, s], np.int64),
                      np.array([end], np.int64), rows)
