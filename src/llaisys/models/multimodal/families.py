"""The vision-language model families llaisys loads from Hugging Face folders, found by the
``model_type`` of a ``config.json`` that has a ``vision_config``: where the text model's config
and weights sit inside the folder (read by the text architecture's own loader), and how the
vision tower is built from the rest.

SmolVLM and Idefics3 (``smolvlm``, ``idefics3``): a Llama text model under
``model.text_model.``, a SigLIP encoder under ``model.vision_model.`` whose patch positions are
bucketed for any grid, and a pixel-shuffle projector (``model.connector.modality_projection``).

Gemma 3 (``gemma3`` with a ``vision_config``): a Gemma 3 text model under
``language_model.model.`` (``model.language_model.`` as transformers 5 names it), a SigLIP
encoder under ``vision_tower.vision_model.`` (or ``vision_tower.``), and a projector that
average-pools the patches to ``mm_tokens_per_image`` rows, RMS-normalises them (Gemma's 1 + w)
and projects them (``multi_modal_projector``); an image's tokens see each other both ways.
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
    text_prefixes: tuple[str, ...]  # the text model's weights are named "model." + what follows one of these
    kept_names: dict[str, str]  # other text weights by their names in the file -> a text model's ("lm_head.weight")
    vision_prefixes: tuple[str, ...]  # the tower's weights
    # (raw config.json, source) -> the text model's config.json
    text_config: Callable[[Mapping[str, Any], str], dict[str, Any]] = field(repr=False)
    # (raw config.json, tower weights by full name, folder, dtype, device) -> the tower
    build: Callable[..., VisionTower] = field(repr=False)

    def text_name(self, name: str) -> str | None:
        """The name the text architecture's table knows ``name`` by, or None when it is the
        tower's."""
        for prefix in self.text_prefixes:
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        return self.kept_names.get(name)

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


def _gemma3_text_config(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``text_config`` (a ``gemma3_text`` model) with the whole model's tied head (true unless
    the top level says otherwise, as transformers' Gemma3Config has it)."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"{source}: text_config must be an object, got {text!r:.80}")
    return {"model_type": "gemma3_text", **text, "tie_word_embeddings": raw.get("tie_word_embeddings", True)}


GEMMA3_VISION = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                 "vision_tower.")
GEMMA3_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")


def _gemma3_tower(raw: Mapping[str, Any], weights: Mapping[str, Any], folder: Path, text_hidden: int,
                  vocab_size: int, dtype: DataType, device: Device) -> VisionTower:
    """Gemma 3's tower from a folder: SigLIP (``vision_config``), then the projector: average
    pooling to ``mm_tokens_per_image`` rows, Gemma's RMS norm, a projection to the text width."""
    source = str(folder / "config.json")
    config = EncoderConfig.from_hf(raw.get("vision_config"), source, SIGLIP_VISION_DEFAULTS)
    prefix = next((p for p in GEMMA3_VISION if p + "embeddings.patch_embedding.weight" in weights), GEMMA3_VISION[-1])
    proj_prefix = next((p for p in GEMMA3_PROJECTOR if p + "mm_input_projection_weight" in weights),
                       GEMMA3_PROJECTOR[-1])
    names = {"norm": proj_prefix + "mm_soft_emb_norm.weight", "proj": proj_prefix + "mm_input_projection_weight"}
    head = {n for n in weights if n.startswith(prefix + "head.")}  # SigLIP's pooling head: Gemma 3 reads no pool
    _refuse_unused(weights, {prefix + n for n in encoder_shapes(config, True)} | set(names.values()) | head, source)
    tokens = raw.get("mm_tokens_per_image", 256)
    if not is_int(tokens) or tokens <= 0:
        raise ModelLoadError(f"{source}: mm_tokens_per_image must be a positive integer, got {tokens!r}")
    token = raw.get("image_token_index", raw.get("image_token_id", 262144))
    if not is_int(token) or not 0 <= token < vocab_size:
        raise ModelLoadError(f"{source}: image_token_index must be a token id below the vocabulary size "
                             f"{vocab_size}, got {token!r}")
    for name in names.values():
        if name not in weights:
            raise ModelLoadError(f"{source}: missing vision weight {name!r}")
    scale = np.float32(1.0) + np.asarray(weights[names["norm"]].read(), dtype=np.float32)  # Gemma's 1 + w
    return gemma3_tower(config, _reader(weights, prefix, source), scale, np.asarray(weights[names["proj"]].read()),
                        tokens, token, read_json_object(folder / PREPROCESSOR_CONFIG), text_hidden,
                        str(folder / PREPROCESSOR_CONFIG), dtype, device)


def gemma3_tower(config: EncoderConfig, read: Callable[[str], np.ndarray], scale: np.ndarray, projection: np.ndarray,
                 tokens: int, image_token_id: int, settings: Mapping[str, Any], text_hidden: int, source: str,
                 dtype: DataType, device: Device) -> VisionTower:
    """A Gemma 3 tower: the SigLIP encoder whose weights ``read(name)`` gives, average pooling to
    ``tokens`` rows an image, the soft-embedding norm's ``scale`` (Dv,) (1 + w), ``projection``
    (Dv, D), and the image processor of ``settings``. ModelLoadError naming ``source``."""
    from ...vision.preprocess import Gemma3Processor
    from .projectors import PooledProjector

    side, grid = int(round(tokens ** 0.5)), config.patches_per_side
    if side * side != tokens or grid % side:
        raise ModelLoadError(f"{source}: {tokens} image tokens must be a square whose side divides the {grid} "
                             "patches per side of the vision encoder")
    if scale.shape != (config.hidden_size,) or projection.shape != (config.hidden_size, text_hidden):
        raise ModelLoadError(f"{source}: the projector's norm has shape {scale.shape} and its weight "
                             f"{projection.shape}; expected ({config.hidden_size},) and ({config.hidden_size}, "
                             f"{text_hidden})")
    encoder = VisionEncoder(config, read, source, dtype=dtype, device=device)
    projector = PooledProjector(scale, projection, grid // side, config.layer_norm_eps, dtype, device)
    try:
        processor = Gemma3Processor.from_config({**settings, "image_seq_length": tokens})
    except ValueError as exc:
        raise ModelLoadError(f"{source}: image preprocessing: {exc}") from exc
    return VisionTower("gemma3", processor, encoder, projector, image_token_id, "<start_of_image>", text_hidden,
                       two_way=True)


# transformers' SiglipVisionConfig defaults
SIGLIP_VISION_DEFAULTS = {**SIGLIP_DEFAULTS, "intermediate_size": 3072, "hidden_size": 768, "num_attention_heads": 12,
                          "patch_size": 16}

def _qwen_text_config(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``text_config`` (transformers 5), or the top level itself (older configs keep the text
    model's keys there), as a ``qwen2_5_vl_text`` model; the tied head as the top level says."""
    text = raw.get("text_config")
    if text is None:
        text = {k: v for k, v in raw.items() if k not in ("vision_config", "text_config")}
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"{source}: text_config must be an object, got {text!r:.80}")
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": "qwen2_5_vl_text", "tie_word_embeddings": tie}


QWEN_VISION = ("model.visual.", "visual.")


class _Merged:
    """The projector of a tower whose encoder ends in its own merger: the rows as they come."""

    @staticmethod
    def project(rows: np.ndarray) -> np.ndarray:
        return rows


def _qwen_tower(raw: Mapping[str, Any], weights: Mapping[str, Any], folder: Path, text_hidden: int,
                vocab_size: int, dtype: DataType, device: Device) -> VisionTower:
    """Qwen2.5-VL's tower: its windowed ViT with 2-D rope and the patch merger, the image
    processor of preprocessor_config.json, and multimodal rope positions for its tokens."""
    from ...vision.preprocess import Qwen2VLProcessor
    from .qwen_vision import QwenVisionConfig, QwenVisionEncoder, qwen_vision_shapes

    source = str(folder / "config.json")
    config = QwenVisionConfig.from_hf(raw.get("vision_config"), source)
    if config.out_hidden_size != text_hidden:
        raise ModelLoadError(f"{source}: vision_config.out_hidden_size={config.out_hidden_size} must equal the text "
                             f"model's hidden_size={text_hidden}")
    prefix = next((p for p in QWEN_VISION if p + "patch_embed.proj.weight" in weights), QWEN_VISION[-1])
    _refuse_unused(weights, {prefix + n for n in qwen_vision_shapes(config)}, source)
    token = raw.get("image_token_id", 151655)
    if not is_int(token) or not 0 <= token < vocab_size:
        raise ModelLoadError(f"{source}: image_token_id must be a token id below the vocabulary size {vocab_size}, "
                             f"got {token!r}")
    encoder = QwenVisionEncoder(config, _reader(weights, prefix, source), source, dtype=dtype, device=device)
    settings = read_json_object(folder / PREPROCESSOR_CONFIG)
    try:
        processor = Qwen2VLProcessor.from_config(settings)
    except ValueError as exc:
        raise ModelLoadError(f"{folder / PREPROCESSOR_CONFIG}: {exc}") from exc
    if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != (
            config.patch_size, config.spatial_merge_size, config.temporal_patch_size):
        raise ModelLoadError(f"{folder / PREPROCESSOR_CONFIG}: patch_size, merge_size and temporal_patch_size must "
                             "match vision_config's patch_size, spatial_merge_size and temporal_patch_size")
    return VisionTower("qwen2_5_vl", processor, encoder, _Merged(), token, "<|image_pad|>", text_hidden,
                       standalone="<|vision_start|><|image_pad|><|vision_end|>", multimodal_rope=True)


_IDEFICS3 = Family("idefics3", ("model.text_model.",), {"lm_head.weight": "lm_head.weight"},
                   ("model.vision_model.", "model.connector."), _idefics3_text_config, _idefics3_tower)
_GEMMA3 = Family("gemma3", ("model.language_model.", "language_model.model."),
                 {"lm_head.weight": "lm_head.weight", "language_model.lm_head.weight": "lm_head.weight"},
                 GEMMA3_VISION + GEMMA3_PROJECTOR, _gemma3_text_config, _gemma3_tower)
_QWEN2_5_VL = Family("qwen2_5_vl", ("model.language_model.", "model."), {"lm_head.weight": "lm_head.weight"},
                     QWEN_VISION, _qwen_text_config, _qwen_tower)
FAMILIES: dict[str, Family] = {"idefics3": _IDEFICS3, "smolvlm": _IDEFICS3, "gemma3": _GEMMA3,
                               "qwen2_5_vl": _QWEN2_5_VL}


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
