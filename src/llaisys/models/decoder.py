"""A loaded decoder-only model (``CausalLM``): config, weights, tokenizer, its caches, and the
checked entry points that run it: ``forward`` for one sequence over a ``KVCache``,
``forward_batch`` for many over a ``PagedKVCache``. Both go through the model's one
``ModelRunner`` (``models.runner``), which records the layers of its architecture
(``models.architectures``, ``models.layers``) as paged passes and replays them.

Per layer: x += o_proj(attention(rope(q), rope(k), v)) over rms_norm(x), then
x += down(swiglu(gate, up)) over rms_norm(x); each residual add runs in one op with the norm
that follows it (``add_rms_norm``). Qwen2 and Llama differ only in config (q/k/v
biases, tied embeddings, rope theta).
Shapes: S tokens in this pass, T = cache length after it, D hidden, H/KH query/kv heads,
Dh head dim, Dq = H*Dh, Dkv = KH*Dh, I MLP width, V vocabulary.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections import Counter
from typing import Any, Sequence

import numpy as np

from .. import ops
from ..parallel.comm import Communicator, SingleProcess
from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .config import ModelConfig
from .kv_cache import KVCache
from .paged_cache import PagedKVCache, TokenBatch
from . import architectures
from .params import DecoderParams
from .runner import ModelRunner
from .tensor_parallel import Shard
from .tokenizer import Tokenizer

PREFILL_CHUNK = 256  # longer inputs run in chunks: less masked attention work, bounded score memory
MAX_DEFAULT_CACHE = 4096


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
        self._lock = threading.RLock()  # one pass at a time: a cache's passes share work buffers
        self.runner = ModelRunner(self)  # runs the layers: inputs, recorded passes, graphs

    # ---- cache -------------------------------------------------------------------------
    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        """An empty KV cache for this model (default size: the context length, at most 4096)."""
        c = self.local_config
        if max_tokens is None:
            max_tokens = min(c.max_position_embeddings, MAX_DEFAULT_CACHE)
        cache = KVCache(c.num_hidden_layers, max_tokens, c.num_key_value_heads, c.head_dim, self.dtype, self.device,
                        owner=self)
        return self._keyed(cache, ("kv", max_tokens))

    def new_paged_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """An empty paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens for
        ``forward_batch`` (block tables as wide as the context length needs)."""
        c = self.local_config
        max_blocks = -(-c.max_position_embeddings // block_size) if block_size > 0 else 1
        if not c.kv_window():  # a sequence holds its table's blocks at once (behind a window it hands them back)
            max_blocks = min(max_blocks, num_blocks)
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
        """Run ``ids`` in chunks of at most PREFILL_CHUNK tokens (under the model's lock):
        host logits (S, V) with ``all_logits``, else the last row's (V,), or with ``greedy``
        its argmax id."""
        outputs = []
        with self._lock:
            for begin in range(0, len(ids), PREFILL_CHUNK):
                chunk = ids[begin:begin + PREFILL_CHUNK]
                last = begin + PREFILL_CHUNK >= len(ids)
                rows = "all" if all_logits else "last" if last else "none"
                logits = self.runner.run_sequence(chunk, cache, rows)
                if all_logits:
                    outputs.append(self._gathered(logits))
                elif last:
                    return self._head_result(logits, greedy)
        return np.concatenate(outputs, axis=0)

    def _head_result(self, logits: Tensor, greedy: bool) -> "np.ndarray | int":
        """Host logits (V,) of a (1, V or c) device row, or with ``greedy`` the argmax, taken
        on the device (a single process holds the whole row then)."""
        if not greedy:
            return self._gathered(logits).reshape(-1)  # (V,)
        idx = Tensor.empty((1,), DataType.I64, self.device)
        ops.argmax(idx, Tensor.empty((1,), self.dtype, self.device), logits)  # (1,)
        return int(idx.numpy()[0])

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
        return self.runner.run_batch(batch, cache)

    def hidden_states(self, cache: PagedKVCache, num_tokens: int) -> np.ndarray:
        """The final hidden states (N, D) float32 (after the last norm) of the pass of
        ``num_tokens`` tokens that just ran over ``cache`` (the rows an embedding pools)."""
        with self._lock:
            return self.runner.hidden_states(cache, num_tokens).numpy().astype(np.float32, copy=False)

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
            tensors += [t for t in (lp.attn_norm, lp.qkv, lp.qkv_bias, lp.o, lp.o_bias, lp.ffn_norm, lp.gate_up, lp.down,
                                    *lp.qkv_parts, *lp.gate_up_parts, lp.router, lp.gate_exps, lp.up_exps,
                                    lp.down_exps) if t is not None]
        return sum(t.numel() for t in tensors)

    def weight_types(self) -> dict[str, str]:
        """The data type each weight is held in, by role: ``{"embed": "Q8_0", "qkv": "Q4_1", ...}``;
        a role whose layers differ lists the counts (``"Q4_K x20, Q6_K x10"``)."""
        p = self.params
        roles: dict[str, list[Tensor]] = {"embed": [p.embed], "lm_head": [p.lm_head]}
        for name in ("qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "router", "gate_exps", "up_exps",
                     "down_exps"):
            tensors = [t for lp in p.layers for t in ((getattr(lp, name),) if getattr(lp, name) is not None
                                                     else getattr(lp, name + "_parts", ()))]
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
            lp.attn_norm, lp.qkv, lp.qkv_bias, lp.o, lp.o_bias, lp.ffn_norm, lp.gate_up, lp.down,
            *lp.qkv_parts, *lp.gate_up_parts, lp.router, lp.gate_exps, lp.up_exps, lp.down_exps) if t is not None]
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
