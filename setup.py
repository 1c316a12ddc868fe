"""Native libraries built by ``pip install`` with the system C compiler.

Each folder ``csrc/<name>/`` is compiled into one shared library ``llaisys/_native/_<name>``
(a plain C library loaded with ctypes by ``llaisys._native.load``, not a Python extension).
They are optional: without a compiler the install still succeeds and llaisys uses its
portable Python paths, saying so where a feature needs the library. No -march: SIMD code
carries target attributes and is chosen at run time; -ffp-contract=off keeps a written
multiply-then-add from becoming one fused instruction (decoders must match NumPy bit for bit).
"""
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).parent


def native_libraries() -> list[Extension]:
    libs = []
    for folder in sorted(p for p in (ROOT / "csrc").iterdir() if p.is_dir()):
        sources = sorted(str(p.relative_to(ROOT)) for p in folder.glob("*.c"))
        if sources:
            libs.append(Extension(
                f"llaisys._native._{folder.name}", sources, include_dirs=["include", "csrc", str(folder.relative_to(ROOT))],
                extra_compile_args=["-std=c11", "-O3", "-ffp-contract=off", "-fPIC", "-pthread", "-fvisibility=hidden",
                                    "-Wall"],
                extra_link_args=["-pthread", "-lm"], optional=True))
    return libs


setup(ext_modules=native_libraries())
