"""The Qwen2/Llama decoder, written with ``llaisys.ops`` only.

Per layer: x += o_proj(attention(rope(q), rope(k), v)) over rms_norm(x), then
x += down(swiglu(gate, up)) over rms_norm(x). Qwen2 and Llama differ only in config (q/k/v
biases, tied embeddings, rope theta). Intermediate results go to preallocated buffers
(``Workspace``) through the output-first ops, so a decoding step allocates nothing.
Shapes: S tokens in this pass, T = cache length after it, D hidden, H/KH query/kv heads,
Dh head dim, Dq = H*Dh, Dkv = KH*Dh, I MLP width, V vocabulary.
"""
from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from typing import Any, Sequence

import numpy as np

from .. import ops
from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from .config import ModelConfig
from .kv_cache import KVCache
from .params import DecoderParams, LayerParams
from .tokenizer import Tokenizer

PREFILL_CHUNK = 256  # longer inputs run in chunks: less masked attention work, bounded score memory
MAX_DEFAULT_CACHE = 4096


class Workspace:
    """Buffers for one pass of S tokens, reused by every layer and every pass of that size."""

    def __init__(self, config: ModelConfig, s: int, dtype: DataType, device: Device):
        d, dh, inter = config.hidden_size, config.head_dim, config.intermediate_size
        h, kh = config.num_attention_heads, config.num_key_value_heads
        dq, dkv = h * dh, kh * dh
        new = lambda *shape: Tensor.empty(shape, dtype, device)  # noqa: E731
        self.ids = Tensor.empty((s,), DataType.I64, device)  # (S,)
        self.pos = Tensor.empty((s,), DataType.I64, device)  # (S,)
        self.x = new(s, d)  # (S, D) the residual stream
        self.h = new(s, d)  # (S, D) normalised input of a block
        self.qkv = new(s, dq + 2 * dkv)  # (S, Dq + 2*Dkv)
        self.qk_in = self.qkv.slice(1, 0, dq + dkv).view(s, h + kh, dh)  # (S, H+KH, Dh) strided view
        self.v_in = self.qkv.slice(1, dq + dkv, dq + 2 * dkv).view(s, kh, dh)  # (S, KH, Dh)
        self.qk = new(s, h + kh, dh)  # (S, H+KH, Dh) q and k heads after rope (one rope call for both)
        self.q = self.qk.slice(1, 0, h)  # (S, H, Dh)
        self.k = self.qk.slice(1, h, h + kh)  # (S, KH, Dh)
        self.attn = new(s, h, dh)  # (S, H, Dh)
        self.attn_flat = self.attn.view(s, dq)  # (S, Dq)
        self.proj = new(s, d)  # (S, D) output of a block before the residual add
        self.gate_up = new(s, 2 * inter)  # (S, 2I)
        self.gate = self.gate_up.slice(1, 0, inter)  # (S, I) strided view
        self.up = self.gate_up.slice(1, inter, 2 * inter)  # (S, I)
        self.act = new(s, inter)  # (S, I)
        self.x_last = self.x.slice(0, s - 1, s)  # (1, D)
        self.h_last = new(1, d)  # (1, D)
        self.logits = new(1, config.vocab_size)  # (1, V)


def attention(ws: Workspace, lp: LayerParams, cache: KVCache, layer: int, start: int, end: int,
              config: ModelConfig, scale: float) -> None:
    """ws.proj = o_proj(causal attention of rms_norm(ws.x)); appends this pass's K/V to the cache."""
    ops.rms_norm(ws.h, ws.x, lp.attn_norm, config.rms_norm_eps)  # (S, D)
    ops.linear(ws.qkv, ws.h, lp.qkv, lp.qkv_bias)  # (S, Dq + 2*Dkv)
    ops.rope(ws.qk, ws.qk_in, ws.pos, config.rope_theta)  # (S, H+KH, Dh)
    k_all, v_all = cache.k_layers[layer], cache.v_layers[layer]  # (Tmax, KH, Dh)
    ops.rearrange(k_all.slice(0, start, end), ws.k)  # (S, KH, Dh) into the cache
    ops.rearrange(v_all.slice(0, start, end), ws.v_in)  # (S, KH, Dh)
    ops.self_attention(ws.attn, ws.q, k_all.slice(0, 0, end), v_all.slice(0, 0, end), scale)  # (S, H, Dh)
    ops.linear(ws.proj, ws.attn_flat, lp.o, lp.o_bias)  # (S, D)


def mlp(ws: Workspace, lp: LayerParams, config: ModelConfig) -> None:
    """ws.proj = down(swiglu(gate, up)) of rms_norm(ws.x)."""
    ops.rms_norm(ws.h, ws.x, lp.ffn_norm, config.rms_norm_eps)  # (S, D)
    ops.linear(ws.gate_up, ws.h, lp.gate_up)  # (S, 2I)
    ops.swiglu(ws.act, ws.gate, ws.up)  # (S, I)
    ops.linear(ws.proj, ws.act, lp.down)  # (S, D)


def decoder_layer(ws: Workspace, lp: LayerParams, cache: KVCache, layer: int, start: int, end: int,
                  config: ModelConfig, scale: float) -> None:
    """One pre-norm decoder layer applied to ws.x in place."""
    attention(ws, lp, cache, layer, start, end, config, scale)
    ops.add(ws.x, ws.x, ws.proj)  # (S, D)
    mlp(ws, lp, config)
    ops.add(ws.x, ws.x, ws.proj)  # (S, D)


class CausalLM:
    """A loaded Qwen2/Llama model: config, weights on a device, tokenizer."""

    def __init__(self, config: ModelConfig, params: DecoderParams, tokenizer: Tokenizer, *, dtype: DataType,
                 device: Device, source: str, generation_defaults: dict | None = None,
                 eos_token_ids: Sequence[int] = (), file_info: dict[str, Any] | None = None):
        self.config = config
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
        self._lock = threading.Lock()  # guards the shared workspaces: one chunk runs at a time

    # ---- cache -------------------------------------------------------------------------
    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        """An empty KV cache for this model (default size: the context length, at most 4096)."""
        c = self.config
        if max_tokens is None:
            max_tokens = min(c.max_position_embeddings, MAX_DEFAULT_CACHE)
        return KVCache(c.num_hidden_layers, max_tokens, c.num_key_value_heads, c.head_dim, self.dtype, self.device,
                       owner=self)

    def _workspace(self, s: int) -> Workspace:
        ws = self._workspaces.get(s)
        if ws is None:
            ws = Workspace(self.config, s, self.dtype, self.device)
            self._workspaces[s] = ws
            while len(self._workspaces) > 3:  # keep the decode one and the last prefill sizes
                oldest = next(k for k in self._workspaces if k != 1)
                del self._workspaces[oldest]
        return ws

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
        outputs = []
        for begin in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[begin:begin + PREFILL_CHUNK]
            last = begin + PREFILL_CHUNK >= len(ids)
            if all_logits:
                outputs.append(self._run(chunk, cache, all_rows=True))
            else:
                logits = self._run(chunk, cache, all_rows=False, head=last)
                if last:
                    outputs.append(logits)
        return np.concatenate(outputs, axis=0) if all_logits else outputs[0]

    __call__ = forward

    def _run(self, ids: np.ndarray, cache: KVCache, all_rows: bool, head: bool = True) -> np.ndarray | None:
        with self._lock:
            return self._run_locked(ids, cache, all_rows, head)

    def _run_locked(self, ids: np.ndarray, cache: KVCache, all_rows: bool, head: bool) -> np.ndarray | None:
        s = len(ids)
        start, end = cache.length, cache.length + s
        ws = self._workspace(s)
        ws.ids.load(ids)
        ws.pos.load(np.arange(start, end, dtype=np.int64))
        p = self.params
        ops.embedding(ws.x, ws.ids, p.embed)  # (S, D)
        for i, lp in enumerate(p.layers):
            decoder_layer(ws, lp, cache, i, start, end, self.config, self._scale)
        cache.length = end
        if all_rows:
            out = Tensor.empty((s, self.config.vocab_size), self.dtype, self.device)  # (S, V)
            ops.rms_norm(ws.h, ws.x, p.norm, self.config.rms_norm_eps)  # (S, D)
            ops.linear(out, ws.h, p.lm_head)  # (S, V)
            return out.numpy().astype(np.float32, copy=False)
        if not head:
            return None
        ops.rms_norm(ws.h_last, ws.x_last, p.norm, self.config.rms_norm_eps)  # (1, D)
        ops.linear(ws.logits, ws.h_last, p.lm_head)  # (1, V)
        return ws.logits.numpy().reshape(-1).astype(np.float32, copy=False)  # (V,)

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
        tensors = [p.embed, p.norm] + ([] if p.lm_head is p.embed else [p.lm_head])
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
        if p.lm_head is p.embed:
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
