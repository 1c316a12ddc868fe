"""Rotary frequencies from a config's rope parameters, as transformers computes them
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` and the models' default): the inverse
frequency of each rotated pair, float32 (R/2,), and the attention factor that multiplies cos
and sin (YaRN's mscale; 1 otherwise). The float32 arithmetic follows transformers' torch code
step by step, so the frequencies agree to the last bit or two.

Rope types: "default", "linear" (frequencies / factor), "llama3" (long wavelengths / factor,
a smooth blend between), "yarn" (a ramp between interpolated and extrapolated frequencies,
attention factor from ``factor``, ``mscale``/``mscale_all_dim`` or given), and "dynamic"
(NTK: transformers rescales the base once a forward call reaches past
``max_position_embeddings``; llaisys never runs a context that long (the engine stops
there), and up to it the frequencies are the default ones, which is what
transformers uses there too). ``partial_rotary_factor`` < 1 rotates the first
R = int(Dh * factor) dims of each head only. A GGUF file's ``rope_freqs.weight`` (Llama 3.x)
divides each pair's frequency, as llama.cpp applies it. Anything else ("longrope",
"proportional", ...) is refused by name.

Every parameter is checked once, by the rule of its type (``PARAMETERS``), before any
arithmetic, so a value that would divide by zero, take the log of a number <= 0 or give NaN is a
ModelLoadError naming the key as the file spells it (``ModelConfig.key_name``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from .config import is_number, is_positive
from .errors import ModelLoadError

if TYPE_CHECKING:
    from .config import ModelConfig

F32 = np.float32
Table = Mapping[str, Any]  # a rope type's checked parameters (absent or null optional ones None)
Frequencies = tuple[np.ndarray, float]  # inverse frequencies float32 (R/2,), attention factor
Rule = tuple[str, Callable[[Any], bool]]  # what a value must be, in words, and its test

POSITIVE: Rule = ("a positive number", is_positive)
NON_NEGATIVE: Rule = ("a non-negative number", lambda v: is_number(v) and v >= 0)
BOOLEAN: Rule = ("true or false", lambda v: isinstance(v, bool))
# required: the key must hold a value; optional: absent or null takes the default; keyed: the key
# must be there, null taking the default (transformers' yarn factor)
REQUIRED, OPTIONAL, KEYED = "required", "optional", "keyed"

# The parameters each rope type reads, with their rules, as transformers' validation (required
# keys) and compute functions (what would raise or give NaN) treat them. yarn: a null factor is
# max_position_embeddings / original_max_position_embeddings; beta_fast/beta_slow 0 take their
# defaults (32, 1) and mscale or mscale_all_dim 0 leaves the attention factor to ``factor``
# alone, as transformers reads them (with ``or``); negative ones would make the attention
# factor 0 or negative, and a negative beta the log of a negative number.
PARAMETERS: dict[str, dict[str, tuple[Rule, str]]] = {
    "default": {},
    "linear": {"factor": (POSITIVE, REQUIRED)},
    "dynamic": {"factor": (POSITIVE, REQUIRED)},
    "llama3": {"factor": (POSITIVE, REQUIRED), "low_freq_factor": (POSITIVE, REQUIRED),
               "high_freq_factor": (POSITIVE, REQUIRED), "original_max_position_embeddings": (POSITIVE, REQUIRED)},
    "yarn": {"factor": (POSITIVE, KEYED), "original_max_position_embeddings": (POSITIVE, REQUIRED),
             "attention_factor": (POSITIVE, OPTIONAL), "beta_fast": (NON_NEGATIVE, OPTIONAL),
             "beta_slow": (NON_NEGATIVE, OPTIONAL), "mscale": (NON_NEGATIVE, OPTIONAL),
             "mscale_all_dim": (NON_NEGATIVE, OPTIONAL), "truncate": (BOOLEAN, OPTIONAL)},
}
SUPPORTED_TYPES = tuple(PARAMETERS)


def rotary_dims(config: "ModelConfig") -> int:
    """R, the rotated dims of each head: int(head_dim * partial_rotary_factor), as transformers sizes them."""
    return int(config.head_dim * config.partial_rotary_factor)


def rope_frequencies(config: "ModelConfig", source: str = "config") -> tuple[np.ndarray | None, float]:
    """(inverse frequencies float32 (R/2,), attention factor) of ``config``'s rope; (None, 1.0)
    for the plain rope (every dim rotated by theta^(-2j/Dh), which ``ops.rope`` computes
    itself). Raises ModelLoadError naming ``source`` and the key for a type llaisys does not
    apply or a missing or bad parameter, before computing anything with it."""
    table = dict(config.rope_scaling or {})
    kind = table.get("rope_type", table.get("type", "default"))
    dim = rotary_dims(config)
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{source}: rope type {kind!r} (rope_type) is not supported; llaisys applies "
                             f"{', '.join(map(repr, SUPPORTED_TYPES))}")
    if dim < 2 or dim % 2:
        raise ModelLoadError(f"{source}: {config.key_name('partial_rotary_factor')}={config.partial_rotary_factor} "
                             f"rotates {dim} dims of {config.key_name('head_dim')}={config.head_dim}; expected an even "
                             f"number of at least 2")
    params = _checked(table, kind, config, source)
    _check_combination(kind, params, dim, config, source)
    factors = _checked_factors(config, dim, source)
    inv_freq, attention_factor = _finite(kind, params, dim, factors, config, source)
    if kind == "default" and dim == config.head_dim and factors is None:
        return None, 1.0
    return inv_freq, attention_factor


def _finite(kind: str, params: Table, dim: int, factors: np.ndarray | None, config: "ModelConfig",
            source: str) -> Frequencies:
    """The frequencies (dim/2,) float32 and attention factor of checked parameters; values that
    each pass their rule but together overflow float32 (a theta of 1e-300) are a ModelLoadError."""
    try:
        with np.errstate(all="ignore"):
            inv_freq, attention_factor = _COMPUTE[kind](params, config.rope_theta, dim, config)
            if factors is not None:
                inv_freq = inv_freq / factors  # llama.cpp: theta / freq_factors[i]
            finite = bool(np.isfinite(inv_freq).all() and np.isfinite(F32(attention_factor)) and attention_factor > 0)
    except (ArithmeticError, ValueError):
        finite = False
    if not finite:
        given = {k: v for k, v in params.items() if v is not None}
        what = f"rope type {kind!r} {given}" if given else f"rope type {kind!r}"
        raise ModelLoadError(f"{source}: {config.key_name('rope_theta')}={config.rope_theta!r} with {what} gives "
                             f"rotary frequencies or an attention factor that are not finite float32 numbers")
    return np.asarray(inv_freq, F32), float(attention_factor)


def _checked(table: Mapping[str, Any], kind: str, config: "ModelConfig", source: str) -> dict[str, Any]:
    """The parameters rope type ``kind`` reads from ``table``, each checked by its rule
    (``PARAMETERS``); an optional one absent or null is None."""
    out: dict[str, Any] = {}
    for param, ((words, test), need) in PARAMETERS[kind].items():
        if param not in table and need != OPTIONAL:
            raise ModelLoadError(f"{source}: rope type {kind!r} needs {param} in its rope parameters "
                                 f"({config.key_name('rope_scaling')})")
        value = table.get(param)
        if (value is not None or need == REQUIRED) and not test(value):
            raise ModelLoadError(f"{source}: {config.key_name('rope_scaling.' + param)} must be {words}, "
                                 f"got {value!r}")
        out[param] = value
    return out


def _check_combination(kind: str, params: Table, dim: int, config: "ModelConfig", source: str) -> None:
    """Checks of parameters that are each fine alone but not together with the others."""
    if kind == "yarn" and config.rope_theta == 1:
        raise ModelLoadError(f"{source}: {config.key_name('rope_theta')} must be a positive number other than 1 for "
                             f"rope type 'yarn' (its ramp divides by log(rope_theta)), got {config.rope_theta!r}")
    if kind == "dynamic" and dim <= 2:
        raise ModelLoadError(f"{source}: rope type 'dynamic' needs more than 2 rotated dims (its base grows with "
                             f"the power R / (R - 2)); {config.key_name('partial_rotary_factor')}="
                             f"{config.partial_rotary_factor} of {config.key_name('head_dim')}={config.head_dim} "
                             f"rotates {dim}")
    if kind == "llama3" and params["high_freq_factor"] == params["low_freq_factor"]:
        raise ModelLoadError(f"{source}: rope type 'llama3' needs high_freq_factor != low_freq_factor, both are "
                             f"{params['low_freq_factor']}")


def _checked_factors(config: "ModelConfig", dim: int, source: str) -> np.ndarray | None:
    """The per-pair divisors (R/2,) float32 of ``config.rope_freq_factors``: one positive finite
    number per rotated pair, or None."""
    factors = config.rope_freq_factors
    if factors is None:
        return None
    name = config.key_name("rope_freq_factors")
    if not isinstance(factors, (list, tuple)) or len(factors) != dim // 2:
        count = f"{len(factors)} factors" if isinstance(factors, (list, tuple)) else repr(factors)
        raise ModelLoadError(f"{source}: {name} holds {count}; expected {dim // 2}, one per rotated pair of the "
                             f"{dim} rotated dims")
    for i, value in enumerate(factors):
        if not is_positive(value):
            raise ModelLoadError(f"{source}: {name} must hold positive finite divisors of the frequencies; "
                                 f"found {value!r} at {i}")
    return np.asarray(factors, F32)


def inverse_frequencies(config: "ModelConfig", source: str = "config") -> tuple[np.ndarray, float]:
    """``rope_frequencies`` with the plain rope's frequencies computed too: (inverse
    frequencies float32 (R/2,), attention factor), never None (multimodal rope splits them)."""
    inv_freq, factor = rope_frequencies(config, source)
    if inv_freq is None:
        inv_freq = _default(rotary_dims(config), config.rope_theta)
    return inv_freq, factor


def _default(dim: int, base: float) -> np.ndarray:
    # 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return F32(1.0) / (F32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)))


# Each computes (inverse frequencies float32 (dim/2,), attention factor) from the checked
# parameters ``p``, the base theta and the rotated dims, as transformers' function of that type does.
def _plain(p: Table, base: float, dim: int, config: "ModelConfig") -> Frequencies:
    return _default(dim, base), 1.0


def _linear(p: Table, base: float, dim: int, config: "ModelConfig") -> Frequencies:
    return _default(dim, base) / F32(p["factor"]), 1.0


def _dynamic(p: Table, base: float, dim: int, config: "ModelConfig") -> Frequencies:
    # At seq_len = max_position_embeddings, as transformers computes it at load and for every call up to it.
    factor, seq_len = p["factor"], config.max_position_embeddings
    base = base * ((factor * seq_len / config.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _default(dim, base), 1.0


def _llama3(p: Table, base: float, dim: int, config: "ModelConfig") -> Frequencies:
    factor, low_freq_factor, high_freq_factor = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    inv_freq = _default(dim, base)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = F32(2 * math.pi) / inv_freq
    inv_freq_llama = np.where(wavelen > F32(low_freq_wavelen), inv_freq / F32(factor), inv_freq)
    smooth_factor = (F32(old_context_len) / wavelen - F32(low_freq_factor)) / F32(high_freq_factor - low_freq_factor)
    smoothed = (F32(1) - smooth_factor) * inv_freq_llama / F32(factor) + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < F32(high_freq_wavelen)) & ~(wavelen > F32(low_freq_wavelen))
    return np.where(is_medium, smoothed, inv_freq_llama).astype(F32), 1.0


def _yarn(p: Table, base: float, dim: int, config: "ModelConfig") -> Frequencies:
    original = p["original_max_position_embeddings"]
    factor = p["factor"]
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor, mscale, mscale_all_dim = p["attention_factor"], p["mscale"], p["mscale_all_dim"]

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p["beta_fast"] or 32
    beta_slow = p["beta_slow"] or 1
    truncate = True if p["truncate"] is None else p["truncate"]

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
