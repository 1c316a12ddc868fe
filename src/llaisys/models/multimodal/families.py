"""The vision-language model families llaisys loads from Hugging Face folders, found by the
``model_type`` of a ``config.json`` that has a ``vision_config``: where the text model's config
and weights sit inside the folder (read by the text architecture's own loader), and how the
vision tower is built from the rest.

SmolVLM and Idefics3 (``smolvlm``, ``idefics3``): a Llama text model under
``model.text_model.``, a SigLIP encoder under ``model.vision_model.`` whose patch positions are
bucketed for any grid, and a pixel-shuffle projector (``model.connector.modality_projection``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ...runtime.device import Device
from ...runtime.dtypes import DataType
from ...tensor import Tensor
from ..config import is_int
from ..errors import ModelLoadError, read_json_object
from .encoder import VisionEncoder, encoder_shapes
from .encoder_config import EncoderConfig
from .projectors import PixelShuffleProjector
from .tower import VisionTower

# transformers' Idefics3VisionConfig / SmolVLMVisionConfig defaults
SIGLIP_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16,
                   "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}
PREPROCESSOR_CONFIG = "preprocessor_config.json"


@dataclass(frozen=True)
class Family:
    """Where a vision-language folder keeps its parts, and how its tower is built."""

    name: str
    text_prefix: str  # the text model's weights are named "model." + what follows this prefix
    kept_names: frozenset[str]  # text weights named as a text model names them ("lm_head.weight")
    vision_prefixes: tuple[str, ...]  # the tower's weights
    # (raw config.json, source) -> the text model's config.json
    text_config: Callable[[Mapping[str, Any], str], dict[str, Any]] = field(repr=False)
    # (raw config.json, tower weights by full name, folder, dtype, device) -> the tower
    build: Callable[..., VisionTower] = field(repr=False)

    def text_name(self, name: str) -> str | None:
        """The name the text architecture's table knows ``name`` by, or None when it is the
        tower's."""
        if name.startswith(self.text_prefix):
            return "model." + name[len(self.text_prefix):]
        if name in self.kept_names:
            return name
        return None

    def is_vision(self, name: str) -> bool:
        return name.startswith(self.vision_prefixes)


def _idefics3_text_config(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``text_config`` with transformers' defaults for it (a Llama, rms_norm_eps 1e-5) and the
    tied head of the whole model (``tie_word_embeddings`` of the top level, false by default)."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"{source}: text_config must be an object, got {text!r:.80}")
    values = {"model_type": "llama", "rms_norm_eps": 1e-5, **text}
    values["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
    return values


def _idefics3_tower(raw: Mapping[str, Any], weights: Mapping[str, Any], folder: Path, text_hidden: int,
                    vocab_size: int, dtype: DataType, device: Device) -> VisionTower:
    """SmolVLM's tower from a folder: ``vision_config``, ``scale_factor``, ``image_token_id``,
    the weights under ``model.vision_model.`` and the connector's, preprocessor_config.json."""
    source = str(folder / "config.json")
    encoder_config = EncoderConfig.from_hf(raw.get("vision_config"), source, SIGLIP_DEFAULTS)
    token = raw.get("image_token_id", 128257)
    if not is_int(token) or not 0 <= token < vocab_size:
        raise ModelLoadError(f"{source}: image_token_id must be a token id below the vocabulary size {vocab_size}, "
                             f"got {token!r}")
    proj_name = "model.connector.modality_projection.proj.weight"
    _refuse_unused(weights, {"model.vision_model." + n for n in encoder_shapes(encoder_config, True)} | {proj_name},
                   source)
    if proj_name not in weights:
        raise ModelLoadError(f"{source}: missing vision weight {proj_name!r}")
    settings = read_json_object(folder / PREPROCESSOR_CONFIG)
    return idefics3_tower(encoder_config, _reader(weights, "model.vision_model.", source),
                          np.asarray(weights[proj_name].read()), raw.get("scale_factor", 2), token, settings,
                          text_hidden, source, dtype, device)


def idefics3_tower(encoder_config: EncoderConfig, read: Callable[[str], np.ndarray], projection: np.ndarray,
                   scale: Any, image_token_id: int, settings: Mapping[str, Any], text_hidden: int, source: str,
                   dtype: DataType, device: Device) -> VisionTower:
    """A SmolVLM/Idefics3 tower: the SigLIP encoder whose weights ``read(name)`` gives (names
    of ``encoder_shapes``), pixel shuffle by ``scale``, ``projection`` (D, s^2*Dv) to the text
    width, and the image processor of ``settings`` (a preprocessor_config.json). ModelLoadError
    naming ``source`` for a bad value."""
    from ...vision.preprocess import Idefics3Processor

    grid = encoder_config.patches_per_side
    if not is_int(scale) or scale <= 0 or grid % scale:
        raise ModelLoadError(f"{source}: scale_factor must be a positive integer dividing the {grid} patches per "
                             f"side of the vision encoder, got {scale!r}")
    expected = (text_hidden, encoder_config.hidden_size * scale * scale)
    if projection.shape != expected:
        raise ModelLoadError(f"{source}: the projector's weight has shape {projection.shape}; expected {expected} "
                             "(the text width, the encoder width times scale_factor squared)")
    encoder = VisionEncoder(encoder_config, read, source, dtype=dtype, device=device)
    projector = PixelShuffleProjector(Tensor.from_numpy(np.ascontiguousarray(projection, dtype=np.float32),
                                                        device=device, dtype=dtype), scale)
    try:
        processor = Idefics3Processor.from_config({**settings, "image_seq_len": projector.tokens_per_image(grid * grid)})
    except ValueError as exc:
        raise ModelLoadError(f"{source}: image preprocessing: {exc}") from exc
    return VisionTower("idefics3", processor, encoder, projector, image_token_id, "<image>", text_hidden)


def _reader(weights: Mapping[str, Any], prefix: str, source: str) -> Callable[[str], np.ndarray]:
    def read(name: str) -> np.ndarray:
        full = prefix + name
        if full not in weights:
            raise ModelLoadError(f"{source}: missing vision weight {full!r}")
        return weights[full].read()
    return read


def _refuse_unused(weights: Mapping[str, Any], used: set[str], source: str) -> None:
    """A tower weight the tower does not apply is a ModelLoadError (it would compute without it)."""
    extra = sorted(set(weights) - used)
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ModelLoadError(f"{source}: vision weight {extra[0]!r}{more} is not applied by the vision tower; "
                             "expected only the encoder's and the projector's weights")


_IDEFICS3 = Family("idefics3", "model.text_model.", frozenset({"lm_head.weight"}),
                   ("model.vision_model.", "model.connector."), _idefics3_text_config, _idefics3_tower)
FAMILIES: dict[str, Family] = {"idefics3": _IDEFICS3, "smolvlm": _IDEFICS3}


def family_of(raw: Any) -> Family | None:
    """The family of a parsed ``config.json`` with a ``vision_config`` (None for a text model);
    ModelLoadError for a vision-language model_type llaisys does not load."""
    if not isinstance(raw, Mapping) or "vision_config" not in raw:
        return None
    kind = raw.get("model_type")
    if kind not in FAMILIES:
        raise ModelLoadError(f"vision-language model_type {kind!r} is not supported; expected one of "
                             f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[kind]
