"""The plugin conformance check behind ``llaisys plugin check PATH``.

It loads the plugin and exercises its device API with data verified on the host: devices,
allocation at odd sizes, copies in every direction (sync and async), memset, stream order,
events across streams, host callbacks, memory stats and allocator sizes. Then it runs one
decoder layer's chain of ops (embedding, rms_norm, q/k/v projections, rope, attention,
output projection, residual add, SwiGLU MLP, head, argmax) on the plugin's device and on the
CPU and compares them; ops without a plugin kernel run through the CPU fallback.

Each row is ``pass``, ``fallback`` (passed, through a fallback for a missing optional API),
``fail`` or ``skip``. The check fails when any row fails.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..kernels.registry import find_kernel
from ..runtime.dtypes import DataType, MemcpyKind
from ..plugins import PluginError

log = logging.getLogger(__name__)

PASS, FALLBACK, FAIL, SKIP = "pass", "fallback", "fail", "skip"
OPS = ("embedding", "rms_norm", "linear", "rope", "self_attention", "add", "swiglu", "argmax", "rearrange")


@dataclass
class CheckRow:
    """One line of the report."""

    name: str
    status: str
    detail: str = ""


ROW_WIDTH = 24  # the check-name column


def format_row(row: CheckRow) -> str:
    """One table line; the detail on one line."""
    return f"  {row.name:<{ROW_WIDTH}}  {row.status:<8}  {' '.join(row.detail.split())}"


@dataclass
class CheckReport:
    """What ``run_check`` found for the library at ``path``. ``on_row`` sees each row as it
    is added (the command prints them as they come)."""

    path: str
    rows: list[CheckRow] = field(default_factory=list)
    on_row: Callable[[CheckRow], None] | None = field(default=None, repr=False)

    def add(self, name: str, status: str, detail: str = "") -> None:
        """Append a row."""
        row = CheckRow(name, status, detail)
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return all(r.status != FAIL for r in self.rows)

    def header(self) -> str:
        """The lines above the rows."""
        return f"plugin check: {self.path}\n  {'check':<{ROW_WIDTH}}  {'result':<8}  detail"

    def summary(self) -> str:
        """The line below the rows: OK or FAILED, and the count of each result."""
        counts = {s: sum(r.status == s for r in self.rows) for s in (PASS, FALLBACK, FAIL, SKIP)}
        return f"{'OK' if self.ok else 'FAILED'}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)

    def table(self) -> str:
        """Header, rows and summary as text."""
        return "\n".join([self.header(), *map(format_row, self.rows), self.summary()])


class _Host:
    """Host buffers kept alive for the duration of the check (async copies read them later)."""

    def __init__(self) -> None:
        self.keep: list[np.ndarray] = []

    def random(self, n: int, seed: int) -> np.ndarray:
        a = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        self.keep.append(a)
        return a

    def zeros(self, n: int) -> np.ndarray:
        a = np.zeros(n, np.uint8)
        self.keep.append(a)
        return a


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class _Checker:
    def __init__(self, plugin: Any, index: int, report: CheckReport):
        self.plugin = plugin
        self.b = plugin.backend
        self.i = index
        self.report = report
        self.host = _Host()
        self.fallbacks = set(self.b.fallbacks())
        self._allocs: list[tuple[int, int]] = []

    # ---- plumbing --------------------------------------------------------------------------
    def run(self, name: str, fn: Callable[[], str], uses: Sequence[str] = ()) -> None:
        """Run one check; it returns a detail string or raises. ``uses``: optional APIs whose
        absence turns a pass into a fallback."""
        missing = [a for a in uses if a in self.fallbacks]
        try:
            detail = fn()
            status = FALLBACK if missing else PASS
            if missing:
                detail = (detail + "; " if detail else "") + "fallback for " + ", ".join(missing)
        except Exception as exc:  # any failure is a row, never a crash
            log.debug("check %s failed", name, exc_info=True)
            status, detail = FAIL, f"{type(exc).__name__}: {exc}"
        finally:
            self._free_all()
        self.report.add(name, status, detail)

    def alloc(self, n: int) -> int:
        ptr = self.b.allocate(self.i, n)
        self._allocs.append((ptr, n))
        return ptr

    def _free_all(self) -> None:
        while self._allocs:
            ptr, n = self._allocs.pop()
            try:
                self.b.deallocate(self.i, ptr, n)
            except PluginError as exc:
                self.report.add("free", FAIL, str(exc))

    def h2d(self, dst: int, a: np.ndarray) -> None:
        self.b.copy_h2d(self.i, dst, _ptr(a), a.nbytes)

    def d2h(self, a: np.ndarray, src: int) -> None:
        self.b.copy_d2h(self.i, _ptr(a), src, a.nbytes)

    def stream(self) -> Any:
        return self.b.create_stream(self.i)

    def close_stream(self, s: Any) -> None:
        self.b.destroy_stream(self.i, s)

    # ---- device API checks ---------------------------------------------------------------------
    def devices(self) -> str:
        n = self.b.device_count()
        if n < 1:
            raise AssertionError("get_device_count reports no devices")
        if self.i >= n:
            raise AssertionError(f"device {self.i} asked for, but the plugin has {n}")
        ids = []
        for k in range(n):
            self.b.set_device(k)
            ids.append(self.b.current_device_id())
        expected = [self.b.device_handle(k).contents.id for k in range(n)]
        if ids != expected:
            raise AssertionError(f"get_device after set_device gave ids {ids}, expected {expected}")
        self.b.set_device(self.i)
        return f"{n} device(s), ids {expected}; set_device/get_device agree"

    def odd_allocations(self) -> str:
        sizes = (1, 3, 17, 4097, (1 << 20) + 13)
        ptrs = [self.alloc(n) for n in sizes]
        if len(set(ptrs)) != len(ptrs):
            raise AssertionError("device_memory_allocate returned the same pointer twice")
        for n, p in zip(sizes, ptrs):
            src, back = self.host.random(n, n), self.host.zeros(n)
            self.h2d(p, src)
            self.d2h(back, p)
            if not np.array_equal(src, back):
                raise AssertionError(f"{n} bytes did not survive H2D then D2H")
        return "sizes " + ", ".join(map(str, sizes)) + " allocated, written, read back, freed"

    def sync_copies(self) -> str:
        n = 3 * 4096 + 5
        a, back = self.host.random(n, 1), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        self.h2d(x, a)
        self.b.copy_d2d(self.i, y, x, n)
        self.d2h(back, y)
        if not np.array_equal(a, back):
            raise AssertionError("H2D -> D2D -> D2H changed the data")
        part = self.host.zeros(100)
        self.b.copy_d2h(self.i, _ptr(part), x + 1001, 100)  # a pointer inside an allocation
        if not np.array_equal(part, a[1001:1101]):
            raise AssertionError("D2H from an offset pointer read the wrong bytes")
        return f"H2D, D2D, D2H of {n} bytes and D2H at an offset verified"

    def async_copies(self) -> str:
        n = (2 << 20) + 7
        a, back = self.host.random(n, 2), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        s = self.stream()
        try:
            self.b.copy_async(self.i, x, _ptr(a), n, MemcpyKind.H2D, s)
            self.b.copy_async(self.i, y, x, n, MemcpyKind.D2D, s)
            self.b.copy_async(self.i, _ptr(back), y, n, MemcpyKind.D2H, s)
            self.b.synchronize_stream(self.i, s)
        finally:
            self.close_stream(s)
        if not np.array_equal(a, back):
            raise AssertionError("async H2D -> D2D -> D2H on one stream changed the data")
        return f"{n} bytes through async H2D, D2D, D2H on one stream"

    def memset(self) -> str:
        n = 1001
        x = self.alloc(n)
        self.b.memset(self.i, x, 0x5A, n)
        self.b.memset(self.i, x + 13, 0x11, 100)
        back = self.host.zeros(n)
        self.d2h(back, x)
        want = np.full(n, 0x5A, np.uint8)
        want[13:113] = 0x11
        if not np.array_equal(back, want):
            raise AssertionError("device_memory_set wrote the wrong bytes")
        return "whole and partial (offset) fills verified"

    def stream_order(self) -> str:
        n = 4 << 20
        a, c = self.host.random(n, 3), self.host.random(n, 4)
        b1, b2 = self.host.zeros(n), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        s = self.stream()
        try:
            # Each copy overwrites a buffer the one before reads: only in-order execution gives a, c.
            for src, dst in ((a, b1), (c, b2)):
                self.b.copy_async(self.i, x, _ptr(src), n, MemcpyKind.H2D, s)
                self.b.copy_async(self.i, y, x, n, MemcpyKind.D2D, s)
                self.b.copy_async(self.i, _ptr(dst), y, n, MemcpyKind.D2H, s)
            self.b.synchronize_stream(self.i, s)
            done = self.b.query_stream(self.i, s)
        finally:
            self.close_stream(s)
        if not (np.array_equal(b1, a) and np.array_equal(b2, c)):
            raise AssertionError("work on one stream ran out of order")
        if not done:
            raise AssertionError("query_stream reports pending work after synchronize_stream")
        return "6 dependent copies ran in order; query_stream done after synchronize"

    def events(self) -> str:
        n = 8 << 20
        a, back = self.host.random(n, 5), self.host.zeros(n)
        x, y = self.alloc(n), self.alloc(n)
        s1, s2 = self.stream(), self.stream()
        ev = self.b.create_event(self.i)
        try:
            self.b.copy_async(self.i, x, _ptr(a), n, MemcpyKind.H2D, s1)
            self.b.record_event(self.i, s1, ev)
            self.b.stream_wait_event(self.i, s2, ev)
            self.b.copy_async(self.i, y, x, n, MemcpyKind.D2D, s2)
            self.b.copy_async(self.i, _ptr(back), y, n, MemcpyKind.D2H, s2)
            self.b.synchronize_stream(self.i, s2)
            self.b.synchronize_event(self.i, ev)
            done = self.b.query_event(self.i, ev)
        finally:
            self.b.destroy_event(self.i, ev)
            self.close_stream(s1)
            self.close_stream(s2)
        if not np.array_equal(a, back):
            raise AssertionError("a stream waiting on an event ran before the event's work")
        if not done:
            raise AssertionError("query_event reports pending after synchronize_event")
        return "stream 2 waited for an event recorded on stream 1; query after synchronize done"

    def callbacks(self) -> str:
        n = 4 << 20
        a, back = self.host.random(n, 6), self.host.zeros(n)
        x = self.alloc(n)
        seen: list[bool] = []
        s = self.stream()
        try:
            self.b.copy_async(self.i, x, _ptr(a), n, MemcpyKind.H2D, s)
            self.b.copy_async(self.i, _ptr(back), x, n, MemcpyKind.D2H, s)
            self.b.stream_add_callback(self.i, s, lambda: seen.append(bool(np.array_equal(back, a))))
            self.b.synchronize_stream(self.i, s)
        finally:
            self.close_stream(s)
        if seen != [True]:
            raise AssertionError(f"the callback ran {len(seen)} time(s); it saw the copies done: {seen}")
        return "ran once, after the copies queued before it"

    def memory_stats(self) -> str:
        total, free = self.b.memory_stats(self.i)
        if total == 0 or free > total:
            raise AssertionError(f"device_memory_stats gave total {total}, free {free}")
        n = 16 << 20
        self.alloc(n)
        _, free_after = self.b.memory_stats(self.i)
        drop = free - free_after
        note = "tracks allocations" if drop >= n else f"free memory dropped by {drop} bytes after a {n}-byte allocation"
        return f"total {total >> 20} MiB, free {free >> 20} MiB; {note}"

    def allocator(self) -> str:
        s = self.b.allocator_sizes(self.i)
        if s.max_chunk_size < s.min_chunk_size:
            raise AssertionError(f"max chunk {s.max_chunk_size} is below min chunk {s.min_chunk_size}")
        return (f"min chunk {s.min_chunk_size}, max chunk {s.max_chunk_size}, max alloc {s.max_alloc_size}, "
                f"padding {s.extra_padding_size}, init {s.init_alloc_size}, realloc {s.realloc_size}")

    # ---- ops on the device ----------------------------------------------------------------------
    def kernels(self, missing: Sequence[str]) -> str:
        have = [op for op in OPS if op not in missing]
        text = f"F32 kernels: {', '.join(have) or 'none'}"
        return text + (f"; CPU fallback for {', '.join(missing)}" if missing else "")

    def model(self) -> str:
        device = f"{self.plugin.name}:{self.i}"
        want, want_tokens = random_model_run("cpu")
        got, got_tokens = random_model_run(device)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg="model logits differ from the CPU")
        if got_tokens != want_tokens:
            raise AssertionError(f"greedy tokens on the device {got_tokens} != CPU {want_tokens}")
        err = float(np.abs(got - want).max())
        return f"2-layer Qwen2 logits {got.shape} match the CPU (max abs diff {err:.1e}); 8 greedy tokens equal"

    def decoder_layer(self) -> str:
        device = f"{self.plugin.name}:{self.i}"
        want = decoder_layer_chain("cpu")
        got = decoder_layer_chain(device)
        for key in ("hidden", "transposed"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-4, err_msg=f"{key} differs from the CPU")
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4, err_msg="logits differ")
        ties = np.abs(want["logits"].max(-1) - want["logits"][np.arange(len(got["argmax"])), got["argmax"]]) > 1e-4
        if ties.any():
            raise AssertionError(f"argmax on the device {got['argmax'].tolist()} != CPU {want['argmax'].tolist()}")
        err = float(np.abs(got["logits"] - want["logits"]).max())
        return f"logits (5, 64) match the CPU (max abs diff {err:.1e}); argmax {got['argmax'].tolist()}"


def decoder_layer_chain(device: str, seed: int = 0) -> dict[str, np.ndarray]:
    """One Qwen2-style decoder layer plus the head, in F32 on ``device``, from fixed random weights.

    Returns host arrays: ``hidden`` (S, D) after the layer, ``transposed`` (D, S) made by
    rearrange of a permuted view, ``logits`` (S, V) and ``argmax`` (S,).
    """
    from .. import ops
    from ..tensor import Tensor

    f = ops.functional
    rng = np.random.default_rng(seed)
    s, d, heads, kv_heads, dh, inter, vocab = 5, 32, 4, 2, 8, 48, 64
    w = lambda *shape, scale=0.2: Tensor.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32), device)  # noqa: E731
    embed = w(vocab, d, scale=1.0)  # (V, D)
    norm1, norm2, norm_out = (Tensor.from_numpy((1 + 0.1 * rng.standard_normal(d)).astype(np.float32), device) for _ in range(3))
    wq, bq = w(heads * dh, d), w(heads * dh)
    wk, bk = w(kv_heads * dh, d), w(kv_heads * dh)
    wv, bv = w(kv_heads * dh, d), w(kv_heads * dh)
    wo = w(d, heads * dh)
    w_gate, w_up, w_down = w(inter, d), w(inter, d), w(d, inter)
    ids = Tensor.from_numpy(rng.integers(0, vocab, s).astype(np.int64), device)  # (S,)
    pos = Tensor.from_numpy(np.arange(3, 3 + s, dtype=np.int64), device)  # (S,)

    x = f.embedding(ids, embed)  # (S, D)
    h = f.rms_norm(x, norm1, 1e-6)  # (S, D)
    q = f.rope(f.linear(h, wq, bq).view(s, heads, dh), pos, 10000.0)  # (S, H, Dh)
    k = f.rope(f.linear(h, wk, bk).view(s, kv_heads, dh), pos, 10000.0)  # (S, KH, Dh)
    v = f.linear(h, wv, bv).view(s, kv_heads, dh)  # (S, KH, Dh)
    attn = f.self_attention(q, k, v, 1.0 / np.sqrt(dh)).view(s, heads * dh)  # (S, H*Dh)
    x = f.add(x, f.linear(attn, wo))  # (S, D)
    h = f.rms_norm(x, norm2, 1e-6)  # (S, D)
    x = f.add(x, f.linear(f.swiglu(f.linear(h, w_gate), f.linear(h, w_up)), w_down))  # (S, D)
    transposed = f.rearrange(x.permute(1, 0))  # (D, S)
    logits = f.linear(f.rms_norm(x, norm_out, 1e-6), embed)  # (S, V), tied head
    idx, _ = f.argmax(logits)  # (S,)
    return {"hidden": x.numpy(), "transposed": transposed.numpy(), "logits": logits.numpy(), "argmax": idx.numpy()}


def write_random_qwen2(folder: "str | os.PathLike[str]", seed: int = 0) -> None:
    """A small Qwen2 model with random F32 weights, as a Hugging Face folder (config.json and
    model.safetensors, no tokenizer): V=96, D=32, 2 layers, 4 query and 2 key/value heads."""
    import json

    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    v, d, inter, layers, heads, kv_heads = 96, 32, 48, 2, 4, 2
    dh = d // heads
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": v, "hidden_size": d,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 64, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}
    w = lambda *shape, scale=0.15: (rng.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(v, d, scale=1.0), "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(heads * dh, d), p + "self_attn.q_proj.bias": w(heads * dh),
            p + "self_attn.k_proj.weight": w(kv_heads * dh, d), p + "self_attn.k_proj.bias": w(kv_heads * dh),
            p + "self_attn.v_proj.weight": w(kv_heads * dh, d), p + "self_attn.v_proj.bias": w(kv_heads * dh),
            p + "self_attn.o_proj.weight": w(d, heads * dh),
            p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d),
            p + "mlp.down_proj.weight": w(d, inter),
        })
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def random_model_run(device: str, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """Load ``write_random_qwen2``'s model on ``device``; return the logits (S, V) of a 6-token
    prompt and 8 greedy tokens decoded after it with the KV cache."""
    import tempfile

    from ..models import load_model

    with tempfile.TemporaryDirectory() as folder:
        write_random_qwen2(folder, seed)
        models_log = logging.getLogger("llaisys.models")
        level = models_log.level
        models_log.setLevel(logging.ERROR)  # the folder has no tokenizer, on purpose
        try:
            model = load_model(folder, device=device)
        finally:
            models_log.setLevel(level)
    prompt = [3, 17, 42, 5, 77, 8]
    cache = model.new_cache(len(prompt) + 8)
    logits = model.forward(prompt, cache, all_logits=True)  # (S, V)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < 8:
        tokens.append(int(np.argmax(model.forward([tokens[-1]], cache))))
    return logits, tokens


def run_check(path: "str | os.PathLike[str]", device_index: int = 0, ops: bool = True,
              on_row: Callable[[CheckRow], None] | None = None) -> CheckReport:
    """Load the plugin at ``path`` and run every check on device ``device_index``; ``ops``
    also runs the decoder layer and the model against the CPU. ``on_row`` sees each row."""
    from ..plugins import load_plugin

    report = CheckReport(os.fspath(path), on_row=on_row)
    try:
        plugin = load_plugin(path)
    except (PluginError, OSError, ValueError) as exc:
        report.add("load", FAIL, str(exc))
        return report
    version = ".".join(map(str, plugin.version))
    report.add("load", PASS, f"device type {plugin.name} ({plugin.sub_device_type or 'no sub type'}), "
                             f"ABI {version}; required APIs present")
    c = _Checker(plugin, device_index, report)
    c.run("devices", c.devices)
    if report.rows[-1].status == FAIL:
        return report
    c.run("allocate/free odd sizes", c.odd_allocations)
    c.run("copies (sync)", c.sync_copies)
    c.run("copies (async)", c.async_copies,
          ["create_stream", "async_memory_copy_h2d", "async_memory_copy_d2d", "async_memory_copy_d2h"])
    c.run("memset", c.memset, ["device_memory_set"])
    c.run("stream order", c.stream_order, ["create_stream", "query_stream"])
    c.run("events across streams", c.events, ["create_event", "stream_wait_event", "query_event"])
    c.run("host callbacks", c.callbacks, ["create_stream", "stream_add_callback"])
    c.run("memory stats", c.memory_stats)
    c.run("allocator sizes", c.allocator, ["device_max_chunk_size", "device_max_alloc_size",
                                           "device_init_alloc_size", "device_realloc_size"])
    if ops:
        missing = [op for op in OPS if find_kernel(op, plugin.name, DataType.F32) is None]
        c.fallbacks |= {f"kernel {op}" for op in missing}
        c.run("kernels", lambda: c.kernels(missing))
        c.run("decoder layer vs CPU", c.decoder_layer, [f"kernel {op}" for op in missing])
        c.run("model vs CPU", c.model, [f"kernel {op}" for op in missing])
    else:
        report.add("decoder layer vs CPU", SKIP, "not asked for (--no-ops)")
        report.add("model vs CPU", SKIP, "not asked for (--no-ops)")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The check's command-line arguments."""
    parser.add_argument("path", help="the plugin library (lib*.so)")
    parser.add_argument("--device", type=int, default=0, metavar="INDEX", help="device index to check (default 0)")
    parser.add_argument("--no-ops", action="store_true", help="skip running ops and a model on the device")
    parser.add_argument("--in-process", action="store_true",
                        help="run in this process (by default a child process runs the check, so that a "
                             "plugin that crashes is reported rather than taking the command down)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (repeat for debug)")


def run_cli(args: argparse.Namespace) -> int:
    """Run the check for parsed ``args``, printing the table as it goes; returns the exit
    status: 0 when nothing failed, 1 otherwise."""
    if args.device < 0:
        raise ValueError(f"--device must be >= 0, got {args.device}")
    if args.in_process:
        print(CheckReport(os.fspath(args.path)).header(), flush=True)
        report = run_check(args.path, args.device, ops=not args.no_ops,
                           on_row=lambda row: print(format_row(row), flush=True))
        print(report.summary(), flush=True)
        return 0 if report.ok else 1
    cmd = [sys.executable, "-m", "llaisys.tools.plugin_check", "--in-process", os.fspath(args.path),
           "--device", str(args.device), *(["--no-ops"] if args.no_ops else []), *(["-v"] * args.verbose)]
    sys.stdout.flush()
    rc = subprocess.run(cmd).returncode
    if rc >= 0:
        return rc
    try:
        why = signal.Signals(-rc).name
    except ValueError:
        why = f"signal {-rc}"
    print(format_row(CheckRow("(crash)", FAIL, f"the plugin crashed the checking process ({why}) in the check "
                                               "after the last row above")))
    print("FAILED: the plugin crashed", flush=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m llaisys.tools.plugin_check PATH``: print the report; 1 when a check failed."""
    parser = argparse.ArgumentParser(prog="llaisys plugin check", description="Check a device plugin library.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose <= 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_cli(args)
    except ValueError as exc:
        print(f"llaisys plugin check: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
