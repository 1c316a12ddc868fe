"""The decoder of Qwen2/Llama-family models, written with ``llaisys.ops`` only; each layer is
the one its architecture module names (``models.architectures``, ``models.layers``).

Per layer: x += o_proj(attention(rope(q), rope(k), v)) over rms_norm(x), then
x += down(swiglu(gate, up)) over rms_norm(x); each residual add runs in one op with the norm
that follows it (``add_rms_norm``). Qwen2 and Llama differ only in config (q/k/v
biases, tied embeddings, rope theta). Intermediate results go to preallocated buffers
(``Workspace``) through the output-first ops, so a decoding step allocates nothing; a pass's
op calls are checked once, recorded (``Pass``, an ``ops.Plan``) and replayed by later passes
of the same size over the same cache.
Shapes: S tokens in this pass, T = cache length after it, D hidden, H/KH query/kv heads,
Dh head dim, Dq = H*Dh, Dkv = KH*Dh, I MLP width, V vocabulary.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from .. import ops
from ..parallel.comm import Communicator, SingleProcess, record_all_reduce
from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .config import ModelConfig
from .kv_cache import KVCache
from .paged_cache import PagedKVCache, TokenBatch
from . import architectures
from .layers import CACHE_CALLS_AT, Workspace, attention, paged_attention
from .params import DecoderParams, LayerParams
from .tensor_parallel import Shard
from .tokenizer import Tokenizer

PREFILL_CHUNK = 256  # longer inputs run in chunks: less masked attention work, bounded score memory
MAX_DEFAULT_CACHE = 4096
BATCH_PASSES_KEPT = 32  # recorded batched passes kept per paged cache (by N, B, R)
BATCH_WORKSPACES_KEPT = 8  # work buffers kept per paged cache (by N)
GRAPH_DECODE = "graph-decode"  # KVCache.passes key of the single-sequence decoding pass replayed as a graph


def record_layers(model: "CausalLM", ws: Workspace, plan: ops.Plan,
                  attend: Callable[[int, LayerParams], None]) -> None:
    """Record embedding, every layer (``attend(i, lp)`` records layer i's attention block) and
    the final norm into ``plan``: afterwards ws.h holds the finally normalised rows."""
    p, layer = model.params, model.architecture.decoder_layer
    ops.embedding(ws.x, ws.ids, p.embed, plan=plan)  # (S, D)
    if ws.comm is not None:  # each rank looked up the ids of its vocabulary range, zeros for the rest
        record_all_reduce(plan, ws.comm, ws.x)
    ops.rms_norm(ws.h, ws.x, p.layers[0].attn_norm, model.config.rms_norm_eps, plan=plan)  # (S, D)
    next_norms = [lp.attn_norm for lp in p.layers[1:]] + [p.norm]
    for i, (lp, next_norm) in enumerate(zip(p.layers, next_norms)):
        layer(ws, lp, next_norm, lambda: attend(i, lp), model.config, plan)


class Pass:
    """The checked op calls of a pass of S tokens over one cache, recorded once and replayed.

    Everything but the cache rows stays put between passes of one size (the workspace, the
    weights), so only the three calls per layer that touch the cache are rebound to the
    rows of each new position (``move``). ``head`` is the output head of the last row."""

    def __init__(self, model: "CausalLM", ws: Workspace, cache: KVCache, start: int, end: int):
        self.ws = ws
        self.plan = ops.Plan()
        self.kv_at: list[int] = []  # per layer: index of its first call that touches the cache
        plan = self.plan

        def attend(i: int, lp: LayerParams) -> None:
            self.kv_at.append(len(plan) + CACHE_CALLS_AT)
            attention(ws, lp, cache.rows(i, start, end), model.config, model._scale, plan)

        record_layers(model, ws, plan, attend)
        self.span = (start, end)
        # the last row's logits (1, V or c), replayed after the pass when wanted (on a plugin
        # device a quantized head's CPU fallback then runs from C too)
        self.head = ops.Plan()
        ops.linear(ws.logits, ws.h_last, model.params.lm_head, plan=self.head)

    def move(self, cache: KVCache, start: int, end: int) -> None:
        """Point the cache calls at positions ``start:end`` (end - start = S)."""
        if self.span == (start, end):
            return
        plan, q = self.plan, self.ws.q
        for layer, at in enumerate(self.kv_at):
            k_new, v_new, k_seen, v_seen = cache.rows(layer, start, end)
            plan.rebind(at, outputs=(k_new,))
            plan.rebind(at + 1, outputs=(v_new,))
            plan.rebind(at + 2, inputs=(q, k_seen, v_seen))
        self.span = (start, end)


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
            paged_attention(ws, lp, pools[i], self.idx, model.config, model._scale, plan)

        record_layers(model, ws, plan, attend)
        if r:
            ops.embedding(self.h_rows, self.idx.logit_rows, ws.h, plan=plan)  # (R, D): gather the rows
            ops.linear(self.logits, self.h_rows, model.params.lm_head, plan=plan)  # (R, V)


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


class CausalLM:
    """A loaded Qwen2/Llama model: config, weights on a device, tokenizer.

    Under tensor parallelism (``comm`` of several ranks, ``shard`` this rank's part), every
    rank holds a ``CausalLM`` of its part and rank 0 drives: each of its ``forward`` and
    ``forward_batch`` calls first sends its inputs to the other ranks, which run the same call
    in ``tensor_parallel.follow`` (their caches mirror rank 0's), and returns the whole logits."""

    def __init__(self, config: ModelConfig, params: DecoderParams, tokenizer: Tokenizer, *, dtype: DataType,
                 device: Device, source: str, generation_defaults: dict | None = None,
                 eos_token_ids: Sequence[int] = (), file_info: dict[str, Any] | None = None,
                 comm: Communicator | None = None, shard: Shard | None = None):
        self.config = config
        self.comm = comm if comm is not None else SingleProcess()
        self.shard = shard if self.comm.size > 1 else None
        self.local_config = self.shard.local_config() if self.shard is not None else config  # this rank's part
        self._cache_keys = itertools.count()
        self._dropped_caches: list[int] = []  # caches rank 0 dropped, for the other ranks to drop too
        self.released = False  # rank 0 told the other ranks to stop (tensor_parallel.release)
        self.architecture = architectures.get(config.architecture)  # its layer, names and fix-ups
        self.params = params
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = device
        self.source = source
        self.generation_defaults: dict = dict(generation_defaults or {})
        self.eos_token_ids: list[int] = list(dict.fromkeys(
            [*config.eos_token_id, *eos_token_ids, *tokenizer.eos_token_ids]))
        self._file_info = dict(file_info or {})
        self._scale = 1.0 / math.sqrt(config.head_dim)
        self._workspaces: OrderedDict[int, Workspace] = OrderedDict()
        self._graph_caches: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # per cache
        self._lock = threading.RLock()  # guards the shared workspaces: one chunk runs at a time

    # ---- cache -------------------------------------------------------------------------
    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        """An empty KV cache for this model (default size: the context length, at most 4096)."""
        c = self.local_config
        if max_tokens is None:
            max_tokens = min(c.max_position_embeddings, MAX_DEFAULT_CACHE)
        cache = KVCache(c.num_hidden_layers, max_tokens, c.num_key_value_heads, c.head_dim, self.dtype, self.device,
                        owner=self)
        return self._keyed(cache, ("kv", max_tokens))

    def _workspace(self, s: int) -> Workspace:
        ws = self._workspaces.get(s)
        if ws is None:
            ws = Workspace(self.local_config, s, self.dtype, self.device, self.comm)
            self._workspaces[s] = ws
            while len(self._workspaces) > 3:  # keep the decode one and the last prefill sizes
                oldest = next(k for k in self._workspaces if k != 1)
                del self._workspaces[oldest]
        return ws

    def new_paged_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """An empty paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens for
        ``forward_batch`` (block tables as wide as the context length needs)."""
        c = self.local_config
        max_blocks = min(-(-c.max_position_embeddings // block_size), num_blocks) if block_size > 0 else 1
        cache = PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                             self.dtype, self.device, max_blocks, owner=self)
        return self._keyed(cache, ("paged", num_blocks, block_size))

    def _keyed(self, cache, spec: tuple):
        """Name a new cache for the other ranks (which make theirs from ``spec`` when first
        used) and tell them when rank 0 drops it."""
        if self.shard is not None:
            cache.tp_key, cache.tp_spec = next(self._cache_keys), spec
            if self.comm.is_driver:
                weakref.finalize(cache, self._dropped_caches.append, cache.tp_key)
        return cache

    def _lead(self, *message: Any) -> None:
        """On rank 0 of several: send the other ranks the call they are to run with it."""
        if self.shard is not None and self.comm.is_driver:
            if self.released:
                raise RuntimeError("this model's other tensor-parallel ranks were released (tensor_parallel.release); "
                                   "it runs no more passes")
            dropped, self._dropped_caches[:] = list(self._dropped_caches), []
            self.comm.broadcast_object((dropped, *message))

    def _gathered(self, local: Tensor) -> np.ndarray:
        """Whole float32 host logits (R, V) from this rank's (R, V or c)."""
        if self.shard is None:
            return local.numpy().astype(np.float32, copy=False)
        out = Tensor.empty((self.comm.size, *local.shape), local.dtype, local.device)  # (N, R, c)
        self.comm.all_gather(out, local)
        return self.shard.gather_logits(out.numpy().astype(np.float32, copy=False))

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes in a cache of this model (all layers; this
        rank's KV heads under tensor parallelism)."""
        c = self.local_config
        return PagedKVCache.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, token_ids: "Sequence[int] | np.ndarray", cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run ``token_ids`` (S,) after the cache's content and append their K/V to the cache.

        Returns float32 host logits: (V,) for the last position, or (S, V) if ``all_logits``.
        Raises ValueError for empty or out-of-vocabulary ids, a cache of another model, or a
        cache that would overflow.

        Thread-safe by a lock, the simplest correct choice: a model's passes share its work
        buffers, so each chunk runs under a lock on the model and threads sharing a model take
        turns (each with its own cache; load a model per thread to run them in parallel).
        """
        ids = self._check_ids(token_ids)
        self._check_cache(cache, len(ids))
        # Under tensor parallelism the ranks must run the calls in one order: one call at a time.
        with self._lock if self.shard is not None else contextlib.nullcontext():
            self._lead("forward", getattr(cache, "tp_key", None), getattr(cache, "tp_spec", None), cache.length,
                       ids, all_logits)
            return self._forward_chunks(ids, cache, all_logits)

    __call__ = forward

    def forward_greedy(self, token_ids: "Sequence[int] | np.ndarray", cache: KVCache) -> int:
        """``forward(token_ids, cache)`` and the argmax of its last logits (the first index of
        the maximum, as ``np.argmax``), taken on the model's device: off the CPU only the id
        crosses to the host, not V logits. Raises as ``forward`` does."""
        if self.device.is_cpu or self.shard is not None:
            return int(np.argmax(self.forward(token_ids, cache)))
        ids = self._check_ids(token_ids)
        self._check_cache(cache, len(ids))
        return self._forward_chunks(ids, cache, False, greedy=True)

    def _forward_chunks(self, ids: np.ndarray, cache: KVCache, all_logits: bool,
                        greedy: bool = False) -> "np.ndarray | int":
        outputs = []
        for begin in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[begin:begin + PREFILL_CHUNK]
            last = begin + PREFILL_CHUNK >= len(ids)
            if all_logits:
                outputs.append(self._run(chunk, cache, all_rows=True))
            else:
                logits = self._run(chunk, cache, all_rows=False, head=last, greedy=greedy)
                if last:
                    outputs.append(logits)
        return np.concatenate(outputs, axis=0) if all_logits else outputs[0]

    def _run(self, ids: np.ndarray, cache: KVCache, all_rows: bool, head: bool = True,
             greedy: bool = False) -> "np.ndarray | int | None":
        with self._lock:
            return self._run_locked(ids, cache, all_rows, head, greedy)

    def _run_locked(self, ids: np.ndarray, cache: KVCache, all_rows: bool, head: bool,
                    greedy: bool = False) -> "np.ndarray | int | None":
        """Run ``ids`` after the cache's content: host logits (S, V) with ``all_rows``, else
        the last row's (V,) (None without ``head``), or with ``greedy`` its argmax id."""
        s = len(ids)
        if s == 1 and head and not all_rows:
            graphs = self._graphs(cache)
            if graphs is not None:
                return self._head_result(self._decode_graphed(ids, cache, graphs), greedy)
        start, end = cache.length, cache.length + s
        step = self._pass(cache, s, start, end)
        ws = step.ws
        ws.ids.load(ids if self.shard is None else self.shard.local_ids(ids))
        ws.pos.load(np.arange(start, end, dtype=np.int64))
        step.plan.run()
        cache.length = end
        p = self.params
        if all_rows:
            out = Tensor.empty((s, self.local_config.vocab_size), self.dtype, self.device)  # (S, V or c)
            ops.linear(out, ws.h, p.lm_head)  # from the finally normalised rows
            return self._gathered(out)  # (S, V)
        if not head:
            return None
        step.head.run()  # ws.logits (1, V or c) = linear(ws.h_last, lm_head)
        return self._head_result(ws.logits, greedy)

    def _head_result(self, logits: Tensor, greedy: bool) -> "np.ndarray | int":
        """Host logits (V,) of a (1, V or c) device row, or with ``greedy`` the argmax, taken
        on the device (a single process holds the whole row then)."""
        if not greedy:
            return self._gathered(logits).reshape(-1)  # (V,)
        idx = Tensor.empty((1,), DataType.I64, self.device)
        ops.argmax(idx, Tensor.empty((1,), self.dtype, self.device), logits)  # (1,)
        return int(idx.numpy()[0])

    def _graphs(self, cache: "KVCache | PagedKVCache") -> Any:
        """The graph cache (``backends.nvidia.graphs.GraphCache``) that replays the decoding
        passes over ``cache``, or None: on a device whose backend captures no graphs (the CPU,
        plugins), with ``LLAISYS_NVIDIA_GRAPHS=0``, or under tensor parallelism (its plans hold
        collective calls)."""
        if self.shard is not None or self.device.is_cpu:
            return None
        try:
            return self._graph_caches[cache]
        except KeyError:
            pass
        from ..runtime import get_runtime

        make = getattr(get_runtime(self.device).backend, "graph_cache", None)
        graphs = self._graph_caches[cache] = make(self.device.index) if make is not None else None
        return graphs

    def _decode_graphed(self, ids: np.ndarray, cache: KVCache, graphs: Any) -> Tensor:
        """One token after the cache's content, as a paged pass over the cache (each layer one
        block of max_tokens slots) replayed from a graph: the same kernels and arithmetic as
        the plain pass, with the position and key count read from static device buffers
        instead of being baked into the launches. Returns the logits row (1, V) on the device."""
        step = cache.passes.get(GRAPH_DECODE)
        if step is None:
            pools = [(k.view(1, *k.shape), v.view(1, *v.shape)) for k, v in zip(cache.k_layers, cache.v_layers)]
            step = cache.passes[GRAPH_DECODE] = BatchPass(self, self._workspace(1), pools, 1, 1, 1, 1)
            step.idx.block_tables.load(np.zeros((1, 1), np.int64))  # constant: the one block, the query, row 0
            step.idx.query_starts.load(np.arange(2, dtype=np.int64))
            step.idx.logit_rows.load(np.zeros(1, np.int64))
        t = np.array([cache.length], np.int64)  # (1,) the new token's position, and its slot in block 0
        step.ws.ids.load(ids)
        step.ws.pos.load(t)
        step.idx.slots.load(t)
        step.idx.context_lens.load(t + 1)
        graphs.run(GRAPH_DECODE, step.plan.run)
        cache.length += 1
        return step.logits

    def _pass(self, cache: KVCache, s: int, start: int, end: int) -> Pass:
        """The recorded pass of ``s`` tokens over ``cache``, pointed at ``start:end``; the
        cache keeps the decoding one (S = 1) and the last other size."""
        step = cache.passes.get(s)
        if step is None:
            step = Pass(self, self._workspace(s), cache, start, end)
            for other in [k for k in cache.passes if k not in (1, GRAPH_DECODE)]:
                del cache.passes[other]
            cache.passes[s] = step
        step.move(cache, start, end)
        return step

    def forward_batch(self, batch: TokenBatch, cache: PagedKVCache) -> np.ndarray:
        """Run a flat batch of tokens from many sequences (``TokenBatch``) in one pass over the
        paged ``cache``: each token's K/V go to its slot, each sequence attends to its own
        keys. Returns float32 host logits (R, V) of ``batch.logit_rows``, in that order.

        Raises ValueError for out-of-vocabulary ids, a cache of another model, or index
        arrays that do not fit the cache. Serialized by the model's lock, like ``forward``.
        """
        with self._lock:
            return self._gathered(self._forward_batch(batch, cache))  # (R, V)

    def forward_batch_logits(self, batch: TokenBatch, cache: PagedKVCache) -> Tensor:
        """``forward_batch`` without the copy: the logits (R, V) of ``batch.logit_rows`` as a
        tensor on the model's device, in the model's dtype, for sampling there. The tensor is
        the pass's own buffer: valid until the next pass over ``cache``. Raises as
        ``forward_batch`` does, and ValueError under tensor parallelism (each rank holds a
        slice of the vocabulary)."""
        if self.shard is not None:
            raise ValueError("forward_batch_logits: under tensor parallelism the logits are gathered on the host; "
                             "use forward_batch")
        with self._lock:
            return self._forward_batch(batch, cache)

    def _forward_batch(self, batch: TokenBatch, cache: PagedKVCache) -> Tensor:
        """The pass of ``forward_batch`` (under the model's lock): this rank's logits (R, V or
        c) on the device."""
        if not isinstance(cache, PagedKVCache) or not cache.made_by(self):
            raise ValueError(f"cache {cache!r} was not made for this model; use model.new_paged_cache()")
        self._check_ids(batch.token_ids)
        n, b, r = batch.num_tokens, batch.num_seqs, int(batch.logit_rows.shape[0])
        if batch.block_tables.shape != (b, cache.max_blocks):
            raise ValueError(f"forward_batch: block_tables has shape {batch.block_tables.shape}; expected "
                             f"({b}, {cache.max_blocks}) for {b} sequences and this cache")
        if batch.positions.shape != (n,) or batch.slots.shape != (n,) or batch.query_starts.shape != (b + 1,):
            raise ValueError(f"forward_batch: positions {batch.positions.shape}, slots {batch.slots.shape} and "
                             f"query_starts {batch.query_starts.shape} must be ({n},), ({n},) and ({b + 1},)")
        if r and (batch.logit_rows.min() < 0 or batch.logit_rows.max() >= n):
            raise ValueError(f"forward_batch: logit_rows must lie in [0, {n})")
        self._lead("batch", getattr(cache, "tp_key", None), getattr(cache, "tp_spec", None), batch)
        # A decoding step (a token per sequence) replays its bucket's graph, padded to it.
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
            step = BatchPass(self, self._batch_workspace(cache, n), pools, cache.max_blocks, *key)
            cache.passes[key] = step
            while len(cache.passes) > BATCH_PASSES_KEPT:
                cache.passes.popitem(last=False)
            if graphs is not None:
                graphs.drop(size)  # captured over a pass of this shape that was dropped since
        else:
            cache.passes.move_to_end(key)
        ids = batch.token_ids if self.shard is None else self.shard.local_ids(batch.token_ids)
        step.ws.ids.load(ids)
        step.ws.pos.load(batch.positions)
        step.idx.load(batch)
        if graphs is not None:
            graphs.run(size, step.plan.run)
            return step.logits.slice(0, 0, r)  # (R, V): the batch's own rows
        step.plan.run()
        return step.logits  # (R, V)

    def _batch_workspace(self, cache: PagedKVCache, n: int) -> Workspace:
        """The workspace for passes of ``n`` tokens over ``cache`` (shared by its passes of
        every B and R with that N; the least recently made beyond a few are dropped)."""
        spaces = cache.workspaces
        ws = spaces.get(n)
        if ws is None:
            ws = spaces[n] = Workspace(self.local_config, n, self.dtype, self.device, self.comm)
            while len(spaces) > BATCH_WORKSPACES_KEPT:
                oldest = next(iter(spaces))
                spaces.pop(oldest)
                for key in [k for k in cache.passes if k[0] == oldest]:
                    del cache.passes[key]
        else:
            spaces.move_to_end(n)
        return ws

    def _check_ids(self, token_ids: "Sequence[int] | np.ndarray") -> np.ndarray:
        try:
            ids = np.asarray(token_ids)
        except (TypeError, ValueError):
            raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}") from None
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence of ints; got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(ids[bad][0])} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids.astype(np.int64, copy=False)

    def _check_cache(self, cache: KVCache, s: int) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache from new_cache(), got {type(cache).__name__}")
        if not cache.made_by(self):  # another model's cache, even of the same layout, holds its own keys
            raise ValueError(f"cache {cache!r} was not made for this model; use model.new_cache()")
        if cache.length + s > cache.max_tokens:
            raise ValueError(
                f"KV cache overflow: {cache.length} tokens held + {s} new > max_tokens={cache.max_tokens}; "
                f"make a larger cache with new_cache(max_tokens=...) or shorten the input"
            )

    # ---- description -------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Parameters of the model as stored (a tied head counted once)."""
        p = self.params
        tensors = [p.embed, p.norm] + ([] if self.config.tie_word_embeddings else [p.lm_head])
        for lp in p.layers:
            tensors += [t for t in (lp.attn_norm, lp.qkv, lp.qkv_bias, lp.o, lp.o_bias, lp.ffn_norm, lp.gate_up, lp.down)
                        if t is not None]
        return sum(t.numel() for t in tensors)

    def weight_types(self) -> dict[str, str]:
        """The data type each weight is held in, by role: ``{"embed": "Q8_0", "qkv": "Q4_1", ...}``;
        a role whose layers differ lists the counts (``"Q4_K x20, Q6_K x10"``)."""
        p = self.params
        roles: dict[str, list[Tensor]] = {"embed": [p.embed], "lm_head": [p.lm_head]}
        for name in ("qkv", "o", "gate_up", "down", "qkv_bias", "o_bias"):
            tensors = [getattr(lp, name) for lp in p.layers if getattr(lp, name) is not None]
            if tensors:
                roles[name] = tensors
        roles["norms"] = [p.norm] + [t for lp in p.layers for t in (lp.attn_norm, lp.ffn_norm)]
        out = {}
        for role, tensors in roles.items():
            counts = Counter(t.dtype.name for t in tensors)
            out[role] = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        if self.config.tie_word_embeddings:
            out["lm_head"] = "embed (tied)"
        return out

    def weight_bytes(self) -> int:
        """Bytes the weights take on the device (a tied head counted once)."""
        p = self.params
        tensors = [p.embed, p.lm_head, p.norm] + [t for lp in p.layers for t in (
            lp.attn_norm, lp.qkv, lp.qkv_bias, lp.o, lp.o_bias, lp.ffn_norm, lp.gate_up, lp.down) if t is not None]
        return sum({id(t.storage): t.storage.nbytes for t in tensors}.values())

    def info(self) -> dict:
        """Architecture, size and type facts for display (``llaisys info``)."""
        c = self.config
        return {
            "source": self.source,
            "architecture": c.architecture,
            "parameters": self.num_parameters(),
            "layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "attention_heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
            "context_length": c.max_position_embeddings,
            "rope_theta": c.rope_theta,
            "tie_word_embeddings": c.tie_word_embeddings,
            "attention_bias": c.attention_bias,
            "dtype": self.dtype.name.lower(),
            "weights": self.weight_types(),
            "weight_bytes": self.weight_bytes(),
            "device": str(self.device),
            "eos_token_ids": list(self.eos_token_ids),
            "has_chat_template": bool(self.tokenizer.chat_template),
            **self._file_info,
        }

    def __repr__(self) -> str:
        c = self.config
        return (f"CausalLM({c.architecture}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"dtype={self.dtype.name}, device={self.device}, source={self.source!r})")
