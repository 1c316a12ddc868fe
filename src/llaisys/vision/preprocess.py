"""Pictures turned into the pixel arrays and the prompt text a vision-language model expects,
equal to transformers' PIL image processors: Idefics3/SmolVLM, Gemma 3 and Qwen2-VL (also
Qwen2.5-VL and Qwen3-VL). Each processor is built from a ``preprocessor_config.json`` dict and
repeats the reference's steps in its order: Pillow resizes of uint8 pixels (every intermediate
size rounded back to uint8, as transformers goes through PIL each time), then rescale in
float64 cast to float32, then normalize in float32."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, TypeVar

import numpy as np
from PIL import Image

from .images import ImageError, to_rgb

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
IDEFICS3_MAX_SIDE = 4096  # transformers' MAX_IMAGE_SIZE for Idefics3: no resized side goes above it

ProcessorT = TypeVar("ProcessorT", bound="ImageProcessor")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessedImage:
    """One picture ready for a vision encoder, and the text that stands for it in the prompt."""

    pixels: np.ndarray  # float32: (N, 3, H, W) tiles or crops; Qwen: (h*w, 3*T*p*p) patches
    num_image_tokens: int  # prompt positions the encoder's features fill (the image tokens)
    prompt: str  # this image's placeholder text, as the transformers processor writes it
    rows: int = 0  # Idefics3: tile rows and columns before the global image (0, 0: not split)
    cols: int = 0
    num_crops: int = 0  # Gemma 3: pan-and-scan crops after the full image
    grid_thw: tuple[int, int, int] | None = None  # Qwen: (t, h, w) in patches


def _fail(owner: str, key: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{owner} config: {key} must be {expected}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageProcessor:
    """The steps every family shares, with transformers' ``preprocessor_config.json`` names.
    A family overrides the defaults and adds its own fields; ``from_config`` drops unknown keys
    and treats null as absent; every value is checked on construction."""

    do_resize: bool = True
    size: Mapping[str, int] = field(default_factory=dict)
    resample: int = 2  # PIL.Image.Resampling value
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF

    @classmethod
    def from_config(cls: type[ProcessorT], config: Mapping[str, Any]) -> ProcessorT:
        """The processor described by a ``preprocessor_config.json``-style dict (keys it does not
        use are ignored; a missing or null key takes transformers' class default). ValueError
        naming the key for a value of the wrong kind."""
        if not isinstance(config, Mapping):
            raise TypeError(f"{cls.__name__}.from_config needs a dict, got {type(config).__name__}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for key in ("do_resize", "do_rescale", "do_normalize"):
            if not isinstance(getattr(self, key), bool):
                raise _fail(owner, key, "true or false", getattr(self, key))
        if not _is_int(self.resample) or int(self.resample) not in RESAMPLE_NAMES:
            raise _fail(owner, "resample", f"a PIL resampling filter {RESAMPLE_NAMES}", self.resample)
        object.__setattr__(self, "resample", int(self.resample))
        if not _is_number(self.rescale_factor) or not math.isfinite(self.rescale_factor) or self.rescale_factor <= 0:
            raise _fail(owner, "rescale_factor", "a positive number (1/255 for 8-bit pixels)", self.rescale_factor)
        object.__setattr__(self, "rescale_factor", float(self.rescale_factor))
        for key in ("image_mean", "image_std"):
            object.__setattr__(self, key, _three_floats(owner, key, getattr(self, key)))
        if any(s == 0 for s in self.image_std):
            raise _fail(owner, "image_std", "three non-zero numbers", self.image_std)
        if not isinstance(self.size, Mapping):
            if not _is_int(self.size):
                raise _fail(owner, "size", "an object such as {\"height\": 224, \"width\": 224}", self.size)
            # transformers reads a bare int as a square of that side
            object.__setattr__(self, "size", {"height": int(self.size), "width": int(self.size)})
        for key, value in self.size.items():
            if not _is_int(value) or value <= 0:
                raise _fail(owner, f"size.{key}", "a positive integer", value)
        object.__setattr__(self, "size", {k: int(v) for k, v in self.size.items()})
        self._check()

    def _check(self) -> None:
        """The family's own checks (size keys, tiling parameters)."""

    def __call__(self, image: Image.Image) -> ProcessedImage:
        """The pixel arrays, grid and prompt text of one PIL image (converted to RGB first, as
        transformers does)."""
        if not isinstance(image, Image.Image):
            raise TypeError(f"{type(self).__name__} takes a PIL image, got {type(image).__name__}")
        return self._process(np.asarray(to_rgb(image)))  # (H, W, 3) uint8

    def _process(self, pixels: np.ndarray) -> ProcessedImage:
        raise NotImplementedError

    def to_float(self, pixels: np.ndarray) -> np.ndarray:
        """Rescale then normalize (each as configured) of (H, W, 3) uint8 pixels: (3, H, W)
        float32, with transformers' arithmetic (rescale in float64 then cast, normalize in
        float32)."""
        x = pixels.transpose(2, 0, 1)  # (3, H, W)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]  # (3, 1, 1)
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            x = (x.astype(np.float32, copy=False) - mean) / std
        return np.ascontiguousarray(x, dtype=np.float32)


def _three_floats(owner: str, key: str, value: Any) -> tuple[float, float, float]:
    if _is_number(value):
        return (float(value),) * 3
    if isinstance(value, (list, tuple)) and len(value) == 3 and all(_is_number(v) for v in value):
        return tuple(float(v) for v in value)  # type: ignore[return-value]
    raise _fail(owner, key, "a number or a list of 3 numbers (one per RGB channel)", value)


def resize(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """(H, W, 3) uint8 pixels resized to (height, width, 3) uint8 by Pillow, as transformers'
    PIL backend does (``Image.resize`` with ``reducing_gap=None``)."""
    image = Image.fromarray(pixels)
    return np.asarray(image.resize((width, height), resample=resample, reducing_gap=None))


# ---------------------------------------------------------------- Idefics3 / SmolVLM

def idefics3_image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Image tokens per tile for Idefics3/SmolVLM: the encoder's (image_size / patch_size)^2
    patches after the pixel shuffle merges scale_factor^2 of them into one."""
    return ((image_size // patch_size) ** 2) // (scale_factor**2)


def idefics3_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The text for one Idefics3/SmolVLM image of rows x cols tiles (0, 0: not split): each
    tile ``<fake_token_around_image><row_r_col_c>`` then its ``<image>`` tokens, a newline after
    each row, then the global image between ``<fake_token_around_image>`` tokens."""
    fake, image = "<fake_token_around_image>", "<image>" * image_seq_len
    whole = f"{fake}<global-img>{image}{fake}"
    if rows == 0 and cols == 0:
        return whole
    tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                    for r in range(rows))
    return f"{tiles}\n{whole}"


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """Idefics3's resize target: the longer side set to ``longest`` (up or down), the shorter
    one scaled and made even, then both scaled below 4096."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > IDEFICS3_MAX_SIDE:
        width = IDEFICS3_MAX_SIDE
        height = int(width / aspect)
    elif height > width and height > IDEFICS3_MAX_SIDE:
        height = IDEFICS3_MAX_SIDE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3's size before splitting: both sides rounded up to multiples of ``tile``, the
    shorter one from the aspect ratio of the rounded longer one."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True, slots=True, kw_only=True)
class Idefics3Processor(ImageProcessor):
    """Idefics3 and SmolVLM (transformers' ``Idefics3ImageProcessorPil``, which
    ``SmolVLMImageProcessorPil`` repeats): resize so the longer side is ``size.longest_edge``,
    then either cut into rows x cols square tiles of ``max_image_size.longest_edge`` plus the
    whole image shrunk to one tile (``do_image_splitting``), or only that whole image."""

    size: Mapping[str, int] = field(default_factory=lambda: {"longest_edge": 4 * 364})
    resample: int = 1  # LANCZOS
    do_image_splitting: bool = True
    max_image_size: Mapping[str, int] = field(default_factory=lambda: {"longest_edge": 364})
    image_seq_len: int = 169  # from processor_config.json; see idefics3_image_seq_len

    def _check(self) -> None:
        owner = type(self).__name__
        if "longest_edge" not in self.size and not {"height", "width"} <= set(self.size):
            raise _fail(owner, "size", "{\"longest_edge\": N} or {\"height\": H, \"width\": W}", self.size)
        if not isinstance(self.do_image_splitting, bool):
            raise _fail(owner, "do_image_splitting", "true or false", self.do_image_splitting)
        tile = self.max_image_size.get("longest_edge") if isinstance(self.max_image_size, Mapping) else None
        if not _is_int(tile) or tile <= 0:
            raise _fail(owner, "max_image_size", "{\"longest_edge\": N} with N a positive integer",
                        self.max_image_size)
        object.__setattr__(self, "max_image_size", {"longest_edge": int(tile)})
        if not _is_int(self.image_seq_len) or self.image_seq_len <= 0:
            raise _fail(owner, "image_seq_len", "a positive integer", self.image_seq_len)

    @property
    def tile(self) -> int:
        """The side S of every tile and of the global image."""
        return self.max_image_size["longest_edge"]

    def _process(self, pixels: np.ndarray) -> ProcessedImage:
        tile = self.tile
        if self.do_resize:
            if "longest_edge" in self.size:
                h, w = _longest_edge_size(*pixels.shape[:2], self.size["longest_edge"])
            else:
                h, w = self.size["height"], self.size["width"]
            pixels = resize(pixels, h, w, self.resample)
        rows = cols = 0
        if not self.do_image_splitting:
            frames = [resize(pixels, tile, tile, self.resample)]
        else:
            h, w = _tile_multiple_size(*pixels.shape[:2], tile)
            pixels = resize(pixels, h, w, self.resample)
            if h > tile or w > tile:
                rows, cols = h // tile, w // tile
                frames = [pixels[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
                          for r in range(rows) for c in range(cols)]
                frames.append(resize(pixels, tile, tile, self.resample))
            else:
                frames = [pixels]
        tiles = np.stack([self.to_float(f) for f in frames])  # (rows*cols + 1, 3, S, S)
        return ProcessedImage(pixels=tiles, rows=rows, cols=cols,
                              num_image_tokens=self.image_seq_len * len(frames),
                              prompt=idefics3_prompt(rows, cols, self.image_seq_len))


# ---------------------------------------------------------------- Gemma 3

def gemma3_prompt(num_crops: int, image_seq_length: int) -> str:
    """The text for one Gemma 3 image: ``\\n\\n<start_of_image>``, ``<image_soft_token>`` x
    image_seq_length, ``<end_of_image>\\n\\n``; with pan-and-scan crops, the full image's block
    is introduced and followed by one block per crop, as transformers' processor writes."""
    block = f"\n\n<start_of_image>{'<image_soft_token>' * image_seq_length}<end_of_image>\n\n"
    if not num_crops:
        return block
    return (f"Here is the original image {block} and here are some crops to help you see better "
            + " ".join([block] * num_crops))


def pan_and_scan_boxes(height: int, width: int, min_crop_size: int, max_num_crops: int,
                       min_ratio_to_activate: float) -> list[tuple[int, int, int, int]]:
    """Gemma 3's pan-and-scan crops of an H x W picture as (top, left, bottom, right) boxes,
    row-major: a row (landscape) or column (portrait) of about aspect-ratio many equal crops,
    2 to max_num_crops of them; none when the picture is not elongated enough or the crops
    would be smaller than min_crop_size. The last box may reach past the edge (slicing clips)."""
    if width >= height:
        if width / height < min_ratio_to_activate:
            return []
        num_w = min(int(math.floor(width / min_crop_size)), int(math.floor(width / height + 0.5)))
        num_w, num_h = min(max_num_crops, max(2, num_w)), 1
    else:
        if height / width < min_ratio_to_activate:
            return []
        num_h = min(int(math.floor(height / min_crop_size)), int(math.floor(height / width + 0.5)))
        num_w, num_h = 1, min(max_num_crops, max(2, num_h))
    crop_w, crop_h = int(math.ceil(width / num_w)), int(math.ceil(height / num_h))
    if min(crop_w, crop_h) < min_crop_size:
        return []
    return [(top, left, top + crop_h, left + crop_w)
            for top, left in itertools.product(range(0, crop_h * num_h, crop_h), range(0, crop_w * num_w, crop_w))]


@dataclass(frozen=True, slots=True, kw_only=True)
class Gemma3Processor(ImageProcessor):
    """Gemma 3 (transformers' ``Gemma3ImageProcessorPil`` with ``Gemma3Processor``'s defaults
    for the pan-and-scan keys a config leaves null): the image resized to ``size``, then, with
    ``do_pan_and_scan``, crops of the original picture each resized the same way."""

    size: Mapping[str, int] = field(default_factory=lambda: {"height": 224, "width": 224})
    resample: int = 2  # BILINEAR
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    image_seq_length: int = 256  # the model's mm_tokens_per_image

    def _check(self) -> None:
        owner = type(self).__name__
        if not {"height", "width"} <= set(self.size):
            raise _fail(owner, "size", "{\"height\": H, \"width\": W}", self.size)
        if not isinstance(self.do_pan_and_scan, bool):
            raise _fail(owner, "do_pan_and_scan", "true or false", self.do_pan_and_scan)
        if self.do_pan_and_scan and not self.do_resize:
            raise _fail(owner, "do_resize", "true when do_pan_and_scan is (crops differ in size)", self.do_resize)
        for key in ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "image_seq_length"):
            if not _is_int(getattr(self, key)) or getattr(self, key) <= 0:
                raise _fail(owner, key, "a positive integer", getattr(self, key))
        ratio = self.pan_and_scan_min_ratio_to_activate
        if not _is_number(ratio) or not ratio > 0:
            raise _fail(owner, "pan_and_scan_min_ratio_to_activate", "a positive number", ratio)

    def _process(self, pixels: np.ndarray) -> ProcessedImage:
        boxes = []
        if self.do_pan_and_scan:
            boxes = pan_and_scan_boxes(*pixels.shape[:2], self.pan_and_scan_min_crop_size,
                                       self.pan_and_scan_max_num_crops, self.pan_and_scan_min_ratio_to_activate)
        frames = [pixels] + [pixels[top:bottom, left:right] for top, left, bottom, right in boxes]
        if self.do_resize:
            frames = [resize(f, self.size["height"], self.size["width"], self.resample) for f in frames]
        images = np.stack([self.to_float(f) for f in frames])  # (1 + crops, 3, H, W)
        return ProcessedImage(pixels=images, num_crops=len(boxes),
                              num_image_tokens=self.image_seq_length * len(frames),
                              prompt=gemma3_prompt(len(boxes), self.image_seq_length))


# ---------------------------------------------------------------- Qwen2-VL / Qwen2.5-VL / Qwen3-VL

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size (h, w): both multiples of ``factor``, h*w within
    [min_pixels, max_pixels], the aspect ratio kept as closely as rounding allows. ImageError
    for an aspect ratio over 200, which the model refuses."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image is {width}x{height}, an aspect ratio of "
                         f"{max(height, width) / min(height, width):.1f}; Qwen2-VL accepts at most 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_patchify(image: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """(C, H, W) float32 -> (H/p * W/p, C*T*p*p) patches in Qwen2-VL's order: merge_size x
    merge_size groups of neighbouring patches are consecutive rows, and each row holds the
    patch's C x T x p x p values, the one picture repeated over the T temporal slots."""
    c, h, w = image.shape
    gh, gw, m, p = h // patch_size, w // patch_size, merge_size, patch_size
    x = image.reshape(c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal_patch_size, p, p))  # (..., C, T, p, p)
    return x.reshape(gh * gw, c * temporal_patch_size * p * p)


def qwen_prompt(num_image_tokens: int) -> str:
    """The text for one Qwen-VL image: ``<|vision_start|>``, ``<|image_pad|>`` x tokens,
    ``<|vision_end|>``."""
    return f"<|vision_start|>{'<|image_pad|>' * num_image_tokens}<|vision_end|>"


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen2VLProcessor(ImageProcessor):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers' ``Qwen2VLImageProcessorPil``): the image
    resized by ``smart_resize`` to multiples of patch_size * merge_size with a pixel count in
    [size.shortest_edge, size.longest_edge] (``min_pixels``/``max_pixels`` of older configs
    override them), then cut into flat patches with grid (1, h, w)."""

    size: Mapping[str, int] = field(default_factory=lambda: {"shortest_edge": 56 * 56,
                                                             "longest_edge": 28 * 28 * 1280})
    resample: int = 3  # BICUBIC
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    min_pixels: int | None = None
    max_pixels: int | None = None
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    def _check(self) -> None:
        owner = type(self).__name__
        size = dict(self.size)
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = getattr(self, key)
            if value is not None:
                if not _is_int(value) or value <= 0:
                    raise _fail(owner, key, "a positive integer", value)
                size[edge] = int(value)
        if not {"shortest_edge", "longest_edge"} <= set(size):
            raise _fail(owner, "size", "{\"shortest_edge\": min_pixels, \"longest_edge\": max_pixels}", self.size)
        if size["shortest_edge"] > size["longest_edge"]:
            raise _fail(owner, "size.shortest_edge", f"at most size.longest_edge={size['longest_edge']}",
                        size["shortest_edge"])
        object.__setattr__(self, "size", size)
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if not _is_int(getattr(self, key)) or getattr(self, key) <= 0:
                raise _fail(owner, key, "a positive integer", getattr(self, key))

    @property
    def factor(self) -> int:
        """The side every resized image is a multiple of: patch_size * merge_size."""
        return self.patch_size * self.merge_size

    def _process(self, pixels: np.ndarray) -> ProcessedImage:
        h, w = pixels.shape[:2]
        if self.do_resize:
            h, w = smart_resize(h, w, self.factor, self.size["shortest_edge"], self.size["longest_edge"])
            pixels = resize(pixels, h, w, self.resample)
        elif h % self.factor or w % self.factor:
            raise ImageError(f"image is {w}x{h}; without do_resize both sides must be multiples of "
                             f"patch_size * merge_size = {self.factor}")
        patches = qwen_patchify(self.to_float(pixels), self.patch_size, self.merge_size, self.temporal_patch_size)
        grid = (1, h // self.patch_size, w // self.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        return ProcessedImage(pixels=patches, grid_thw=grid, num_image_tokens=tokens, prompt=qwen_prompt(tokens))


# transformers' image_processor_type (its "Fast"/"Pil" suffix dropped) -> our processor
PROCESSORS: dict[str, type[ImageProcessor]] = {
    "Idefics3ImageProcessor": Idefics3Processor,
    "SmolVLMImageProcessor": Idefics3Processor,
    "Gemma3ImageProcessor": Gemma3Processor,
    "Qwen2VLImageProcessor": Qwen2VLProcessor,
}


def processor_from_config(config: Mapping[str, Any]) -> ImageProcessor:
    """The processor a ``preprocessor_config.json`` dict names in ``image_processor_type``.
    ValueError listing the known types for another one."""
    kind = config.get("image_processor_type") if isinstance(config, Mapping) else None
    name = kind.removesuffix("Fast").removesuffix("Pil") if isinstance(kind, str) else kind
    if name not in PROCESSORS:
        raise ValueError(f"preprocessor config: image_processor_type must be one of {sorted(PROCESSORS)}, "
                         f"got {kind!r}")
    return PROCESSORS[name].from_config(config)
