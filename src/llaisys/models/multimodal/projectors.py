"""Projectors: from a vision encoder's output to rows of the text model's embedding space.

``PixelShuffleProjector`` is SmolVLM's (Idefics3's connector): each s x s square of patches
becomes one row of s*s*Dv values, then a linear without bias maps it to D.
``PooledProjector`` is Gemma 3's: each k x k square of patches averaged into one row, the rows
RMS-normalised with Gemma's (1 + w) weight, then projected to D. Shapes: N images, P patches
per image (a square grid G x G), Dv encoder width, s the scale factor, k the pooling side, D
the text width.
"""
from __future__ import annotations

import numpy as np

from ...ops import functional as F
from ...runtime.device import Device
from ...runtime.dtypes import DataType
from ...tensor import Tensor


def pixel_shuffle(x: np.ndarray, scale: int) -> np.ndarray:
    """Idefics3's pixel shuffle of ``x`` (N, P, Dv), P = G*G patches row by row: (N, P/s^2,
    s^2*Dv), each output row the s x s patches of one square, in the order transformers'
    ``Idefics3Connector.pixel_shuffle`` reshapes and permutes them."""
    n, p, d = x.shape
    g = int(round(p ** 0.5))
    x = x.reshape(n, g, g // scale, d * scale).transpose(0, 2, 1, 3)  # (N, G/s, G, s*Dv)
    x = x.reshape(n, g // scale, g // scale, d * scale * scale).transpose(0, 2, 1, 3)  # (N, G/s, G/s, s^2*Dv)
    return np.ascontiguousarray(x.reshape(n, p // (scale * scale), d * scale * scale))


class PixelShuffleProjector:
    """Pixel shuffle by ``scale`` then ``weight`` (D, s^2*Dv): the image rows of the text model."""

    def __init__(self, weight: Tensor, scale: int):
        self.weight, self.scale = weight, scale

    def tokens_per_image(self, patches: int) -> int:
        """Rows the projector makes of an image of ``patches`` patches."""
        return patches // (self.scale * self.scale)

    def project(self, encoded: Tensor) -> np.ndarray:
        """The rows (N*P/s^2, D) float32 of encoder output ``encoded`` (N, P, Dv), image by image."""
        shuffled = pixel_shuffle(encoded.numpy().astype(np.float32, copy=False), self.scale)  # (N, P/s^2, s^2*Dv)
        rows = Tensor.from_numpy(shuffled.reshape(-1, shuffled.shape[-1]), device=self.weight.device,
                                 dtype=self.weight.dtype if not self.weight.dtype.is_quantized else DataType.F32)
        return F.linear(rows, self.weight).numpy().astype(np.float32, copy=False)


class PooledProjector:
    """Gemma 3's projector: average pooling by ``side`` x ``side`` patches, RMS norm scaled by
    ``scale`` (Dv,) (Gemma's 1 + w, as transformers computes it in float32 and llama.cpp stores
    it) with ``eps``, then ``proj`` (Dv, D)."""

    def __init__(self, scale: np.ndarray, proj: np.ndarray, side: int, eps: float, dtype: DataType,
                 device: Device | None):
        self.norm = Tensor.from_numpy(scale.astype(np.float32), device=device, dtype=dtype)  # (Dv,)
        self.proj = Tensor.from_numpy(np.ascontiguousarray(proj.astype(np.float32).T), device=device,
                                      dtype=dtype)  # (D, Dv)
        self.side, self.eps = side, eps

    def tokens_per_image(self, patches: int) -> int:
        """Rows the projector makes of an image of ``patches`` patches."""
        return patches // (self.side * self.side)

    def project(self, encoded: Tensor) -> np.ndarray:
        """The rows (N*P/k^2, D) float32 of encoder output ``encoded`` (N, P, Dv), image by image,
        each image's pooled squares row by row."""
        x = encoded.numpy().astype(np.float32, copy=False)
        n, p, d = x.shape
        g, k = int(round(p ** 0.5)), self.side
        pooled = x.reshape(n, g // k, k, g // k, k, d).mean(axis=(2, 4), dtype=np.float32)  # (N, G/k, G/k, Dv)
        rows = Tensor.from_numpy(np.ascontiguousarray(pooled.reshape(-1, d)), device=self.norm.device,
                                 dtype=self.norm.dtype)
        return F.linear(F.rms_norm(rows, self.norm, self.eps), self.proj).numpy().astype(np.float32, copy=False)
