"""A vision tower from a GGUF ``mmproj`` file as llama.cpp writes it (``clip.*`` metadata,
``v.*`` encoder and ``mm.*`` projector tensors), beside a GGUF text model: SmolVLM/Idefics3
(``clip.projector_type`` "idefics3"). The text model's tokenizer gives the image token's id."""
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
from .families import idefics3_tower
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
    if kind != "idefics3":
        raise ModelLoadError(f"{path}: clip.projector_type {kind!r} is not supported; expected 'idefics3' "
                             "(SmolVLM) in an mmproj file")
    if meta.get("clip.has_vision_encoder") is False:
        raise ModelLoadError(f"{path}: clip.has_vision_encoder is false; expected an mmproj with a vision encoder")
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
        raise ModelLoadError(f"{path}: clip.use_silu is set; the idefics3 encoder's MLP uses GELU")
    config = EncoderConfig.from_hf(raw, path, {"num_channels": 3})
    tensors = {t.name: t for t in gguf.tensors}
    wanted = {gguf_name(name): name for name in encoder_shapes(config, post_norm=True)}
    extra = sorted(set(tensors) - set(wanted) - {PROJECTOR})
    if extra:
        raise ModelLoadError(f"{path}: tensor {extra[0]!r}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''} "
                             "is not applied by the idefics3 vision tower")

    def read(name: str) -> np.ndarray:
        stored = gguf_name(name)
        if stored not in tensors:
            raise ModelLoadError(f"{path}: missing vision tensor {stored!r}")
        return tensor_values(tensors[stored], path)

    if PROJECTOR not in tensors:
        raise ModelLoadError(f"{path}: missing vision tensor {PROJECTOR!r}")
    token = tokenizer.backend.token_to_id("<image>") if tokenizer.missing is None else None
    if token is None:
        raise ModelLoadError(f"{path}: the text model's vocabulary has no '<image>' token; expected the SmolVLM "
                             "text model this mmproj belongs to")
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


def sibling_mmproj(model_path: Path) -> Path | None:
    """The one ``mmproj*.gguf`` file beside the GGUF model at ``model_path``, or None (none, or
    several: then the caller must name one)."""
    found = sorted(p for p in model_path.parent.glob("mmproj*.gguf") if p.is_file() and p != model_path)
    if len(found) > 1:
        log.warning("%s: several mmproj files beside it (%s); pass mmproj= / --mmproj to use one",
                    model_path, ", ".join(p.name for p in found))
        return None
    return found[0] if found else None
