"""Qwen2: always biases on q/k/v, never on the output projection; with ``use_sliding_window``,
a sliding window on the upper layers (``sliding_layers``, Qwen3's rule too). GGUF files store
every tensor in Hugging Face order (llama.cpp runs Qwen2 with the halves rope), so none is fixed."""
from __future__ import annotations

from typing import Any, Collection, Mapping

from ..config import json_flag
from . import Architecture, WindowArgs, register, silu_only

BIASES = {"attention_bias": True, "attention_out_bias": False}


def sliding_layers(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Qwen2/Qwen3's sliding window (``WindowArgs``) as transformers reads it: with
    ``use_sliding_window``, the layers from ``max_window_layers`` on (or those ``layer_types``
    names) attend to the last ``sliding_window`` keys; without it, every layer to all keys."""
    if not json_flag(raw, "use_sliding_window", False, source):
        return {}
    window, first = raw.get("sliding_window"), raw.get("max_window_layers", 0)
    layers = raw.get("num_hidden_layers")
    types = raw.get("layer_types")
    if types is None and isinstance(first, int) and isinstance(layers, int) and 0 <= layers <= 1 << 20:
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {"sliding_window": window, "layer_types": types}


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """q/k/v biases and no output bias, whatever ``config.json`` says (it has no such flag);
    the sliding window of the upper layers with ``use_sliding_window``."""
    return {**BIASES, **silu_only(raw, source), **sliding_layers(raw, source)}


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """The same biases as ``hf_config``."""
    return dict(BIASES)


QWEN2 = register(Architecture(name="qwen2", args=WindowArgs, hf_config=hf_config, gguf_config=gguf_config))
