"""The registry of model architectures: one module per architecture, found by name.

An ``Architecture`` holds everything that differs between architectures: its own
hyper-parameters (``args``, an ``ArchArgs`` dataclass, the config's ``arch_args``), how a
Hugging Face ``config.json`` and GGUF metadata set them and the shared config fields it decides
(and what it refuses), its weight names in each file format and the weights each layer has, the
fix-ups its tensors need, and the decoder layer it runs, built from the shared blocks of
``models.layers``. Its name is the config's ``model_type`` and the GGUF file's
``general.architecture`` (and so the prefix of the GGUF's hyper-parameter keys,
``{name}.block_count`` ...). Each module (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``,
``gemma3``) builds one and calls ``register``; ``ALIASES`` maps a model type that is another's
with a flag (``mistral``: Llama with its sliding window). The loaders look one up with ``get``
and read a ``config.json`` through ``config_from_hf``. Adding an architecture is one new module
here plus its import below (docs/architecture.md, "Adding an architecture", walks through Qwen3).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import numpy as np

from ..config import ArchArgs, ModelConfig, hf_common_fields, is_int, is_number, json_flag, read_config_json
from ..errors import ModelLoadError
from ..layers import decoder_layer
from ..weights import GGUF_NAMES, HF_NAMES, LayerShapes, NameTable, WeightSource, layer_shapes

# A fix applied to a block of a GGUF tensor's rows (float rows, or the raw rows of a quantized
# matrix) as they are read, with the row count the blocks' bounds must be multiples of.
RowFix = tuple[Callable[[np.ndarray], np.ndarray], int]
log = logging.getLogger(__name__)


def no_row_fix(ours: str, config: ModelConfig) -> RowFix | None:
    """``gguf_row_fix`` of an architecture whose GGUF tensors are stored as we use them."""
    return None


@dataclass(frozen=True)
class Architecture:
    """What makes one architecture: its config fix-ups, weight names and layer function."""

    name: str  # config.json model_type == GGUF general.architecture == GGUF key prefix
    # (raw config.json, source for messages, the alias's flags) -> the values it sets: shared
    # ModelConfig fields (attention_bias ...) and its ``args``' fields; keys that are neither
    # are dropped. Raises ModelLoadError for what it does not apply
    hf_config: Callable[[Mapping[str, Any], str, Mapping[str, Any]], dict[str, Any]] = field(repr=False)
    # (GGUF metadata, the file's tensor names, source) -> the same from a GGUF file
    gguf_config: Callable[[Mapping[str, Any], Collection[str], str], dict[str, Any]] = field(repr=False)
    # its own hyper-parameters (``ModelConfig.arch_args``), filled from the values above and
    # checked by their ``validate``; default: none (the base ``ArchArgs``)
    args: type[ArchArgs] = field(default=ArchArgs, repr=False)
    hf_names: NameTable = field(default=HF_NAMES, repr=False)  # safetensors names -> ours (default: the Llama family's)
    gguf_names: NameTable = field(default=GGUF_NAMES, repr=False)  # GGUF names -> ours
    # (our weight name, config) -> the fix its GGUF rows need, or None when stored as we use it
    gguf_row_fix: Callable[[str, ModelConfig], RowFix | None] = field(default=no_row_fix, repr=False)
    # (ws, layer params, next norm, attend, config, plan) -> None: the layer the decoder runs
    decoder_layer: Callable[..., None] = field(default=decoder_layer, repr=False)
    # (config, layer index) -> that layer's weights by our name, with their shapes
    layer_shapes: LayerShapes = field(default=layer_shapes, repr=False)
    # (raw config.json, source) -> the same put in the form the shared reading takes (Gemma 3:
    # its per-layer-type rope table split into the full layers' table and the local base)
    hf_prepare: Callable[[Mapping[str, Any], str], Mapping[str, Any]] = field(default=lambda raw, source: raw,
                                                                            repr=False)
    # (our weight name, config) -> a function fixing a safetensors weight's values as read, or None
    hf_value_fix: Callable[[str, ModelConfig], Callable[[np.ndarray], np.ndarray] | None] = field(
        default=lambda ours, config: None, repr=False)
    # (weights by our name, config, source) -> the same put in the form ``layer_shapes`` names,
    # before the strict check (Qwen3-MoE: a safetensors file's experts, one tensor each, stacked)
    sanitize_weights: Callable[[dict[str, WeightSource], ModelConfig, str], dict[str, WeightSource]] = field(
        default=lambda weights, config, source: weights, repr=False)
    # (raw config.json as found) -> how it spells the fields its ``hf_prepare`` moved, for
    # messages (``ModelConfig.key_names``; Gemma 3: "rope_parameters.full_attention")
    hf_key_names: Callable[[Mapping[str, Any]], dict[str, str]] = field(default=lambda raw: {}, repr=False)
    # Whether its attention rotates only the first int(Dh * partial_rotary_factor) dims of each
    # head. False: whole heads, as transformers' Llama, Qwen and Gemma classes do (``whole_heads``)
    partial_rotary: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)  # the flags of an alias (``ALIASES``)


_REGISTRY: dict[str, Architecture] = {}
# Model types that are a registered architecture with flags its ``hf_config`` reads.
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("llama", {"sliding_window": True}),  # Llama with a sliding window on every layer
    "gemma3_text": ("gemma3", {}),  # the text model's config of Gemma 3
    "qwen3moe": ("qwen3_moe", {}),  # llama.cpp's name (GGUF general.architecture) for Qwen3-MoE
    "qwen2vl": ("qwen2_5_vl_text", {}),  # llama.cpp's name for the text model of Qwen2-VL and Qwen2.5-VL
}


def register(arch: Architecture) -> Architecture:
    """Make ``arch`` findable by its name; returns it. A name already taken is a ValueError."""
    if not isinstance(arch, Architecture):
        raise TypeError(f"register() takes an Architecture, got {type(arch).__name__}")
    if not isinstance(arch.name, str) or not arch.name:
        raise ValueError(f"an architecture's name must be a non-empty string, got {arch.name!r}")
    if arch.name in _REGISTRY:
        raise ValueError(f"architecture {arch.name!r} is already registered")
    _REGISTRY[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    """Forget the architecture ``name`` (for tests that register one of their own)."""
    if _REGISTRY.pop(name, None) is None:
        raise ValueError(f"architecture {name!r} is not registered")


def names() -> tuple[str, ...]:
    """The architecture names llaisys runs (registered ones and aliases), sorted."""
    return tuple(sorted([*_REGISTRY, *(a for a, (target, _) in ALIASES.items() if target in _REGISTRY)]))


def get(name: Any, source: str | None = None, key: str = "architecture") -> Architecture:
    """The architecture called ``name``.

    Anything else (an unknown name, a value that is not a string) is a ModelLoadError
    ``{source}: unsupported {key} {name!r}; expected one of llama, qwen2`` (``source``, the file
    read, when given; ``key``, what the file calls the name, e.g. "model_type").
    """
    arch = _REGISTRY.get(name) if isinstance(name, str) else None
    if arch is None and isinstance(name, str) and name in ALIASES and ALIASES[name][0] in _REGISTRY:
        target, flags = ALIASES[name]
        arch = dataclasses.replace(_REGISTRY[target], name=name, options=dict(flags))
    if arch is None:
        where = f"{source}: " if source else ""
        raise ModelLoadError(f"{where}unsupported {key} {name!r}; expected one of {', '.join(names())}")
    return arch


def config_from_hf(raw: Any, source: str) -> ModelConfig:
    """The config of a Hugging Face ``config.json`` already parsed into ``raw``: the fields
    every architecture reads alike (``config.hf_common_fields``), then those its
    ``model_type``'s architecture sets, its own args among them; checked. Raises
    ModelLoadError naming ``source``."""
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    arch = get(raw.get("model_type"), source, key="model_type")
    names = arch.hf_key_names(raw)
    raw = arch.hf_prepare(raw, source)
    values = hf_common_fields(raw, source)
    values["architecture"] = arch.name
    values["key_names"] = {**values["key_names"], **names}
    values.update(arch.hf_config(raw, source, arch.options))
    if not arch.partial_rotary:
        values = whole_heads(values, source)
    try:
        config = ModelConfig.from_dict(values, arch.args)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: bad value in config: {exc}") from exc
    return config.validate(source)


def read_hf_config(path: "str | os.PathLike[str]") -> ModelConfig:
    """Read and check a ``config.json``."""
    return config_from_hf(read_config_json(path), os.fspath(path))


def whole_heads(values: dict[str, Any], source: str) -> dict[str, Any]:
    """The config ``values`` of an architecture whose attention rotates whole heads, as
    transformers' model of it does: a ``partial_rotary_factor`` < 1 is ignored with the default
    rope (transformers sizes that rope by the head alone) and refused with a scaled one (whose
    frequencies transformers sizes by the factor, then cannot apply to the whole head)."""
    partial = values.get("partial_rotary_factor", 1.0)
    if not is_number(partial) or not 0 < partial < 1:  # 1, or a bad value ``validate`` names
        return values
    key = values.get("key_names", {}).get("partial_rotary_factor", "partial_rotary_factor")
    scaling = values.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type") if isinstance(scaling, Mapping) else scaling
        raise ModelLoadError(f"{source}: {key}={partial} with rope type {kind!r} is not supported for model_type "
                             f"{values['architecture']!r}, which rotates whole heads (transformers cannot apply a "
                             f"scaled rope to part of one); expected 1 or absent")
    log.warning("%s: %s=%s is ignored: model_type %r rotates whole heads with the default rope, as transformers "
                "does", source, key, partial, values["architecture"])
    return {**values, "partial_rotary_factor": 1.0}


def refuse_sliding_window(raw: Mapping[str, Any], source: str) -> None:
    """For an architecture without sliding windows: ``use_sliding_window: true`` is refused."""
    if json_flag(raw, "use_sliding_window", False, source):
        raise ModelLoadError(f"{source}: use_sliding_window=true is not supported for model_type "
                             f"{raw.get('model_type')!r}; expected full attention")


def silu_only(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``hidden_act`` of a SwiGLU architecture: "silu" (the default); anything else refused."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    return {"hidden_act": "silu"}


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(slots=True)
class WindowArgs(ArchArgs):
    """Sliding-window attention, the args of Llama (Mistral's window), Qwen2 and Qwen3, and the
    base of Qwen3-MoE's and Gemma 3's: the layers ``layer_types`` names "sliding_attention"
    (every layer when it is None) attend to the last ``sliding_window`` keys, their own
    included; the others to every key."""

    sliding_window: int = 0  # W; 0: no window
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"; None: all alike

    def validate(self, config: ModelConfig, source: str) -> None:
        """A window of 0 or more keys; a type per layer, a window for the sliding ones."""
        if not is_int(self.sliding_window) or self.sliding_window < 0:
            raise ModelLoadError(f"{source}: sliding_window must be a positive integer or absent, "
                                 f"got {self.sliding_window!r}")
        types = self.layer_types
        if types is None:
            return
        if (not isinstance(types, list) or len(types) != config.num_hidden_layers
                or any(t not in LAYER_TYPES for t in types)):
            raise ModelLoadError(f"{source}: layer_types must list one of {', '.join(map(repr, LAYER_TYPES))} per "
                                 f"layer ({config.num_hidden_layers}), got {types!r:.200}")
        if "sliding_attention" in types and not self.sliding_window:
            raise ModelLoadError(f"{source}: layer_types names sliding_attention layers but sliding_window "
                                 f"is not set")

    def layer_window(self, layer: int) -> int:
        """W on a sliding layer (on every layer without ``layer_types``), else 0."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0


from . import gemma3, llama, qwen2, qwen2_vl, qwen3, qwen3_moe  # noqa: E402,F401  (each registers itself; they import the names above)
