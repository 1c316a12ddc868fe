"""The text model of Qwen2-VL and Qwen2.5-VL (``qwen2_vl_text``, ``qwen2_5_vl_text``): Qwen2 with
multimodal rope. Each token has three positions (time, height, width: equal for text, an
image's grid for its tokens), and ``mrope_section`` says how many rotated pairs of each head
take their angle from each, in order (transformers' ``recomposition_frequencies``).

To rotate each section with one ``ops.rope`` call, the q and k rows of every head are stored
permuted (``section_order``): section s's pairs (i, i + Dh/2) for i in its range become one
contiguous rotate-half block. Scores q . k are the same under a permutation applied to both.

llama.cpp writes the text model of Qwen2-VL and Qwen2.5-VL as ``general.architecture``
"qwen2vl" (an alias of ``qwen2_5_vl_text``, whose text model is the same): Qwen2's tensor names
in Hugging Face row order, and the sections in ``qwen2vl.rope.dimension_sections`` (t, h, w, 0)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import numpy as np

from ..config import ModelConfig, is_int
from ..errors import ModelLoadError
from . import Architecture, RowFix, WindowArgs, register
from . import qwen2


@dataclass(slots=True)
class MropeArgs(WindowArgs):
    """Qwen2's window, and the rope sections (``mrope_section``: pairs per position stream)."""

    mrope_section: list[int] | None = None

    def validate(self, config: ModelConfig, source: str) -> None:
        """Sections of positive sizes whose sum is half the head: every pair rotates."""
        WindowArgs.validate(self, config, source)
        sections = self.mrope_section
        if (not isinstance(sections, list) or not sections or len(sections) > 3
                or not all(is_int(n) and n > 0 for n in sections) or sum(sections) != config.head_dim // 2):
            raise ModelLoadError(f"{source}: {config.key_name('mrope_section')} must list up to three positive pair "
                                 f"counts summing to head_dim / 2 = {config.head_dim // 2}, got {sections!r}")
        if config.partial_rotary_factor != 1.0:
            raise ModelLoadError(f"{source}: multimodal rope rotates whole heads; partial_rotary_factor must be 1")

    def rope_sections(self) -> tuple[int, ...]:
        return tuple(self.mrope_section or ())


def hf_prepare(raw: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """``mrope_section`` taken out of the rope table (``rope_parameters``, or ``rope_scaling``
    of type "mrope" as older configs write it) into a key of its own; the rope is then plain."""
    out = dict(raw)
    for key in ("rope_parameters", "rope_scaling"):
        table = raw.get(key)
        if isinstance(table, Mapping) and "mrope_section" in table:
            table = dict(table)
            out["mrope_section"] = table.pop("mrope_section")
            if table.get("rope_type", table.get("type")) == "mrope":
                table.pop("type", None)
                table["rope_type"] = "default"
            out[key] = table
    if "mrope_section" not in out:
        raise ModelLoadError(f"{source}: model_type {raw.get('model_type')!r} needs rope_parameters.mrope_section "
                             "(its multimodal rope's sections)")
    return out


def section_order(head_dim: int, sections: tuple[int, ...]) -> np.ndarray:
    """The order of one head's Dh dims in which each section's rotated pairs form a rotate-half
    block: for a section of pairs [a, b), dims a..b-1 then Dh/2+a..Dh/2+b-1. (Dh,) int."""
    half, order, a = head_dim // 2, [], 0
    for n in sections:
        order += list(range(a, a + n)) + list(range(half + a, half + a + n))
        a += n
    return np.asarray(order, dtype=np.int64)


def hf_value_fix(ours: str, config: ModelConfig) -> Callable[[np.ndarray], np.ndarray] | None:
    """q and k rows (weights and biases) put in ``section_order`` within each head."""
    if ours.rpartition(".")[2] not in ("q", "k", "q_bias", "k_bias"):
        return None
    dh = config.head_dim
    order = section_order(dh, config.arch_args.rope_sections())

    def fix(rows: np.ndarray) -> np.ndarray:
        heads = rows.reshape(rows.shape[0] // dh, dh, *rows.shape[1:])
        return np.ascontiguousarray(heads[:, order].reshape(rows.shape))
    return fix


def gguf_row_fix(ours: str, config: ModelConfig) -> RowFix | None:
    """``hf_value_fix``'s permutation for a GGUF file's q and k rows, which llama.cpp stores in
    Hugging Face order; it stays within each head, so whole heads can be read at a time."""
    fix = hf_value_fix(ours, config)
    return None if fix is None else (fix, config.head_dim)


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2's, and the sections ``hf_prepare`` took out of the rope table."""
    return {**qwen2.hf_config(raw, source, options), "mrope_section": raw.get("mrope_section")}


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """Qwen2's, and the sections of ``{arch}.rope.dimension_sections``: llama.cpp pads them to
    four counts with zeros, which are dropped here (``MropeArgs.validate`` checks the rest)."""
    key = f"{meta.get('general.architecture')}.rope.dimension_sections"
    sections = meta.get(key)
    if not isinstance(sections, list) or not 0 < len(sections) <= 4 or not all(is_int(n) and n >= 0 for n in sections):
        raise ModelLoadError(f"{source}: {key} must list the multimodal rope's pair counts per position stream "
                             f"(time, height, width, 0), got {sections!r}")
    while sections and sections[-1] == 0:
        sections = sections[:-1]
    return {**qwen2.gguf_config(meta, tensors, source), "mrope_section": list(sections),
            "key_names": {"mrope_section": key}}


def _register(name: str) -> Architecture:
    return register(Architecture(name=name, args=MropeArgs, hf_config=hf_config, gguf_config=gguf_config,
                                 gguf_row_fix=gguf_row_fix, hf_prepare=hf_prepare, hf_value_fix=hf_value_fix,
                                 hf_key_names=lambda raw: {"mrope_section": "rope_parameters.mrope_section"}))


QWEN2_VL = _register("qwen2_vl_text")
QWEN2_5_VL = _register("qwen2_5_vl_text")
