"""The Qwen2.5-VL vision encoder and patch merger written with ``llaisys.ops``: transformers'
``Qwen2_5_VisionTransformerPretrainedModel``.

An image arrives as flat patches of C x T x p x p values (T frames of a p x p square, what
``Qwen2VLProcessor`` makes), grid (t, h, w) in patches, ordered so that the m x m patches of each
merge unit are consecutive. One linear (a Conv3d whose kernel is its stride) embeds each patch.
The patches are then regrouped by window (squares of W x W merge units, W = window_size / p / m),
so that windowed attention is attention within row ranges; every block runs RMSNorm, attention
(q and k turned by a 2-D rotary embedding: half of each head by the patch's row, half by its
column), a residual add, RMSNorm, a SiLU-gated MLP and a residual add. Blocks listed in
``fullatt_block_indexes`` attend over a whole frame, the others within a window. The merger
normalises, joins each merge unit's m*m rows into one, and maps it through Linear, GELU (erf),
Linear; the rows are put back in merge-unit order at the end.

Shapes: S patches, U = S / m^2 merge units (the image's tokens), D hidden, H heads, Dh head dim,
F MLP width, E out_hidden_size.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ... import ops
from ...ops import functional as F
from ...runtime.device import Device
from ...runtime.dtypes import DataType
from ...tensor import Tensor
from ..config import is_int, is_positive
from ..errors import ModelLoadError

EPS = 1e-6  # every RMSNorm of the encoder and merger
ACTIVATIONS = ("silu", "swish")  # the gated MLP's: ops.swiglu


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    """The ``vision_config`` of a Qwen2.5-VL ``config.json``, with transformers' names and
    defaults (``Qwen2_5_VLVisionConfig``)."""

    depth: int = 32  # blocks
    hidden_size: int = 3584  # D
    intermediate_size: int = 3420  # F
    num_heads: int = 16  # H
    in_channels: int = 3  # C
    patch_size: int = 14  # p
    spatial_merge_size: int = 2  # m
    temporal_patch_size: int = 2  # T
    window_size: int = 112  # a window's side in pixels
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584  # E
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Dh = D / H."""
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """C*T*p*p: the values of one flat patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_units(self) -> int:
        """W: a window's side in merge units."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, raw: Any, source: str = "vision_config") -> "QwenVisionConfig":
        """The encoder of ``vision_config`` ``raw`` (missing or null keys take transformers'
        defaults, unknown keys are ignored); ModelLoadError naming ``source`` and the key for a
        bad value."""
        if not isinstance(raw, Mapping):
            raise ModelLoadError(f"{source}: vision_config must be an object, got {type(raw).__name__}")
        where = f"{source}: vision_config"
        values = {k: v for k, v in raw.items() if v is not None}
        defaults = {f.name: f.default for f in fields(cls)}
        args: dict[str, Any] = {}
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                    "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):
            value = values.get(key, defaults[key])
            if not is_int(value) or value <= 0:
                raise ModelLoadError(f"{where}.{key} must be a positive integer, got {value!r}")
            args[key] = value
        full = values.get("fullatt_block_indexes", defaults["fullatt_block_indexes"])
        if not isinstance(full, (list, tuple)) or not all(is_int(i) for i in full):
            raise ModelLoadError(f"{where}.fullatt_block_indexes must be a list of block indexes, got {full!r}")
        args["fullatt_block_indexes"] = tuple(full)
        rope = values.get("rope_parameters") or {}
        theta = values.get("rope_theta", defaults["rope_theta"])
        theta = rope.get("rope_theta", theta) if isinstance(rope, Mapping) else rope
        if not is_positive(theta):
            raise ModelLoadError(f"{where}.rope_parameters.rope_theta must be a positive number, got {theta!r}")
        args["rope_theta"] = float(theta)
        act = values.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"{where}.hidden_act {act!r} is not supported; expected one of "
                                 f"{', '.join(map(repr, ACTIVATIONS))}")
        config = cls(**args)
        if config.hidden_size % (4 * config.num_heads):
            # the 2-D rotary embedding turns head dims in four equal parts (row and column, each a pair of halves)
            raise ModelLoadError(f"{where}.hidden_size={config.hidden_size} / num_heads={config.num_heads} must be "
                                 "a multiple of 4")
        if config.window_units == 0 and not set(range(config.depth)) <= set(config.fullatt_block_indexes):
            raise ModelLoadError(f"{where}.window_size={config.window_size} is smaller than one merge unit of "
                                 f"{config.spatial_merge_size * config.patch_size} pixels")
        return config


def qwen_vision_shapes(c: QwenVisionConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the encoder and merger by its name in transformers' vision model (the
    state dict of ``Qwen2_5_VisionTransformerPretrainedModel``), with its shape."""
    d, f, m2 = c.hidden_size, c.intermediate_size, c.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (d, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)}
    for i in range(c.depth):
        at = f"blocks.{i}."
        shapes.update({at + "norm1.weight": (d,), at + "norm2.weight": (d,),
                       at + "attn.qkv.weight": (3 * d, d), at + "attn.qkv.bias": (3 * d,),
                       at + "attn.proj.weight": (d, d), at + "attn.proj.bias": (d,),
                       at + "mlp.gate_proj.weight": (f, d), at + "mlp.gate_proj.bias": (f,),
                       at + "mlp.up_proj.weight": (f, d), at + "mlp.up_proj.bias": (f,),
                       at + "mlp.down_proj.weight": (d, f), at + "mlp.down_proj.bias": (d,)})
    shapes.update({"merger.ln_q.weight": (d,), "merger.mlp.0.weight": (m2 * d, m2 * d), "merger.mlp.0.bias": (m2 * d,),
                   "merger.mlp.2.weight": (c.out_hidden_size, m2 * d), "merger.mlp.2.bias": (c.out_hidden_size,)})
    return shapes


def rotary_order(head_dim: int) -> np.ndarray:
    """The order (Dh,) in which a head's q/k dims are stored so that each rotary axis is one
    rotate-half block: transformers turns pair (i, i + Dh/2) by the row for i < Dh/4 and by the
    column for Dh/4 <= i < Dh/2; stored in this order, dims [0, Dh/2) are the row's pairs
    (j, j + Dh/4) and dims [Dh/2, Dh) the column's."""
    q = head_dim // 4
    return np.concatenate([np.arange(0, q), np.arange(2 * q, 3 * q), np.arange(q, 2 * q), np.arange(3 * q, 4 * q)])


def patch_positions(t: int, h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """The row and column (S,) int64 of each patch of a (t, h, w) grid, patches in the
    processor's order: merge units row by row, the m x m patches of a unit row by row, frames
    one after another (transformers' ``get_vision_position_ids``)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # (h, w) each

    def units(a: np.ndarray) -> np.ndarray:
        return a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    return np.tile(units(rows), t).astype(np.int64), np.tile(units(cols), t).astype(np.int64)


def window_order(t: int, h: int, w: int, merge: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Transformers' ``get_vision_window_index`` for one (t, h, w) grid: the merge units (U,)
    int64 in window order (windows of ``window`` x ``window`` units row by row, the units of a
    window row by row, frames one after another) and each window's unit count (empty windows
    left out)."""
    uh, uw = h // merge, w // merge
    nh, nw = -(-uh // window), -(-uw // window)
    padded = np.full((t, nh * window, nw * window), -1, dtype=np.int64)
    padded[:, :uh, :uw] = np.arange(t * uh * uw).reshape(t, uh, uw)
    windows = padded.reshape(t, nh, window, nw, window).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, window * window)
    counts = (windows >= 0).sum(axis=1)
    return windows[windows >= 0], counts[counts > 0]


@dataclass(slots=True)
class QwenVisionBlock:
    """One block's weights on the device; the q and k rows of ``qkv`` (3D, D) and ``qkv_bias``
    are stored per head in ``rotary_order``."""

    norm1: Tensor  # (D,)
    qkv: Tensor  # (3D, D)
    qkv_bias: Tensor  # (3D,)
    proj: Tensor  # (D, D)
    proj_bias: Tensor  # (D,)
    norm2: Tensor  # (D,)
    gate: Tensor  # (F, D)
    gate_bias: Tensor  # (F,)
    up: Tensor  # (F, D)
    up_bias: Tensor  # (F,)
    down: Tensor  # (D, F)
    down_bias: Tensor  # (D,)


class QwenVisionEncoder:
    """The Qwen2.5-VL vision encoder and patch merger on ``device`` in ``dtype``; ``encode``
    turns flat patches into the image tokens' rows (U, E)."""

    def __init__(self, vision_config: Mapping[str, Any] | QwenVisionConfig, read: Callable[[str], np.ndarray],
                 source: str = "vision model", *, dtype: DataType = DataType.F32, device: Device | None = None):
        """Weights come from ``read(name)`` (a name of ``qwen_vision_shapes``, a float array); a
        missing weight or one of another shape is a ModelLoadError naming ``source``."""
        c = vision_config if isinstance(vision_config, QwenVisionConfig) else \
            QwenVisionConfig.from_hf(vision_config, source)
        self.config, self.dtype = c, dtype
        shapes = qwen_vision_shapes(c)

        def value(name: str) -> np.ndarray:
            try:
                array = np.asarray(read(name))
            except KeyError:
                raise ModelLoadError(f"{source}: vision weight {name!r} is missing") from None
            if array.shape != shapes[name]:
                raise ModelLoadError(f"{source}: vision weight {name!r} has shape {array.shape}; expected "
                                     f"{shapes[name]} for this vision_config")
            return array.astype(np.float32)

        def tensor(array: np.ndarray) -> Tensor:
            return Tensor.from_numpy(np.ascontiguousarray(array), device=device, dtype=dtype)

        d, heads, dh = c.hidden_size, c.num_heads, c.head_dim
        # q and k rows of each head in rotary order: scores q.k are unchanged by one permutation of both
        order = (np.arange(2 * heads)[:, None] * dh + rotary_order(dh)[None, :]).reshape(-1)
        qkv_rows = np.concatenate([order, np.arange(2 * d, 3 * d)])  # (3D,)
        self.patch = tensor(value("patch_embed.proj.weight").reshape(d, c.patch_values))  # (D, C*T*p*p)
        self.blocks = []
        for i in range(c.depth):
            at = f"blocks.{i}."
            self.blocks.append(QwenVisionBlock(
                tensor(value(at + "norm1.weight")),
                tensor(value(at + "attn.qkv.weight")[qkv_rows]), tensor(value(at + "attn.qkv.bias")[qkv_rows]),
                tensor(value(at + "attn.proj.weight")), tensor(value(at + "attn.proj.bias")),
                tensor(value(at + "norm2.weight")),
                *(tensor(value(at + f"mlp.{x}_proj.{kind}")) for x in ("gate", "up", "down") for kind in
                  ("weight", "bias"))))
        self.merge_norm = tensor(value("merger.ln_q.weight"))  # (D,)
        self.merge_fc1, self.merge_fc1_bias = tensor(value("merger.mlp.0.weight")), tensor(value("merger.mlp.0.bias"))
        self.merge_fc2, self.merge_fc2_bias = tensor(value("merger.mlp.2.weight")), tensor(value("merger.mlp.2.bias"))
        spatial = dh // 2
        # as transformers computes them: in float32 over the Dh/2 dims each axis turns
        exponents = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
        inv_freq = (1.0 / np.float32(c.rope_theta) ** exponents).astype(np.float32)  # (Dh/4,)
        self.inv_freq = Tensor.from_numpy(inv_freq, device=self.patch.device)  # (Dh/4,) F32
        self.device = self.patch.device

    def tokens(self, grid_thw: Sequence[int]) -> int:
        """The rows ``encode`` makes of an image of grid (t, h, w): t*h*w / m^2."""
        t, h, w = grid_thw
        return t * h * w // self.config.spatial_merge_size ** 2

    def _grids(self, pixels: np.ndarray, grid_thw: Any) -> list[tuple[int, int, int]]:
        c = self.config
        grids = np.asarray(grid_thw)
        if grids.ndim == 1:
            grids = grids[None]
        m = c.spatial_merge_size
        if grids.ndim != 2 or grids.shape[1] != 3 or not np.issubdtype(grids.dtype, np.integer) or len(grids) == 0 \
                or (grids <= 0).any() or (grids[:, 1:] % m).any():
            raise ValueError(f"encode: grid_thw must be (t, h, w) or (N, 3) positive integers with h and w multiples "
                             f"of spatial_merge_size={m}; got {grid_thw!r}")
        patches = int(np.prod(grids, axis=1).sum())
        if pixels.shape != (patches, c.patch_values):
            raise ValueError(f"encode: pixels have shape {pixels.shape}; the grids {grids.tolist()} need "
                             f"({patches}, {c.patch_values})")
        return [tuple(int(v) for v in g) for g in grids]

    def encode(self, pixels: np.ndarray, grid_thw: Any) -> np.ndarray:
        """The rows (U, E) float32 of the image tokens of ``pixels`` (S, C*T*p*p), the flat
        patches of one image of grid ``grid_thw`` (t, h, w), or of several images one after
        another with ``grid_thw`` (N, 3) (their rows one image after another), as
        ``Qwen2VLProcessor`` makes them: transformers' ``visual(pixel_values, grid_thw)``.
        ValueError when the shapes do not agree."""
        c = self.config
        pixels = np.asarray(pixels)
        grids = self._grids(pixels, grid_thw)
        m2 = c.spatial_merge_size ** 2
        units, rows, cols, windows, frames = [], [], [], [0], [0]
        for t, h, w in grids:
            order, counts = window_order(t, h, w, c.spatial_merge_size, max(c.window_units, 1))
            units.append(order + sum(map(len, units)))
            r, k = patch_positions(t, h, w, c.spatial_merge_size)
            rows.append(r)
            cols.append(k)
            windows.extend(windows[-1] + np.cumsum(counts * m2))
            frames.extend(frames[-1] + h * w * np.arange(1, t + 1))
        unit_order = np.concatenate(units)  # (U,) merge units in window order
        patch_order = (unit_order[:, None] * m2 + np.arange(m2)).reshape(-1)  # (S,)
        rows, cols = np.concatenate(rows)[patch_order], np.concatenate(cols)[patch_order]  # (S,) each
        x = Tensor.from_numpy(np.ascontiguousarray(pixels[patch_order], dtype=np.float32), device=self.device,
                              dtype=self.dtype)  # (S, C*T*p*p)
        x = F.linear(x, self.patch)  # (S, D)
        pos = tuple(Tensor.from_numpy(p, device=self.device) for p in (rows, cols))  # (S,) I64 each
        full = set(c.fullatt_block_indexes)
        h = F.rms_norm(x, self.blocks[0].norm1, EPS)  # (S, D)
        for i, block in enumerate(self.blocks):
            bounds = frames if i in full else windows
            h, x = F.add_rms_norm(x, self._attention(h, block, pos, bounds), block.norm2, EPS)
            gated = F.swiglu(F.linear(h, block.gate, block.gate_bias), F.linear(h, block.up, block.up_bias))  # (S, F)
            after = self.blocks[i + 1].norm1 if i + 1 < len(self.blocks) else self.merge_norm
            h, x = F.add_rms_norm(x, F.linear(gated, block.down, block.down_bias), after, EPS)
        merged = F.linear(h.view(-1, m2 * c.hidden_size), self.merge_fc1, self.merge_fc1_bias)  # (U, m^2 D)
        merged = F.linear(F.gelu(merged, approximate="none"), self.merge_fc2, self.merge_fc2_bias)  # (U, E)
        out = np.empty((len(unit_order), c.out_hidden_size), dtype=np.float32)
        out[unit_order] = merged.numpy()  # back to merge-unit order
        return out

    def encode_image(self, processed: Any) -> np.ndarray:
        """The rows (num_image_tokens, E) float32 of one ``ProcessedImage`` of
        ``Qwen2VLProcessor`` (its ``pixels`` and ``grid_thw``)."""
        if processed.grid_thw is None:
            raise ValueError("encode_image: the image has no grid_thw; it was not made by Qwen2VLProcessor")
        return self.encode(processed.pixels, processed.grid_thw)

    def _attention(self, h: Tensor, block: QwenVisionBlock, pos: tuple[Tensor, Tensor],
                   bounds: Sequence[int]) -> Tensor:
        """The attention output (S, D) of normed rows ``h`` (S, D): each query sees the keys of
        its own range [bounds[j], bounds[j+1]) of rows (a window or a frame)."""
        c = self.config
        s, d, heads, dh = h.shape[0], c.hidden_size, c.num_heads, c.head_dim
        qkv = F.linear(h, block.qkv, block.qkv_bias)  # (S, 3D)
        qk = qkv.slice(1, 0, 2 * d).view(s, 2 * heads, dh)  # (S, 2H, Dh) q heads then k heads
        turned = Tensor.empty((s, 2 * heads, dh), self.dtype, self.device)  # (S, 2H, Dh)
        half = dh // 2
        for j, p in enumerate(pos):  # dims [0, Dh/2) turn by row, [Dh/2, Dh) by column
            part = slice(j * half, (j + 1) * half)
            ops.rope(turned.slice(2, part.start, part.stop), qk.slice(2, part.start, part.stop), p, c.rope_theta,
                     freqs=self.inv_freq)
        q, k = turned.slice(1, 0, heads), turned.slice(1, heads, 2 * heads)  # (S, H, Dh) each
        v = qkv.slice(1, 2 * d, 3 * d).view(s, heads, dh)  # (S, H, Dh)
        attn = Tensor.empty((s, heads, dh), self.dtype, self.device)  # (S, H, Dh)
        scale = dh ** -0.5
        for a, b in zip(bounds[:-1], bounds[1:]):
            a, b = int(a), int(b)
            ops.self_attention(attn.slice(0, a, b), q.slice(0, a, b), k.slice(0, a, b), v.slice(0, a, b), scale,
                               causal=False)
        return F.linear(attn.view(s, d), block.proj, block.proj_bias)  # (S, D)
