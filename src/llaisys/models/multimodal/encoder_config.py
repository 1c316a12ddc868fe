"""The hyper-parameters of a vision encoder (a SigLIP-style vision transformer), read from the
``vision_config`` of a vision-language model's ``config.json`` with transformers' defaults, and
checked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..config import is_int, is_positive
from ..errors import ModelLoadError

# ``hidden_act`` -> the form of ``ops.gelu``
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """A vision transformer over square patches: patch embedding (a linear over each patch's
    C*p*p values), learned positions of a grid of (image_size / patch_size)^2, then
    ``num_hidden_layers`` pre-norm layers (layer norm, attention over all patches of an image,
    layer norm, GELU MLP), then a final layer norm."""

    hidden_size: int  # Dv
    intermediate_size: int  # the MLP width
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # the side of the image the position table was trained for
    patch_size: int  # p
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    activation: str = "tanh"  # ``ops.gelu``'s approximate: "tanh" | "none"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, raw: Any, source: str, defaults: Mapping[str, Any]) -> "EncoderConfig":
        """The encoder of ``vision_config`` ``raw`` (missing keys take ``defaults``, the
        transformers class's); ModelLoadError naming ``source`` and the key for a bad value."""
        if not isinstance(raw, Mapping):
            raise ModelLoadError(f"{source}: vision_config must be an object, got {type(raw).__name__}")
        values = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
        where = f"{source}: vision_config"
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                    "patch_size", "num_channels"):
            if not is_int(values.get(key)) or values[key] <= 0:
                raise ModelLoadError(f"{where}.{key} must be a positive integer, got {values.get(key)!r}")
        if values["hidden_size"] % values["num_attention_heads"]:
            raise ModelLoadError(f"{where}.hidden_size={values['hidden_size']} is not a multiple of "
                                 f"num_attention_heads={values['num_attention_heads']}")
        if values["image_size"] % values["patch_size"]:
            raise ModelLoadError(f"{where}.image_size={values['image_size']} is not a multiple of "
                                 f"patch_size={values['patch_size']}")
        if not is_positive(values.get("layer_norm_eps")):
            raise ModelLoadError(f"{where}.layer_norm_eps must be a positive number, got "
                                 f"{values.get('layer_norm_eps')!r}")
        act = values.get("hidden_act")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"{where}.hidden_act {act!r} is not supported; expected one of "
                                 f"{', '.join(map(repr, ACTIVATIONS))}")
        return cls(values["hidden_size"], values["intermediate_size"], values["num_hidden_layers"],
                   values["num_attention_heads"], values["image_size"], values["patch_size"], values["num_channels"],
                   float(values["layer_norm_eps"]), ACTIVATIONS[act])
