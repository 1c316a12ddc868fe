"""Gemma 3 (text): sliding-window layers interleaved with global ones (every sixth global by
default), the sliding ones rotating with a local rope base (10000) and the global ones with
``rope_theta`` (and its scaling); per-head q/k norms; a norm after each block as well as before
it (``gemma3_layer``, over ``layers.sandwich_layer``); a tanh-GELU gated MLP; embeddings scaled
by sqrt(hidden_size); attention scores scaled by 1/sqrt(``query_pre_attn_scalar``); a tied head.
Its args (``Gemma3Args``) hold the windows, the scales, the local rope base and the activation.

Its RMSNorm multiplies by (1 + w): Hugging Face files store w (``hf_value_fix`` adds the 1 as
the weights are read, in float32 as transformers does), GGUF files store 1 + w already. GGUF
files keep q and k in Hugging Face order. A multimodal Gemma 3 folder (a ``text_config``
inside) and the logit soft-capping of Gemma 2 are refused by name."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import numpy as np

from ... import ops
from ...tensor import Tensor
from ..config import ModelConfig, is_number, is_positive, json_flag
from ..errors import ModelLoadError
from ..layers import ACTIVATIONS, Workspace, mlp, sandwich_layer
from ..params import LayerParams
from ..weights import GGUF_NAMES, HF_NAMES, NameTable, layer_shapes
from . import Architecture, WindowArgs, register

PATTERN = 6  # every sixth layer is global unless layer_types says otherwise
LOCAL_ROPE_THETA = 10000.0  # transformers' default rope base of the sliding layers
GLOBAL_ROPE_THETA = 1_000_000.0  # ... and of the global ones

HF_LAYER = {**{k: v for k, v in HF_NAMES.layer.items() if k != "post_attention_layernorm.weight"},
            "post_attention_layernorm.weight": "post_attn_norm",
            "pre_feedforward_layernorm.weight": "ffn_norm",
            "post_feedforward_layernorm.weight": "post_ffn_norm"}
GGUF_LAYER = {**GGUF_NAMES.layer,
              "post_attention_norm.weight": "post_attn_norm",
              "post_ffw_norm.weight": "post_ffn_norm"}
HF_TABLE = NameTable(HF_NAMES.globals, HF_NAMES.layer_prefix, HF_LAYER, HF_NAMES.ignored, HF_NAMES.layer_count_key)
GGUF_TABLE = NameTable(GGUF_NAMES.globals, GGUF_NAMES.layer_prefix, GGUF_LAYER, GGUF_NAMES.ignored,
                       GGUF_NAMES.layer_count_key, GGUF_NAMES.refused)
NORMS = ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm")


@dataclass(slots=True)
class Gemma3Args(WindowArgs):
    """The sliding layers (``WindowArgs``) and what else Gemma 3 sets (``config.json`` names)."""

    hidden_act: str = "gelu_tanh"  # the gated MLP's activation: "gelu_tanh" (GeGLU) | "silu" (SwiGLU)
    query_pre_attn_scalar: float | None = None  # attention scores times 1/sqrt(this); None: head_dim
    embedding_multiplier: float = 1.0  # the token embeddings times this (sqrt(hidden_size))
    rope_local_theta: float | None = None  # the rope base of sliding-window layers; None: rope_theta

    def embedding_scale(self) -> float:
        return self.embedding_multiplier

    def validate(self, config: ModelConfig, source: str) -> None:
        """A known activation, the window's checks, positive scales and base."""
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"{source}: hidden_act {self.hidden_act!r} is not supported; expected one of "
                                 f"{', '.join(map(repr, ACTIVATIONS))}")
        WindowArgs.validate(self, config, source)
        for name in ("query_pre_attn_scalar", "rope_local_theta", "embedding_multiplier"):
            value = getattr(self, name)
            if not is_positive(value) and not (value is None and name != "embedding_multiplier"):
                raise ModelLoadError(f"{source}: {config.key_name(name)} must be a positive number, got {value!r}")

    def layer_rope_theta(self, layer: int) -> float | None:
        """A sliding layer rotates with the local base, unscaled (when there is one)."""
        return self.rope_local_theta if self.rope_local_theta and self.layer_window(layer) else None

    def attention_scale(self, head_dim: int) -> float:
        """1/sqrt(query_pre_attn_scalar), or of head_dim without it."""
        return 1.0 / math.sqrt(head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar)


def pattern_layers(layers: int, pattern: int = PATTERN) -> list[str]:
    """Layer types of the default pattern: every ``pattern``-th layer global, the rest sliding."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def embedding_multiplier(hidden_size: int) -> float:
    """sqrt(hidden_size) rounded to float32, as transformers scales the embeddings."""
    return float(np.float32(math.sqrt(hidden_size)))


def hf_prepare(raw: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """The full layers' rope table as the config's rope table, and the sliding layers' base as
    ``rope_local_base_freq`` (transformers 5 writes one table per layer type); the full layers'
    base 1000000 when the file gives none, as transformers' Gemma 3 defaults it."""
    if "text_config" in raw:
        raise ModelLoadError(f"{source}: a multimodal Gemma 3 config (text_config inside); llaisys runs the text "
                             f"model only (model_type 'gemma3_text')")
    params = raw.get("rope_parameters")
    out = dict(raw)
    if isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values()):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ModelLoadError(f"{source}: rope_parameters names layer types {unknown}; expected full_attention "
                                 f"and sliding_attention")
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{source}: rope_parameters.sliding_attention has rope_type "
                                 f"{local.get('rope_type')!r}; llaisys applies only 'default' to the sliding layers")
        out.pop("rope_scaling", None)
        out["rope_parameters"] = dict(params.get("full_attention") or {})
        out["rope_local_base_freq"] = given(local, "rope_theta", LOCAL_ROPE_THETA, source,
                                            "rope_parameters.sliding_attention.rope_theta")
    table = out.get("rope_scaling") or out.get("rope_parameters")
    if "rope_theta" not in out and not (isinstance(table, Mapping) and "rope_theta" in table):
        out["rope_theta"] = GLOBAL_ROPE_THETA
    return out


def hf_key_names(raw: Mapping[str, Any]) -> dict[str, str]:
    """Where a ``config.json`` holds what ``hf_prepare`` moves: the per-layer-type rope tables'
    keys, or ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if not isinstance(params, Mapping) or not any(isinstance(v, Mapping) for v in params.values()):
        return {"rope_local_theta": "rope_local_base_freq"}
    full = params.get("full_attention")
    names = {"rope_scaling": "rope_parameters.full_attention",
             "rope_local_theta": "rope_parameters.sliding_attention.rope_theta"}
    for key in ("rope_theta", "partial_rotary_factor"):
        if isinstance(full, Mapping) and key in full:
            names[key] = f"rope_parameters.full_attention.{key}"
    return names


def given(raw: Mapping[str, Any], key: str, default: Any, source: str, name: str | None = None) -> Any:
    """``raw[key]``, ``default`` when absent; null, which transformers' Gemma 3 cannot run
    either, is a ModelLoadError naming the key (``name``, where it sits)."""
    if key not in raw:
        return default
    if raw[key] is None:
        raise ModelLoadError(f"{source}: {name or key} must be a number, got null")
    return raw[key]


def sliding_pattern(raw: Mapping[str, Any], source: str) -> int:
    """``sliding_window_pattern`` (every n-th layer global): a positive integer (a float of
    integer value too, as transformers takes it); ``PATTERN`` when absent."""
    key = "sliding_window_pattern" if "sliding_window_pattern" in raw else "_sliding_window_pattern"
    pattern = given(raw, key, PATTERN, source)
    if not is_number(pattern) or pattern < 1 or pattern != int(pattern):
        raise ModelLoadError(f"{source}: {key} must be a positive integer (every n-th layer global), got {pattern!r}")
    return int(pattern)


def _refuse_softcap(get: Any, source: str, prefix: str = "") -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if get(prefix + key) is not None:
            raise ModelLoadError(f"{source}: {prefix}{key}={get(prefix + key)!r} asks for logit soft-capping, which "
                                 f"llaisys does not apply; expected none (Gemma 3 has none)")


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields from its ``config.json``."""
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{source}: hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'")
    _refuse_softcap(raw.get, source)
    if json_flag(raw, "use_bidirectional_attention", False, source):
        raise ModelLoadError(f"{source}: use_bidirectional_attention=true is not supported; expected causal attention")
    bias = json_flag(raw, "attention_bias", False, source)
    layers = raw.get("num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        pattern = sliding_pattern(raw, source)
        if isinstance(layers, int) and 0 <= layers <= 1 << 20:
            types = pattern_layers(layers, pattern)
    hidden = raw.get("hidden_size")
    return {"hidden_act": "gelu_tanh", "attention_bias": bias, "attention_out_bias": bias,
            "sliding_window": raw.get("sliding_window", 4096), "layer_types": types,
            "query_pre_attn_scalar": given(raw, "query_pre_attn_scalar", 256, source),
            "embedding_multiplier": embedding_multiplier(hidden) if isinstance(hidden, int) and hidden > 0 else 1.0,
            "rope_local_theta": given(raw, "rope_local_base_freq", LOCAL_ROPE_THETA, source),
            "tie_word_embeddings": json_flag(raw, "tie_word_embeddings", True, source)}


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """Gemma 3's fields from GGUF metadata, as llama.cpp reads them: the window from
    ``gemma3.attention.sliding_window``, every sixth layer global, the attention scale from the
    head size (the 27B model's, 62 layers, from hidden_size / heads)."""
    _refuse_softcap(meta.get, source, "gemma3.")
    layers, hidden = meta.get("gemma3.block_count"), meta.get("gemma3.embedding_length")
    heads = meta.get("gemma3.attention.head_count")
    scalar, scalar_key = meta.get("gemma3.attention.key_length"), "gemma3.attention.key_length"
    if layers == 62 and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        scalar, scalar_key = hidden // heads, "gemma3.embedding_length / gemma3.attention.head_count"
    return {"hidden_act": "gelu_tanh", "attention_bias": False, "attention_out_bias": False,
            "sliding_window": meta.get("gemma3.attention.sliding_window", 0),
            "layer_types": pattern_layers(layers) if isinstance(layers, int) and 0 <= layers <= 1 << 20 else None,
            "query_pre_attn_scalar": scalar,  # None (no key_length): head_dim
            "embedding_multiplier": embedding_multiplier(hidden) if isinstance(hidden, int) and hidden > 0 else 1.0,
            "rope_local_theta": LOCAL_ROPE_THETA,
            "key_names": {"query_pre_attn_scalar": scalar_key, "sliding_window": "gemma3.attention.sliding_window"}}


def gemma3_layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Llama's weights with q/k norms, plus the norms after the attention and MLP blocks."""
    p, d, dh = f"layers.{layer}.", config.hidden_size, config.head_dim
    return {**layer_shapes(config, layer), p + "q_norm": (dh,), p + "k_norm": (dh,), p + "post_attn_norm": (d,),
            p + "post_ffn_norm": (d,)}


def gemma3_layer(ws: Workspace, lp: LayerParams, next_norm: Tensor, attend: Callable[[], None],
                 config: ModelConfig, plan: ops.Plan) -> None:
    """The pre-and-post-norm layer (``layers.sandwich_layer``) with the args' activation in the
    MLP (tanh-GELU)."""
    act = config.arch_args.hidden_act
    sandwich_layer(ws, lp, next_norm, attend, config, plan, lambda: mlp(ws, lp, act, plan))


def hf_value_fix(ours: str, config: ModelConfig):
    """The (1 + w) of every norm weight of a Hugging Face file, added in float32."""
    short = ours.rpartition(".")[2]
    if ours == "norm" or short in NORMS:
        return lambda w: (np.asarray(w, np.float32) + np.float32(1.0))
    return None


GEMMA3 = register(Architecture(name="gemma3", args=Gemma3Args, hf_config=hf_config, gguf_config=gguf_config,
                               hf_names=HF_TABLE, gguf_names=GGUF_TABLE, decoder_layer=gemma3_layer,
                               layer_shapes=gemma3_layer_shapes, hf_prepare=hf_prepare, hf_key_names=hf_key_names,
                               hf_value_fix=hf_value_fix))
