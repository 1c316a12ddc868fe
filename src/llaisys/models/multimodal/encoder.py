"""A SigLIP-style vision transformer written with ``llaisys.ops``: the encoder of SmolVLM
(Idefics3) and Gemma 3.

An image (or a tile of one) of C x H x W pixels is cut into P = (H/p)(W/p) patches of p x p; each
patch's C*p*p values go through one linear (the patch embedding, a convolution of stride p),
plus a learned position; then every layer runs layer norm, attention of each patch over all
patches of its image (no causal mask), a residual add, layer norm, a GELU MLP and a residual
add; a final layer norm ends it. Images are encoded together: the linears see all N*P rows,
attention runs per image.

Shapes: N images, P patches per image, Dv hidden, H heads, Dh head dim, F MLP width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ... import ops
from ...ops import functional as F
from ...runtime.device import Device
from ...runtime.dtypes import DataType
from ...tensor import Tensor
from ..errors import ModelLoadError
from .encoder_config import EncoderConfig

LAYER_NAMES = ("layer_norm1.weight", "layer_norm1.bias", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
               "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
               "self_attn.v_proj.bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias",
               "layer_norm2.weight", "layer_norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight",
               "mlp.fc2.bias")


def encoder_shapes(c: EncoderConfig, post_norm: bool) -> dict[str, tuple[int, ...]]:
    """Every weight of the encoder by its name in transformers' vision model, with its shape."""
    d, f, p = c.hidden_size, c.intermediate_size, c.patch_size
    shapes = {"embeddings.patch_embedding.weight": (d, c.num_channels, p, p), "embeddings.patch_embedding.bias": (d,),
              "embeddings.position_embedding.weight": (c.patches_per_side ** 2, d)}
    per_layer = {"layer_norm1.weight": (d,), "layer_norm1.bias": (d,), "layer_norm2.weight": (d,),
                 "layer_norm2.bias": (d,), "mlp.fc1.weight": (f, d), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (d, f),
                 "mlp.fc2.bias": (d,)}
    for x in ("q", "k", "v", "out"):
        per_layer[f"self_attn.{x}_proj.weight"] = (d, d)
        per_layer[f"self_attn.{x}_proj.bias"] = (d,)
    for i in range(c.num_hidden_layers):
        shapes.update({f"encoder.layers.{i}.{name}": per_layer[name] for name in LAYER_NAMES})
    if post_norm:
        shapes.update({"post_layernorm.weight": (d,), "post_layernorm.bias": (d,)})
    return shapes


@dataclass(slots=True)
class EncoderLayer:
    """One layer's weights on the device: qkv (3Dv, Dv) is q, k and v stacked (one linear)."""

    norm1: tuple[Tensor, Tensor]
    qkv: Tensor
    qkv_bias: Tensor
    out: Tensor
    out_bias: Tensor
    norm2: tuple[Tensor, Tensor]
    fc1: Tensor
    fc1_bias: Tensor
    fc2: Tensor
    fc2_bias: Tensor


class VisionEncoder:
    """The encoder's weights on ``device`` in ``dtype`` and its forward pass (``encode``)."""

    def __init__(self, config: EncoderConfig, read: Callable[[str], np.ndarray], source: str, *,
                 post_norm: bool = True, dtype: DataType = DataType.F32, device: Device | None = None):
        """Weights come from ``read(name)`` (a name of ``encoder_shapes``, a float array); a
        missing weight or one of another shape is a ModelLoadError naming ``source``."""
        self.config, self.dtype = config, dtype
        shapes = encoder_shapes(config, post_norm)

        def tensor(name: str, shape: tuple[int, ...] | None = None) -> Tensor:
            value = np.asarray(read(name))
            if value.shape != shapes[name]:
                raise ModelLoadError(f"{source}: vision weight {name!r} has shape {value.shape}; expected "
                                     f"{shapes[name]} for this vision_config")
            value = value.astype(np.float32).reshape(shape or value.shape)
            return Tensor.from_numpy(np.ascontiguousarray(value), device=device, dtype=dtype)

        def stacked(names: list[str]) -> Tensor:
            arrays = []
            for name in names:
                value = np.asarray(read(name))
                if value.shape != shapes[name]:
                    raise ModelLoadError(f"{source}: vision weight {name!r} has shape {value.shape}; expected "
                                         f"{shapes[name]} for this vision_config")
                arrays.append(value.astype(np.float32))
            return Tensor.from_numpy(np.ascontiguousarray(np.concatenate(arrays)), device=device, dtype=dtype)

        d, c, p = config.hidden_size, config.num_channels, config.patch_size
        self.patch = tensor("embeddings.patch_embedding.weight", (d, c * p * p))  # (Dv, C*p*p), a conv's (C, p, p)
        self.patch_bias = tensor("embeddings.patch_embedding.bias")  # (Dv,)
        self.positions = tensor("embeddings.position_embedding.weight").numpy()  # (G*G, Dv) host: added per image
        self.layers = []
        for i in range(config.num_hidden_layers):
            at = f"encoder.layers.{i}."
            self.layers.append(EncoderLayer(
                (tensor(at + "layer_norm1.weight"), tensor(at + "layer_norm1.bias")),
                stacked([at + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                stacked([at + f"self_attn.{x}_proj.bias" for x in "qkv"]),
                tensor(at + "self_attn.out_proj.weight"), tensor(at + "self_attn.out_proj.bias"),
                (tensor(at + "layer_norm2.weight"), tensor(at + "layer_norm2.bias")),
                tensor(at + "mlp.fc1.weight"), tensor(at + "mlp.fc1.bias"),
                tensor(at + "mlp.fc2.weight"), tensor(at + "mlp.fc2.bias")))
        self.post_norm = (tensor("post_layernorm.weight"), tensor("post_layernorm.bias")) if post_norm else None
        self.device = self.patch.device

    def patches(self, pixels: np.ndarray) -> np.ndarray:
        """The patch rows (N*P, C*p*p) of ``pixels`` (N, C, H, W), each patch's values in the
        order of a convolution weight (channel, row, column), patches row by row."""
        n, c, h, w = pixels.shape
        p = self.config.patch_size
        grid = pixels.reshape(n, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)  # (N, H/p, W/p, C, p, p)
        return np.ascontiguousarray(grid.reshape(n * (h // p) * (w // p), c * p * p), dtype=np.float32)

    def position_ids(self, rows: int, cols: int) -> np.ndarray:
        """The position of each patch of a grid of ``rows`` x ``cols`` (P,) in the table of
        G x G positions: its fractional coordinates bucketed into G steps, as transformers'
        Idefics3 embeddings compute them in float32 (0 .. G*G-1 in order when the grid is G x G)."""
        g = self.config.patches_per_side
        # torch.arange(1/g, 1.0, 1/g) in float32: ceil((end - start) / step) values, each start + step * i
        # computed in double, then rounded
        count = max(int(np.ceil((1.0 - 1 / g) / (1 / g))), 0)
        boundaries = (1 / g + (1 / g) * np.arange(count, dtype=np.float64)).astype(np.float32)  # (G-1,)

        def buckets(n: int) -> np.ndarray:
            frac = np.arange(n, dtype=np.float32) * (np.float32(1.0) / np.float32(n))
            frac = np.minimum(frac, np.float32(1.0 - 1e-6))
            return np.searchsorted(boundaries, frac, side="right")  # torch.bucketize(right=True)

        return (buckets(rows)[:, None] * g + buckets(cols)[None, :]).reshape(-1)

    def encode(self, pixels: np.ndarray) -> Tensor:
        """The encoder's output (N, P, Dv) on its device for ``pixels`` (N, C, H, W) float32
        (H and W multiples of the patch size); ValueError for another shape."""
        c = self.config
        if pixels.ndim != 4 or pixels.shape[1] != c.num_channels or pixels.shape[2] % c.patch_size \
                or pixels.shape[3] % c.patch_size or 0 in pixels.shape:
            raise ValueError(f"encode: pixels have shape {pixels.shape}; expected (N, {c.num_channels}, H, W) with H "
                             f"and W positive multiples of {c.patch_size}")
        n, rows, cols = pixels.shape[0], pixels.shape[2] // c.patch_size, pixels.shape[3] // c.patch_size
        p, d, heads, dh = rows * cols, c.hidden_size, c.num_attention_heads, c.head_dim
        if rows * cols > 1 << 16:
            raise ValueError(f"encode: {rows} x {cols} patches per image is more than the encoder takes")
        x = Tensor.from_numpy(self.patches(pixels), device=self.device, dtype=self.dtype)  # (N*P, C*p*p)
        x = F.linear(x, self.patch, self.patch_bias)  # (N*P, Dv)
        pos = np.tile(self.positions[self.position_ids(rows, cols)], (n, 1))  # (N*P, Dv)
        x = F.add(x, Tensor.from_numpy(pos.astype(np.float32), device=self.device, dtype=self.dtype))
        attn = Tensor.empty((n * p, heads, dh), self.dtype, self.device)  # (N*P, H, Dh)
        scale = dh ** -0.5
        for layer in self.layers:
            h = F.layer_norm(x, *layer.norm1, c.layer_norm_eps)  # (N*P, Dv)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # (N*P, 3Dv)
            for i in range(n):
                rows_i = qkv.slice(0, i * p, (i + 1) * p)  # (P, 3Dv)
                q, k, v = (rows_i.slice(1, j * d, (j + 1) * d).view(p, heads, dh) for j in range(3))
                ops.self_attention(attn.slice(0, i * p, (i + 1) * p), q, k, v, scale, causal=False)
            x = F.add(x, F.linear(attn.view(n * p, d), layer.out, layer.out_bias))
            h = F.layer_norm(x, *layer.norm2, c.layer_norm_eps)
            h = F.gelu(F.linear(h, layer.fc1, layer.fc1_bias), approximate=c.activation)  # (N*P, F)
            x = F.add(x, F.linear(h, layer.fc2, layer.fc2_bias))
        if self.post_norm is not None:
            x = F.layer_norm(x, *self.post_norm, c.layer_norm_eps)
        return x.view(n, p, d)


def read_from(weights: Mapping[str, np.ndarray], prefix: str) -> Callable[[str], np.ndarray]:
    """A reader of ``weights`` whose names start with ``prefix``: ``read(name)`` is
    ``weights[prefix + name]`` (KeyError when absent)."""
    return lambda name: weights[prefix + name]
