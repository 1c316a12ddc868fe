"""The registry of model architectures: one module per architecture, found by name.

An ``Architecture`` holds everything that differs between architectures: how a Hugging Face
``config.json`` and GGUF metadata set its config fields, its weight names in each file format,
the fix-up GGUF tensors need, and the decoder layer it runs. Its name is the config's
``model_type`` and the GGUF file's ``general.architecture`` (and so the prefix of the GGUF's
hyper-parameter keys, ``{name}.block_count`` ...). Each module (``llama``, ``qwen2``) builds one
and calls ``register``; the loaders and the config reader look it up with ``get``. Adding an
architecture is one new module here plus its import below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import numpy as np

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..weights import NameTable

# A fix applied to a block of a GGUF tensor's rows (float rows, or the raw rows of a quantized
# matrix) as they are read, with the row count the blocks' bounds must be multiples of.
RowFix = tuple[Callable[[np.ndarray], np.ndarray], int]


@dataclass(frozen=True)
class Architecture:
    """What makes one architecture: its config fix-ups, weight names and layer function."""

    name: str  # config.json model_type == GGUF general.architecture == GGUF key prefix
    # (raw config.json, source for messages) -> the ModelConfig fields it sets (attention_bias ...)
    hf_config: Callable[[Mapping[str, Any], str], dict[str, Any]] = field(repr=False)
    # (GGUF metadata, the file's tensor names, source) -> the ModelConfig fields it sets
    gguf_config: Callable[[Mapping[str, Any], Collection[str], str], dict[str, Any]] = field(repr=False)
    hf_names: NameTable = field(repr=False)  # safetensors names -> ours
    gguf_names: NameTable = field(repr=False)  # GGUF names -> ours
    # (our weight name, config) -> the fix its GGUF rows need, or None when stored as we use it
    gguf_row_fix: Callable[[str, ModelConfig], RowFix | None] = field(repr=False)
    decoder_layer: Callable[..., None] = field(repr=False)  # the layer the decoder runs (models.layers.decoder_layer)


_REGISTRY: dict[str, Architecture] = {}


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
    """The registered architecture names, sorted."""
    return tuple(sorted(_REGISTRY))


def no_row_fix(ours: str, config: ModelConfig) -> RowFix | None:
    """``gguf_row_fix`` of an architecture whose GGUF tensors are stored as we use them."""
    return None


def get(name: Any, source: str | None = None, key: str = "architecture") -> Architecture:
    """The architecture called ``name``.

    Anything else (an unknown name, a value that is not a string) is a ModelLoadError
    ``{source}: unsupported {key} {name!r}; expected one of llama, qwen2`` (``source``, the file
    read, when given; ``key``, what the file calls the name, e.g. "model_type").
    """
    arch = _REGISTRY.get(name) if isinstance(name, str) else None
    if arch is None:
        where = f"{source}: " if source else ""
        raise ModelLoadError(f"{where}unsupported {key} {name!r}; expected one of {', '.join(names())}")
    return arch


from . import llama, qwen2  # noqa: E402,F401  (each registers itself; they import the names above)
