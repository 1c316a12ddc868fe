"""The model runner: every pass of a model runs here, for every caller.

A ``ModelRunner`` is made once per loaded model (``CausalLM``, the record of what was loaded:
config, weights, tokenizer) and owns how it runs: its caches (``new_cache``, a contiguous
``KVCache`` of one sequence; ``new_paged_cache``, the engine's block pools), the checked entry
points (``forward`` for one sequence, ``forward_batch`` for a flat batch of many, as the engine
steps), one pass at a time under its lock, and under tensor parallelism rank 0's leading of
the other ranks (``tensor_parallel.Leader``).

A single sequence and a serving step are the same thing here: a flat batch of tokens
(``TokenBatch``) run by one recorded paged pass (``passes.BatchPass``), the paged ops inside
the pass's native stretch. The runner keeps what a pass needs besides the weights: the work
buffers of each token count (``Workspace``), the recorded passes of each batch shape (N tokens,
B sequences, R logit rows) per cache, and, on an nvidia device, the CUDA graphs that replay
decoding steps. Later steps of a shape only load their index arrays and replay.

A device without paged kernels (a device plugin that registers only the nine ops) runs single
sequences with its own contiguous ops instead (``passes.RowsPass``), since the CPU fallback of
a paged op would copy a whole layer's pool to the host and back at each call.

Shapes: N tokens in a pass, B sequences, R logit rows, S tokens of one sequence, D hidden,
V vocabulary (V or c: this rank's slice under tensor parallelism).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .. import ops
from ..kernels.registry import find_kernel
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .kv_cache import KVCache
from .layers import Workspace
from .paged_cache import PagedKVCache, TokenBatch, parse_kv_cache_dtype
from .passes import BatchPass, RowsPass, pad_decode_batch, sequence_batch
from .tensor_parallel import Leader

if TYPE_CHECKING:
    from .decoder import CausalLM

PREFILL_CHUNK = 256  # ``forward``'s longer inputs run in chunks: less masked attention work, bounded score memory
MAX_DEFAULT_CACHE = 4096
PASSES_KEPT = 32  # recorded passes kept per cache (by N, B, R), least recently used dropped
WORKSPACES_KEPT = 8  # work buffers kept per cache (by N)


class ModelRunner:
    """Runs ``model`` (a ``CausalLM``): its caches, its checked passes, their recordings.

    Thread-safe by a lock, the simplest correct choice: a model's passes share its work
    buffers, so each pass runs under the runner's lock and threads sharing a model take turns
    (each with its own cache; load a model per thread to run them in parallel)."""

    def __init__(self, model: "CausalLM"):
        self.model = model
        self.lock = threading.RLock()  # one pass at a time: a cache's passes share work buffers
        # rank 0 of several sends each call to the other ranks first (tensor_parallel.follow)
        self.leader = Leader(model.comm, self.lock) if model.shard is not None and model.comm.is_driver else None
        self._graph_caches: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # per cache
        name, dtype = model.device.type.name, model.dtype
        self.paged = all(find_kernel(op, name, dtype) is not None for op in ("kv_cache_write", "paged_attention"))

    # ---- caches ------------------------------------------------------------------------
    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        """An empty KV cache for this model (default size: the context length, at most 4096)."""
        m, c = self.model, self.model.local_config
        if max_tokens is None:
            max_tokens = min(c.max_position_embeddings, MAX_DEFAULT_CACHE)
        cache = KVCache(c.num_hidden_layers, max_tokens, c.num_key_value_heads, c.head_dim, m.dtype, m.device, owner=self)
        return self._keyed(cache, ("kv", max_tokens))

    def new_paged_cache(self, num_blocks: int, block_size: int = 16,
                        kv_dtype: "DataType | str | None" = None) -> PagedKVCache:
        """An empty paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens for
        ``forward_batch`` (block tables as wide as the context length needs). ``kv_dtype``: None
        or "auto" for the model's own type; DataType.I8 ("int8", "q8_0") for keys and values in
        8 bits with a scale per head of each slot (``PagedKVCache``), ValueError where the model's
        device lacks the kernels of that layout."""
        c = self.model.local_config
        dtype = self._kv_dtype(kv_dtype)
        max_blocks = -(-c.max_position_embeddings // block_size) if block_size > 0 else 1
        if not c.kv_window():  # a sequence holds its table's blocks at once (behind a window it hands them back)
            max_blocks = min(max_blocks, num_blocks)
        cache = PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                             dtype, self.model.device, max_blocks, owner=self)
        spec = ("paged", num_blocks, block_size) + ((dtype,) if dtype is not self.model.dtype else ())
        return self._keyed(cache, spec)

    def kv_bytes_per_token(self, kv_dtype: "DataType | str | None" = None) -> int:
        """Bytes of keys and values one token takes in a cache of this model (all layers; this
        rank's KV heads under tensor parallelism), in the model's type or ``kv_dtype`` (as
        ``new_paged_cache`` takes it; the 8-bit layout's scales included)."""
        c = self.model.local_config
        dtype = self.model.dtype if kv_dtype is None else self._kv_dtype(kv_dtype)
        return PagedKVCache.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype)

    def _kv_dtype(self, kv_dtype: "DataType | str | None") -> DataType:
        """The cache type ``kv_dtype`` names (``paged_cache.parse_kv_cache_dtype``): the model's
        own, or I8 where the device has the kernels of the 8-bit layout (ValueError otherwise)."""
        dtype = None if kv_dtype is None else parse_kv_cache_dtype(kv_dtype)
        m = self.model
        if dtype is None or dtype is m.dtype:
            return m.dtype
        if dtype is not DataType.I8:
            raise ValueError(f"a KV cache holds the model's type ({m.dtype.name}) or I8 (int8), not {dtype.name}")
        missing = [op for op in self._q8_kernels() if find_kernel(op, m.device.type.name, m.dtype) is None]
        if missing or not self.paged:
            raise ValueError(f"an int8 KV cache needs the 8-bit paged kernels on {m.device} for {m.dtype.name} "
                             f"activations, and this device lacks {', '.join(missing or ['the paged kernels'])}; "
                             f"use kv_cache_dtype='auto' (the model's own type) here")
        return DataType.I8

    def _q8_kernels(self) -> list[str]:
        """The kernels a pass over an 8-bit pool dispatches to (``ops.paged_attention``'s names):
        the window's forms where a layer has one, the key ends' where the model takes images."""
        c = self.model.config
        windows = [""] + (["_window"] if any(c.layer_window(i) for i in range(c.num_hidden_layers)) else [])
        ends = [""] + (["_ends"] if getattr(self.model, "vision", None) is not None else [])
        return ["kv_cache_write_q8"] + [f"paged_attention_q8{w}{e}" for w in windows for e in ends]

    def _keyed(self, cache, spec: tuple):
        """Name a new cache for the other ranks (which make theirs from ``spec`` when first
        used and drop it when rank 0 does)."""
        if self.leader is not None:
            self.leader.name(cache, spec)
        return cache

    def _lead(self, *message: Any) -> None:
        """On rank 0 of several: send the other ranks the call they are to run with it."""
        if self.leader is not None:
            self.leader.send(*message)

    def _gathered(self, local: Tensor) -> np.ndarray:
        """Whole float32 host logits (R, V) from this rank's (R, V or c)."""
        m = self.model
        if m.shard is None:
            return local.numpy().astype(np.float32, copy=False)
        out = Tensor.empty((m.comm.size, *local.shape), local.dtype, local.device)  # (N, R, c)
        m.comm.all_gather(out, local)
        return m.shard.gather_logits(out.numpy().astype(np.float32, copy=False))

    # ---- checked passes ------------------------------------------------------------------
    def forward(self, token_ids: "Sequence[int] | np.ndarray", cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run ``token_ids`` (S,) after the cache's content and append their K/V to the cache.

        Returns float32 host logits: (V,) for the last position, or (S, V) if ``all_logits``.
        Raises ValueError for empty or out-of-vocabulary ids, a cache of another model, or a
        cache that would overflow.

        Serialized by the runner's lock (see ``ModelRunner``).
        """
        ids = self._check_ids(token_ids)
        self._check_cache(cache, len(ids))
        # Under tensor parallelism the ranks must run the calls in one order: one call at a time.
        with self.lock if self.model.shard is not None else contextlib.nullcontext():
            self._lead("forward", getattr(cache, "tp_key", None), getattr(cache, "tp_spec", None), cache.length,
                       ids, all_logits)
            return self._forward_chunks(ids, cache, all_logits)

    def _forward_chunks(self, ids: np.ndarray, cache: KVCache, all_logits: bool) -> np.ndarray:
        """Run ``ids`` in chunks of at most PREFILL_CHUNK tokens (under the model's lock):
        host logits (S, V) with ``all_logits``, else the last row's (V,)."""
        outputs = []
        with self.lock:
            for begin in range(0, len(ids), PREFILL_CHUNK):
                chunk = ids[begin:begin + PREFILL_CHUNK]
                last = begin + PREFILL_CHUNK >= len(ids)
                rows = "all" if all_logits else "last" if last else "none"
                logits = self.run_sequence(chunk, cache, rows)
                if all_logits:
                    outputs.append(self._gathered(logits))
                elif last:
                    return self._gathered(logits).reshape(-1)  # (V,)
        return np.concatenate(outputs, axis=0)

    def forward_batch(self, batch: TokenBatch, cache: PagedKVCache) -> np.ndarray:
        """Run a flat batch of tokens from many sequences (``TokenBatch``) in one pass over the
        paged ``cache``: each token's K/V go to its slot, each sequence attends to its own
        keys. Returns float32 host logits (R, V) of ``batch.logit_rows``, in that order.

        Raises ValueError for out-of-vocabulary ids, a cache of another model, or index
        arrays that do not fit the cache. Serialized by the model's lock, like ``forward``.
        """
        with self.lock:
            return self._gathered(self._forward_batch(batch, cache))  # (R, V)

    def forward_batch_logits(self, batch: TokenBatch, cache: PagedKVCache) -> Tensor:
        """``forward_batch`` without the copy: the logits (R, V) of ``batch.logit_rows`` as a
        tensor on the model's device, in the model's dtype, for sampling there. The tensor is
        the pass's own buffer: valid until the next pass over ``cache``. Raises as
        ``forward_batch`` does, and ValueError under tensor parallelism (each rank holds a
        slice of the vocabulary)."""
        if self.model.shard is not None:
            raise ValueError("forward_batch_logits: under tensor parallelism the logits are gathered on the host; "
                             "use forward_batch")
        with self.lock:
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
        if batch.key_ends is not None and batch.key_ends.shape != (n,):
            raise ValueError(f"forward_batch: key_ends has shape {batch.key_ends.shape}; expected ({n},)")
        if batch.rope_positions is not None and batch.rope_positions.shape != (3, n):
            raise ValueError(f"forward_batch: rope_positions has shape {batch.rope_positions.shape}; expected (3, {n})")
        if batch.input_rows is not None:
            rows, values = batch.input_rows
            d = self.model.config.hidden_size
            if rows.ndim != 1 or values.shape != (len(rows), d) or (len(rows) and (
                    rows.min() < 0 or rows.max() >= n or np.any(np.diff(rows) <= 0))):
                raise ValueError(f"forward_batch: input_rows must be (rows (K,) ascending in [0, {n}), values (K, {d})); "
                                 f"got rows {rows.shape}, values {values.shape}")
        self._lead("batch", getattr(cache, "tp_key", None), getattr(cache, "tp_spec", None), batch)
        return self.run_batch(batch, cache)

    def hidden_states(self, cache: PagedKVCache, num_tokens: int) -> np.ndarray:
        """The final hidden states (N, D) float32 (after the last norm) of the pass of
        ``num_tokens`` tokens that just ran over ``cache`` (the rows an embedding pools)."""
        with self.lock:
            return self.hidden_rows(cache, num_tokens).numpy().astype(np.float32, copy=False)

    def _check_ids(self, token_ids: "Sequence[int] | np.ndarray") -> np.ndarray:
        try:
            ids = np.asarray(token_ids)
        except (TypeError, ValueError):
            raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}") from None
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence of ints; got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {ids.dtype}")
        vocab = self.model.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = ids[(ids < 0) | (ids >= vocab)]
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab})")
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
        if ws.rope_pos is not None:  # one sequence of text: its three streams are its positions
            ws.rope_pos.load(np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, s)))
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
        inputs = batch.input_rows if batch.input_rows is not None and len(batch.input_rows[0]) else None
        ends = batch.key_ends is not None
        # graphs replay decoding steps (a token per sequence, no rows given as input) only
        graphs = self._graphs(cache) if inputs is None and not ends else None  # None on the CPU too
        if graphs is not None and not (n == b and np.array_equal(batch.query_starts, np.arange(b + 1))):
            graphs = None
        if graphs is not None:
            size = graphs.bucket(b)
            batch = pad_decode_batch(batch, size)
            n = b = size
        key = (n, b, b if graphs is not None else r) + (("inputs",) if inputs is not None else ()) + (
            ("key_ends",) if ends else ())
        step = cache.passes.get(key)
        if step is None:
            pools = [cache.pool(i) for i in range(len(cache.k_layers))]  # (K, V[, K scales, V scales]) per layer
            step = BatchPass(m, self._workspace(cache, n), pools, cache.max_blocks, n, b, key[2],
                             with_inputs=inputs is not None, with_key_ends=ends)
            cache.passes[key] = step
            self._trim(cache)
            if graphs is not None:
                graphs.drop(size)  # captured over a pass of this shape that was dropped since
        else:
            cache.passes.move_to_end(key)
        step.ws.ids.load(batch.token_ids if m.shard is None else m.shard.local_ids(batch.token_ids))
        step.ws.pos.load(batch.positions)
        if step.ws.rope_pos is not None:
            rope = batch.rope_positions
            step.ws.rope_pos.load(rope if rope is not None else np.broadcast_to(batch.positions, (3, n)))
        step.idx.load(batch)
        if graphs is not None:
            graphs.run(size, step.plan.run)
            return step.logits.slice(0, 0, r)  # (R, V): the batch's own rows
        step.run(inputs)
        return step.logits  # (R, V)

    # ---- buffers, passes, graphs -----------------------------------------------------------
    def hidden_rows(self, cache: PagedKVCache, num_tokens: int) -> Tensor:
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
        if m.config.arch_args.routed_experts()[0] and find_kernel("moe_mlp", m.device.type.name, m.dtype) is None:
            return None
        try:
            return self._graph_caches[cache]
        except KeyError:
            pass
        from ..runtime import get_runtime

        make = getattr(get_runtime(m.device).backend, "graph_cache", None)
        graphs = self._graph_caches[cache] = make(m.device.index) if make is not None else None
        return graphs
