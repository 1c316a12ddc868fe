"""NumPy front end of the native quantized kernels (``csrc/kernels``, loaded with ctypes).

The block formats run in one of three arithmetics (``quant_math``): int16 where the CPU has
AVX512-VNNI or AVX-VNNI (activations as 16-bit integers per 32-element block on the integer dot-product
units, the weights repacked once at load; ``reference_int16``), else f32; int8 when asked for
(the same with 8-bit activations, as llama.cpp's: faster on a batch, further from float32). What
follows is the f32 arithmetic, which F16/BF16 weights always use.

``linear`` computes Y = X W^T + b with W in a GGUF block format, activations and accumulation in
float32 (the weights are never widened in memory, the activations never quantized), for any
number of rows M: M = 1 decodes the weights in registers (so do a few rows, M <= 4 at the
AVX-512 level and 2 at AVX2, each weight once for all of them); up to 64 rows (batched decoding,
more while X fits in L2) the AVX-512 kernels decode a few rows of W in registers for the first
rows of X and keep them for the others; more rows decode a tile of rows of W at a time and
multiply it with all of X in register blocks, reading the weight bytes once.
Each output element is computed by one fixed sequence of f32 operations (``csrc/kernels/quant.h``)
whatever M is, wherever its row sits in X and whatever the thread count: a row of Y has the
same bits alone or in a batch (batch-invariant), at a given SIMD level. The SIMD level is
chosen by CPU at first use (``LLAISYS_SIMD=scalar|avx2|avx512`` forces one; levels may differ
from each other in the last bits); the thread pool is the library's own (``set_threads``).

A weight used many times is best wrapped once with ``prepare`` (its checks run once; a call then
costs a few microseconds of Python).
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Callable

import numpy as np

from ... import _native
from ..._native.structs import LinearCall
from .formats import BlockFormat, get_format

SIMD_LEVELS = ("scalar", "avx2", "avx512")

log = logging.getLogger(__name__)

_lib: "_native.Library | None" = None  # None until first use


def _library() -> _native.Library:
    """The native library (signatures declared by ``_native``, loaded once); RuntimeError
    saying how to build it when it is not built."""
    global _lib
    if _lib is None:  # loading twice in a race is harmless: _native keeps one copy
        lib = _native.require("kernels")
        wanted, level = os.environ.get("LLAISYS_SIMD"), lib.llaisys_quant_simd_level().decode()
        if wanted and wanted != level:
            mask = lib.llaisys_quant_simd_available()
            runs = ", ".join(name for i, name in enumerate(SIMD_LEVELS) if mask >> i & 1)
            log.warning("LLAISYS_SIMD=%s ignored: this CPU runs %s; using %s", wanted, runs, level)
        _lib = lib
    return _lib


def available() -> bool:
    """Whether the native library was built (a C compiler was present at install)."""
    return _native.load("kernels") is not None


def _check(status: int, what: str) -> None:
    if status != 0:  # the arguments were validated here, so this is a bug, not bad input
        raise RuntimeError(f"llaisys_quant_{what} failed with status {status}")


def _weight_bytes(raw: np.ndarray, fmt: BlockFormat) -> tuple[np.ndarray, int]:
    """Validated weight bytes (N, row_bytes) uint8 and K."""
    if not isinstance(raw, np.ndarray):
        raise ValueError(f"raw weights must be a NumPy array, got {type(raw).__name__}")
    if raw.ndim != 2:
        raise ValueError(f"raw weights must be 2-D (N, row_bytes), got shape {raw.shape}")
    if raw.dtype != np.uint8:
        # F32/F16/BF16 weights may come as their own dtype, (N, K)
        if fmt.block_size != 1 or raw.dtype.itemsize != fmt.block_bytes:
            raise ValueError(f"raw {fmt.name} weights must be uint8 (N, row_bytes), got dtype {raw.dtype}")
        if not raw.flags.c_contiguous:
            raise ValueError(f"{fmt.name} weights must be C-contiguous, got strides {raw.strides}")
        raw = raw.view(np.uint8)
    if not raw.flags.c_contiguous:
        raise ValueError(f"raw weights must be C-contiguous (N, row_bytes), got strides {raw.strides}")
    if raw.ctypes.data % 2:
        raise ValueError("raw weights must start at an even address (blocks hold 16-bit scales)")
    return raw, fmt.row_elements(raw.shape[1])


def _require_f32(a: object, name: str) -> None:
    if type(a) is not np.ndarray or a.dtype != np.float32:
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a float32 NumPy array, got {got}")


def _rows_contiguous(a: np.ndarray, name: str) -> None:
    """a (rows, cols) float32 must have contiguous rows that do not overlap."""
    rows, cols = a.shape
    if a.strides[1] != 4 or a.strides[0] % 4 or (rows > 1 and a.strides[0] < 4 * cols):
        raise ValueError(f"{name} rows must be contiguous, non-overlapping float32, got strides {a.strides} "
                         f"for shape {a.shape}")


class QuantWeight:
    """A weight matrix W (N, K) in a GGUF format, checked once, for repeated ``linear`` calls.

    ``raw``: uint8 (N, row_bytes), C-contiguous (F32/F16/BF16 weights may also be (N, K) of
    their own dtype). The array is referenced, not copied: keep it unchanged while in use.
    ``pack``: while an integer arithmetic (int16, int8) is in use, also keep W repacked for its kernels
    (``packed``: about the bytes of W, the codes of 16 rows interleaved as the dot-product
    instructions read them), so that a call reads it as is instead of rearranging W's blocks;
    the results are the same bits either way.
    """

    __slots__ = ("fmt", "raw", "n", "k", "packed", "_ptr", "_packed_ptr")

    def __init__(self, qtype: int | str | BlockFormat, raw: np.ndarray, pack: bool = True):
        self.fmt = get_format(qtype)
        self.raw, self.k = _weight_bytes(raw, self.fmt)  # (N, row_bytes) uint8, K
        self.n = self.raw.shape[0]
        self._ptr = self.raw.ctypes.data
        self.packed = _pack(self.fmt, self.raw, self.n, self.k) if pack and quant_math() in INTEGER_ARITHMETICS else None
        self._packed_ptr = None if self.packed is None else self.packed.ctypes.data

    def __repr__(self) -> str:
        return f"QuantWeight({self.fmt.name}, N={self.n}, K={self.k})"

    def dequantize(self, out: np.ndarray | None = None) -> np.ndarray:
        """W as float32 (N, K), bit-exact with ``reference.dequantize``; into ``out`` (N, K)
        float32 C-contiguous if given."""
        if out is None:
            out = np.empty((self.n, self.k), np.float32)
        else:
            _require_f32(out, "out")
            if out.shape != (self.n, self.k) or not out.flags.c_contiguous:
                raise ValueError(f"out must be C-contiguous of shape {(self.n, self.k)}, got shape {out.shape}")
        if self.n:
            status = _library().llaisys_quant_dequantize(self.fmt.type_id, self._ptr, self.n, self.k, out.ctypes.data)
            _check(status, "dequantize")
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (integers in [0, N), any shape S) of W as float32 (*S, K): an embedding
        lookup. Bit-exact with ``reference.dequantize``."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.n):
            raise ValueError(f"row ids must lie in [0, {self.n}), got {ids.min()} .. {ids.max()}")
        picked = QuantWeight(self.fmt, self.raw[ids.reshape(-1)], pack=False)  # (ids.size, row_bytes), a copy
        return picked.dequantize().reshape(*ids.shape, self.k)

    def linear(self, x: np.ndarray, bias: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Y (M, N) = x (M, K) @ W^T + bias (N,), float32; row r of Y depends on row r of x
        only, bit for bit (not on M, the other rows or the thread count).

        x: float32 (M, K) with contiguous rows (any row stride). bias: float32 (N,) or None.
        out: float32 (M, N) with contiguous rows, not overlapping x; a new array if None.
        Returns out.
        """
        out = self._checked(x, bias, out)
        if x.shape[0] and self.n:
            _check(_library().llaisys_quant_linear(*self._arguments(x, bias, out)), "linear")
        return out

    def linear_f32(self, x: np.ndarray, bias: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """``linear`` in the f32 arithmetic whichever one is in use (the mixture-of-experts
        kernels compute their experts in it, in their C and NumPy forms alike). Returns out."""
        out = self._checked(x, bias, out)
        if x.shape[0] and self.n:
            _check(_library().llaisys_quant_linear_f32(*self._arguments(x, bias, out)[:-1]), "linear_f32")
        return out

    def _checked(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None) -> np.ndarray:
        """Raise ValueError unless ``linear(x, bias, out)`` is well formed; returns out (new
        when None)."""
        _require_f32(x, "x")
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"x must be 2-D (M, K={self.k}) for {self!r}, got shape {x.shape}")
        _rows_contiguous(x, "x")
        m, n = x.shape[0], self.n
        if bias is not None:
            _require_f32(bias, "bias")
            if bias.shape != (n,) or bias.strides != (4,):
                raise ValueError(f"bias must be contiguous of shape {(n,)}, got shape {bias.shape}")
        if out is None:
            return np.empty((m, n), np.float32)
        _require_f32(out, "out")
        if out.shape != (m, n):
            raise ValueError(f"out must have shape {(m, n)}, got {out.shape}")
        _rows_contiguous(out, "out")
        if np.may_share_memory(out, x):
            raise ValueError("out must not overlap x")
        return out

    def _arguments(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> tuple:
        """The arguments of ``llaisys_quant_linear`` for checked arrays (M >= 1, N >= 1)."""
        m, n = x.shape[0], self.n
        return (self.fmt.type_id, self._ptr, n, self.k, x.ctypes.data, x.strides[0] // 4 if m > 1 else self.k, m,
                out.ctypes.data, out.strides[0] // 4 if m > 1 else n, None if bias is None else bias.ctypes.data,
                self._packed_ptr)

    def bind(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> "Callable[[], None]":
        """``linear(x, bias, out)`` checked once, as a function of no arguments that runs it
        again on the same arrays, reading what x and bias hold at the time: what a replayed
        decoding step calls, without this module's checks (a few microseconds a call).
        The arrays must stay where they are (the function keeps them alive)."""
        if out is None:
            raise ValueError("bind needs the output array")
        made = self.call_block(x, bias, out)
        if made is None:
            return lambda: None
        kept = (self, x, bias, out, made[1])  # the block points into the arrays
        fn, address = _library().llaisys_quant_linear_call, ctypes.addressof(made[1])

        def call() -> None:
            status = fn(address)
            if status:
                _check(status, f"linear of {kept[0]!r}")

        return call

    def call_block(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> "tuple[int, LinearCall] | None":
        """``linear(x, bias, out)`` checked once, as the address of ``llaisys_quant_linear_call``
        and its argument block (for a replayed list of calls, ``kernels.cpu.native_calls``), or
        None when there is nothing to compute (M or N is 0). The arrays must stay where they are."""
        self._checked(x, bias, out)
        if x.shape[0] == 0 or self.n == 0:
            return None
        return (_native.address(_library(), "llaisys_quant_linear_call"), LinearCall(*self._arguments(x, bias, out)))


def _pack(fmt: BlockFormat, raw: np.ndarray, n: int, k: int) -> np.ndarray | None:
    """W (N rows of K) repacked for the int16 arithmetic's kernels (uint8, 64-byte aligned), or
    None where they do not take this format."""
    lib = _library()
    nbytes = lib.llaisys_quant_int_packed_bytes(fmt.type_id, n, k)
    if nbytes <= 0 or n == 0:
        return None
    buf = np.empty(nbytes + 64, np.uint8)
    packed = buf[(-buf.ctypes.data) % 64:][:nbytes]  # a view that starts on a cache line
    _check(lib.llaisys_quant_int_pack(fmt.type_id, raw.ctypes.data, n, k, packed.ctypes.data), "int_pack")
    return packed


def packs(qtype: int | str) -> bool:
    """Whether a ``QuantWeight`` of format ``qtype`` made now keeps a packed copy (an integer
    arithmetic is in use and its kernels take the format)."""
    fmt = get_format(qtype)
    lib = _library()
    return quant_math() in INTEGER_ARITHMETICS and lib.llaisys_quant_int_packed_bytes(fmt.type_id, 16, 256) > 0


def prepare(qtype: int | str, raw: np.ndarray) -> QuantWeight:
    """Check weight bytes raw (N, row_bytes) uint8 in format ``qtype`` once, for repeated use."""
    return QuantWeight(qtype, raw)


def dequantize(qtype: int | str, raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Weights (N, row_bytes) uint8 in format ``qtype`` -> float32 (N, K), bit-exact with
    ``reference.dequantize``; ``out`` (N, K) float32 C-contiguous receives it if given."""
    return QuantWeight(qtype, raw, pack=False).dequantize(out)  # once: a packed copy would go unread


def linear(x: np.ndarray, qtype: int | str, raw: np.ndarray, bias: np.ndarray | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Y (M, N) = x (M, K) @ W (N, K)^T + bias (N,), all float32, W given as its encoded bytes.

    x: float32 (M, K), rows contiguous (any row stride). raw: uint8 (N, row_bytes) in format
    ``qtype`` (a GGML type id or name; F32/F16/BF16 weights may also be (N, K) arrays of their
    own dtype). bias: float32 (N,) or None. out: float32 (M, N) with contiguous rows, not
    overlapping x; a new array if None. Returns out. Repeated calls on one weight: ``prepare``.
    """
    return QuantWeight(qtype, raw, pack=False).linear(x, bias, out)  # once: packing costs more than it saves


def set_threads(n: int) -> int:
    """Size the native thread pool to ``n`` threads (the caller counts as one; 0 means one per
    available CPU). Returns the number of threads it now has."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"thread count must be a non-negative int, got {n!r}")
    return _library().llaisys_quant_set_threads(n)


def threads() -> int:
    """Threads in the native pool."""
    return _library().llaisys_quant_threads()


def simd_level() -> str:
    """The SIMD level the kernels use now: "scalar", "avx2" or "avx512"."""
    return _library().llaisys_quant_simd_level().decode()


def available_simd_levels() -> tuple[str, ...]:
    """The SIMD levels this CPU runs, lowest first ("scalar" always)."""
    mask = _library().llaisys_quant_simd_available()
    return tuple(name for i, name in enumerate(SIMD_LEVELS) if mask >> i & 1)


def fma_peak(repeat: int = 7, rounds: int = 100_000) -> float:
    """The machine's multiply-add peak (multiply-adds per second) at the SIMD level in use, on
    all the pool's threads: the best of ``repeat`` timed runs of independent float32 FMA chains
    in registers (``fma_loop`` of csrc/kernels/quant.h), what no kernel can exceed."""
    lib, chunks = _library(), 4 * threads()  # several chunks a thread: one slow to wake costs little
    best = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        done = lib.llaisys_quant_fma_loop(rounds, chunks)
        best = max(best, done / (time.perf_counter() - start))
    return best


def set_simd_level(name: str) -> None:
    """Use SIMD level ``name`` from now on (for tests and comparisons); ValueError if this CPU
    lacks it. The level at start is the best available, or the one ``LLAISYS_SIMD`` names."""
    if name not in available_simd_levels():
        raise ValueError(f"SIMD level {name!r} is not available here; available: {', '.join(available_simd_levels())}")
    _check(_library().llaisys_quant_set_simd_level(name.encode()), "set_simd_level")


ARITHMETICS = ("f32", "int16", "int8")
INTEGER_ARITHMETICS = ("int16", "int8")  # on the integer dot-product units, weights packed at load


def quant_math() -> str:
    """The arithmetic of the block formats now: "f32" (weights decoded to float32, float32
    multiply-adds), "int16" (activations as 16-bit integers per 32-element block on the integer
    dot-product units; reference_int16.py) or "int8" (the same with 8-bit activations): int16
    where the CPU has AVX512-VNNI or AVX-VNNI, else f32; ``LLAISYS_QUANT_MATH`` names another."""
    return _library().llaisys_quant_math().decode()


def available_quant_maths() -> tuple[str, ...]:
    """The arithmetics this CPU runs ("int16" and "int8" need AVX512-VNNI or AVX-VNNI)."""
    lib, now = _library(), quant_math()
    runs = tuple(name for name in ARITHMETICS if lib.llaisys_quant_set_math(name.encode()) == 0)
    lib.llaisys_quant_set_math(now.encode())
    return runs


def int_level() -> str | None:
    """The units the integer arithmetics (int16, int8) run on now: "avx512_vnni", "avx_vnni"
    (a CPU without AVX512-VNNI, or the SIMD level set to avx2 on one with both), or None where
    this CPU has neither. The results are the same bits on either."""
    return _library().llaisys_quant_int_level().decode() or None


def int16_uses_amx() -> bool:
    """Whether the int16 arithmetic runs 16 rows of X at a time on the AMX tiles here (the CPU has
    amx_int8, Linux granted this process the tile state, and ``LLAISYS_AMX=0`` did not turn them
    off); its results are the same bits either way."""
    return bool(_library().llaisys_quant_int_amx())


def set_quant_math(name: str) -> None:
    """Use arithmetic ``name`` for the block formats from now on; ValueError where this CPU
    lacks it. A model's rows then have the bits of that arithmetic, alone or in any batch."""
    if name not in ARITHMETICS:
        raise ValueError(f"unknown arithmetic {name!r}; expected one of {', '.join(ARITHMETICS)}")
    if _library().llaisys_quant_set_math(name.encode()) != 0:
        raise ValueError(f"the {name} arithmetic does not run on this CPU (it needs AVX512-VNNI or AVX-VNNI); "
                         f"available: {', '.join(available_quant_maths())}")


# ---- the machine's limits, for benchmarks (csrc/kernels/peak.c) ----------------------------

INT8_UNITS = ("avx512_vnni", "avx_vnni", "amx_int8")  # peak.c's unit numbers, in order


def _peak_library() -> _native.Library:
    """The native library, whose peak probes (``csrc/kernels/peak.c``) ``_native`` declared
    with the rest of its table."""
    return _library()


def int8_peak(unit: str, repeat: int = 7, rounds: int = 200_000) -> float | None:
    """Int8 multiply-adds per second of ``unit`` (one of INT8_UNITS) on all the pool's threads, the
    best of ``repeat`` timed runs of independent accumulator chains in registers; None when the CPU
    lacks the unit (or, for AMX, the kernel refuses this process the tile state)."""
    if unit not in INT8_UNITS:
        raise ValueError(f"unknown int8 unit {unit!r}; expected one of {', '.join(INT8_UNITS)}")
    lib, index, best = _peak_library(), INT8_UNITS.index(unit), 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        done = lib.llaisys_peak_int8_loop(index, rounds, 4 * threads())
        if done < 0:
            return None
        best = max(best, done / (time.perf_counter() - start))
    return best


def read_bandwidth(nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """Bytes per second the pool's threads read from memory: the best of ``repeat`` timed sums of a
    buffer of ``nbytes`` (rounded down to 8-byte words), which should dwarf the last-level cache."""
    lib, buf, best = _peak_library(), np.ones(max(nbytes // 8, 1), np.uint64), 0.0  # written: every page mapped
    for _ in range(repeat):
        start = time.perf_counter()
        lib.llaisys_peak_read(buf.ctypes.data, buf.nbytes, max(buf.nbytes >> 20, 1))  # 1 MiB pieces
        best = max(best, buf.nbytes / (time.perf_counter() - start))
    return best
