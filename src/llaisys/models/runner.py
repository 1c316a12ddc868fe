"""The model runner: the one place a model's layers run on tensors, for every caller.

A single sequence (``CausalLM.forward`` over a ``KVCache``: one block of ``max_tokens``
slots) and a serving step (``forward_batch`` over a ``PagedKVCache`` shared by many
sequences) are the same thing here: a flat batch of tokens (``TokenBatch``) run by one
recorded paged pass (``BatchPass``), the paged ops inside the pass's native stretch.

The runner owns what a pass needs besides the weights: the work buffers of each token count
(``Workspace``), the recorded passes of each batch shape, their index buffers, and, on an
nvidia device, the CUDA graphs that replay decoding steps. A pass is recorded once per shape
(N tokens, B sequences, R logit rows) and cache; later steps of that shape only load their
index arrays into its static buffers and replay it.

A device without paged kernels (a device plugin that registers only the nine ops; the
reference plugin has them) runs single sequences with its own contiguous ops instead
(``RowsPass``: the cache calls of a recorded pass moved to the rows of each new position),
since the CPU fallback of a paged op would copy a whole layer's pool to the host and back at
each call.

Shapes: N tokens in a pass, B sequences, MB block-table width, R logit rows, S tokens of one
sequence, D hidden, V vocabulary (V or c: this rank's slice under tensor parallelism).
"""
from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .. import ops
from ..kernels.registry import find_kernel
from ..parallel.comm import record_all_reduce
from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .kv_cache import KVCache
from .layers import Workspace, attention, paged_attention
from .paged_cache import PagedKVCache, TokenBatch
from .params import LayerParams

if TYPE_CHECKING:
    from .decoder import CausalLM

PASSES_KEPT = 32  # recorded passes kept per cache (by N, B, R), least recently used dropped
WORKSPACES_KEPT = 8  # work buffers kept per cache (by N)


def record_layers(model: "CausalLM", ws: Workspace, plan: ops.Plan,
                  attend: Callable[[int, LayerParams], None]) -> None:
    """Record embedding, every layer (``attend(i, lp)`` records layer i's attention block) and
    the final norm into ``plan``: afterwards ws.h holds the finally normalised rows."""
    p, layer, c = model.params, model.architecture.decoder_layer, model.config
    ops.embedding(ws.x, ws.ids, p.embed, plan=plan)  # (N, D)
    if ws.comm is not None:  # each rank looked up the ids of its vocabulary range, zeros for the rest
        record_all_reduce(plan, ws.comm, ws.x)
    if c.embedding_multiplier != 1.0:
        ops.scale(ws.x, ws.x, c.embedding_multiplier, plan=plan)  # (N, D)
    ops.rms_norm(ws.h, ws.x, p.layers[0].attn_norm, model.config.rms_norm_eps, plan=plan)  # (N, D)
    next_norms = [lp.attn_norm for lp in p.layers[1:]] + [p.norm]
    for i, (lp, next_norm) in enumerate(zip(p.layers, next_norms)):
        layer(ws, lp, next_norm, lambda: attend(i, lp), model.config, plan)


class BatchIndex:
    """Device index tensors of a batched pass over a paged cache (see ``TokenBatch``): N
    tokens, B sequences, block tables MB wide, R rows of logits."""

    def __init__(self, n: int, b: int, mb: int, r: int, device: Device):
        new = lambda *shape: Tensor.empty(shape, DataType.I64, device)  # noqa: E731
        self.slots = new(n)  # (N,)
        self.block_tables = new(b, mb)  # (B, MB)
        self.query_starts = new(b + 1)  # (B+1,)
        self.context_lens = new(b)  # (B,)
        self.logit_rows = new(r)  # (R,)

    def load(self, batch: TokenBatch) -> None:
        self.slots.load(batch.slots)
        self.block_tables.load(batch.block_tables)
        self.query_starts.load(batch.query_starts)
        self.context_lens.load(batch.context_lens)
        self.logit_rows.load(batch.logit_rows)


class BatchPass:
    """The recorded op calls of a batched pass of one shape (N, B, R) over paged block pools
    (per layer (K, V), each (NB, BS, KH, Dh), block tables ``max_blocks`` wide), the head
    included: the rows whose logits are wanted are gathered, normalised, then projected. Its
    inputs are static device buffers (``ws.ids``, ``ws.pos``, ``idx``) loaded before each run,
    so a run can be replayed from a graph."""

    def __init__(self, model: "CausalLM", ws: Workspace, pools: "Sequence[tuple[Tensor, Tensor]]", max_blocks: int,
                 n: int, b: int, r: int):
        self.ws = ws
        self.idx = BatchIndex(n, b, max_blocks, r, model.device)
        self.plan = plan = ops.Plan()
        self.h_rows = Tensor.empty((r, model.config.hidden_size), model.dtype, model.device)  # (R, D)
        self.logits = Tensor.empty((r, model.local_config.vocab_size), model.dtype, model.device)  # (R, V or c)

        def attend(i: int, lp: LayerParams) -> None:
            paged_attention(ws, lp, pools[i], self.idx, model.config, plan)

        record_layers(model, ws, plan, attend)
        if r:
            ops.embedding(self.h_rows, self.idx.logit_rows, ws.h, plan=plan)  # (R, D): gather the rows
            ops.linear(self.logits, self.h_rows, model.params.lm_head, plan=plan)  # (R, V)


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


class _RowField(ctypes.Structure):
    """``lo_row_field`` of csrc/ops/plugin_calls.c: *field = base + per_start * start + per_end * end."""

    _fields_ = [("field", ctypes.c_void_p), ("base", ctypes.c_int64), ("per_start", ctypes.c_int64),
                ("per_end", ctypes.c_int64)]


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
        from .. import _native

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
    return TokenBatch(more(batch.token_ids), more(batch.positions), more(batch.slots), more(batch.block_tables),
                      np.arange(size + 1, dtype=np.int64), more(batch.context_lens), rows)


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


class ModelRunner:
    """Runs ``model``'s layers: ``run_batch`` for a flat batch over a paged cache,
    ``run_sequence`` for one sequence's tokens over a ``KVCache``. Not thread-safe: the
    model serializes its calls (its passes share work buffers)."""

    def __init__(self, model: "CausalLM"):
        self.model = model
        self._graph_caches: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # per cache
        name, dtype = model.device.type.name, model.dtype
        self.paged = all(find_kernel(op, name, dtype) is not None for op in ("kv_cache_write", "paged_attention"))

    # ---- one sequence --------------------------------------------------------------------
    def run_sequence(self, ids: np.ndarray, cache: KVCache, logit_rows: str) -> "Tensor | None":
        """Run ``ids`` (S,) after the cache's content and advance ``cache.length`` by S.
        Returns this rank's logits on the device: (S, V or c) for ``logit_rows="all"``,
        (1, V or c) for "last", None for "none"."""
        start = cache.length
        if not self.paged:
            return self._run_rows(ids, cache, logit_rows)
        logits = self.run_batch(sequence_batch(ids, start, logit_rows), cache)
        cache.length = start + len(ids)
        return logits if logit_rows != "none" else None

    def _run_rows(self, ids: np.ndarray, cache: KVCache, logit_rows: str) -> "Tensor | None":
        """``run_sequence`` with the device's contiguous ops (``RowsPass``)."""
        m, s = self.model, len(ids)
        start, end = cache.length, cache.length + s
        step = cache.passes.get(s)
        if step is None:
            step = cache.passes[s] = RowsPass(m, self._workspace(cache, s), cache, start, end)
            self._trim(cache)
        else:
            cache.passes.move_to_end(s)
        step.move(cache, start, end)
        ws = step.ws
        ws.ids.load(ids if m.shard is None else m.shard.local_ids(ids))
        ws.pos.load(np.arange(start, end, dtype=np.int64))
        step.plan.run()
        cache.length = end
        if logit_rows == "all":
            out = Tensor.empty((s, m.local_config.vocab_size), m.dtype, m.device)  # (S, V or c)
            ops.linear(out, ws.h, m.params.lm_head)  # from the finally normalised rows
            return out
        if logit_rows == "none":
            return None
        step.head.run()  # ws.logits (1, V or c) = linear(ws.h_last, lm_head)
        return ws.logits

    # ---- a batch -------------------------------------------------------------------------
    def run_batch(self, batch: TokenBatch, cache: PagedKVCache) -> Tensor:
        """Run a checked ``batch`` over ``cache``: this rank's logits (R, V or c) of
        ``batch.logit_rows`` on the device, the pass's own buffer (valid until the next pass
        over ``cache``). A decoding step (a token per sequence) on a device that captures
        graphs replays its bucket's graph, padded to it."""
        m = self.model
        n, b, r = batch.num_tokens, batch.num_seqs, int(batch.logit_rows.shape[0])
        decode = n == b and np.array_equal(batch.query_starts, np.arange(b + 1))
        graphs = self._graphs(cache) if decode else None
        if graphs is not None:
            size = graphs.bucket(b)
            batch = pad_decode_batch(batch, size)
            n = b = size
        key = (n, b, b if graphs is not None else r)
        step = cache.passes.get(key)
        if step is None:
            pools = list(zip(cache.k_layers, cache.v_layers))
            step = BatchPass(m, self._workspace(cache, n), pools, cache.max_blocks, *key)
            cache.passes[key] = step
            self._trim(cache)
            if graphs is not None:
                graphs.drop(size)  # captured over a pass of this shape that was dropped since
        else:
            cache.passes.move_to_end(key)
        step.ws.ids.load(batch.token_ids if m.shard is None else m.shard.local_ids(batch.token_ids))
        step.ws.pos.load(batch.positions)
        step.idx.load(batch)
        if graphs is not None:
            graphs.run(size, step.plan.run)
            return step.logits.slice(0, 0, r)  # (R, V): the batch's own rows
        step.plan.run()
        return step.logits  # (R, V)

    # ---- buffers, passes, graphs -----------------------------------------------------------
    def hidden_states(self, cache: PagedKVCache, num_tokens: int) -> Tensor:
        """The finally normalised rows (N, D) of the last pass of ``num_tokens`` tokens over
        ``cache`` (its work buffer, valid until the next pass of that size); RuntimeError when
        no such pass ran."""
        ws = cache.workspaces.get(num_tokens)
        if ws is None:
            raise RuntimeError(f"no pass of {num_tokens} tokens ran over this cache; its hidden states are gone")
        return ws.h

    def decoding_pass(self, cache: KVCache) -> "BatchPass | RowsPass":
        """The recorded pass that decodes one token of the sequence in ``cache`` (after at
        least one decoding step ran); KeyError before that."""
        return cache.passes[(1, 1, 1) if self.paged else 1]

    def _workspace(self, cache: PagedKVCache, n: int) -> Workspace:
        """The work buffers for passes of ``n`` tokens over ``cache`` (shared by its passes
        of every B and R with that N; the least recently made beyond a few are dropped, with
        the passes that use them)."""
        spaces = cache.workspaces
        ws = spaces.get(n)
        if ws is None:
            m = self.model
            ws = spaces[n] = Workspace(m.local_config, n, m.dtype, m.device, m.comm)
            while len(spaces) > WORKSPACES_KEPT:
                oldest = next(iter(spaces))
                spaces.pop(oldest)
                for key in [k for k in cache.passes if (k[0] if isinstance(k, tuple) else k) == oldest]:
                    del cache.passes[key]
        else:
            spaces.move_to_end(n)
        return ws

    @staticmethod
    def _trim(cache: PagedKVCache) -> None:
        while len(cache.passes) > PASSES_KEPT:
            cache.passes.popitem(last=False)

    def _graphs(self, cache: PagedKVCache) -> Any:
        """The graph cache (``backends.nvidia.graphs.GraphCache``) that replays the decoding
        passes over ``cache``, or None: on a device whose backend captures no graphs (the CPU,
        plugins), with ``LLAISYS_NVIDIA_GRAPHS=0``, under tensor parallelism (its plans hold
        collective calls), or for routed experts with no kernel on the device (the CPU fallback's
        host copies cannot be captured; nvidia has one, ``kernels/nvidia/moe.py``)."""
        m = self.model
        if m.shard is not None or m.device.is_cpu:
            return None
        if m.config.num_experts and find_kernel("moe_mlp", m.device.type.name, m.dtype) is None:
            return None
        try:
            return self._graph_caches[cache]
        except KeyError:
            pass
        from ..runtime import get_runtime

        make = getattr(get_runtime(m.device).backend, "graph_cache", None)
        graphs = self._graph_caches[cache] = make(m.device.index) if make is not None else None
        return graphs
