"""Qwen3-MoE: Qwen3's layer (per-head q/k norms) whose MLP, on its sparse layers, is a routed
mixture of SwiGLU experts (``moe_layer``, over ``layers.routed_mlp``): softmax of the router's
logits, the top ``num_experts_per_tok`` experts, their weights renormalised when
``norm_topk_prob``. Layer i is sparse when it is not in ``mlp_only_layers`` and
(i + 1) % ``decoder_sparse_step`` == 0; the others run the dense MLP of ``intermediate_size``.
These are its args (``Qwen3MoeArgs``), besides Qwen3's window.

Files: safetensors folders hold one tensor per expert (``mlp.experts.{e}.gate_proj.weight``,
as ``save_pretrained`` writes them) or transformers' fused stacks (``mlp.experts.gate_up_proj``
(E, 2I, D), ``mlp.experts.down_proj`` (E, D, I)); ``sanitize_weights`` stacks or splits them
into ours: ``router`` (E, D), ``gate_exps``/``up_exps`` (E, I, D), ``down_exps`` (E, D, I), as
llama.cpp's GGUF stores them (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``, kept quantized).
A GGUF's ``general.architecture`` is "qwen3moe" (an alias); its dense layers are those
without a router."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import numpy as np

from ... import ops
from ...tensor import Tensor
from ..config import ModelConfig, is_int, json_flag
from ..errors import ModelLoadError
from ..layers import Workspace, decoder_layer, routed_mlp
from ..params import LayerParams
from ..weights import GGUF_NAMES, HF_NAMES, NameTable, WeightSource
from . import Architecture, WindowArgs, register
from .qwen3 import gguf_config as qwen3_gguf_config
from .qwen3 import hf_config as qwen3_hf_config
from .qwen3 import qwen3_layer_shapes

MAX_EXPERTS = 1024  # per-expert tensor names the safetensors table knows
PROJECTIONS = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))  # ours, transformers'

HF_LAYER = {**HF_NAMES.layer, "mlp.gate.weight": "router",
            "mlp.experts.gate_up_proj": "gate_up_exps", "mlp.experts.down_proj": "down_exps",
            **{f"mlp.experts.{e}.{theirs}.weight": f"experts.{e}.{ours}"
               for e in range(MAX_EXPERTS) for ours, theirs in PROJECTIONS}}
GGUF_LAYER = {**GGUF_NAMES.layer, "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "gate_exps",
              "ffn_up_exps.weight": "up_exps", "ffn_down_exps.weight": "down_exps"}
HF_TABLE = NameTable(HF_NAMES.globals, HF_NAMES.layer_prefix, HF_LAYER, HF_NAMES.ignored, HF_NAMES.layer_count_key)
GGUF_TABLE = NameTable(GGUF_NAMES.globals, GGUF_NAMES.layer_prefix, GGUF_LAYER, GGUF_NAMES.ignored,
                       GGUF_NAMES.layer_count_key, GGUF_NAMES.refused)


@dataclass(slots=True)
class Qwen3MoeArgs(WindowArgs):
    """Qwen3's window and the routed experts (``config.json`` names)."""

    num_experts: int = 0  # E; 0: every layer dense
    num_experts_per_tok: int = 0  # k experts chosen per token
    norm_topk_prob: bool = False  # the chosen experts' weights divided by their sum
    moe_intermediate_size: int = 0  # an expert's MLP width
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and it is not listed here

    def routed_experts(self) -> tuple[int, int]:
        return self.num_experts, self.num_experts_per_tok

    def validate(self, config: ModelConfig, source: str) -> None:
        """The experts' fields (when there are experts), then the window's."""
        self._validate_experts(config, source)
        WindowArgs.validate(self, config, source)

    def _validate_experts(self, config: ModelConfig, source: str) -> None:
        if not is_int(self.num_experts) or not 0 <= self.num_experts <= 1 << 16:
            raise ModelLoadError(f"{source}: num_experts must be an integer in [0, 65536], got {self.num_experts!r}")
        if not self.num_experts:
            return
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                raise ModelLoadError(f"{source}: {name} must be a positive integer, got {getattr(self, name)!r}")
        k = self.num_experts_per_tok
        if not is_int(k) or not 1 <= k <= self.num_experts:
            raise ModelLoadError(f"{source}: num_experts_per_tok must be an integer in [1, num_experts="
                                 f"{self.num_experts}], got {k!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ModelLoadError(f"{source}: norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        layers = self.mlp_only_layers
        if not isinstance(layers, list) or not all(is_int(i) and 0 <= i < config.num_hidden_layers for i in layers):
            raise ModelLoadError(f"{source}: mlp_only_layers must list layer indices in [0, "
                                 f"{config.num_hidden_layers}), got {layers!r:.200}")

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` runs the routed experts rather than the dense MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def shard_widths(self) -> dict[str, int]:
        """Each expert's MLP width, split over the ranks like the dense one."""
        return {"experts' MLP width (moe_intermediate_size)": self.moe_intermediate_size} if self.num_experts else {}

    def sharded(self, size: int) -> "Qwen3MoeArgs":
        """A rank's I/N of each expert's width (the router and the experts whole)."""
        return dataclasses.replace(self, moe_intermediate_size=self.moe_intermediate_size // size)


def hf_config(raw: Mapping[str, Any], source: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3's fields, then the experts' (``num_experts``, which transformers 5 writes as
    ``num_local_experts``)."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise ModelLoadError(f"{source}: missing required key num_experts (or num_local_experts)")
    return {**qwen3_hf_config(raw, source, options), "num_experts": experts,
            "num_experts_per_tok": raw.get("num_experts_per_tok"),
            "norm_topk_prob": json_flag(raw, "norm_topk_prob", False, source),
            "moe_intermediate_size": raw.get("moe_intermediate_size"),
            "decoder_sparse_step": raw.get("decoder_sparse_step", 1),
            "mlp_only_layers": raw.get("mlp_only_layers") or []}


def gguf_config(meta: Mapping[str, Any], tensors: Collection[str], source: str) -> dict[str, Any]:
    """Qwen3's fields, the experts' from ``qwen3moe.expert_*`` as llama.cpp reads them (the
    weights renormalised unless ``expert_weights_norm`` says not), the dense layers those
    without a router."""
    arch = "qwen3moe"
    layers = meta.get(f"{arch}.block_count")
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors] if isinstance(
        layers, int) and 0 <= layers <= len(tensors) else []
    return {**qwen3_gguf_config(meta, tensors, source), "num_experts": meta.get(f"{arch}.expert_count"),
            "num_experts_per_tok": meta.get(f"{arch}.expert_used_count"),
            "norm_topk_prob": meta.get(f"{arch}.expert_weights_norm", True),
            "moe_intermediate_size": meta.get(f"{arch}.expert_feed_forward_length"),
            "decoder_sparse_step": 1, "mlp_only_layers": dense}


def moe_layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Qwen3's weights; a sparse layer's router and stacked experts in place of its MLP."""
    shapes, args = qwen3_layer_shapes(config, layer), config.arch_args
    if not args.layer_is_sparse(layer):
        return shapes
    p, d, e, i = f"layers.{layer}.", config.hidden_size, args.num_experts, args.moe_intermediate_size
    for ours in ("gate", "up", "down"):
        del shapes[p + ours]
    return {**shapes, p + "router": (e, d), p + "gate_exps": (e, i, d), p + "up_exps": (e, i, d),
            p + "down_exps": (e, d, i)}


def _stacked(parts: list[WeightSource], name: str) -> WeightSource:
    """One source (E, N, K) reading the experts' sources (N, K) as a stack."""
    kinds = {s.kind for s in parts}

    def matrix_rows(e: int, start: int, stop: int) -> np.ndarray:
        part = parts[e]
        return part.read_rows(start, stop) if part.read_rows is not None else part.read()[start:stop]
    return WeightSource(parts[0].file, name, (len(parts), *parts[0].shape), kinds.pop() if len(kinds) == 1 else "F32",
                        read=lambda: np.stack([s.read() for s in parts]),
                        read_rows=lambda start, stop: np.stack([s.read() for s in parts[start:stop]]),
                        read_matrix_rows=matrix_rows)


def _half(src: WeightSource, which: int, name: str) -> WeightSource:
    """Half ``which`` (0: gate, 1: up) of a fused (E, 2I, D) source's middle dimension."""
    e, two_i, d = src.shape
    cut = slice(which * two_i // 2, (which + 1) * two_i // 2)
    matrix_rows = src.read_matrix_rows
    return dataclasses.replace(src, file_name=name, shape=(e, two_i // 2, d), read=lambda: src.read()[:, cut],
                               read_rows=lambda start, stop: src.read_rows(start, stop)[:, cut],
                               read_raw_rows=None, mapped=None,
                               read_matrix_rows=None if matrix_rows is None else (
                                   lambda x, a, b: matrix_rows(x, cut.start + a, cut.start + b)))


def sanitize_weights(weights: dict[str, WeightSource], config: ModelConfig, source: str) -> dict[str, WeightSource]:
    """Each sparse layer's experts as ``moe_layer_shapes`` names them: one tensor per expert
    stacked, a fused gate_up stack split in two; an expert missing is an error naming it."""
    args = config.arch_args
    for layer in range(config.num_hidden_layers):
        if not args.layer_is_sparse(layer):
            continue
        p = f"layers.{layer}."
        fused = weights.pop(p + "gate_up_exps", None)
        if fused is not None:
            if len(fused.shape) != 3 or fused.shape[1] % 2:
                raise ModelLoadError(f"{fused.file}: tensor {fused.file_name!r} has shape {fused.shape}; expected "
                                     f"(E, 2*I, D)")
            weights[p + "gate_exps"] = _half(fused, 0, fused.file_name + "[gate]")
            weights[p + "up_exps"] = _half(fused, 1, fused.file_name + "[up]")
        for ours, theirs in PROJECTIONS:
            names = [f"{p}experts.{e}.{ours}" for e in range(args.num_experts)]
            if p + ours + "_exps" in weights and not any(n in weights for n in names):
                continue
            missing = [e for e, n in enumerate(names) if n not in weights]
            if missing:
                raise ModelLoadError(f"{source}: missing tensor 'model.layers.{layer}.mlp.experts.{missing[0]}."
                                     f"{theirs}.weight' ({len(missing)} of the {args.num_experts} experts' "
                                     f"{theirs} missing)")
            parts = [weights.pop(n) for n in names]
            want = (args.moe_intermediate_size, config.hidden_size)[::-1 if ours == "down" else 1]
            for part in parts:
                if tuple(part.shape) != want:
                    raise ModelLoadError(f"{part.file}: tensor {part.file_name!r} has shape {tuple(part.shape)}; "
                                         f"expected {want} from the config")
            weights[p + ours + "_exps"] = _stacked(parts, f"model.layers.{layer}.mlp.experts.*.{theirs}.weight")
    return weights


def moe_layer(ws: Workspace, lp: LayerParams, next_norm: Tensor, attend: Callable[[], None], config: ModelConfig,
              plan: ops.Plan) -> None:
    """Qwen3's pre-norm layer (``layers.decoder_layer``) whose MLP step, on a sparse layer (one
    holding a router), is the routed experts (``layers.routed_mlp``)."""
    args = config.arch_args
    ffn = None if lp.router is None else (
        lambda: routed_mlp(ws, lp, args.num_experts_per_tok, args.norm_topk_prob, plan))
    decoder_layer(ws, lp, next_norm, attend, config, plan, ffn)


QWEN3_MOE = register(Architecture(name="qwen3_moe", args=Qwen3MoeArgs, hf_config=hf_config, gguf_config=gguf_config,
                                  hf_names=HF_TABLE, gguf_names=GGUF_TABLE, layer_shapes=moe_layer_shapes,
                                  sanitize_weights=sanitize_weights, decoder_layer=moe_layer))
