"""The model configuration shared by both file formats, with Hugging Face field names.

``ModelConfig`` holds what every architecture has (sizes, heads, context, rope, norm epsilon,
tied head, q/k/v biases, special tokens) and, in ``arch_args``, what only its architecture has:
an ``ArchArgs`` subclass that the architecture's module (``models.architectures``) declares and
fills from a file (Gemma 3's windows and scales, Qwen3-MoE's experts) and checks. Code outside
that module asks the args only through ``ArchArgs``'s methods (``layer_window`` ...). This
module reads the keys every architecture shares and checks the values.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import ModelLoadError, read_json


@dataclass(slots=True)
class ArchArgs:
    """An architecture's own hyper-parameters, beyond ``ModelConfig``'s. This base has none and
    answers the shared code's questions as the Llama family's layer would; an architecture's
    subclass adds the fields its module reads from ``config.json`` and GGUF metadata (named as
    ``config.json`` names them) and overrides the answers that differ."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ArchArgs":
        """Args from ``values``, ignoring keys that are not fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def validate(self, config: "ModelConfig", source: str) -> None:
        """Check the values (with ``config``, whose checks passed); ModelLoadError naming
        ``source`` and the key as the file spells it (``config.key_name``)."""

    def layer_window(self, layer: int) -> int:
        """Keys layer ``layer`` attends to, its own included (0: all before it)."""
        return 0

    def layer_rope_theta(self, layer: int) -> float | None:
        """The base of the plain, unscaled rope layer ``layer`` rotates with instead of the
        model's; None: the model's (``rope_theta`` and ``rope_scaling``)."""
        return None

    def attention_scale(self, head_dim: int) -> float:
        """The factor of the attention scores: 1/sqrt(head_dim)."""
        return 1.0 / math.sqrt(head_dim)

    def embedding_scale(self) -> float:
        """The factor of the token embeddings (1: none)."""
        return 1.0

    def rope_sections(self) -> tuple[int, ...]:
        """Multimodal rope (Qwen2-VL's mrope): how many rotated pairs of each head take their
        angle from each of the token's position streams (time, height, width), in order; ():
        one position per token, as every text model has."""
        return ()

    def routed_experts(self) -> tuple[int, int]:
        """(E, k): the experts of a routed layer and how many each token runs; (0, 0): dense."""
        return 0, 0

    def shard_widths(self) -> dict[str, int]:
        """Widths of its own blocks that a tensor-parallel rank count must divide, by what
        they are (``tensor_parallel.check_fits``)."""
        return {}

    def sharded(self, size: int) -> "ArchArgs":
        """The args of one rank's part of ``size`` (those widths divided by ``size``)."""
        return self


@dataclass(slots=True)
class ModelConfig:
    """Hyper-parameters of a decoder: those every architecture has (field names follow
    ``config.json``), and the architecture's own in ``arch_args``."""

    architecture: str  # a registered architecture's name, "llama" | "qwen2" | ... (config.json: model_type)
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # I, the MLP width
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int | None = None  # KH; None means H (no grouping)
    head_dim: int | None = None  # Dh; None means D // H
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # rope type and its parameters (models.rope); None: plain rope
    partial_rotary_factor: float = 1.0  # rotated share of each head: R = int(Dh * factor) dims
    rope_freq_factors: list[float] | None = None  # (R/2,) divisors of the frequencies (GGUF rope_freqs.weight)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the q/k/v projections
    attention_out_bias: bool = False  # a bias on the output projection (Llama's attention_bias sets both)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    arch_args: ArchArgs = field(default_factory=ArchArgs)  # the architecture's own (Architecture.args)
    # How the file spells a field or rope parameter, for messages: "head_dim" ->
    # "llama.attention.key_length", "rope_scaling" -> "rope_parameters" (its parameters follow)
    key_names: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and all(is_int(v) and v > 0 for v in (self.hidden_size, self.num_attention_heads)):
            self.head_dim = self.hidden_size // self.num_attention_heads
        # Values of other types are kept as found, for ``validate`` to name them.
        if is_int(self.eos_token_id):
            self.eos_token_id = [self.eos_token_id]
        elif self.eos_token_id is None:
            self.eos_token_id = []
        elif isinstance(self.eos_token_id, (list, tuple)):
            self.eos_token_id = list(self.eos_token_id)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], args: type[ArchArgs] = ArchArgs) -> "ModelConfig":
        """A config from ``values``: its own fields, and ``arch_args`` of type ``args`` (the
        architecture's) from the keys that are its fields; other keys are ignored."""
        return cls(**{k: v for k, v in values.items() if k in SHARED_FIELDS}, arch_args=args.from_dict(values))

    def key_name(self, name: str) -> str:
        """How the file this config came from spells field or rope parameter ``name``
        ("head_dim", "rope_scaling.factor"), for messages (``key_names``); else ``name``."""
        if name in self.key_names:
            return self.key_names[name]
        table, dot, param = name.partition(".")
        return f"{self.key_names[table]}.{param}" if dot and table in self.key_names else name

    def validate(self, source: str) -> "ModelConfig":
        """Check the values describe a model the shared blocks can run; raises ModelLoadError
        naming ``source`` and the key as the file spells it; then the architecture's own
        (``ArchArgs.validate``)."""
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ModelLoadError(f"{source}: architecture must be a non-empty name, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ModelLoadError(f"{source}: {self.key_name(name)} must be a positive integer, got {value!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ModelLoadError(f"{source}: {self.key_name('max_position_embeddings')} must be at most "
                                 f"{MAX_POSITIONS}, got {self.max_position_embeddings}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"{source}: {self.key_name('num_attention_heads')}={self.num_attention_heads} is not a multiple of "
                f"{self.key_name('num_key_value_heads')}={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: {self.key_name('head_dim')} must be even for rotary embeddings, "
                                 f"got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not is_positive(getattr(self, name)):
                raise ModelLoadError(f"{source}: {self.key_name(name)} must be a positive number, "
                                     f"got {getattr(self, name)!r}")
        value = self.partial_rotary_factor
        if not is_number(value) or not 0 < value <= 1:
            raise ModelLoadError(f"{source}: {self.key_name('partial_rotary_factor')} must be a number in (0, 1], "
                                 f"got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Mapping):
            raise ModelLoadError(f"{source}: {self.key_name('rope_scaling')} must be an object, "
                                 f"got {self.rope_scaling!r}")
        from .rope import rope_frequencies  # here: models.rope imports this module's type

        rope_frequencies(self, source)  # refuses a rope type or parameter llaisys does not apply
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ModelLoadError(f"{source}: {name} must be true or false, got {getattr(self, name)!r}")
        self.arch_args.validate(self, source)
        if self.bos_token_id is not None and not is_token_id(self.bos_token_id):
            raise ModelLoadError(
                f"{source}: bos_token_id must be a token id (an integer >= 0), got {self.bos_token_id!r}"
            )
        self.eos_token_id = token_ids(self.eos_token_id, source, "eos_token_id")
        return self

    def layer_window(self, layer: int) -> int:
        """Keys layer ``layer`` attends to, its own included (0: all before it)."""
        return self.arch_args.layer_window(layer)

    def kv_window(self) -> int:
        """Keys behind a new token that some layer still attends to, when every layer has a
        sliding window (the largest); 0 when some layer sees every key."""
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        return 0 if not windows or 0 in windows else max(windows)

    @property
    def attention_scale(self) -> float:
        """The factor of the attention scores (1/sqrt(head_dim) unless the architecture says)."""
        return self.arch_args.attention_scale(self.head_dim)


MAX_POSITIONS = 2**32 - 1  # llama.cpp reads a context length as a 32-bit unsigned integer
SHARED_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig)) - {"arch_args"}  # read from a file


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a JSON/GGUF integer, not a bool or a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a finite real number (a JSON/GGUF number, not a bool, NaN, infinity
    or an integer past the float range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_positive(value: Any) -> bool:
    """Whether ``value`` is a finite number > 0."""
    return is_number(value) and value > 0


def is_token_id(value: Any) -> bool:
    """Whether ``value`` can be a token id: an integer >= 0."""
    return is_int(value) and value >= 0


def token_ids(value: Any, source: str, key: str) -> list[int]:
    """``value`` (an id, a list of ids or None/absent) as a list of ids.

    Anything else, floats included, is a ModelLoadError naming ``source`` and ``key``.
    """
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not is_token_id(item):
            raise ModelLoadError(
                f"{source}: {key} must be a token id or a list of token ids (integers >= 0); "
                f"found {item!r} in {value!r}"
            )
    return items


def typed_value(raw: Mapping[str, Any], key: str, default: Any, source: str, kind: type, expected: str,
                describe: Callable[[Any], str] = repr) -> Any:
    """``raw[key]`` (``default`` when absent or None) if it is a ``kind``; any other value is a
    ModelLoadError: "``key`` must be ``expected``, got ``describe(value)``"."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ModelLoadError(f"{source}: {key} must be {expected}, got {describe(value)}")
    return value


def json_flag(raw: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    """The JSON boolean ``raw[key]`` (``default`` when absent or null); any other value is a ModelLoadError."""
    return typed_value(raw, key, default, source, bool, "true or false")


DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def _rope_parameters(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling and partial_rotary_factor as transformers 5 reads them
    (``convert_rope_params_to_dict``, ``standardize_rope_params``): the rope table is
    ``rope_scaling`` when it is non-empty, otherwise ``rope_parameters``; its ``rope_theta``
    comes first, then the flat ``rope_theta``, then 10000; its ``partial_rotary_factor`` first,
    then the flat one, then 1. A table of type "llama3", "yarn" or "longrope" takes a flat
    ``original_max_position_embeddings`` over its own, else its own, else
    ``max_position_embeddings``. A table of per-layer-type entries is refused; the rope type is
    checked with the rest of the config (``models.rope``). rope_scaling is None for the plain
    rope. ``key_names`` says where each value was found, for messages."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], Mapping):
            raise ModelLoadError(f"{source}: {key} must be an object, got {raw[key]!r}")
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    table = dict(raw.get(key) or {})
    nested = [name for name, value in table.items() if isinstance(value, Mapping)]
    if nested:
        raise ModelLoadError(f"{source}: {key} holds per-layer-type entries ({', '.join(map(repr, nested))}), "
                             f"which llaisys does not apply; expected one table of rope parameters")
    names = {"rope_scaling": key}
    if "rope_type" not in table and "type" in table:
        names["rope_scaling.rope_type"] = f"{key}.type"
    kind = table.get("rope_type", table.get("type", "default"))
    if "rope_theta" in table:
        theta, names["rope_theta"] = table.pop("rope_theta"), f"{key}.rope_theta"
    else:
        theta = raw.get("rope_theta", DEFAULT_ROPE_THETA)
    partial = table.pop("partial_rotary_factor", None)
    if partial is None:
        partial = raw.get("partial_rotary_factor")
    else:
        names["partial_rotary_factor"] = f"{key}.partial_rotary_factor"
    if kind in ("llama3", "yarn", "longrope"):
        origin = "original_max_position_embeddings"
        if raw.get(origin) is not None:
            table[origin] = raw[origin]
            names[f"rope_scaling.{origin}"] = origin
        elif table.get(origin) is None:
            table[origin] = raw.get("max_position_embeddings")
            names[f"rope_scaling.{origin}"] = "max_position_embeddings"
    table["rope_type"] = kind
    table.pop("type", None)
    return {"rope_theta": theta, "rope_scaling": None if kind == "default" else table,
            "partial_rotary_factor": 1.0 if partial is None else partial, "key_names": names}


def hf_common_fields(raw: Any, source: str) -> dict[str, Any]:
    """The ``ModelConfig`` values of a Hugging Face ``config.json`` already parsed into ``raw``
    that every architecture reads alike: the keys as found, the rope parameters, the tied head;
    a required key missing, or MLP biases, is a ModelLoadError. The architecture's module adds
    its own fields after (``architectures.config_from_hf``)."""
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
               if k not in raw]
    if missing:
        raise ModelLoadError(f"{source}: missing required key(s) {', '.join(missing)}")
    if json_flag(raw, "mlp_bias", False, source):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported; expected MLP projections without bias")
    values = {k: v for k, v in raw.items() if k in SHARED_FIELDS and k != "key_names"}  # the architecture sets its own
    values.update(_rope_parameters(raw, source))
    values["tie_word_embeddings"] = json_flag(raw, "tie_word_embeddings", False, source)
    return values


def read_config_json(path: "str | os.PathLike[str]") -> Any:
    """The parsed ``config.json`` at ``path`` (ModelLoadError when missing or not JSON)."""
    return read_json(Path(path), hint="; a model folder needs a config.json")
