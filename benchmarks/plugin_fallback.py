"""Decode speed of a model on a plugin device with no kernels, next to the CPU.

Every op on a kernel-less plugin device runs through the CPU fallback: its inputs are copied
to the host, the CPU kernel runs, its outputs are copied back. The model's weights are frozen,
so each keeps one host copy and a decoding step copies only activations; this measures what
that costs. Devices:

  cpu        the CPU backend (the reference)
  minimal    tests/plugins/contract_devices.c: devices, memory, synchronous copies and memory
             stats only; no streams, no events, no kernels
  reference  the reference plugin (plugins/custom_cpu) with its kernels unregistered

Each run prefills a prompt, then decodes greedily with the KV cache; only the decode is
timed. The devices take turns token by token, so a busy machine slows each alike; the figure
is the median tokens/s over --repeats runs after one warm-up run.

    python benchmarks/plugin_fallback.py [--model PATH] [--tokens 32] [--repeats 5] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MINIMAL_SOURCE = ROOT / "tests" / "plugins" / "contract_devices.c"
DEVICES = ("cpu", "minimal", "reference")


def load_device(name: str, build_dir: str) -> str:
    """Make device ``name`` available; returns the device to load the model on."""
    import llaisys
    from llaisys.plugins.build import build_plugin, build_reference_plugin

    if name == "cpu":
        return "cpu"
    if name == "minimal":
        path = build_plugin(MINIMAL_SOURCE, Path(build_dir) / "libfallback_dev.so", ['DEVICE_TYPE="fallback_dev"'])
        return f"{llaisys.load_plugin(path).name}:0"
    if name == "reference":
        plugin = llaisys.load_plugin(build_reference_plugin())
        llaisys.kernels.unregister_kernels(plugin.name)  # every op takes the CPU fallback
        return f"{plugin.name}:0"
    raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)}")


def decode_run(models: dict[str, Any], prompt: list[int], tokens: int) -> dict[str, float]:
    """One greedy decode of ``tokens`` tokens after ``prompt`` on each model, with fresh KV
    caches; decode tokens/s of each. The models take turns token by token, so a burst of
    other work on the machine slows each alike."""
    import numpy as np

    caches = {name: model.new_cache(len(prompt) + tokens + 1) for name, model in models.items()}
    last = {name: int(np.argmax(model.forward(prompt, caches[name]))) for name, model in models.items()}
    spent = dict.fromkeys(models, 0.0)
    for _ in range(tokens):
        for name, model in models.items():
            start = time.perf_counter()
            last[name] = int(np.argmax(model.forward([last[name]], caches[name])))
            spent[name] += time.perf_counter() - start
    return {name: tokens / seconds for name, seconds in spent.items()}


def measure(devices: list[str], model_path: str | None, prompt_tokens: int, tokens: int, repeats: int) -> dict[str, float]:
    """Median decode tokens/s on each device over ``repeats`` runs, after a warm-up run."""
    from llaisys.models import load_model

    with tempfile.TemporaryDirectory() as build_dir:
        models = {name: load_model(model_path, device=load_device(name, build_dir)) for name in devices}
    vocab = next(iter(models.values())).config.vocab_size
    prompt = [(7 * i + 1) % vocab for i in range(prompt_tokens)]
    decode_run(models, prompt, tokens)  # warm-up; makes the weights' host copies
    runs = [decode_run(models, prompt, tokens) for _ in range(repeats)]
    return {name: statistics.median(run[name] for run in runs) for name in devices}


def main() -> None:
    parser = argparse.ArgumentParser(description="Decode tokens/s on kernel-less plugin devices next to the CPU.")
    parser.add_argument("--model", default=None, help="a .gguf file or model folder (default: the bundled SmolLM2)")
    parser.add_argument("--devices", default="cpu,minimal,reference", help=f"comma-separated, from {', '.join(DEVICES)}")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default 16)")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per run (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per device (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="BLAS threads (default: the library's own)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.threads:  # before NumPy's BLAS starts its thread pool
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if "cpu" not in devices:
        devices.insert(0, "cpu")
    rates = measure(devices, args.model, args.prompt_tokens, args.tokens, args.repeats)
    if args.json:
        print(json.dumps({"decode_tok_s": rates, "ratio_to_cpu": {d: r / rates["cpu"] for d, r in rates.items()}}))
        return
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    print(f"decode of {args.tokens} tokens after {args.prompt_tokens}, median of {args.repeats}{load}")
    print(f"{'device':10} {'tok/s':>8} {'vs cpu':>7}")
    for name, rate in rates.items():
        print(f"{name:10} {rate:8.2f} {rate / rates['cpu']:7.2f}")


if __name__ == "__main__":
    main()
