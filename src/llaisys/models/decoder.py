"""A loaded decoder-only model (``CausalLM``): the record of what was loaded (config, weights
on a device, tokenizer, end ids, generation defaults, where it came from) and facts about it
(``info``). How it runs is its ``ModelRunner``'s (``models.runner``): the caches, the checked
passes (``forward`` for one sequence, ``forward_batch`` for the engine's batches), their
recordings, tensor-parallel leading; ``CausalLM.forward`` and the others hand the call to it.
The layers run are its architecture's (``models.architectures``, ``models.layers``).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np

from ..parallel.comm import Communicator, SingleProcess
from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from . import architectures
from .config import ModelConfig
from .kv_cache import KVCache
from .paged_cache import PagedKVCache, TokenBatch
from .params import DecoderParams
from .runner import ModelRunner
from .tensor_parallel import Shard
from .tokenizer import Tokenizer


class CausalLM:
    """A loaded model: config, weights on a device, tokenizer, and its runner.

    Under tensor parallelism (``comm`` of several ranks, ``shard`` this rank's part), every
    rank holds a ``CausalLM`` of its part and rank 0 drives: each of its passes first goes to
    the other ranks, which run it in ``tensor_parallel.follow`` (their caches mirror rank 0's),
    and returns the whole logits."""

    def __init__(self, config: ModelConfig, params: DecoderParams, tokenizer: Tokenizer, *, dtype: DataType,
                 device: Device, source: str, generation_defaults: dict | None = None,
                 eos_token_ids: Sequence[int] = (), file_info: dict[str, Any] | None = None,
                 comm: Communicator | None = None, shard: Shard | None = None, vision: Any = None):
        self.config = config
        self.comm = comm if comm is not None else SingleProcess()
        self.shard = shard if self.comm.size > 1 else None
        self.local_config = self.shard.local_config() if self.shard is not None else config  # this rank's part
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
        self.vision = vision  # its VisionTower (models.multimodal) when it takes images, else None
        self.runner = ModelRunner(self)  # runs it: caches, checked passes, recordings, graphs

    # ---- running: the runner's ---------------------------------------------------------
    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        """``ModelRunner.new_cache``: an empty KV cache of one sequence (default: the context, at most 4096)."""
        return self.runner.new_cache(max_tokens)

    def new_paged_cache(self, num_blocks: int, block_size: int = 16, kv_dtype: Any = None) -> PagedKVCache:
        """``ModelRunner.new_paged_cache``: ``num_blocks`` blocks of ``block_size`` tokens for
        ``forward_batch``, in the model's type or ``kv_dtype`` (DataType.I8 or "int8": 8 bits)."""
        return self.runner.new_paged_cache(num_blocks, block_size, kv_dtype)

    def kv_bytes_per_token(self, kv_dtype: Any = None) -> int:
        """``ModelRunner.kv_bytes_per_token``: bytes of keys and values one token takes."""
        return self.runner.kv_bytes_per_token(kv_dtype)

    def forward(self, token_ids: "Sequence[int] | np.ndarray", cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """``ModelRunner.forward``: run ``token_ids`` (S,) after the cache's content; float32
        host logits (V,) of the last position, or (S, V) with ``all_logits``."""
        return self.runner.forward(token_ids, cache, all_logits)

    __call__ = forward

    def forward_batch(self, batch: TokenBatch, cache: PagedKVCache) -> np.ndarray:
        """``ModelRunner.forward_batch``: one pass of a flat batch over a paged cache; float32
        host logits (R, V) of ``batch.logit_rows``."""
        return self.runner.forward_batch(batch, cache)

    def forward_batch_logits(self, batch: TokenBatch, cache: PagedKVCache) -> Tensor:
        """``ModelRunner.forward_batch_logits``: ``forward_batch`` with the logits (R, V) left on the device."""
        return self.runner.forward_batch_logits(batch, cache)

    def hidden_states(self, cache: PagedKVCache, num_tokens: int) -> np.ndarray:
        """``ModelRunner.hidden_states``: the final hidden states (N, D) of the last pass over ``cache``."""
        return self.runner.hidden_states(cache, num_tokens)

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
            "vision": None if self.vision is None else self.vision.family,
            **self._file_info,
        }

    def __repr__(self) -> str:
        c = self.config
        return (f"CausalLM({c.architecture}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"dtype={self.dtype.name}, device={self.device}, source={self.source!r})")
