"""Llama: q/k/v and output biases both set by ``attention_bias``; GGUF files store the rows of
q and k in the order of llama.cpp's interleaved rope, which ``unpermute_rows`` undoes.
Mistral is Llama with a sliding window on every layer (``ALIASES``: the ``sliding_window`` flag),
so Llama's own args are ``WindowArgs`` (its ``sliding_window``, 0 for Llama itself)."""
from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np

from ..config import ModelConfig, json_flag
from ..errors import ModelLoadError
from ..weights import GGUF_NAMES
from . import Architecture, RowFix, WindowArgs, refuse_sliding_window, register, silu_only


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``attention_bias`` (a JSON boolean, false when absent) puts biases on q/k/v and o alike.
    With the ``sliding_window`` flag (Mistral), ``sliding_window`` (null: none) applies to
    every layer; without it a sliding window is refused."""
    bias = json_flag(raw, "attention_bias", False, source)
    values = {"attention_bias": bias, "attention_out_bias": bias, **silu_only(raw, source)}
    if options.get("sliding_window"):
        window = raw.get("sliding_window")
        if window is not None:
            if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
                raise ModelLoadError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
            values["sliding_window"] = window
    else:
        refuse_sliding_window(raw, source)
    return values


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """GGUF has no bias flag: the biases are there when layer 0's tensors are."""
    return {"attention_bias": GGUF_NAMES.to_file("layers.0.q_bias") in tensors,
            "attention_out_bias": GGUF_NAMES.to_file("layers.0.o_bias") in tensors}


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, GGUF interleaves the two rope halves row
    by row (x0, y0, x1, y1, ...); ours keeps them as halves (x0, x1, ..., y0, y1, ...).

    w: (n_heads * Dh, ...) rows of one projection (weight or bias). Returns the same shape.
    """
    dh = w.shape[0] // n_heads
    return w.reshape(n_heads, dh // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # (n_heads*Dh, ...)


def gguf_row_fix(ours: str, config: ModelConfig) -> RowFix | None:
    """``unpermute_rows`` for q, k and their biases; the permutation stays within each head's
    rows, so whole heads (multiples of head_dim rows) can be read at a time."""
    if ours.rpartition(".")[2] not in ("q", "k", "q_bias", "k_bias"):
        return None
    dh = config.head_dim
    return (lambda rows: unpermute_rows(rows, rows.shape[0] // dh)), dh


LLAMA = register(Architecture(name="llama", args=WindowArgs, hf_config=hf_config, gguf_config=gguf_config,
                              gguf_row_fix=gguf_row_fix))
