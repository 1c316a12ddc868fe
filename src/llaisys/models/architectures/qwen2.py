"""Qwen2: always biases on q/k/v, never on the output projection; GGUF files store every
tensor in Hugging Face order (llama.cpp runs Qwen2 with the halves rope), so none is fixed."""
from __future__ import annotations

from typing import Any, Collection, Mapping

from . import Architecture, qwen_sliding_layers, register, silu_only

BIASES = {"attention_bias": True, "attention_out_bias": False}


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """q/k/v biases and no output bias, whatever ``config.json`` says (it has no such flag);
    the sliding window of the upper layers with ``use_sliding_window``."""
    return {**BIASES, **silu_only(raw, source), **qwen_sliding_layers(raw, source)}


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """The same biases as ``hf_config``."""
    return dict(BIASES)


QWEN2 = register(Architecture(
    name="qwen2",
    hf_config=hf_config,
    gguf_config=gguf_config,
))
