"""A vision tower from a GGUF ``mmproj`` file as llama.cpp writes it (``clip.*`` metadata,
``v.*`` encoder and ``mm.*`` projector tensors), beside a GGUF text model: SmolVLM/Idefics3
(``clip.projector_type`` "idefics3"), Gemma 3 ("gemma3") and Qwen2.5-VL ("qwen2.5vl_merger",
read by ``mmproj_qwen``). The text model's tokenizer gives the image token's id."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...runtime.device import Device
from ...runtime.dtypes import DataType
from ..config import is_int, is_number
from ..errors import ModelLoadError
from ..loaders.gguf import open_gguf, tensor_values
from .encoder import encoder_shapes
from .encoder_config import EncoderConfig
from .families import gemma3_tower, idefics3_tower
from .mmproj_qwen import qwen_mmproj_tower
from .tower import VisionTower

log = logging.getLogger(__name__)

# our encoder weight names (transformers') -> llama.cpp's, per layer after "encoder.layers.{i}." / "v.blk.{i}."
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
               "mlp.fc2": "ffn_down"}
GLOBAL_NAMES = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
                "post_layernorm": "v.post_ln"}
PROJECTOR = "mm.model.fc.weight"


def gguf_name(ours: str) -> str:
    """llama.cpp's name of encoder weight ``ours`` (``encoder.layers.3.mlp.fc1.weight`` ->
    ``v.blk.3.ffn_up.weight``)."""
    stem, _, kind = ours.rpartition(".")
    if stem.startswith("encoder.layers."):
        index, _, rest = stem[len("encoder.layers."):].partition(".")
        return f"v.blk.{index}.{LAYER_NAMES[rest]}.{kind}"
    return f"{GLOBAL_NAMES[stem]}.{kind}"


def _meta(meta: dict, key: str, path: str, check: Callable[[Any], bool], expected: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None or not check(value):
        raise ModelLoadError(f"{path}: {key} must be {expected}, got {value!r}")
    return value


def mmproj_tower(path: "str | Path", tokenizer: Any, text_hidden: int, dtype: DataType, device: Device) -> VisionTower:
    """The vision tower of the mmproj GGUF at ``path`` for a text model of width
    ``text_hidden`` whose ``tokenizer`` holds the image token; ModelLoadError naming the file
    for a projector type llaisys does not run, a missing or misshapen tensor, a tensor it does
    not apply, or bad metadata."""
    path = str(path)
    gguf = open_gguf(path)
    meta = gguf.meta
    kind = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if meta.get("clip.has_vision_encoder") is False:
        raise ModelLoadError(f"{path}: clip.has_vision_encoder is false; expected an mmproj with a vision encoder")
    if kind == "idefics3":
        return _idefics3(gguf, path, tokenizer, text_hidden, dtype, device)
    if kind == "gemma3":
        return _gemma3(gguf, path, tokenizer, text_hidden, dtype, device)
    if kind == "qwen2.5vl_merger":
        return qwen_mmproj_tower(gguf, path, tokenizer, text_hidden, dtype, device)
    raise ModelLoadError(f"{path}: clip.projector_type {kind!r} is not supported; expected one of "
                         f"{', '.join(map(repr, PROJECTOR_TYPES))} in an mmproj file")


PROJECTOR_TYPES = ("idefics3", "gemma3", "qwen2.5vl_merger")
GEMMA3_PROJECTOR = ("mm.input_projection.weight", "mm.soft_emb_norm.weight")


def _siglip(gguf: Any, path: str, projector: tuple[str, ...]) -> tuple[EncoderConfig, Callable[[str], np.ndarray], dict]:
    """The SigLIP encoder of an mmproj file: its config from ``clip.vision.*``, a reader of its
    weights by our names, and the file's tensors by name; ModelLoadError for a tensor that is
    neither the encoder's nor one of ``projector``."""
    meta = gguf.meta
    positive = lambda v: is_int(v) and v > 0  # noqa: E731
    raw = {"hidden_size": _meta(meta, "clip.vision.embedding_length", path, positive, "a positive integer"),
           "intermediate_size": _meta(meta, "clip.vision.feed_forward_length", path, positive, "a positive integer"),
           "num_hidden_layers": _meta(meta, "clip.vision.block_count", path, positive, "a positive integer"),
           "num_attention_heads": _meta(meta, "clip.vision.attention.head_count", path, positive, "a positive integer"),
           "image_size": _meta(meta, "clip.vision.image_size", path, positive, "a positive integer"),
           "patch_size": _meta(meta, "clip.vision.patch_size", path, positive, "a positive integer"),
           "layer_norm_eps": _meta(meta, "clip.vision.attention.layer_norm_epsilon", path,
                                   lambda v: is_number(v) and v > 0, "a positive number", 1e-6),
           "hidden_act": "gelu" if meta.get("clip.use_gelu_erf") else "gelu_pytorch_tanh"}
    if meta.get("clip.use_silu"):
        raise ModelLoadError(f"{path}: clip.use_silu is set; the SigLIP encoder's MLP uses GELU")
    config = EncoderConfig.from_hf(raw, path, {"num_channels": 3})
    tensors = {t.name: t for t in gguf.tensors}
    wanted = {gguf_name(name): name for name in encoder_shapes(config, post_norm=True)}
    extra = sorted(set(tensors) - set(wanted) - set(projector))
    if extra:
        raise ModelLoadError(f"{path}: tensor {extra[0]!r}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''} "
                             "is not applied by the vision tower")
    for name in projector:
        if name not in tensors:
            raise ModelLoadError(f"{path}: missing vision tensor {name!r}")

    shapes = encoder_shapes(config, post_norm=True)

    def read(name: str) -> np.ndarray:
        stored = gguf_name(name)
        if ".ffn_" in stored:  # older converters named fc1 ffn_down and fc2 ffn_up: the shapes tell them apart
            pair = (stored, stored.replace(".ffn_up.", ".ffn_down.") if ".ffn_up." in stored
                    else stored.replace(".ffn_down.", ".ffn_up."))
            stored = next((n for n in pair if n in tensors and tuple(tensors[n].shape[::-1]) == shapes[name]),
                          stored)
        if stored not in tensors:
            raise ModelLoadError(f"{path}: missing vision tensor {stored!r}")
        return tensor_values(tensors[stored], path)

    return config, read, tensors


def _token(tokenizer: Any, text: str, path: str, model: str) -> int:
    token = tokenizer.backend.token_to_id(text) if tokenizer.missing is None else None
    if token is None:
        raise ModelLoadError(f"{path}: the text model's vocabulary has no {text!r} token; expected the {model} "
                             "text model this mmproj belongs to")
    return token


def _idefics3(gguf: Any, path: str, tokenizer: Any, text_hidden: int, dtype: DataType, device: Device) -> VisionTower:
    """SmolVLM's tower: SigLIP, pixel shuffle by ``clip.vision.projector.scale_factor``, and
    ``mm.model.fc.weight``; images resized to ``clip.vision.preproc_image_size`` then tiled."""
    meta = gguf.meta
    config, read, tensors = _siglip(gguf, path, (PROJECTOR,))
    token = _token(tokenizer, "<image>", path, "SmolVLM")
    mean, std = meta.get("clip.vision.image_mean", [0.5] * 3), meta.get("clip.vision.image_std", [0.5] * 3)
    longest = meta.get("clip.vision.preproc_image_size")
    if longest is None:
        longest = 4 * config.image_size  # SmolVLM's processors: four tiles a side
        log.info("%s: no clip.vision.preproc_image_size; images are resized to a longest side of %d", path, longest)
    settings = {"image_mean": mean, "image_std": std, "size": {"longest_edge": longest},
                "max_image_size": {"longest_edge": config.image_size}}
    scale = meta.get("clip.vision.projector.scale_factor", 2)
    return idefics3_tower(config, read, tensor_values(tensors[PROJECTOR], path), scale, token, settings, text_hidden,
                          path, dtype, device)


def _gemma3(gguf: Any, path: str, tokenizer: Any, text_hidden: int, dtype: DataType, device: Device) -> VisionTower:
    """Gemma 3's tower: SigLIP, average pooling by ``clip.vision.projector.scale_factor`` (4:
    256 tokens of an 896 px image), the soft-embedding norm (stored as 1 + w, as llama.cpp's
    converter writes it) and ``mm.input_projection.weight`` (Dv, D); images resized to the
    encoder's square."""
    meta = gguf.meta
    config, read, tensors = _siglip(gguf, path, GEMMA3_PROJECTOR)
    token = _token(tokenizer, "<image_soft_token>", path, "Gemma 3")
    pool = meta.get("clip.vision.projector.scale_factor", 4)
    if not is_int(pool) or pool <= 0 or config.patches_per_side % pool:
        raise ModelLoadError(f"{path}: clip.vision.projector.scale_factor must be a positive integer dividing the "
                             f"{config.patches_per_side} patches per side, got {pool!r}")
    tokens = (config.patches_per_side // pool) ** 2
    settings = {"image_mean": meta.get("clip.vision.image_mean", [0.5] * 3),
                "image_std": meta.get("clip.vision.image_std", [0.5] * 3),
                "size": {"height": config.image_size, "width": config.image_size}}
    scale = tensor_values(tensors["mm.soft_emb_norm.weight"], path).astype(np.float32)
    projection = tensor_values(tensors["mm.input_projection.weight"], path)
    return gemma3_tower(config, read, scale, projection, tokens, token, settings, text_hidden, path, dtype, device)


def sibling_mmproj(model_path: Path) -> Path | None:
    """The one ``mmproj*.gguf`` file beside the GGUF model at ``model_path``, or None (none, or
    several: then the caller must name one)."""
    found = sorted(p for p in model_path.parent.glob("mmproj*.gguf") if p.is_file() and p != model_path)
    if len(found) > 1:
        log.warning("%s: several mmproj files beside it (%s); pass mmproj= / --mmproj to use one",
                    model_path, ", ".join(p.name for p in found))
        return None
    return found[0] if found else None
