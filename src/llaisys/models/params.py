"""Weights as llaisys tensors on the model's device, fused where that saves ops per token:
q/k/v stacked into one projection, gate/up into another.

A matrix stored in a block format llaisys computes on (Q4_0 ... Q6_K; ``WeightSource.read_raw_rows``)
stays as stored, a tensor of that DataType; on the CPU, one the file holds unchanged (and a fused
matrix whose parts lie back to back there) is a frozen view of the file's memory map, not a copy,
and so is a float matrix kept in its stored type (an F16/BF16 matrix kept half, an F32 one in an
F32 model).
With ``keep_half`` and an F32 model, an F16/BF16 matrix (q/k/v, o, gate/up, down, an untied
lm_head, and on the CPU the embedding table) stays F16/BF16: ``linear`` and ``embedding`` take
such a weight with F32 activations and widen it inside the kernel. The rest is converted to the model's dtype. A fused
matrix stays as stored when its parts share a type; else its runs of parts of one type do, or
(CPU, integer arithmetic, parts apart in the file) each part as its own view of the file."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..runtime.device import Device
from ..runtime.dtypes import DataType
from ..tensor import Tensor
from ..tensor.storage import drop_file_pages
from .config import ModelConfig
from .errors import ModelLoadError
from .rope import inverse_frequencies, rope_frequencies
from .tensor_parallel import Shard
from .weights import WeightSource


@dataclass(slots=True)
class LayerParams:
    """One decoder layer's weights. Dq = H*Dh, Dkv = KH*Dh."""

    attn_norm: Tensor  # (D,)
    qkv: Tensor | None  # (Dq + 2*Dkv, D): rows of q, then k, then v; None: held in parts
    qkv_bias: Tensor | None  # (Dq + 2*Dkv,)
    o: Tensor  # (D, Dq)
    o_bias: Tensor | None  # (D,)
    ffn_norm: Tensor  # (D,)
    gate_up: Tensor | None  # (2*I, D): rows of gate, then up; None: held in parts
    down: Tensor | None  # (D, I); None in a sparse layer
    # (R/2,) F32 inverse rotary frequencies, shared by the layers of one kind; None: the plain rope
    rope_freqs: Tensor | None = None
    rope_factor: float = 1.0  # multiplies rope's cos and sin (YaRN's attention factor)
    rope_theta: float = 10000.0  # the plain rope's base (when rope_freqs is None)
    window: int = 0  # keys each query attends to, its own included; 0: every key before it
    # multimodal rope: per position stream (time, height, width), the head dims it rotates
    # (offset, width: a rotate-half block, q/k rows stored so) and their inverse frequencies (width/2,) F32
    rope_sections: tuple[tuple[int, int, Tensor], ...] = ()
    q_norm: Tensor | None = None  # (Dh,) RMSNorm weight of each query head (Qwen3, Gemma 3)
    k_norm: Tensor | None = None  # (Dh,) of each key head
    post_attn_norm: Tensor | None = None  # (D,) norm of the attention block's output (Gemma 3)
    post_ffn_norm: Tensor | None = None  # (D,) norm of the MLP block's output (Gemma 3)
    # qkv and gate_up as consecutive row ranges (q and k, then v ...) where their parts are
    # stored in different block formats: each kept as stored rather than all converted to floats
    qkv_parts: tuple[Tensor, ...] = ()
    gate_up_parts: tuple[Tensor, ...] = ()
    # A sparse layer's routed experts (it holds a router; Qwen3-MoE), in place of gate_up and down:
    router: Tensor | None = None  # (E, D) the router's logits projection
    gate_exps: Tensor | None = None  # (E*I, D): expert e's gate rows e*I:(e+1)*I
    up_exps: Tensor | None = None  # (E*I, D)
    down_exps: Tensor | None = None  # (E*D, I): expert e's rows e*D:(e+1)*D


@dataclass(slots=True)
class DecoderParams:
    """All weights of a decoder."""

    embed: Tensor  # (V, D)
    norm: Tensor  # (D,)
    lm_head: Tensor  # (V, D); the very tensor ``embed`` when the embeddings are tied
    layers: list[LayerParams]


class Progress:
    """A progress line on stderr (``loading NAME: 12/272 tensors``), redrawn at most 10 times a second."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.done, self._last, self._start = 0, 0.0, time.perf_counter()

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            sys.stderr.write(f"\rloading {self.label}: {self.done}/{self.total} tensors")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\rloading {self.label}: {self.total}/{self.total} tensors in "
                             f"{time.perf_counter() - self._start:.1f} s\n")
            sys.stderr.flush()


BLOCK_BYTES = 1 << 20  # float32 bytes decoded at a time: temporaries stay small and in cache
RAW_BLOCK_BYTES = 16 << 20  # stored bytes copied at a time for a matrix kept quantized


HALF_KINDS = ("F16", "BF16")


def kept_dtype(src: WeightSource) -> DataType | None:
    """The block-format DataType a weight stays in, or None when it is converted."""
    return DataType[src.kind] if src.read_raw_rows is not None else None


class _Builder:
    def __init__(self, weights: Mapping[str, WeightSource], dtype: DataType, device: Device, progress: Progress,
                 keep_half: bool = False):
        self.weights, self.dtype, self.device, self.progress = weights, dtype, device, progress
        self.keep_half = keep_half and dtype is DataType.F32

    def _float_dtype(self, names: Sequence[str]) -> DataType:
        """The float type of a converted matrix made of weights ``names``: their shared F16/BF16
        type when half matrices are kept, else the model's dtype."""
        kinds = {self.weights[n].kind for n in names}
        if self.keep_half and len(kinds) == 1 and kinds <= set(HALF_KINDS) and all(
                len(self.weights[n].shape) in (2, 3) for n in names):
            return DataType[kinds.pop()]
        return self.dtype

    def _fill(self, dst: Tensor, name: str) -> None:
        """Read weight ``name`` into ``dst`` (its shape), a block of rows at a time when the
        source can, converting to ``dst``'s dtype on the way."""
        src = self.weights[name]
        if src.read_rows is None:
            arr = src.read()
            if arr.shape != src.shape:
                raise ModelLoadError(f"{src.file}: tensor {src.file_name!r} holds shape {arr.shape}; expected {src.shape}")
            dst.load(arr)
        else:
            rows = src.shape[0]
            row_bytes = 4 * max(1, int(np.prod(src.shape[1:])))
            step = max(src.row_multiple, BLOCK_BYTES // row_bytes // src.row_multiple * src.row_multiple)
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                part = src.read_rows(start, stop)
                if part.shape != (stop - start, *src.shape[1:]):
                    raise ModelLoadError(f"{src.file}: tensor {src.file_name!r} rows {start}:{stop} hold shape "
                                         f"{part.shape}; expected {(stop - start, *src.shape[1:])}")
                (dst if start == 0 and stop == rows else dst.slice(0, start, stop)).load(part)
        if src.mapped is not None:  # copied: the file's pages of it need not stay in this process
            data, offset = src.mapped
            drop_file_pages(data[offset:offset + DataType[src.kind].nbytes_of(math.prod(src.shape))])
        self.progress.step()

    def _fill_raw(self, dst: Tensor, name: str) -> None:
        """Copy weight ``name``'s raw blocks into ``dst`` (its shape, its block format)."""
        src = self.weights[name]
        rows, row_bytes = dst.raw_shape
        step = max(src.row_multiple, RAW_BLOCK_BYTES // row_bytes // src.row_multiple * src.row_multiple)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            (dst if start == 0 and stop == rows else dst.slice(0, start, stop)).load(src.read_raw_rows(start, stop))
        if src.mapped is not None:  # copied: the file's pages of it need not stay in this process
            data, offset = src.mapped
            drop_file_pages(data[offset:offset + rows * row_bytes])
        self.progress.step()

    def _mapped(self, names: Sequence[str], dtype: DataType | None) -> Tensor | None:
        """Weights ``names`` stacked, as a frozen tensor over their file's memory map, when the
        model is on the CPU and they lie there as stored (``dtype``), back to back; else None."""
        if dtype is None or not self.device.is_cpu:
            return None
        sources = [self.weights[n] for n in names]
        if any(s.mapped is None for s in sources) or not self._back_to_back(names, dtype):
            return None
        data, start = sources[0].mapped
        end = start + sum(dtype.nbytes_of(math.prod(s.shape)) for s in sources)
        rows = sum(math.prod(s.shape[:-1]) for s in sources)  # a stack of matrices (E, N, K) as E*N rows
        out = Tensor.host_view(data[start:end], (rows, sources[0].shape[-1]), dtype)
        self.progress.step(len(names))
        return out

    def one(self, name: str, half: bool = True) -> Tensor:
        """Weight ``name`` as a tensor; ``half=False``: never kept F16/BF16. A matrix whose
        stored type is the one it is kept in is a view of the file's memory map (CPU)."""
        src = self.weights[name]
        kept = kept_dtype(src)
        float_dtype = self._float_dtype([name]) if half else self.dtype
        as_stored = kept or (float_dtype if len(src.shape) == 2 and src.kind == float_dtype.name else None)
        mapped = self._mapped([name], as_stored)
        if mapped is not None:
            return mapped
        out = Tensor.empty(src.shape, float_dtype if kept is None else kept, self.device)
        (self._fill if kept is None else self._fill_raw)(out, name)
        return out.freeze()

    def experts(self, name: str) -> Tensor:
        """Weight ``name``, a stack of matrices (E, N, K), as one matrix (E*N, K)."""
        src = self.weights[name]
        e, n, k = src.shape
        kept = kept_dtype(src)
        mapped = self._mapped([name], kept)
        if mapped is not None:
            return mapped
        if kept is not None:  # read_raw_rows takes the E*N rows
            out = Tensor.empty((e * n, k), kept, self.device)
            self._fill_raw(out, name)
            return out.freeze()
        out = Tensor.empty((e, n, k), self._float_dtype([name]), self.device)
        self._fill(out, name)
        return out.freeze().view(e * n, k)

    def fused(self, names: Sequence[str]) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        """The named tensors stacked along dim 0 as (one tensor, ()) when they share a stored
        block format (or are all converted to floats); else (None, parts): runs of consecutive
        names of one format stacked, each kept as stored; and a run that ``_held_apart`` keeps
        as its names' own tensors."""
        kinds = [kept_dtype(self.weights[n]) for n in names]
        if all(k is None for k in kinds):
            return self.stacked(names), ()
        runs: list[list[str]] = []
        for name, kind in zip(names, kinds):
            if runs and kept_dtype(self.weights[runs[-1][-1]]) == kind:
                runs[-1].append(name)
            else:
                runs.append([name])
        if len(runs) == 1 and not self._held_apart(names, kinds[0]):
            return self.stacked(names), ()
        parts: list[Tensor] = []
        for run in runs:
            if self._held_apart(run, kept_dtype(self.weights[run[0]])):
                parts.extend(self.one(name) for name in run)
            else:
                parts.append(self.stacked(run))
        return None, tuple(parts)

    def _held_apart(self, names: Sequence[str], dtype: DataType | None) -> bool:
        """Whether weights ``names`` of block format ``dtype`` are better not stacked: on the CPU,
        where the integer arithmetic repacks them at first use, each stays a view of the file's
        memory map whose pages the repacking lets go, where stacking would copy them (they do not
        lie back to back in the file) and keep that copy beside the packed one."""
        if len(names) < 2 or dtype is None or not self.device.is_cpu:
            return False
        if any(self.weights[n].mapped is None for n in names) or self._back_to_back(names, dtype):
            return False
        from ..kernels.cpu.quantized import repacks

        return repacks(dtype)

    def _back_to_back(self, names: Sequence[str], dtype: DataType) -> bool:
        """Whether weights ``names``, stored as ``dtype``, lie back to back in one memory map."""
        sources = [self.weights[n] for n in names]
        data, end = sources[0].mapped
        for s in sources:
            if s.mapped is None or s.mapped[0] is not data or s.mapped[1] != end:
                return False
            end += dtype.nbytes_of(math.prod(s.shape))
        return True

    def maybe(self, name: str) -> Tensor | None:
        return self.one(name) if name in self.weights else None

    def stacked(self, names: Sequence[str]) -> Tensor:
        """The named tensors stacked along dim 0, each read straight into its rows."""
        shapes = [self.weights[n].shape for n in names]
        rows = sum(s[0] for s in shapes)
        kept = {kept_dtype(self.weights[n]) for n in names}
        dtype = kept.pop() if len(kept) == 1 and None not in kept else None
        float_dtype = self._float_dtype(names)
        as_stored = dtype or (float_dtype if all(len(s) == 2 and self.weights[n].kind == float_dtype.name
                                                 for n, s in zip(names, shapes)) else None)
        mapped = self._mapped(names, as_stored)
        if mapped is not None:
            return mapped
        out = Tensor.empty((rows, *shapes[0][1:]), float_dtype if dtype is None else dtype, self.device)
        start = 0
        for name, shape in zip(names, shapes):
            (self._fill if dtype is None else self._fill_raw)(out.slice(0, start, start + shape[0]), name)
            start += shape[0]
        return out.freeze()


def _rope_sections(config: ModelConfig, device: Device) -> tuple[tuple[int, int, Tensor], ...]:
    """The (offset, width, inverse frequencies) of each multimodal rope section (``LayerParams``),
    () for a model with one position per token."""
    sections = config.arch_args.rope_sections()
    if not sections:
        return ()
    inv_freq, _ = inverse_frequencies(config)  # (Dh/2,)
    out, pair = [], 0
    for n in sections:
        freqs = Tensor.from_numpy(np.ascontiguousarray(inv_freq[pair:pair + n]), device).freeze()  # (n,)
        out.append((2 * pair, 2 * n, freqs))
        pair += n
    return tuple(out)


def build_params(weights: Mapping[str, WeightSource], config: ModelConfig, dtype: DataType,
                 device: Device, progress: Progress, keep_half: bool = False,
                 shard: "Shard | None" = None) -> DecoderParams:
    """Read every weight into a tensor of ``dtype`` on ``device``, fusing q/k/v and gate/up;
    ``keep_half``: F16/BF16 matrices of an F32 model stay as stored (the embedding table too, on
    the CPU).
    ``shard``: read only a tensor-parallel rank's part of each (``Shard.shard_weights``); a
    tied head is then the embedding table's first c rows (its last row is the zero row)."""
    if shard is not None:
        weights = shard.shard_weights(weights)
    b = _Builder(weights, dtype, device, progress, keep_half)
    inv_freq, rope_factor = rope_frequencies(config)  # every rank computes the same ones
    rope_freqs = None if inv_freq is None else Tensor.from_numpy(inv_freq, device).freeze()  # (R/2,) F32
    rope_sections = _rope_sections(config, device)
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        # a layer with a rope base of its own (Gemma 3's sliding ones) rotates with it, unscaled
        local_theta = config.arch_args.layer_rope_theta(i)
        local = local_theta is not None
        qkv, qkv_parts = b.fused([p + "q", p + "k", p + "v"])
        sparse = p + "router" in b.weights  # checked against the architecture's layer_shapes
        gate_up, gate_up_parts = (None, ()) if sparse else b.fused([p + "gate", p + "up"])
        layers.append(LayerParams(
            attn_norm=b.one(p + "attn_norm"),
            qkv=qkv,
            qkv_parts=qkv_parts,
            qkv_bias=b.stacked([p + "q_bias", p + "k_bias", p + "v_bias"]) if config.attention_bias else None,
            o=b.one(p + "o"),
            o_bias=b.maybe(p + "o_bias"),
            ffn_norm=b.one(p + "ffn_norm"),
            gate_up=gate_up,
            gate_up_parts=gate_up_parts,
            down=None if sparse else b.one(p + "down"),
            rope_freqs=None if local else rope_freqs,
            rope_factor=1.0 if local else rope_factor,
            rope_theta=local_theta if local else config.rope_theta,
            window=config.layer_window(i),
            rope_sections=rope_sections,
            q_norm=b.maybe(p + "q_norm"),
            k_norm=b.maybe(p + "k_norm"),
            post_attn_norm=b.maybe(p + "post_attn_norm"),
            post_ffn_norm=b.maybe(p + "post_ffn_norm"),
            router=b.one(p + "router") if sparse else None,
            gate_exps=b.experts(p + "gate_exps") if sparse else None,
            up_exps=b.experts(p + "up_exps") if sparse else None,
            down_exps=b.experts(p + "down_exps") if sparse else None,
        ))
        lp = layers[-1]
        _prepare_for_linear(device, (lp.qkv, *lp.qkv_parts, lp.o, lp.gate_up, *lp.gate_up_parts, lp.down))
    # the CPU's embedding widens F16/BF16 rows as it looks them up; other devices look rows up
    # in the activations' type only
    embed = b.one("embed", half=device.is_cpu)
    if config.tie_word_embeddings:
        lm_head = embed if shard is None else embed.slice(0, 0, shard.vocab_rows)
    else:
        lm_head = b.one("lm_head")
    _prepare_for_linear(device, (lm_head,))
    return DecoderParams(embed=embed, norm=b.one("norm"), lm_head=lm_head, layers=layers)


def _prepare_for_linear(device: Device, weights: Sequence[Tensor | None]) -> None:
    """On the CPU, ready block-format matrices for ``linear`` as they are loaded (checked, and
    repacked in an integer arithmetic, their file pages let go), rather than on a request."""
    if device.is_cpu:
        from ..kernels.cpu.quantized import prepare_weight

        for w in weights:
            if w is not None:
                prepare_weight(w)
