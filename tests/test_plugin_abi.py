"""The plugin ABI headers against the published PaddlePaddle custom-device layout (0.1.x),
measured by the C compiler, and our ctypes bindings against the headers."""
from __future__ import annotations

import ctypes
import subprocess

import pytest

from llaisys.backends.plugin import abi
from llaisys.plugins.build import build_plugin, include_dir

# Byte offsets in PaddlePaddle's paddle/phi/backends/device_ext.h (custom runtime 0.1.x) on
# LP64: size_t and pointers are 8 bytes; each group of APIs is followed by its reserved slots
# (8 pointers, 7 for the last group).
PUBLISHED_OFFSETS = {
    "C_DeviceInterface": {
        "size": 0, "initialize": 8, "set_device": 32, "create_stream": 56, "stream_wait_event": 144,
        "reserved_dev_api": 152, "device_memory_allocate": 216, "device_memory_set": 232,
        "memory_copy_h2d": 272, "async_memory_copy_p2p": 328, "reserved_mem_api": 336,
        "get_device_count": 400, "device_memory_stats": 416, "device_min_chunk_size": 424,
        "get_driver_version": 488, "reserved_info_api": 496, "xccl_get_unique_id_size": 560,
        "xccl_all_reduce": 592, "xccl_all_to_all": 664, "reserved_ccl_api": 672,
        "profiler_initialize": 736, "reserved_profiler_api": 784, "blas_axpby": 848,
        "reserved_other_api": 856,
    },
    "CustomRuntimeParams": {
        "size": 0, "interface": 8, "version": 16, "device_type": 40, "sub_device_type": 48, "reserved": 56,
    },
}
PUBLISHED_SIZES = {"C_DeviceInterface": 912, "CustomRuntimeParams": 88, "CustomRuntimeVersion": 24,
                   "C_CCLRootId": 16, "struct C_Device_st": 4}
KERNEL_STRUCTS = {"LlaisysTensorDesc": abi.LlaisysTensorDesc, "LlaisysKernelAttr": abi.LlaisysKernelAttr,
                  "LlaisysKernelRegistrar": abi.LlaisysKernelRegistrar}
ENUMS = {"C_SUCCESS": 0, "C_WARNING": 1, "C_FAILED": 2, "C_ERROR": 3, "C_INTERNAL_ERROR": 4,
         "UNDEFINED": 0, "BOOL": 1, "UINT8": 2, "INT64": 9, "FLOAT16": 10, "FLOAT32": 11, "BFLOAT16": 13,
         "COMPLEX128": 15, "ANY": 0, "ALL_LAYOUT": 0, "NHWC": 1, "NCHW": 2, "STRIDED": 5,
         "SUM": 0, "AVG": 1, "PRODUCT": 4}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, int]:
    """sizeof/offsetof/enum values printed by a C program compiled against our headers."""
    lines = []
    for struct, fields in PUBLISHED_OFFSETS.items():
        lines += [f'printf("{struct}.{f} %zu\\n", offsetof({struct}, {f}));' for f in fields]
    for name, _ in abi.C_DeviceInterface._fields_:
        lines.append(f'printf("iface.{name} %zu\\n", offsetof(C_DeviceInterface, {name}));')
    for struct, cls in KERNEL_STRUCTS.items():
        lines += [f'printf("{struct}.{f} %zu\\n", offsetof({struct}, {f}));' for f, _ in cls._fields_]
        lines.append(f'printf("sizeof {struct} %zu\\n", sizeof({struct}));')
    lines += [f'printf("sizeof {t} %zu\\n", sizeof({t}));' for t in PUBLISHED_SIZES]
    lines += [f'printf("enum {e} %d\\n", (int){e});' for e in ENUMS]
    src = tmp_path_factory.mktemp("abi") / "layout.c"
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "llaisys/kernel_ext.h"\n'
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = src.with_suffix("")
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-pedantic", f"-I{include_dir()}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.rsplit(" ", 1) for line in out.splitlines())}


def test_struct_sizes_match_the_published_layout(measured):
    for name, size in PUBLISHED_SIZES.items():
        assert measured[f"sizeof {name}"] == size, name


@pytest.mark.parametrize("struct", list(PUBLISHED_OFFSETS))
def test_field_offsets_match_the_published_layout(measured, struct):
    for field, offset in PUBLISHED_OFFSETS[struct].items():
        assert measured[f"{struct}.{field}"] == offset, f"{struct}.{field}"


def test_enum_values_match_the_published_header(measured):
    for name, value in ENUMS.items():
        assert measured[f"enum {name}"] == value, name


def test_ctypes_device_interface_matches_the_header(measured):
    assert ctypes.sizeof(abi.C_DeviceInterface) == measured["sizeof C_DeviceInterface"]
    assert ctypes.sizeof(abi.CustomRuntimeParams) == measured["sizeof CustomRuntimeParams"]
    for name, _ in abi.C_DeviceInterface._fields_:
        assert getattr(abi.C_DeviceInterface, name).offset == measured[f"iface.{name}"], name
    for field, _ in abi.CustomRuntimeParams._fields_:
        assert getattr(abi.CustomRuntimeParams, field).offset == measured[f"CustomRuntimeParams.{field}"], field


@pytest.mark.parametrize("struct", list(KERNEL_STRUCTS))
def test_ctypes_kernel_structs_match_the_header(measured, struct):
    cls = KERNEL_STRUCTS[struct]
    assert ctypes.sizeof(cls) == measured[f"sizeof {struct}"]
    for field, _ in cls._fields_:
        assert getattr(cls, field).offset == measured[f"{struct}.{field}"], field


def test_required_and_fallback_tables_name_real_apis():
    assert set(abi.REQUIRED_APIS) <= set(abi.API_NAMES)
    assert set(abi.FALLBACKS) <= set(abi.API_NAMES)
    assert not set(abi.REQUIRED_APIS) & set(abi.FALLBACKS)
    # The memory seed's required APIs: allocation is required; copies, stats and chunk size
    # are required or have a fallback (what PaddlePaddle loads without, llaisys does too).
    assert {"device_memory_allocate", "device_memory_deallocate"} <= set(abi.REQUIRED_APIS)
    assert {"memory_copy_h2d", "memory_copy_d2h", "memory_copy_d2d", "device_memory_stats",
            "device_min_chunk_size"} <= set(abi.FALLBACKS)
    # What PaddlePaddle refuses a plugin without, llaisys requires too or has a fallback for.
    assert set(abi.PADDLE_REQUIRED_APIS) <= set(abi.REQUIRED_APIS) | set(abi.FALLBACKS)


def test_version_numbers_compare_as_paddlepaddle_does():
    assert abi.version_number(abi.MAJOR_VERSION, abi.MINOR_VERSION, abi.PATCH_VERSION) == 101
    assert abi.version_number(0, 1, 0) < 101 <= abi.version_number(0, 0, 150) < abi.version_number(1, 0, 0)


def test_a_plugin_built_with_a_mismatched_header_fails_to_compile(tmp_path):
    """The static size checks catch a header whose table lost a slot."""
    header = (include_dir() / "llaisys" / "device_ext.h").read_text()
    broken = tmp_path / "llaisys"
    broken.mkdir()
    (broken / "device_ext.h").write_text(header.replace("void *reserved_other_api[7];", "void *reserved_other_api[6];"))
    src = tmp_path / "p.c"
    src.write_text('#include "llaisys/device_ext.h"\nvoid InitPlugin(CustomRuntimeParams *p) { (void)p; }\n')
    proc = subprocess.run(["cc", "-c", f"-I{tmp_path}", str(src), "-o", str(tmp_path / "p.o")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "912" in proc.stderr


def test_build_errors_carry_the_compiler_output(tmp_path, monkeypatch):
    src = tmp_path / "bad.c"
    src.write_text("int broken(void) { return undeclared_name; }\n")
    with pytest.raises(RuntimeError, match="undeclared_name"):
        build_plugin(src, tmp_path / "libbad.so")
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob(".*tmp"))
    with pytest.raises(FileNotFoundError, match="nothing.c does not exist"):
        build_plugin(tmp_path / "nothing.c", tmp_path / "libx.so")
    monkeypatch.setenv("LLAISYS_INCLUDE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="set LLAISYS_INCLUDE_DIR"):
        include_dir()
