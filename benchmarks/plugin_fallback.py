"""Decode speed of a model on plugin devices, next to the CPU.

A decoding step is a recorded plan replayed in a few native calls: a plugin's own kernels run
from C inside the stretches, and so does the CPU fallback of an op the plugin lacks (its
inputs copied to the host through the plugin's copy functions, the CPU kernel, its outputs
copied back) where the CPU kernel has a native form. The model's weights are frozen, so each
keeps one host copy and a decoding step copies only activations. Devices:

  cpu           the CPU backend (the reference)
  minimal       tests/plugins/contract_devices.c: devices, memory, synchronous copies and memory
                stats only; no streams, no events, no kernels
  reference     the reference plugin (plugins/custom_cpu) with its own kernels (float32: the
                quantized linear and embedding still take the CPU fallback), its paged kernels
                included, so a single sequence decodes through the paged pass (``BatchPass``)
  reference-rows
                the reference plugin with only its paged kernels unregistered: a single sequence
                decodes with the contiguous ops (``RowsPass``), its cache rows moved from C
  reference-nk  the reference plugin with its kernels unregistered

A run takes at most one of `reference`, `reference-rows` and `reference-nk`: one process loads
the plugin once, and the last two unregister some of its kernels for the whole process.

Each run prefills a prompt, then decodes greedily with the KV cache; only the decode is
timed. Each run's cache is new, so its first decoded token records the decoding step, which
costs a plugin device more than the CPU (its native calls, descriptors and host buffers are
built then). The devices take turns token by token, so a busy machine slows each alike; the
figure is the median tokens/s over --repeats runs after one warm-up run.

    python benchmarks/plugin_fallback.py [--model PATH] [--tokens 32] [--repeats 5] [--threads N]
        [--devices cpu,minimal,reference] [--python-dispatch]

The table gives each device's decode tokens/s and its ratio to the CPU's in the same run, and,
from ``ops.Plan.profile`` of the recorded decoding step, the step's time and its dispatch
part (outside the kernels: Python, crossings into C, the fallback's copies, calls made from
Python); the step of a paged pass (cpu, reference) includes the output head, while with
``RowsPass`` (the devices without paged kernels) the head is a plan of its own replayed after
the step, which counts in tok/s only. The last column, overhead, is the one figure of what the device pays beyond
its kernels: a whole token's time (the step, the head, the argmax and everything around them)
less the time inside every kernel of the step and the head, both taken in the timed runs (the
stretches time their kernels in C as they replay).
On a shared machine compare ratios within one run, not figures across runs.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MINIMAL_SOURCE = ROOT / "tests" / "plugins" / "contract_devices.c"
DEVICES = ("cpu", "minimal", "reference", "reference-rows", "reference-nk")
REFERENCE_DEVICES = ("reference", "reference-rows", "reference-nk")  # the reference plugin, as loaded
PAGED_OPS = ("kv_cache_write", "paged_attention", "paged_attention_window")


def load_device(name: str, build_dir: str) -> str:
    """Make device ``name`` available; returns the device to load the model on."""
    import llaisys
    from llaisys.plugins.build import build_plugin, build_reference_plugin

    if name == "cpu":
        return "cpu"
    if name == "minimal":
        path = build_plugin(MINIMAL_SOURCE, Path(build_dir) / "libfallback_dev.so", ['DEVICE_TYPE="fallback_dev"'])
        return f"{llaisys.load_plugin(path).name}:0"
    if name in REFERENCE_DEVICES:
        plugin = llaisys.load_plugin(build_reference_plugin())
        if name == "reference-rows":
            llaisys.kernels.unregister_kernels(plugin.name, ops=PAGED_OPS)  # single sequences take RowsPass
        if name == "reference-nk":
            llaisys.kernels.unregister_kernels(plugin.name)  # every op takes the CPU fallback
        return f"{plugin.name}:0"
    raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)}")


def kernel_clock(model: Any, cache: Any):
    """A function giving the seconds spent inside kernels (timed in C) by the decoding step and
    its head since its last call, for the recorded decoding step over ``cache`` (after one
    decoding step ran): it turns on the timing of that step's native stretches."""
    from llaisys.kernels.cpu import native_calls

    step = model.runner.decoding_pass(cache)
    plans = [step.plan] + ([step.head] if getattr(step, "head", None) is not None else [])
    stretches = []
    for plan in plans:
        program = plan._program if plan._program is not None else plan._compile()
        plan._program = program
        stretches += [st for st in program if isinstance(st, native_calls.Stretch)]
    for st in stretches:
        st.profile = (ctypes.c_int64 * len(st))()

    def read() -> float:
        ns = 0
        for st in stretches:
            ns += sum(t for call, t in zip(st.calls, st.profile) if call.kernel)
            ctypes.memset(st.profile, 0, ctypes.sizeof(st.profile))
        return ns / 1e9
    return read


def decode_run(models: dict[str, Any], prompt: list[int], tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """One greedy decode of ``tokens`` tokens after ``prompt`` on each model, with fresh KV
    caches: decode tokens/s of each, and its overhead per token in ms (the token's time less
    the time inside the kernels of its decoding step and head, both timed in the same run).
    The models take turns token by token, so a burst of other work on the machine slows each
    alike."""
    import numpy as np

    caches = {name: model.new_cache(len(prompt) + tokens + 2) for name, model in models.items()}
    last = {name: int(np.argmax(model.forward(prompt, caches[name]))) for name, model in models.items()}
    for name, model in models.items():  # records the decoding step (not timed)
        last[name] = int(np.argmax(model.forward([last[name]], caches[name])))
    clocks = {name: kernel_clock(model, caches[name]) for name, model in models.items()}
    spent, inside = dict.fromkeys(models, 0.0), dict.fromkeys(models, 0.0)
    for _ in range(tokens):
        for name, model in models.items():
            clocks[name]()
            start = time.perf_counter()
            last[name] = int(np.argmax(model.forward([last[name]], caches[name])))
            spent[name] += time.perf_counter() - start
            inside[name] += clocks[name]()
    rates = {name: tokens / seconds for name, seconds in spent.items()}
    overhead = {name: (spent[name] - inside[name]) / tokens * 1e3 for name in models}
    return rates, overhead


def dispatch_ms(models: dict[str, Any], prompt: list[int], runs: int = 20) -> dict[str, tuple[float, float, str]]:
    """Per device: (decode step ms, of which kernels ms, how the step replays), from
    ``ops.Plan.profile`` of the recorded decoding step: the rest of the step is dispatch
    (Python, crossings into C, the fallback's copies, calls made from Python)."""
    out = {}
    for name, model in models.items():
        cache = model.new_cache(len(prompt) + 4)
        model.forward(prompt, cache)
        model.forward([1], cache)
        plan = model.runner.decoding_pass(cache).plan
        profile, stats = plan.profile(runs), plan.stats()
        how = f"{stats.native}/{stats.calls} calls in {stats.stretches} native stretches, {stats.python} from Python"
        out[name] = (profile.total * 1e3, profile.kernels * 1e3, how)
    return out


def measure(devices: list[str], model_path: str | None, prompt_tokens: int, tokens: int, repeats: int) -> tuple:
    """Median decode tokens/s and median overhead ms per token on each device over ``repeats``
    runs, after a warm-up run; and ``dispatch_ms`` of each."""
    from llaisys.models import load_model

    same_plugin = [d for d in devices if d in REFERENCE_DEVICES]
    if len(same_plugin) > 1:
        raise ValueError(f"{' and '.join(same_plugin)} load the same plugin; measure them in separate runs")
    with tempfile.TemporaryDirectory() as build_dir:
        models = {name: load_model(model_path, device=load_device(name, build_dir)) for name in devices}
    vocab = next(iter(models.values())).config.vocab_size
    prompt = [(7 * i + 1) % vocab for i in range(prompt_tokens)]
    decode_run(models, prompt, tokens)  # warm-up; makes the weights' host copies
    runs = [decode_run(models, prompt, tokens) for _ in range(repeats)]
    rates = {name: statistics.median(run[0][name] for run in runs) for name in devices}
    overheads = {name: statistics.median(run[1][name] for run in runs) for name in devices}
    return rates, overheads, dispatch_ms(models, prompt)


def python_dispatch() -> None:
    """Make recorded calls on devices other than the CPU run from Python, one by one."""
    from llaisys.kernels.cpu import native_calls

    native_call_of = native_calls.native_call_of

    def cpu_only(kernel, outputs, inputs, attrs):
        return native_call_of(kernel, outputs, inputs, attrs) if outputs[0].device.is_cpu else None

    native_calls.native_call_of = cpu_only


def main() -> None:
    parser = argparse.ArgumentParser(description="Decode tokens/s on plugin devices next to the CPU.")
    parser.add_argument("--model", default=None, help="a .gguf file or model folder (default: the bundled SmolLM2)")
    parser.add_argument("--devices", default="cpu,minimal,reference", help=f"comma-separated, from {', '.join(DEVICES)}")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default 16)")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per run (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per device (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="BLAS threads (default: the library's own)")
    parser.add_argument("--python-dispatch", action="store_true",
                        help="replay every call on a plugin device from Python (plugin kernels through ctypes, the "
                             "fallback's copies in Python), as before plugin calls ran in native stretches")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.threads:  # before NumPy's BLAS starts its thread pool
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if "cpu" not in devices:
        devices.insert(0, "cpu")
    if args.python_dispatch:
        python_dispatch()
    rates, overheads, steps = measure(devices, args.model, args.prompt_tokens, args.tokens, args.repeats)
    if args.json:
        print(json.dumps({"decode_tok_s": rates, "ratio_to_cpu": {d: r / rates["cpu"] for d, r in rates.items()},
                          "step_ms": {d: v[0] for d, v in steps.items()},
                          "step_kernels_ms": {d: v[1] for d, v in steps.items()},
                          "overhead_ms_per_token": overheads}))
        return
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    print(f"decode of {args.tokens} tokens after {args.prompt_tokens}, median of {args.repeats}{load}")
    print("step: the recorded decoding step's time per token; kernels: its part inside kernels (timed in C);\n"
          "dispatch: the rest (Python, crossings into C, the fallback's copies, calls made from Python);\n"
          "overhead: a whole token's time less the time inside the kernels of its step and head (same run)")
    print(f"{'device':14} {'tok/s':>8} {'vs cpu':>7} {'step ms':>8} {'kernels':>8} {'dispatch':>9} {'overhead':>9}  replay")
    for name, rate in rates.items():
        step, kernels, how = steps[name]
        overhead = overheads[name]
        print(f"{name:14} {rate:8.2f} {rate / rates['cpu']:7.2f} {step:8.2f} {kernels:8.2f} {step - kernels:9.3f} "
              f"{overhead:9.3f}  {how}")


if __name__ == "__main__":
    main()
