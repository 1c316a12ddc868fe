"""Rotary frequencies from a config's rope parameters, as transformers computes them
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` and the models' default): the inverse
frequency of each rotated pair, float32 (R/2,), and the attention factor that multiplies cos
and sin (YaRN's mscale; 1 otherwise). The float32 arithmetic follows transformers' torch code
step by step, so the frequencies agree to the last bit or two.

Rope types: "default", "linear" (frequencies / factor), "llama3" (long wavelengths / factor,
a smooth blend between), "yarn" (a ramp between interpolated and extrapolated frequencies,
attention factor from ``factor``, ``mscale``/``mscale_all_dim`` or given), and "dynamic"
(NTK: transformers rescales the base once a forward call reaches past
``max_position_embeddings``; llaisys never runs a context that long, the generation loop and
the engine stop there, and up to it the frequencies are the default ones, which is what
transformers uses there too). ``partial_rotary_factor`` < 1 rotates the first
R = int(Dh * factor) dims of each head only. A GGUF file's ``rope_freqs.weight`` (Llama 3.x)
divides each pair's frequency, as llama.cpp applies it. Anything else ("longrope",
"proportional", ...) is refused by name.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .errors import ModelLoadError

if TYPE_CHECKING:
    from .config import ModelConfig

SUPPORTED_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
F32 = np.float32
Table = Mapping[str, Any]  # a rope table: rope_type and its parameters
Frequencies = tuple[np.ndarray, float]  # inverse frequencies float32 (R/2,), attention factor


def rotary_dims(config: "ModelConfig") -> int:
    """R, the rotated dims of each head: int(head_dim * partial_rotary_factor), as transformers sizes them."""
    return int(config.head_dim * config.partial_rotary_factor)


def rope_frequencies(config: "ModelConfig", source: str = "config") -> tuple[np.ndarray | None, float]:
    """(inverse frequencies float32 (R/2,), attention factor) of ``config``'s rope; (None, 1.0)
    for the plain rope (every dim rotated by theta^(-2j/Dh), which ``ops.rope`` computes
    itself). Raises ModelLoadError naming ``source`` and the key for a type llaisys does not
    apply or a missing or bad parameter."""
    table = dict(config.rope_scaling or {})
    kind = table.get("rope_type", table.get("type", "default"))
    dim = rotary_dims(config)
    factors = config.rope_freq_factors
    if kind == "default" and dim == config.head_dim and factors is None:
        return None, 1.0
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{source}: rope type {kind!r} (rope_type) is not supported; llaisys applies "
                             f"{', '.join(map(repr, SUPPORTED_TYPES))}")
    if dim < 2 or dim % 2:
        raise ModelLoadError(f"{source}: partial_rotary_factor={config.partial_rotary_factor} rotates {dim} dims of "
                             f"head_dim={config.head_dim}; expected an even number of at least 2")
    base = config.rope_theta
    inv_freq, attention_factor = _COMPUTE[kind](table, base, dim, config, source)
    if factors is not None:
        if len(factors) != dim // 2:
            raise ModelLoadError(f"{source}: rope_freqs holds {len(factors)} factors; expected {dim // 2}, one per "
                                 f"rotated pair of the {dim} rotated dims")
        inv_freq = inv_freq / np.asarray(factors, F32)  # llama.cpp: theta / freq_factors[i]
    return inv_freq.astype(F32), float(attention_factor)


def _param(table: Mapping[str, Any], key: str, source: str, kind: str, default: Any = ...,
           positive: bool = True) -> Any:
    """``table[key]`` as a number (``default`` when absent, if given); ModelLoadError naming the key otherwise."""
    if key not in table or table[key] is None:
        if default is not ...:
            return default
        raise ModelLoadError(f"{source}: rope type {kind!r} needs {key} in its rope parameters")
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise ModelLoadError(f"{source}: rope parameter {key} must be a positive number, got {value!r}")
    return value


def _default(dim: int, base: float) -> np.ndarray:
    # 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return F32(1.0) / (F32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)))


# Each computes (inverse frequencies float32 (dim/2,), attention factor) from the rope table
# ``table``, the base theta and the rotated dims, as transformers' function of that type does.
def _plain(table: Table, base: float, dim: int, config: "ModelConfig", source: str) -> Frequencies:
    return _default(dim, base), 1.0


def _linear(table: Table, base: float, dim: int, config: "ModelConfig", source: str) -> Frequencies:
    factor = _param(table, "factor", source, "linear")
    return _default(dim, base) / F32(factor), 1.0


def _dynamic(table: Table, base: float, dim: int, config: "ModelConfig", source: str) -> Frequencies:
    # At seq_len = max_position_embeddings, as transformers computes it at load and for every call up to it.
    factor = _param(table, "factor", source, "dynamic")
    seq_len = config.max_position_embeddings
    base = base * ((factor * seq_len / config.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _default(dim, base), 1.0


def _llama3(table: Table, base: float, dim: int, config: "ModelConfig", source: str) -> Frequencies:
    factor = _param(table, "factor", source, "llama3")
    low_freq_factor = _param(table, "low_freq_factor", source, "llama3")
    high_freq_factor = _param(table, "high_freq_factor", source, "llama3")
    old_context_len = _param(table, "original_max_position_embeddings", source, "llama3")
    if high_freq_factor == low_freq_factor:
        raise ModelLoadError(f"{source}: rope type 'llama3' needs high_freq_factor != low_freq_factor, both are "
                             f"{low_freq_factor}")
    inv_freq = _default(dim, base)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = F32(2 * math.pi) / inv_freq
    inv_freq_llama = np.where(wavelen > F32(low_freq_wavelen), inv_freq / F32(factor), inv_freq)
    smooth_factor = (F32(old_context_len) / wavelen - F32(low_freq_factor)) / F32(high_freq_factor - low_freq_factor)
    smoothed = (F32(1) - smooth_factor) * inv_freq_llama / F32(factor) + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < F32(high_freq_wavelen)) & ~(wavelen > F32(low_freq_wavelen))
    return np.where(is_medium, smoothed, inv_freq_llama).astype(F32), 1.0


def _yarn(table: Table, base: float, dim: int, config: "ModelConfig", source: str) -> Frequencies:
    original = _param(table, "original_max_position_embeddings", source, "yarn")
    factor = _param(table, "factor", source, "yarn", default=None)
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = _param(table, "attention_factor", source, "yarn", default=None)
    mscale = _param(table, "mscale", source, "yarn", default=None, positive=False)
    mscale_all_dim = _param(table, "mscale_all_dim", source, "yarn", default=None, positive=False)

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = table.get("beta_fast") or 32
    beta_slow = table.get("beta_slow") or 1
    truncate = table.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelLoadError(f"{source}: rope parameter truncate must be true or false, got {truncate!r}")

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevents a division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    pos_freqs = F32(base) ** (np.arange(0, dim, 2).astype(F32) / F32(dim))
    extrapolation = F32(1.0) / pos_freqs
    interpolation = F32(1.0) / (F32(factor) * pos_freqs)
    extrapolation_factor = F32(1) - ramp
    inv_freq = interpolation * (F32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(F32), attention_factor


_COMPUTE = {"default": _plain, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn}
