"""The Qwen2/Llama decoder, written with ``llaisys.ops`` only.

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
        self.h_last = self.h.slice(0, s - 1, s)  # (1, D) the last row, finally normalised
        self.logits = new(1, config.vocab_size)  # (1, V)


def attention(ws: Workspace, lp: LayerParams, kv: tuple[Tensor, Tensor, Tensor, Tensor], config: ModelConfig,
              scale: float, plan: ops.Plan) -> None:
    """ws.proj = o_proj(causal attention of ws.h, the normalised input); appends this pass's
    K/V to the cache through ``kv`` = (K rows written, V rows written, K rows read, V rows read)."""
    k_new, v_new, k_seen, v_seen = kv  # (S, KH, Dh) x2, (T, KH, Dh) x2
    ops.linear(ws.qkv, ws.h, lp.qkv, lp.qkv_bias, plan=plan)  # (S, Dq + 2*Dkv)
    ops.rope(ws.qk, ws.qk_in, ws.pos, config.rope_theta, plan=plan)  # (S, H+KH, Dh)
    ops.rearrange(k_new, ws.k, plan=plan)  # (S, KH, Dh) into the cache
    ops.rearrange(v_new, ws.v_in, plan=plan)  # (S, KH, Dh)
    ops.self_attention(ws.attn, ws.q, k_seen, v_seen, scale, plan=plan)  # (S, H, Dh)
    ops.linear(ws.proj, ws.attn_flat, lp.o, lp.o_bias, plan=plan)  # (S, D)


CACHE_CALLS_AT = 2  # attention's calls before its three that touch the cache (see Pass.move)


def mlp(ws: Workspace, lp: LayerParams, config: ModelConfig, plan: ops.Plan) -> None:
    """ws.proj = down(swiglu(gate, up)) of ws.h, the normalised input."""
    ops.linear(ws.gate_up, ws.h, lp.gate_up, plan=plan)  # (S, 2I)
    ops.swiglu(ws.act, ws.gate, ws.up, plan=plan)  # (S, I)
    ops.linear(ws.proj, ws.act, lp.down, plan=plan)  # (S, D)


def decoder_layer(ws: Workspace, lp: LayerParams, next_norm: Tensor, kv: tuple[Tensor, Tensor, Tensor, Tensor],
                  config: ModelConfig, scale: float, plan: ops.Plan) -> None:
    """One pre-norm decoder layer applied to ws.x in place. Takes ws.h = rms_norm(ws.x) by
    the layer's attention norm; leaves it normalised by ``next_norm`` (the next layer's
    attention norm, or the final norm), each residual add fused with the norm after it."""
    eps = config.rms_norm_eps
    attention(ws, lp, kv, config, scale, plan)
    ops.add_rms_norm(ws.h, ws.x, ws.x, ws.proj, lp.ffn_norm, eps, plan=plan)  # (S, D) x += proj; h = norm(x)
    mlp(ws, lp, config, plan)
    ops.add_rms_norm(ws.h, ws.x, ws.x, ws.proj, next_norm, eps, plan=plan)  # (S, D)


class Pass:
    """The checked op calls of a pass of S tokens over one cache, recorded once and replayed.

    Everything but the cache rows stays put between passes of one size (the workspace, the
    weights), so only the three calls per layer that touch the cache are rebound to the
    rows of each new position (``move``)."""

    def __init__(self, model: "CausalLM", ws: Workspace, cache: KVCache, start: int, end: int):
        self.ws = ws
        self.plan = ops.Plan()
        self.kv_at: list[int] = []  # per layer: index of its first call that touches the cache
        p, plan = model.params, self.plan
        ops.embedding(ws.x, ws.ids, p.embed, plan=plan)  # (S, D)
        ops.rms_norm(ws.h, ws.x, p.layers[0].attn_norm, model.config.rms_norm_eps, plan=plan)  # (S, D)
        next_norms = [lp.attn_norm for lp in p.layers[1:]] + [p.norm]
        for i, (lp, next_norm) in enumerate(zip(p.layers, next_norms)):
            self.kv_at.append(len(plan) + CACHE_CALLS_AT)
            decoder_layer(ws, lp, next_norm, cache.rows(i, start, end), model.config, model._scale, plan)
        self.span = (start, end)

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
        step = self._pass(cache, s, start, end)
        ws = step.ws
        ws.ids.load(ids)
        ws.pos.load(np.arange(start, end, dtype=np.int64))
        step.plan.run()
        cache.length = end
        p = self.params
        if all_rows:
            out = Tensor.empty((s, self.config.vocab_size), self.dtype, self.device)  # (S, V)
            ops.linear(out, ws.h, p.lm_head)  # (S, V) from the finally normalised rows
            return out.numpy().astype(np.float32, copy=False)
        if not head:
            return None
        ops.linear(ws.logits, ws.h_last, p.lm_head)  # (1, V)
        return ws.logits.numpy().reshape(-1).astype(np.float32, copy=False)  # (V,)

    def _pass(self, cache: KVCache, s: int, start: int, end: int) -> Pass:
        """The recorded pass of ``s`` tokens over ``cache``, pointed at ``start:end``; the
        cache keeps the decoding one (S = 1) and the last other size."""
        step = cache.passes.get(s)
        if step is None:
            step = Pass(self, self._workspace(s), cache, start, end)
            for other in [k for k in cache.passes if k != 1]:
                del cache.passes[other]
            cache.passes[s] = step
        step.move(cache, start, end)
        return step

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
