"""Qwen2.5-VL's vision tower from a llama.cpp ``mmproj`` file (``clip.projector_type``
"qwen2.5vl_merger"), beside the GGUF of its text model (``general.architecture`` "qwen2vl").

llama.cpp's converter writes transformers' vision model under its own names and in pieces: the
patch embedding (a Conv3d of T = 2 frames) as one 2-D kernel per frame (``v.patch_embd.weight``
and ``v.patch_embd.weight.1``), each block's fused qkv as ``attn_q``, ``attn_k`` and ``attn_v``,
the merger's norm as ``v.post_ln`` and its MLP as ``mm.0`` / ``mm.2``. They are put back
together here under the names ``QwenVisionEncoder`` reads. The windows' full-attention blocks
come from ``clip.vision.n_wa_pattern`` (every n-th block); sizes llama.cpp's converter leaves
out take the defaults llama.cpp's clip runs with (merge 2, windows of 112 pixels).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...runtime.device import Device
from ...runtime.dtypes import DataType
from ..config import is_int
from ..errors import ModelLoadError
from ..loaders.gguf import tensor_values
from ..loaders.gguf_file import GGUFFile
from .families import _Merged
from .qwen_vision import QwenVisionConfig, QwenVisionEncoder, qwen_vision_shapes
from .tower import VisionTower

log = logging.getLogger(__name__)

# transformers' weight names -> llama.cpp's, per block after "blocks.{i}." / "v.blk.{i}."
BLOCK_NAMES = {"norm1.weight": "ln1.weight", "norm2.weight": "ln2.weight",
               "attn.proj.weight": "attn_out.weight", "attn.proj.bias": "attn_out.bias",
               **{f"mlp.{x}_proj.{kind}": f"ffn_{x}.{kind}" for x in ("gate", "up", "down")
                  for kind in ("weight", "bias")}}
GLOBAL_NAMES = {"merger.ln_q.weight": "v.post_ln.weight",
                **{f"merger.mlp.{i}.{kind}": f"mm.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")}}
PATCH_SLICES = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # the Conv3d's frames, one 2-D kernel each
DEFAULT_MERGE = 2  # llama.cpp's clip, when clip.vision.spatial_merge_size is absent
DEFAULT_WINDOW = 112  # llama.cpp's clip, when clip.vision.window_size is absent


def stored_names(ours: str) -> tuple[str, ...]:
    """The mmproj tensors that make weight ``ours`` (a name of ``qwen_vision_shapes``), in the
    order ``join`` takes them: ``blocks.2.attn.qkv.bias`` -> ``v.blk.2.attn_q.bias``,
    ``v.blk.2.attn_k.bias``, ``v.blk.2.attn_v.bias``."""
    if ours == "patch_embed.proj.weight":
        return PATCH_SLICES
    if ours in GLOBAL_NAMES:
        return (GLOBAL_NAMES[ours],)
    index, _, rest = ours[len("blocks."):].partition(".")
    if rest.startswith("attn.qkv."):
        kind = rest.rpartition(".")[2]
        return tuple(f"v.blk.{index}.attn_{x}.{kind}" for x in "qkv")
    return (f"v.blk.{index}.{BLOCK_NAMES[rest]}",)


def join(ours: str, parts: list[np.ndarray]) -> np.ndarray:
    """Weight ``ours`` from its stored ``parts``: the frames' kernels (D, C, p, p) stacked into
    the Conv3d's (D, C, T, p, p); q, k and v rows (D, ...) each concatenated into qkv (3D, ...)."""
    if ours == "patch_embed.proj.weight":
        return np.stack(parts, axis=2)
    return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _vision_config(meta: dict, path: str, text_hidden: int) -> QwenVisionConfig:
    """The encoder's ``vision_config`` from the ``clip.vision.*`` keys; ModelLoadError naming the
    key for a missing or bad value."""
    def count(key: str, default: Any = None, least: int = 1) -> int:
        value = meta.get(key, default)
        if not is_int(value) or value < least:
            raise ModelLoadError(f"{path}: {key} must be an integer >= {least}, got {value!r}")
        return value

    depth = count("clip.vision.block_count")
    pattern = count("clip.vision.n_wa_pattern", least=0)  # 0: no windows, every block attends to the whole image
    if meta.get("clip.use_gelu") or meta.get("clip.use_gelu_erf"):
        raise ModelLoadError(f"{path}: clip.use_gelu is set; the Qwen2.5-VL encoder's MLP is gated by SiLU")
    raw = {"depth": depth, "hidden_size": count("clip.vision.embedding_length"),
           "intermediate_size": count("clip.vision.feed_forward_length"),
           "num_heads": count("clip.vision.attention.head_count"), "patch_size": count("clip.vision.patch_size"),
           "spatial_merge_size": count("clip.vision.spatial_merge_size", DEFAULT_MERGE),
           "window_size": count("clip.vision.window_size", DEFAULT_WINDOW),
           "out_hidden_size": count("clip.vision.projection_dim", text_hidden), "in_channels": 3,
           "temporal_patch_size": len(PATCH_SLICES),
           "fullatt_block_indexes": [i for i in range(depth) if not pattern or (i + 1) % pattern == 0]}
    # clip.vision.attention.layer_norm_epsilon is not read: the converter copies the text model's
    # rms_norm_eps there, while transformers' encoder and merger normalise with 1e-6 always
    config = QwenVisionConfig.from_hf(raw, path)
    if config.out_hidden_size != text_hidden:
        raise ModelLoadError(f"{path}: clip.vision.projection_dim={config.out_hidden_size} must equal the text "
                             f"model's hidden size {text_hidden}")
    return config


def _processor(meta: dict, path: str, config: QwenVisionConfig) -> Any:
    """The image processor of the file's ``image_mean``/``image_std`` and pixel limits
    (``image_min_pixels``/``image_max_pixels``; transformers' defaults without them)."""
    from ...vision.preprocess import Qwen2VLProcessor

    settings = {"image_mean": meta.get("clip.vision.image_mean"), "image_std": meta.get("clip.vision.image_std"),
                "min_pixels": meta.get("clip.vision.image_min_pixels"),
                "max_pixels": meta.get("clip.vision.image_max_pixels"), "patch_size": config.patch_size,
                "merge_size": config.spatial_merge_size, "temporal_patch_size": config.temporal_patch_size}
    if settings["max_pixels"] is None:
        log.info("%s: no clip.vision.image_max_pixels; images are resized within transformers' default limits", path)
    try:
        return Qwen2VLProcessor.from_config(settings)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: image preprocessing (clip.vision.*): {exc}") from exc


def qwen_mmproj_tower(gguf: GGUFFile, path: str, tokenizer: Any, text_hidden: int, dtype: DataType,
                      device: Device) -> VisionTower:
    """The Qwen2.5-VL tower of the parsed mmproj ``gguf`` (read from ``path``) for a text model
    of width ``text_hidden`` whose ``tokenizer`` holds ``<|image_pad|>``, as the tower of a
    Hugging Face folder is built (``families._qwen_tower``). ModelLoadError naming the file for
    bad metadata, a missing or misshapen tensor, or a tensor the tower does not apply."""
    meta = gguf.meta
    config = _vision_config(meta, path, text_hidden)
    tensors = {t.name: t for t in gguf.tensors}
    sources = {ours: stored_names(ours) for ours in qwen_vision_shapes(config)}
    wanted = [name for names in sources.values() for name in names]
    extra = sorted(set(tensors) - set(wanted))
    if extra:
        raise ModelLoadError(f"{path}: tensor {extra[0]!r}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''} "
                             "is not applied by the qwen2.5vl_merger vision tower")
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: missing vision tensor {missing[0]!r}")
    token = tokenizer.backend.token_to_id("<|image_pad|>") if tokenizer.missing is None else None
    if token is None:
        raise ModelLoadError(f"{path}: the text model's vocabulary has no '<|image_pad|>' token; expected the "
                             "Qwen2.5-VL text model this mmproj belongs to")

    def read(ours: str) -> np.ndarray:
        parts = [tensor_values(tensors[name], path) for name in sources[ours]]
        shapes = {p.shape for p in parts}
        if len(shapes) > 1:
            raise ModelLoadError(f"{path}: tensors {', '.join(map(repr, sources[ours]))} have shapes "
                                 f"{[p.shape for p in parts]}; expected one shape (the parts of {ours!r})")
        return join(ours, parts)

    encoder = QwenVisionEncoder(config, read, path, dtype=dtype, device=device)
    return VisionTower("qwen2_5_vl", _processor(meta, path, config), encoder, _Merged(), token, "<|image_pad|>",
                       text_hidden, standalone="<|vision_start|><|image_pad|><|vision_end|>", multimodal_rope=True)

