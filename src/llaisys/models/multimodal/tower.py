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
    float32 and the ``prompt`` text that stands for it (its image tokens among the markers
    the model was trained with)."""

    digest: str
    rows: np.ndarray
    prompt: str


class VisionTower:
    """Preprocessing, encoder and projector of one model (``family``: "idefics3" ...)."""

    def __init__(self, family: str, processor: Any, encoder: Any, projector: Any, image_token_id: int,
                 placeholder: str, hidden_size: int):
        self.family, self.processor, self.encoder, self.projector = family, processor, encoder, projector
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
        rows = self.projector.project(self.encoder.encode(processed.pixels))  # (M, D)
        if rows.shape[0] != processed.num_image_tokens:
            raise RuntimeError(f"the {self.family} projector made {rows.shape[0]} rows of an image whose prompt holds "
                               f"{processed.num_image_tokens} image tokens")
        out = ImageRows(digest, rows, processed.prompt)
        with self._lock:
            self._kept[digest] = out
            while len(self._kept) > ENCODED_KEPT:
                self._kept.popitem(last=False)
        return out

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
        return PromptImages.of(ids, self.image_token_id, images)


@dataclass(frozen=True, slots=True)
class PromptImages:
    """The images of one prompt: ``positions`` (M,) int64 of its image tokens, in order,
    ``rows`` (M, D) float32 their input rows, ``digests`` the images', and ``owners`` (M,) which
    image each row belongs to."""

    positions: np.ndarray
    rows: np.ndarray
    digests: tuple[str, ...]
    owners: np.ndarray

    @classmethod
    def of(cls, ids: Sequence[int], image_token_id: int, images: Sequence[ImageRows]) -> "PromptImages":
        """The images of prompt ``ids`` whose tokens are ``image_token_id``."""
        positions = np.flatnonzero(np.asarray(ids, dtype=np.int64) == image_token_id).astype(np.int64)  # (M,)
        counts = [image.rows.shape[0] for image in images]
        if len(positions) != sum(counts):
            raise ValueError(f"the prompt holds {len(positions)} image tokens; its {len(images)} images have "
                             f"{sum(counts)} rows")
        rows = np.concatenate([image.rows for image in images]) if images else np.zeros((0, 0), np.float32)
        owners = np.repeat(np.arange(len(images), dtype=np.int64), counts)
        return cls(positions, np.ascontiguousarray(rows, dtype=np.float32), tuple(i.digest for i in images), owners)

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

    def between(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The image rows of prompt positions ``start:end``: (their offsets from ``start`` (K,),
        their rows (K, D))."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        return self.positions[lo:hi] - start, self.rows[lo:hi]
