"""Weight names: name tables mapping a file format's names to ours, the shapes a config
implies, strict checking, and the one fix-up step (``sanitize``).

Each architecture (``models.architectures``) names its table per format; ``HF_NAMES`` and
``GGUF_NAMES`` are the Llama-family tables that Llama and Qwen2 both use.

Our names: ``embed`` (V, D), ``norm`` (D,), ``lm_head`` (V, D) and per layer ``layers.{i}.X``
with X in attn_norm (D,), q (H*Dh, D), k (KH*Dh, D), v (KH*Dh, D), q_bias/k_bias/v_bias,
o (D, H*Dh), o_bias (D,), ffn_norm (D,), gate (I, D), up (I, D), down (D, I), and in the layers of
the architectures that have them q_norm/k_norm (Dh,) and post_attn_norm/post_ffn_norm (D,); a
sparse layer of a mixture of experts has router (E, D), gate_exps/up_exps (E, I, D) and
down_exps (E, D, I) in place of gate, up and down (I: the experts' width).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from .config import ModelConfig
from .errors import ModelLoadError

# Hugging Face (safetensors) names -> ours.
HF_GLOBAL = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}
HF_LAYER_PREFIX = "model.layers.{i}."
HF_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o",
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
# Buffers some checkpoints carry that the model recomputes.
HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

# GGUF (llama.cpp) names -> ours.
GGUF_GLOBAL = {
    "token_embd.weight": "embed",
    "output_norm.weight": "norm",
    "output.weight": "lm_head",
}
GGUF_LAYER_PREFIX = "blk.{i}."
GGUF_LAYER = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "attn_output.bias": "o_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
GGUF_IGNORED = re.compile(r"(?!)")  # nothing: every tensor of a GGUF file is used or refused
# Tensors that change what the model computes in ways llaisys does not apply yet: refused by
# name (skipping them would run the model with the wrong rotary frequencies).
GGUF_REFUSED = {
    "rope_factors_long.weight": "LongRoPE scaling factors",
    "rope_factors_short.weight": "LongRoPE scaling factors",
}


@dataclass(frozen=True)
class NameTable:
    """How one file format names the weights."""

    globals: Mapping[str, str]
    layer_prefix: str  # with "{i}" for the layer index
    layer: Mapping[str, str]
    ignored: re.Pattern  # buffers the model recomputes exactly, skipped
    layer_count_key: str  # the key giving the number of layers, with "{arch}" for the architecture
    # known names llaisys does not apply -> what they carry; a file holding one is refused
    refused: Mapping[str, str] = field(default_factory=dict)

    def to_ours(self, name: str) -> str | None:
        """Our name for the file's ``name``; None when the table does not know it."""
        if name in self.globals:
            return self.globals[name]
        head, _, tail = self.layer_prefix.partition("{i}")
        if name.startswith(head):
            index, dot, rest = name[len(head):].partition(".")
            if dot and is_layer_index(index) and tail == "." and rest in self.layer:
                return f"layers.{index}.{self.layer[rest]}"
        return None

    def to_file(self, ours: str) -> str:
        """The file's name for our name ``ours``."""
        for file_name, name in self.globals.items():
            if name == ours:
                return file_name
        _, index, short = ours.split(".", 2)
        for file_name, name in self.layer.items():
            if name == short:
                return self.layer_prefix.format(i=index) + file_name
        raise KeyError(ours)


HF_NAMES = NameTable(HF_GLOBAL, HF_LAYER_PREFIX, HF_LAYER, HF_IGNORED, "num_hidden_layers")
GGUF_NAMES = NameTable(GGUF_GLOBAL, GGUF_LAYER_PREFIX, GGUF_LAYER, GGUF_IGNORED, "{arch}.block_count", GGUF_REFUSED)


def is_layer_index(text: str) -> bool:
    """Whether ``text`` is a layer index as files write it: ASCII digits, no leading zero
    (so ``layers.00`` cannot stand in for ``layers.0``)."""
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


@dataclass
class WeightSource:
    """One tensor of a file, read on demand."""

    file: str  # the file holding it, for messages
    file_name: str  # its name in that file, for messages
    shape: tuple[int, ...]  # logical (NumPy order) shape
    kind: str  # the stored type: "F32", "BF16", "Q4_1", ...
    read: Callable[[], np.ndarray]  # the values as a float array of ``shape``
    read_rows: Callable[[int, int], np.ndarray] | None = None  # rows [start, stop) only
    row_multiple: int = 1  # read_rows (and read_raw_rows) need start and stop to be multiples of this
    # A block-quantized matrix kept as stored: rows [start, stop) as their raw blocks, uint8
    # (stop - start, row_bytes), with the same row fix as read_rows (a stack of matrices
    # (E, N, K): rows of its E*N). None: always dequantized.
    read_raw_rows: Callable[[int, int], np.ndarray] | None = None
    # Where the stored bytes lie, unchanged, in a read-only memory map of the file: (the map,
    # uint8, and the offset of row 0 in it): read_raw_rows' blocks, or the values of a float
    # tensor in its stored type (``kind``). None: they are copied or fixed on the way.
    mapped: tuple[np.ndarray, int] | None = None
    # A stack of matrices (E, N, K): rows [start, stop) of matrix e as floats (stop - start, K),
    # reading only those rows. None: read through read_rows, a whole matrix at a time.
    read_matrix_rows: Callable[[int, int, int], np.ndarray] | None = None


def global_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The weights outside the layers that the config implies, by our name, with their shapes."""
    v, d = config.vocab_size, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (v, d)
    return shapes


def layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The weights of the Llama family's layer ``layer`` that the config implies, by our name,
    with their shapes (an architecture adds its own: Qwen3's q/k norms ...)."""
    d, dh, i = config.hidden_size, config.head_dim, config.intermediate_size
    nq, nkv = config.num_attention_heads * dh, config.num_key_value_heads * dh
    p = f"layers.{layer}."
    shapes = {
        p + "attn_norm": (d,), p + "q": (nq, d), p + "k": (nkv, d), p + "v": (nkv, d),
        p + "o": (d, nq), p + "ffn_norm": (d,), p + "gate": (i, d), p + "up": (i, d), p + "down": (d, i),
    }
    if config.attention_bias:
        shapes.update({p + "q_bias": (nq,), p + "k_bias": (nkv,), p + "v_bias": (nkv,)})
    if config.attention_out_bias:
        shapes[p + "o_bias"] = (d,)
    return shapes


LayerShapes = Callable[[ModelConfig, int], dict[str, tuple[int, ...]]]


def expected_shapes(config: ModelConfig, layer_shapes: LayerShapes = layer_shapes) -> dict[str, tuple[int, ...]]:
    """Every weight the config implies, by our name, with its shape (a layer's from
    ``layer_shapes``, its architecture's)."""
    shapes = global_shapes(config)
    for layer in range(config.num_hidden_layers):
        shapes.update(layer_shapes(config, layer))
    return shapes


def map_names(file_tensors: Mapping[str, WeightSource], table: NameTable, source: str,
              arch: str) -> dict[str, WeightSource]:
    """Rename a file's tensors to ours; a name the table does not know, or one it lists as
    refused, is an error naming it (and ``arch``, the architecture whose table it is)."""
    out: dict[str, WeightSource] = {}
    for name, src in file_tensors.items():
        if name in table.refused:
            raise ModelLoadError(
                f"{src.file}: the file carries {name} ({table.refused[name]}), which llaisys does not apply "
                f"yet; refusing to run the {arch} model without it"
            )
        ours = table.to_ours(name)
        if ours is None:
            if table.ignored.match(name):
                continue
            raise ModelLoadError(f"{src.file}: unexpected tensor {name!r}; it is not part of a {arch} decoder")
        if ours in out:  # unreachable for canonical names; kept so no tensor silently replaces another
            raise ModelLoadError(f"{src.file}: tensors {out[ours].file_name!r} and {name!r} are the same weight")
        out[ours] = src
    return out


def sanitize(weights: dict[str, WeightSource], config: ModelConfig) -> dict[str, WeightSource]:
    """The one fix-up step: a tied model uses ``embed`` as its head, so a stored copy of the
    head (some checkpoints keep one) is dropped rather than loaded twice."""
    if config.tie_word_embeddings:
        weights.pop("lm_head", None)
    return weights


def check_weights(weights: Mapping[str, WeightSource], config: ModelConfig, table: NameTable, source: str,
                  layer_shapes: LayerShapes = layer_shapes) -> None:
    """Strict loading: every expected tensor present with its shape, nothing else (a layer's
    tensors as its architecture's ``layer_shapes`` says).

    Raises ModelLoadError naming the file and the tensor (by its name in the file).
    """
    _check_layer_count(weights, config, table, source, layer_shapes)
    expected = expected_shapes(config, layer_shapes)
    missing = [name for name in expected if name not in weights]
    if missing:
        names = ", ".join(repr(table.to_file(n)) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: missing tensor {names}{more}")
    for name, src in weights.items():
        if name not in expected:
            raise ModelLoadError(
                f"{src.file}: unexpected tensor {src.file_name!r}; the config "
                f"({config.architecture}, attention_bias={config.attention_bias}, "
                f"tie_word_embeddings={config.tie_word_embeddings}) has no use for it"
            )
        if tuple(src.shape) != expected[name]:
            raise ModelLoadError(
                f"{src.file}: tensor {src.file_name!r} has shape {tuple(src.shape)}; expected {expected[name]} from the config"
            )


def _check_layer_count(weights: Mapping[str, WeightSource], config: ModelConfig, table: NameTable, source: str,
                       layer_shapes: LayerShapes) -> None:
    """Refuse a layer count beyond what the file's tensors can hold before anything is sized
    by it: a corrupt count of 2**63 would otherwise build a table with that many entries."""
    layers = config.num_hidden_layers
    if layers > len(weights):
        key = table.layer_count_key.format(arch=config.architecture)
        raise ModelLoadError(
            f"{source}: {key}={layers} is more layers than the file's {len(weights)} tensors can hold "
            f"({len(layer_shapes(config, 0))} per layer)"
        )
