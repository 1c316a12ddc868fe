"""The model configuration shared by both file formats, with Hugging Face field names.

What differs between architectures (Qwen2's fixed q/k/v biases, Llama's ``attention_bias``)
comes from the architecture's module, found by name in ``models.architectures``.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ModelLoadError, read_json


@dataclass(slots=True)
class ModelConfig:
    """Hyper-parameters of a decoder. Field names follow ``config.json``."""

    architecture: str  # a registered architecture's name, "llama" | "qwen2" | ... (config.json: model_type)
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # I, the MLP width
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int = 0  # KH; 0 means H (no grouping)
    head_dim: int = 0  # Dh; 0 means D // H
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the q/k/v projections
    attention_out_bias: bool = False  # a bias on the output projection (Llama's attention_bias sets both)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_key_value_heads == 0:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim == 0 and all(type(v) is int and v > 0 for v in (self.hidden_size, self.num_attention_heads)):
            self.head_dim = self.hidden_size // self.num_attention_heads
        # Values of other types are kept as found, for ``validate`` to name them.
        if is_int(self.eos_token_id):
            self.eos_token_id = [self.eos_token_id]
        elif self.eos_token_id is None:
            self.eos_token_id = []
        elif isinstance(self.eos_token_id, (list, tuple)):
            self.eos_token_id = list(self.eos_token_id)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """A config from ``values``, ignoring keys that are not fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def validate(self, source: str) -> "ModelConfig":
        """Check the values describe a model we can run; raises ModelLoadError naming ``source``."""
        from . import architectures  # here: the architecture modules import this one

        architectures.get(self.architecture, source)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ModelLoadError(f"{source}: {name} must be a positive number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ModelLoadError(f"{source}: {name} must be true or false, got {getattr(self, name)!r}")
        if self.bos_token_id is not None and not is_token_id(self.bos_token_id):
            raise ModelLoadError(
                f"{source}: bos_token_id must be a token id (an integer >= 0), got {self.bos_token_id!r}"
            )
        self.eos_token_id = token_ids(self.eos_token_id, source, "eos_token_id")
        return self


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a JSON/GGUF integer, not a bool or a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_id(value: Any) -> bool:
    """Whether ``value`` can be a token id: an integer >= 0."""
    return is_int(value) and value >= 0


def token_ids(value: Any, source: str, key: str) -> list[int]:
    """``value`` (an id, a list of ids or None/absent) as a list of ids.

    Anything else, floats included, is a ModelLoadError naming ``source`` and ``key``.
    """
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not is_token_id(item):
            raise ModelLoadError(
                f"{source}: {key} must be a token id or a list of token ids (integers >= 0); "
                f"found {item!r} in {value!r}"
            )
    return items


def json_flag(raw: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    """The JSON boolean ``raw[key]`` (``default`` when absent or null); any other value is a ModelLoadError."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {key} must be true or false, got {value!r}")
    return value


DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def _rope_theta(raw: Mapping[str, Any], source: str) -> float:
    """rope_theta as transformers 5 reads it (``convert_rope_params_to_dict``): the rope table
    is ``rope_scaling`` when it is non-empty, otherwise ``rope_parameters``; its ``rope_theta``
    comes first, then the flat ``rope_theta``, then 10000. A rope type other than "default" in
    that table is refused by name, as is a table of per-layer-type entries."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], Mapping):
            raise ModelLoadError(f"{source}: {key} must be an object, got {raw[key]!r}")
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    table = raw.get(key) or {}
    nested = [name for name, value in table.items() if isinstance(value, Mapping)]
    if nested:
        raise ModelLoadError(f"{source}: {key} holds per-layer-type entries ({', '.join(map(repr, nested))}), "
                             f"which llaisys does not apply; expected one table of rope parameters")
    kind = table.get("rope_type", table.get("type", "default"))
    if kind != "default":
        raise ModelLoadError(f"{source}: rope type {kind!r} is not supported ({key}); llaisys applies only "
                             f"'default' (plain rotary embeddings)")
    if "rope_theta" in table:
        return table["rope_theta"]
    return raw.get("rope_theta", DEFAULT_ROPE_THETA)


def config_from_hf(raw: Any, source: str) -> ModelConfig:
    """The config of a Hugging Face ``config.json`` already parsed into ``raw``: the fields
    every architecture shares, then those its ``model_type``'s architecture sets."""
    from . import architectures  # here: the architecture modules import this one

    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    arch = architectures.get(raw.get("model_type"), source, key="model_type")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
               if k not in raw]
    if missing:
        raise ModelLoadError(f"{source}: missing required key(s) {', '.join(missing)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    if json_flag(raw, "mlp_bias", False, source):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported; expected MLP projections without bias")
    if json_flag(raw, "use_sliding_window", False, source):
        raise ModelLoadError(f"{source}: use_sliding_window=true is not supported; expected full attention")
    values = dict(raw)
    values["architecture"] = arch.name
    values["rope_theta"] = _rope_theta(raw, source)
    values["tie_word_embeddings"] = json_flag(raw, "tie_word_embeddings", False, source)
    values.update(arch.hf_config(raw, source))
    for key in ("num_key_value_heads", "head_dim"):
        if values.get(key) is None:
            values[key] = 0
    try:
        config = ModelConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: bad value in config: {exc}") from exc
    return config.validate(source)


def read_hf_config(path: "str | os.PathLike[str]") -> ModelConfig:
    """Read and check a ``config.json``."""
    raw = read_json(Path(path), hint="; a model folder needs a config.json")
    return config_from_hf(raw, os.fspath(path))
