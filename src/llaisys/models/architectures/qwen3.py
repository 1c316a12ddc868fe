"""Qwen3: Llama's layer with an RMSNorm over each query and key head before the rotary
embedding (``q_norm``, ``k_norm``, of head_dim), biases on q/k/v and o alike as
``attention_bias`` says (none by default), and Qwen2's sliding-window rule. GGUF files store
q and k in Hugging Face order (llama.cpp runs Qwen3 with the halves rope), so none is fixed."""
from __future__ import annotations

from typing import Any, Collection, Mapping

from ..config import json_flag
from ..weights import GGUF_NAMES
from . import Architecture, qwen_sliding_layers, register, silu_only


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Per-head q/k norms; ``attention_bias`` on q/k/v and o; the Qwen sliding-window rule."""
    bias = json_flag(raw, "attention_bias", False, source)
    return {"qk_norm": True, "attention_bias": bias, "attention_out_bias": bias, **silu_only(raw, source),
            **qwen_sliding_layers(raw, source)}


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """Per-head q/k norms; biases where layer 0 has them."""
    return {"qk_norm": True,
            "attention_bias": GGUF_NAMES.to_file("layers.0.q_bias") in tensors,
            "attention_out_bias": GGUF_NAMES.to_file("layers.0.o_bias") in tensors}


QWEN3 = register(Architecture(
    name="qwen3",
    hf_config=hf_config,
    gguf_config=gguf_config,
))
