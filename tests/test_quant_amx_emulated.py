"""The AMX kernel of the integer arithmetics (csrc/kernels/quant_int_amx.c) on a CPU without AMX:
the kernels library built again with -DLLAISYS_AMX_EMULATE, where the tile instructions are C
functions computing what the instruction set reference defines (TDPBSUD: signed bytes of A
times unsigned bytes of B, four to a 32-bit sum). Batches of 16 rows of X and more then run
through the kernel's tile loads, strides and float steps, which must equal the NumPy reference
bit for bit, as on a CPU with the tiles.

Needs AVX512-VNNI (the kernel's float steps are AVX-512 code): skipped, saying so, without it.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import gguf
import numpy as np
import pytest

from llaisys.kernels.quant import native
from llaisys.kernels.quant.reference_int16 import linear_int16
from test_quant_kernels import make_weights

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # Q6_K: the tiles pass it on to VNNI


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> ctypes.CDLL:
    """The kernels library with emulated tiles, its signatures declared."""
    if not native.available() or native.int_level() != "avx512_vnni":
        pytest.skip("the AMX kernel's float steps need AVX512-VNNI; this CPU has none")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        compiler = "cc"
    out = tmp_path_factory.mktemp("amx") / "kernels_amx_emulated.so"
    sources = sorted(str(p) for p in (ROOT / "csrc" / "kernels").glob("*.c"))
    subprocess.run([compiler, "-DLLAISYS_AMX_EMULATE", "-std=c11", "-O2", "-ffp-contract=off", "-fPIC", "-pthread",
                    "-fvisibility=hidden", "-shared", f"-I{ROOT / 'include'}", f"-I{ROOT / 'csrc'}",
                    f"-I{ROOT / 'csrc' / 'kernels'}", *sources, "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out), mode=os.RTLD_LOCAL)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.llaisys_quant_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr]
    lib.llaisys_quant_int_packed_bytes.argtypes = [ctypes.c_int, i64, i64]
    lib.llaisys_quant_int_packed_bytes.restype = i64
    lib.llaisys_quant_int_pack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    lib.llaisys_quant_set_math.argtypes = [ctypes.c_char_p]
    return lib


def _aligned(nbytes: int) -> np.ndarray:
    """nbytes of uint8 starting at a multiple of 64 bytes."""
    buf = np.zeros(nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    return buf[start:start + nbytes]


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


@pytest.mark.parametrize("bits", [16, 8], ids=["int16", "int8"])
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "as-stored"])
def test_emulated_tiles_equal_the_reference_bitwise(emulated, name, bits, pack):
    assert emulated.llaisys_quant_set_math(f"int{bits}".encode()) == 0
    assert emulated.llaisys_quant_int_amx() == 1  # the tiles are what runs batches of 16 rows and more
    kind = gguf.GGMLQuantizationType[name].value
    rng = np.random.default_rng(bits + len(name))
    n, k = 37, 512  # two groups of 16 rows of W and a part
    raw = make_weights(name, n, k, rng)
    packed = None
    if pack:
        packed = _aligned(emulated.llaisys_quant_int_packed_bytes(kind, n, k))
        assert emulated.llaisys_quant_int_pack(kind, _ptr(raw), n, k, _ptr(packed)) == 0
    bias = rng.standard_normal(n).astype(np.float32)
    for threads in (1, 2):
        emulated.llaisys_quant_set_threads(threads)
        for m in (16, 17, 40, 64):  # whole tiles of rows, and rows left to the VNNI kernels
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = np.zeros((m, n), np.float32)
            status = emulated.llaisys_quant_linear(kind, _ptr(raw), n, k, _ptr(x), k, m, _ptr(y), n, _ptr(bias),
                                                   _ptr(packed))
            assert status == 0
            want = linear_int16(x, name, raw, bias, bits=bits)
            assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), f"{name} M={m}, {threads} thread(s)"
