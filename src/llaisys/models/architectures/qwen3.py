"""Qwen3: Qwen2's layer with an RMSNorm over each query and key head before the rotary
embedding (``q_norm``, ``k_norm``, of head_dim: ``layer_shapes`` names them, and the shared
``layers.project_qkv`` norms the heads of a layer that holds them), biases on q/k/v and o alike
as ``attention_bias`` says (none by default), and Qwen2's sliding-window rule (its args,
``WindowArgs``). GGUF files store q and k in Hugging Face order (llama.cpp runs Qwen3 with the
halves rope), so none is fixed. Everything Qwen3 adds to the shared blocks is in this module."""
from __future__ import annotations

from typing import Any, Collection, Mapping

from ..config import ModelConfig, json_flag
from ..weights import GGUF_NAMES, layer_shapes
from . import Architecture, WindowArgs, register, silu_only
from .qwen2 import sliding_layers


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``attention_bias`` on q/k/v and o; the Qwen sliding-window rule."""
    bias = json_flag(raw, "attention_bias", False, source)
    return {"attention_bias": bias, "attention_out_bias": bias, **silu_only(raw, source),
            **sliding_layers(raw, source)}


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """Biases where layer 0 has them."""
    return {"attention_bias": GGUF_NAMES.to_file("layers.0.q_bias") in tensors,
            "attention_out_bias": GGUF_NAMES.to_file("layers.0.o_bias") in tensors}


def qwen3_layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Llama's weights and the norms of the query and key heads, (Dh,) each."""
    p, dh = f"layers.{layer}.", config.head_dim
    return {**layer_shapes(config, layer), p + "q_norm": (dh,), p + "k_norm": (dh,)}


QWEN3 = register(Architecture(name="qwen3", args=WindowArgs, hf_config=hf_config, gguf_config=gguf_config,
                              layer_shapes=qwen3_layer_shapes))
