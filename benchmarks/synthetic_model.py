"""Random-weight models of the size people download, written here rather than fetched.

``qwen2.5-1.5b-q4km``: Qwen2.5-1.5B's shapes (28 layers, hidden 1536, MLP 8960, 12 query heads
and 2 key/value heads of 128, q/k/v biases, rope base 1e6, tied embeddings) with SmolLM2's
49152-token vocabulary and tokenizer (the metadata of the bundled SmolLM2 GGUF), stored as
llama.cpp's Q4_K_M: an F16 GGUF written with the ``gguf`` package (weights N(0, 0.02), norms
1, so activations stay finite), then quantized by llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``). ``qwen2.5-1.5b-f16``: the same model left in F16 (as the
unquantized downloads are). A benchmark reads as many weight bytes per token as the real model
does; the text it writes is noise.

The file is cached under ``~/.cache/llaisys/bench-models/`` (``$XDG_CACHE_HOME`` if set), named
by its shape and type, written under a temporary name and renamed when whole, and reused when
present. Building one takes a few minutes and about 3 GB of disk for the F16 file on the way.

    python3 benchmarks/synthetic_model.py                    # builds if absent, prints the path
    python3 benchmarks/synthetic_model.py --list
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Shape:
    """A Qwen2-architecture decoder's sizes, with the GGUF's field meanings."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    context: int

    def tag(self) -> str:
        """The shape in a file name: ``L28-D1536-I8960-H12x128-KV2-V49152``."""
        return (f"L{self.layers}-D{self.hidden}-I{self.intermediate}-H{self.heads}x{self.head_dim}-"
                f"KV{self.kv_heads}-V{self.vocab}")


QWEN25_15B_SMOLLM_VOCAB = Shape(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, head_dim=128,
                                vocab=49152, rope_theta=1e6, context=32768)
# name -> (shape, llama.cpp file type: the name after LLAMA_FTYPE_MOSTLY_)
NAMED = {"qwen2.5-1.5b-q4km": (QWEN25_15B_SMOLLM_VOCAB, "Q4_K_M"),
         "qwen2.5-1.5b-f16": (QWEN25_15B_SMOLLM_VOCAB, "F16")}  # 16-bit weights, as unquantized downloads
WEIGHT_STD = 0.02


def cache_dir() -> Path:
    """The folder the models are kept in."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llaisys" / "bench-models"


def model_path(name: str) -> Path:
    """Where the named model is (or will be) cached."""
    shape, ftype = spec(name)
    return cache_dir() / f"qwen2-random-{shape.tag()}-{ftype}.gguf"


def spec(name: str) -> tuple[Shape, str]:
    """The shape and file type of the named model; ValueError listing the names for another."""
    if name not in NAMED:
        raise ValueError(f"unknown synthetic model {name!r}; expected one of {', '.join(NAMED)}")
    return NAMED[name]


def tokenizer_fields(source: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, item type) of every ``tokenizer.*`` field of the GGUF ``source``."""
    import gguf

    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape, kind) of every tensor; kind "matrix", "bias" or "norm"."""
    d, dq, dkv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (shape.vocab, d), "matrix"), ("output_norm.weight", (d,), "norm")]
    for i in range(shape.layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (d,), "norm"), (p + "ffn_norm.weight", (d,), "norm"),
                 (p + "attn_q.weight", (dq, d), "matrix"), (p + "attn_q.bias", (dq,), "bias"),
                 (p + "attn_k.weight", (dkv, d), "matrix"), (p + "attn_k.bias", (dkv,), "bias"),
                 (p + "attn_v.weight", (dkv, d), "matrix"), (p + "attn_v.bias", (dkv,), "bias"),
                 (p + "attn_output.weight", (d, dq), "matrix"),
                 (p + "ffn_gate.weight", (shape.intermediate, d), "matrix"),
                 (p + "ffn_up.weight", (shape.intermediate, d), "matrix"),
                 (p + "ffn_down.weight", (d, shape.intermediate), "matrix")]
    return plan


def write_f16(path: Path, shape: Shape, tokenizer_source: Path, seed: int = 0) -> None:
    """A random-weight Qwen2 GGUF at ``path``: matrices F16 N(0, WEIGHT_STD), biases F32
    N(0, WEIGHT_STD), norms F32 ones; tensors written one at a time (never all in memory)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(f"random Qwen2.5-1.5B shape ({shape.tag()})")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in tokenizer_fields(tokenizer_source):
        w.add_key_value(key, value, vtype, sub)
    plan = tensor_plan(shape)
    for name, dims, kind in plan:
        dtype = np.float16 if kind == "matrix" else np.float32
        w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in plan:
        if kind == "norm":
            w.write_tensor_data(np.ones(dims, np.float32))
            continue
        data = rng.standard_normal(dims, np.float32) * np.float32(WEIGHT_STD)
        w.write_tensor_data(data.astype(np.float16) if kind == "matrix" else data)
    w.close()


_log_callback = None  # kept alive while llama.cpp holds it


def _errors_only():
    """A llama.cpp log callback that passes its warnings and errors to stderr, drops the rest."""
    global _log_callback
    if _log_callback is None:
        import llama_cpp

        @llama_cpp.llama_log_callback
        def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode(errors="replace"))

        _log_callback = callback
    return _log_callback


def quantize(src: Path, dst: Path, ftype: str) -> None:
    """``dst`` = ``src`` quantized by llama.cpp to ``ftype`` (``Q4_K_M``: the name after
    LLAMA_FTYPE_MOSTLY_), on every CPU."""
    import llama_cpp

    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if code is None:
        raise ValueError(f"llama.cpp has no file type {ftype!r} (LLAMA_FTYPE_MOSTLY_{ftype})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.nthread = os.cpu_count() or 1
    llama_cpp.llama_log_set(_errors_only(), ctypes.c_void_p(0))  # not a line per tensor
    try:
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(llama_cpp.llama_log_callback(), ctypes.c_void_p(0))  # NULL: its default log again
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) failed with status {status}")


def build(name: str, tokenizer_source: Path | None = None) -> Path:
    """The path of the named model, written first if it is not cached."""
    shape, ftype = spec(name)
    final = model_path(name)
    if final.is_file():
        return final
    if tokenizer_source is None:
        from llaisys.models import default_model_path

        tokenizer_source = default_model_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    half = final.with_name(f"{final.name}.f16.tmp-{os.getpid()}")
    part = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    try:
        log.warning("writing %s (F16, random weights) ...", half)
        write_f16(half, shape, tokenizer_source)
        if ftype == "F16":
            half.rename(part)
        else:
            log.warning("quantizing to %s with llama.cpp ...", ftype)
            quantize(half, part, ftype)
        part.rename(final)  # whole or absent: a reader never sees a half-written file
    finally:
        half.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
    return final


def resolve(model: str | os.PathLike | None) -> Path | None:
    """A ``--model`` value as a file: a synthetic model's name (built on first use) or a path;
    None stays None."""
    if model is None:
        return None
    if str(model) in NAMED:
        return build(str(model))
    return Path(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", default=next(iter(NAMED)), choices=tuple(NAMED), help="the model to build")
    p.add_argument("--list", action="store_true", help="list the names and where each is cached")
    args = p.parse_args()
    logging.basicConfig(format="%(message)s")
    if args.list:
        for name in NAMED:
            path = model_path(name)
            print(f"{name}\t{path}\t{'cached' if path.is_file() else 'not built'}")
        return
    print(build(args.name))


if __name__ == "__main__":
    main()
