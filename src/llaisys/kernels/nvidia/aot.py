"""Compile every NVIDIA kernel for GPUs that need not be present, at the shapes and types the
models use: ``python -m llaisys.kernels.nvidia.aot [--arch 80 90]``.

The ops of a decoder (the bundled SmolLM2-135M's and a Qwen2.5-1.5B's head layout), and those a
vision encoder adds (layer_norm, gelu, non-causal attention), run on an nvidia device whose
backend allocates host memory and whose kernels are recorded, not run (``_common.recording``);
each distinct launch (kernel, argument types, constexprs, options) is then compiled with
``triton.compile`` for each target (``GPUTarget("cuda", 80 / 90, 32)``), through ptxas to a
cubin. This catches what Triton's interpreter forgives (types, layouts, register and
shared-memory limits). Needs Triton without ``TRITON_INTERPRET``: run it in a
process of its own. ``--cover`` compiles a covering subset instead (``covering``: every
argument type and constexpr value of each kernel at least once, and its largest tiles in each
float type), what CI runs; the default compiles every distinct launch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                   "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8"}


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder that decide the kernels' constexprs."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


SHAPES = (Shape("SmolLM2-135M", 576, 9, 3, 64, 1536), Shape("Qwen2.5-1.5B", 1536, 12, 2, 128, 8960))
QUANT_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _start_recording_backend() -> None:
    """An nvidia backend over host memory whose kernels are recorded only (no GPU, no interpreter)."""
    import triton

    if triton.knobs.runtime.interpret:
        raise SystemExit("aot: TRITON_INTERPRET is set; compile in a process without it")
    from ...backends.nvidia import NvidiaBackend
    from ...runtime.backends import available_backends, register_backend

    if "nvidia" not in available_backends():
        register_backend(NvidiaBackend(simulate=1, interpret=False))


def workload(shape: Shape, dtype: Any, device: str = "nvidia") -> None:
    """Run every kernel the decoder runs, at ``shape``, in ``dtype``, on ``device`` (prefill and
    decoding, one sequence and a paged batch, with and without key_ends, over a float and an
    8-bit pool; argmax on logits; routed experts; a vision encoder's layer_norm, gelu and
    non-causal attention), through the kernel registry with the arguments the ops would pass."""
    from ...runtime.dtypes import DataType
    from ...tensor import Tensor
    from ..registry import dispatch
    from ._common import tv

    d, h, kh, dh, inter = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    new = lambda *s, dt=dtype: Tensor.empty(s, dt, device)  # noqa: E731
    run = lambda name, outs, ins, attrs=None, wt=None: dispatch(name, dtype, outs, ins, attrs or {}, wt)  # noqa: E731
    w = new(d)
    for s in (1, 5):
        ids = new(s, dt=DataType.I64)
        x, hbuf = new(s, d), new(s, d)
        run("embedding", (x,), (ids, new(64, d)))
        for fmt in QUANT_FORMATS:
            table = Tensor.empty((64, d), DataType[fmt], device).freeze()
            run("embedding", (x,), (ids, table), wt=table.dtype)
        run("rms_norm", (hbuf,), (x, w), {"eps": 1e-6})
        run("add_rms_norm", (hbuf, x), (x, new(s, d), w), {"eps": 1e-6})
        qkv = new(s, (h + 2 * kh) * dh)
        run("linear", (qkv,), (hbuf, new((h + 2 * kh) * dh, d), new((h + 2 * kh) * dh)))
        qk = new(s, h + kh, dh)
        run("rope", (qk,), (qkv.slice(1, 0, (h + kh) * dh).view(s, h + kh, dh), new(s, dt=DataType.I64)),
            {"theta": 1e6})
        for rotated in (dh, dh // 2):  # scaled frequencies (llama3, yarn ...), whole heads and partial rotary
            run("rope_freqs", (qk,), (qkv.slice(1, 0, (h + kh) * dh).view(s, h + kh, dh), new(s, dt=DataType.I64),
                                      new(rotated // 2, dt=DataType.F32)), {"attention_factor": 1.1})
        cache = new(40, kh, dh)
        run("rearrange", (cache.slice(0, 10, 10 + s),), (qk.slice(1, h, h + kh),))
        seen = cache.slice(0, 0, 10 + s)
        run("self_attention", (new(s, h, dh),), (qk.slice(1, 0, h), seen, seen), {"scale": 0.125})
        gate_up = new(s, 2 * inter)
        run("swiglu", (new(s, inter),), (gate_up.slice(1, 0, inter), gate_up.slice(1, inter, 2 * inter)))
        run("geglu", (new(s, inter),), (gate_up.slice(1, 0, inter), gate_up.slice(1, inter, 2 * inter)))  # Gemma's MLP
        run("scale", (x,), (x,), {"factor": d ** 0.5})  # Gemma's embeddings, in place
        for bias in (w, None):  # a vision encoder's norms, MLP activations and attention
            run("layer_norm", (hbuf,), (x, w, bias), {"eps": 1e-6})
        for gelu in ("gelu_tanh", "gelu_erf"):
            run(gelu, (new(s, inter),), (gate_up.slice(1, 0, inter),))
        run("self_attention_full", (new(s, h, dh),), (qk.slice(1, 0, h), seen, seen), {"scale": 0.125})
        run("add", (x,), (x, hbuf))
    for n, b in ((2, 2), (7, 2)):  # a paged decoding step, and a step with a prompt chunk
        pool_k, pool_v = new(8, 16, kh, dh), new(8, 16, kh, dh)
        qk, v = new(n, h + kh, dh), new(n, kh, dh)
        run("kv_cache_write", (pool_k, pool_v), (qk.slice(1, h, h + kh), v, new(n, dt=DataType.I64)))
        index = (new(b, 4, dt=DataType.I64), new(b + 1, dt=DataType.I64), new(b, dt=DataType.I64))
        run("paged_attention", (new(n, h, dh),), (qk.slice(1, 0, h), pool_k, pool_v, *index), {"scale": 0.125})
        # Gemma 3's image tokens: each row's key end given (key_ends), with a sliding window
        run("paged_attention_window_ends", (new(n, h, dh),),
            (qk.slice(1, 0, h), pool_k, pool_v, *index, new(n, dt=DataType.I64)), {"scale": 0.125, "window": 16})
        # an 8-bit pool (kv_cache_dtype="int8"): int8 codes and a scale per slot and head
        q8 = (new(8, 16, kh, dh, dt=DataType.I8), new(8, 16, kh, dh, dt=DataType.I8))
        scales = (new(8, 16, kh, dt=DataType.F32), new(8, 16, kh, dt=DataType.F32))
        run("kv_cache_write_q8", (*q8, *scales), (qk.slice(1, h, h + kh), v, new(n, dt=DataType.I64)))
        run("paged_attention_q8", (new(n, h, dh),), (qk.slice(1, 0, h), *q8, *index, *scales), {"scale": 0.125})
        run("paged_attention_q8_window_ends", (new(n, h, dh),),
            (qk.slice(1, 0, h), *q8, *index, new(n, dt=DataType.I64), *scales), {"scale": 0.125, "window": 16})
    run("argmax", (new(2, dt=DataType.I64), new(2)), (new(2, 4096),))
    experts, inter = 16, 768  # routed experts (Qwen3-MoE's moe_intermediate_size), 8 per token
    gate, up, down = new(experts * inter, d), new(experts * inter, d), new(experts * d, inter)
    for n in (1, 64):  # a decoding step (blocks of 16 pairs) and a prefill (blocks of 32)
        run("moe_mlp", (new(n, d),), (new(n, d), new(n, experts), gate, up, down), {"top_k": 8, "norm_topk_prob": True})
    from .quant import DEVICE_FORMATS, quantized_linear

    for fmt in DEVICE_FORMATS:  # the quantized GEMM (LLAISYS_NVIDIA_QUANT_GEMM=1), decoding and prefill rows
        weight = Tensor.empty((inter, d), fmt, device)
        for m in (1, 64):
            quantized_linear(tv(new(m, inter)), tv(new(m, d)), weight, None, dtype)


def _signature(kernel: Any, args: tuple, consts: dict) -> dict[str, str]:
    import torch

    sig = {}
    names = [n for n in kernel.arg_names]
    for name, value in zip([n for n in names if n not in consts], args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, (int, np.integer)):
            sig[name] = "i32" if -2 ** 31 <= int(value) < 2 ** 31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"aot: argument {name} of {kernel.__name__} is a {type(value).__name__}")
    for name in consts:
        sig[name] = "constexpr"
    return {n: sig[n] for n in names}


def recorded_launches(dtypes: tuple = ("F32", "F16", "BF16")) -> list[tuple]:
    """The distinct launches of ``workload`` over ``SHAPES`` and ``dtypes``: (kernel, signature,
    constexprs, options)."""
    from ...runtime.dtypes import DataType
    from . import _common

    _start_recording_backend()
    from . import attention, elementwise, linear, misc, moe, norm_rope  # noqa: F401  (register the kernels)

    seen: dict[tuple, tuple] = {}
    with _common.recording() as rec:
        for shape in SHAPES:
            for name in dtypes:
                workload(shape, DataType[name])
    for kernel, _grid, args, consts, options in rec.launches:
        sig = _signature(kernel, args, consts)
        key = (kernel.__name__, tuple(sig.items()), tuple(sorted(consts.items())), tuple(sorted(options.items())))
        seen.setdefault(key, (kernel, sig, dict(consts), dict(options)))
    return list(seen.values())


def _features(launch: tuple) -> set:
    _kernel, sig, consts, options = launch
    return ({("type", n, t) for n, t in sig.items() if t != "constexpr"} | {("const", n, v) for n, v in consts.items()}
            | {("option", n, v) for n, v in options.items()})


def covering(launches: list[tuple]) -> list[tuple]:
    """A subset of ``launches`` in which, per kernel, every argument type and every constexpr
    and option value occurs at least once, holding each kernel's largest variant per float type
    (the largest sum of its integer constexprs: the biggest tiles, the most shared memory).
    Greedy set cover: each pick covers the most values not yet covered."""
    by_kernel: dict[str, list[tuple]] = {}
    for launch in launches:
        by_kernel.setdefault(launch[0].__name__, []).append(launch)
    chosen: list[tuple] = []
    for group in by_kernel.values():
        largest: dict[str, tuple] = {}
        for launch in group:
            kind = next((t for t in launch[1].values() if t in ("*fp32", "*fp16", "*bf16")), "")
            size = sum(int(v) for v in launch[2].values() if isinstance(v, (int, np.integer)))
            if kind not in largest or size > largest[kind][0]:
                largest[kind] = (size, launch)
        picked = [launch for _size, launch in largest.values()]
        missing = set().union(*map(_features, group)) - set().union(*map(_features, picked))
        while missing:
            best = max(group, key=lambda launch: len(_features(launch) & missing))
            picked.append(best)
            missing -= _features(best)
        chosen += picked
    return chosen


def compile_all(archs: tuple[int, ...] = (80, 90), dtypes: tuple = ("F32", "F16", "BF16"),
                cover: bool = False) -> list[dict]:
    """Compile every recorded launch (``cover``: the ``covering`` subset) for each compute
    capability in ``archs``; one result per (launch, arch): kernel, arch, constexprs, ok,
    error, cubin bytes, seconds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    launches = recorded_launches(dtypes)
    for kernel, sig, consts, options in covering(launches) if cover else launches:
        for arch in archs:
            start = time.perf_counter()
            entry = {"kernel": kernel.__name__, "arch": f"sm_{arch}", "constexprs": consts,
                     "signature": {k: v for k, v in sig.items() if v != "constexpr"}}
            try:
                compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts),
                                          target=GPUTarget("cuda", arch, 32), options=options)
                entry.update(ok=True, cubin_bytes=len(compiled.asm["cubin"]),
                             shared_bytes=compiled.metadata.shared)
            except Exception as exc:  # reported per kernel; the caller decides
                entry.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            entry["seconds"] = round(time.perf_counter() - start, 3)
            results.append(entry)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llaisys.kernels.nvidia.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (80 = A100)")
    parser.add_argument("--dtype", nargs="+", default=["F32", "F16", "BF16"], choices=["F32", "F16", "BF16"])
    parser.add_argument("--cover", action="store_true",
                        help="a covering subset: every type and constexpr value of each kernel once, its largest tiles")
    parser.add_argument("--json", action="store_true", help="print one JSON object per compiled kernel")
    args = parser.parse_args(argv)
    results = compile_all(tuple(args.arch), tuple(args.dtype), args.cover)
    failed = [r for r in results if not r["ok"]]
    for r in results:
        if args.json:
            print(json.dumps(r, default=str))
        elif not r["ok"]:
            print(f"FAILED {r['kernel']} {r['arch']} {r['constexprs']}: {r['error']}", file=sys.stderr)
    print(f"compiled {len(results) - len(failed)} of {len(results)} kernel variants for "
          f"{', '.join(f'sm_{a}' for a in args.arch)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
