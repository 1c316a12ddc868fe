"""The vision tower of a vision-language model: from a decoded image to the rows its image
tokens take in the text model's input, and where those rows go in a prompt.

``VisionTower.embed`` preprocesses an image as transformers' image processor of the model does
(``llaisys.vision.preprocess``), encodes it (``VisionEncoder``) and projects it; the result is
kept by the image's content digest, so an image sent again (the next turn of a chat) is not
encoded again. ``PromptImages`` is what the engine takes with a prompt: the positions of its
image tokens, their rows, and the ids its prefix-cache blocks are keyed by, in which each image
token stands for its image's digest (two different images never share cached blocks).

Shapes: M image rows (tokens) of a prompt, D the text model's hidden size.
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...vision.images import pixel_hash, to_rgb

ENCODED_KEPT = 32  # images whose rows are kept by digest


@dataclass(frozen=True, slots=True)
class ImageRows:
    """One image as the text model takes it: its content ``digest``, its ``rows`` (M, D)
    float32, the ``prompt`` text that stands for it (its image tokens among the markers the
    model was trained with) and, for multimodal rope, the ``grid`` (t, h, w) of its rows."""

    digest: str
    rows: np.ndarray
    prompt: str
    grid: tuple[int, int, int] | None = None


class VisionTower:
    """Preprocessing, encoder and projector of one model (``family``: "idefics3" ...)."""

    def __init__(self, family: str, processor: Any, encoder: Any, projector: Any, image_token_id: int,
                 placeholder: str, hidden_size: int, two_way: bool = False, standalone: str | None = None,
                 multimodal_rope: bool = False):
        self.family, self.processor, self.encoder, self.projector = family, processor, encoder, projector
        self.two_way = two_way  # an image's tokens see each other both ways (Gemma 3)
        # what an image is in a text that names no place for it (Qwen: the placeholder in its markers)
        self.standalone = standalone if standalone is not None else placeholder
        self.multimodal_rope = multimodal_rope  # its rows have (t, h, w) rope positions (Qwen2-VL)
        self.image_token_id = image_token_id  # the id every image token has in the prompt
        self.placeholder = placeholder  # what a chat template writes for an image ("<image>")
        self.hidden_size = hidden_size  # D
        self._kept: "OrderedDict[str, ImageRows]" = OrderedDict()
        self._lock = threading.Lock()

    def embed(self, image: Any) -> ImageRows:
        """The rows of ``image`` (a PIL image, made RGB as transformers does), computed once per
        picture (its ``pixel_hash``) while kept."""
        image = to_rgb(image)
        digest = pixel_hash(image)
        with self._lock:
            if digest in self._kept:
                self._kept.move_to_end(digest)
                return self._kept[digest]
        processed = self.processor(image)
        rows = self.rows_of(processed)  # (M, D)
        if rows.shape[0] != processed.num_image_tokens:
            raise RuntimeError(f"the {self.family} projector made {rows.shape[0]} rows of an image whose prompt holds "
                               f"{processed.num_image_tokens} image tokens")
        grid = None
        if self.multimodal_rope:  # Qwen: the chat template writes the markers, the image is its pads
            t, h, w = processed.grid_thw
            m = self.processor.merge_size
            grid = (t, h // m, w // m)
        prompt = self.placeholder * processed.num_image_tokens if self.multimodal_rope else processed.prompt
        out = ImageRows(digest, rows, prompt, grid)
        with self._lock:
            self._kept[digest] = out
            while len(self._kept) > ENCODED_KEPT:
                self._kept.popitem(last=False)
        return out

    def rows_of(self, processed: Any) -> np.ndarray:
        """The rows (M, D) float32 of a preprocessed image (``ProcessedImage``): encoder, then
        projector (Qwen's encoder ends in its merger and takes the patch grid)."""
        if self.multimodal_rope:
            return self.projector.project(self.encoder.encode(processed.pixels, processed.grid_thw))
        return self.projector.project(self.encoder.encode(processed.pixels))

    def expand(self, text: str, images: Sequence[ImageRows]) -> str:
        """``text`` (a rendered chat prompt) with its i-th ``placeholder`` replaced by image i's
        prompt; ValueError when the counts differ."""
        parts = text.split(self.placeholder)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt has {len(parts) - 1} image placeholders ({self.placeholder!r}) for "
                             f"{len(images)} images")
        out = [parts[0]]
        for image, rest in zip(images, parts[1:]):
            out += [image.prompt, rest]
        return "".join(out)

    def place(self, ids: Sequence[int], images: Sequence[ImageRows]) -> "PromptImages":
        """Where the rows of ``images`` go in the prompt ``ids``: at its image tokens, in
        order. ValueError when the number of image tokens is not the rows' count."""
        placed = PromptImages.of(ids, self.image_token_id, images, self.two_way)
        if not self.multimodal_rope or not images:
            return placed
        rope = multimodal_positions(ids, self.image_token_id, [image.grid for image in images])  # (3, S)
        return dataclasses.replace(placed, rope_positions=rope, rope_delta=int(rope.max()) + 1 - len(ids))


@dataclass(frozen=True, slots=True)
class PromptImages:
    """The images of one prompt: ``positions`` (M,) int64 of its image tokens, in order,
    ``rows`` (M, D) float32 their input rows, ``digests`` the images', and ``owners`` (M,) which
    image each row belongs to; ``spans`` the runs [a, b) of image tokens that see each other both
    ways (empty for a model whose image tokens are causal like the rest); ``rope_positions``
    (3, S) the prompt's rope positions under multimodal rope (None: its positions), and
    ``rope_delta`` what a token after the prompt adds to its position there."""

    positions: np.ndarray
    rows: np.ndarray
    digests: tuple[str, ...]
    owners: np.ndarray
    spans: tuple[tuple[int, int], ...] = ()
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0

    def rope_rows(self, start: int, end: int) -> np.ndarray:
        """The rope positions (3, E) of sequence positions ``start:end`` (past the prompt: the
        position plus ``rope_delta``)."""
        assert self.rope_positions is not None
        s = self.rope_positions.shape[1]
        inside = self.rope_positions[:, start:min(end, s)]
        after = np.arange(max(start, s), end, dtype=np.int64) + self.rope_delta
        return np.concatenate([inside, np.broadcast_to(after, (3, len(after)))], axis=1)

    @classmethod
    def of(cls, ids: Sequence[int], image_token_id: int, images: Sequence[ImageRows],
           two_way: bool = False) -> "PromptImages":
        """The images of prompt ``ids`` whose tokens are ``image_token_id``; with ``two_way``,
        each run of consecutive image tokens is a span that sees itself both ways."""
        positions = np.flatnonzero(np.asarray(ids, dtype=np.int64) == image_token_id).astype(np.int64)  # (M,)
        counts = [image.rows.shape[0] for image in images]
        if len(positions) != sum(counts):
            raise ValueError(f"the prompt holds {len(positions)} image tokens; its {len(images)} images have "
                             f"{sum(counts)} rows")
        rows = np.concatenate([image.rows for image in images]) if images else np.zeros((0, 0), np.float32)
        owners = np.repeat(np.arange(len(images), dtype=np.int64), counts)
        spans: tuple[tuple[int, int], ...] = ()
        if two_way and len(positions):
            breaks = np.flatnonzero(np.diff(positions) != 1) + 1
            starts = positions[np.concatenate([[0], breaks])]
            ends = positions[np.concatenate([breaks - 1, [len(positions) - 1]])] + 1
            spans = tuple(zip(starts.tolist(), ends.tolist()))
        return cls(positions, np.ascontiguousarray(rows, dtype=np.float32), tuple(i.digest for i in images), owners,
                   spans)

    def key_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with each image token replaced by a negative id made from its image's
        digest and its index in the image: the ids prefix-cache blocks are hashed by."""
        out = list(ids)
        first = {}
        for i, (pos, owner) in enumerate(zip(self.positions.tolist(), self.owners.tolist())):
            start = first.setdefault(owner, i)
            seed = hashlib.blake2b(f"{self.digests[owner]}:{i - start}".encode(), digest_size=8).digest()
            out[pos] = -1 - (int.from_bytes(seed, "little") >> 1)  # in [-2^63, -1]: never a vocabulary id
        return out

    def key_ends(self, start: int, end: int) -> np.ndarray | None:
        """The end of the keys each of prompt positions ``start:end`` sees (E,): a span's end
        for its tokens, the next position for the others; None when no span meets the range."""
        if not any(a < end and start < b for a, b in self.spans):
            return None
        ends = np.arange(start + 1, end + 1, dtype=np.int64)  # (E,)
        for a, b in self.spans:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                ends[lo - start:hi - start] = b
        return ends

    def between(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The image rows of prompt positions ``start:end``: (their offsets from ``start`` (K,),
        their rows (K, D))."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        return self.positions[lo:hi] - start, self.rows[lo:hi]


def multimodal_positions(ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """Qwen2-VL's rope positions (3, S) of prompt ``ids`` (transformers' ``get_rope_index``):
    a text token's three positions are one running position; image k's tokens (a run of
    ``image_token_id``, its grid (t, h, w) of rows in ``grids``) take time, row and column
    positions offset by the running position, which then moves on by max(h, w)."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.empty((3, len(ids)), dtype=np.int64)
    images = iter(grids)
    at = current = 0
    while at < len(ids):
        if ids[at] != image_token_id:
            end = at
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            out[:, at:end] = np.arange(end - at, dtype=np.int64) + current
            current += end - at
        else:
            t, h, w = next(images)
            end = at + t * h * w
            if end > len(ids) or np.any(ids[at:end] != image_token_id):
                raise ValueError(f"the prompt's image tokens from position {at} do not make a {t}x{h}x{w} grid")
            out[0, at:end] = np.repeat(np.arange(t, dtype=np.int64), h * w) + current
            out[1, at:end] = np.tile(np.repeat(np.arange(h, dtype=np.int64), w), t) + current
            out[2, at:end] = np.tile(np.arange(w, dtype=np.int64), t * h) + current
            current += max(h, w)
        at = end
    return out
