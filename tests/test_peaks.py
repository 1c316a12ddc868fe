"""The machine-limit probes of the native kernels library (csrc/kernels/peak.c): the int8 units
they find, against the CPU flags Linux reports, and a read probe that reads every byte, against
NumPy's sum."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llaisys.kernels.quant import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels library is not built")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (``avx512_vnni``, ``avx_vnni``, ``amx_int8``)."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo to compare with")
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo lists no flags")


@pytest.mark.parametrize("unit", native.INT8_UNITS)
def test_an_int8_unit_is_measured_where_the_cpu_flags_list_it(unit: str) -> None:
    flags = cpu_flags()
    peak = native.int8_peak(unit, repeat=1, rounds=1000)
    if unit not in flags:
        assert peak is None
    elif unit != "amx_int8":  # AMX also needs the kernel to grant the tile state: either answer is right
        assert peak is not None and peak > 0


def test_a_zmm_dot_product_does_four_times_the_multiply_adds_of_a_float_fma() -> None:
    if "avx512_vnni" not in cpu_flags() or native.simd_level() != "avx512":
        pytest.skip("needs AVX512-VNNI and the AVX-512 level")
    threads = native.threads()
    native.set_threads(1)
    try:  # 64 int8 multiply-adds an instruction against 16 float32 ones, on the same vector units
        assert native.int8_peak("avx512_vnni") > 2 * native.fma_peak()
    finally:
        native.set_threads(threads)


def test_the_read_probe_sums_every_byte() -> None:
    words = np.random.default_rng(0).integers(0, 1 << 63, size=(1 << 18) + 13, dtype=np.uint64)  # a ragged tail
    lib = native._peak_library()
    for pieces in (1, 7, 64):
        assert lib.llaisys_peak_read(words.ctypes.data, words.nbytes, pieces) == int(words.sum(dtype=np.uint64))


def test_an_unknown_unit_is_named() -> None:
    with pytest.raises(ValueError, match="'avx9'.*avx512_vnni"):
        native.int8_peak("avx9")
