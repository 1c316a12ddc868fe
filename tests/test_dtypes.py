"""Data types, device types and copy kinds against the runtime header, NumPy and PyTorch."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import llaisys
from llaisys import DataType, DeviceType, MemcpyKind
from llaisys.runtime import as_device, as_dtype, lookup_device_type, register_device_type
from llaisys.runtime.device import unregister_device_type

# llaisysDataType_t of the runtime's C header.
HEADER_DTYPES = {
    "INVALID": 0, "BYTE": 1, "BOOL": 2, "I8": 3, "I16": 4, "I32": 5, "I64": 6, "U8": 7, "U16": 8,
    "U32": 9, "U64": 10, "F8": 11, "F16": 12, "F32": 13, "F64": 14, "C16": 15, "C32": 16,
    "C64": 17, "C128": 18, "BF16": 19,
}

# The same types in PyTorch, an independent statement of their element sizes.
TORCH = {
    DataType.BOOL: torch.bool, DataType.I8: torch.int8, DataType.I16: torch.int16,
    DataType.I32: torch.int32, DataType.I64: torch.int64, DataType.U8: torch.uint8,
    DataType.U16: torch.uint16, DataType.U32: torch.uint32, DataType.U64: torch.uint64,
    DataType.F8: torch.float8_e4m3fn, DataType.F16: torch.float16, DataType.F32: torch.float32,
    DataType.F64: torch.float64, DataType.C32: torch.complex32, DataType.C64: torch.complex64,
    DataType.C128: torch.complex128, DataType.BF16: torch.bfloat16,
}

NUMPY_TYPES = [t for t in DataType if t not in (DataType.INVALID, DataType.C16, DataType.C32) and not t.is_quantized]


def test_numbering_matches_header():
    assert {t.name: int(t) for t in DataType if not t.is_quantized} == HEADER_DTYPES


def test_block_formats_are_numbered_after_their_ggml_type():
    import gguf

    quantized = [t for t in DataType if t.is_quantized]
    assert [t.name for t in quantized] == ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
    for t in quantized:
        ggml = gguf.GGMLQuantizationType[t.name]
        assert int(t) == 100 + int(ggml) == 100 + t.ggml_type
        assert (t.block_size, t.block_bytes) == gguf.GGML_QUANT_SIZES[ggml]
    assert (DataType.F32.block_size, DataType.F32.block_bytes, DataType.F32.is_quantized) == (1, 4, False)
    assert DataType.Q4_1.nbytes_of(64) == 40 and DataType.F16.nbytes_of(3) == 6
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        DataType.Q4_1.nbytes_of(48)
    with pytest.raises(TypeError, match="Q4_1 stores 32 elements in 20 bytes"):
        DataType.Q4_1.itemsize


@pytest.mark.parametrize("dt", list(TORCH), ids=lambda t: t.name)
def test_itemsize_matches_torch(dt):
    assert dt.itemsize == TORCH[dt].itemsize


def test_itemsize_of_types_torch_lacks():
    # BYTE is one byte; C16 is a complex of two 8-bit floats.
    assert (DataType.BYTE.itemsize, DataType.C16.itemsize, DataType.INVALID.itemsize) == (1, 2, 0)


@pytest.mark.parametrize("dt", NUMPY_TYPES, ids=lambda t: t.name)
def test_numpy_mapping_has_the_same_size_and_round_trips(dt):
    npd = dt.numpy
    assert npd.itemsize == dt.itemsize
    expected = DataType.U8 if dt is DataType.BYTE else dt  # uint8 reads back as U8
    assert as_dtype(npd) is expected


def test_low_precision_types_come_from_ml_dtypes():
    assert DataType.BF16.numpy == np.dtype(ml_dtypes.bfloat16)
    assert DataType.F8.numpy == np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("dt", [DataType.F16, DataType.BF16, DataType.F8], ids=lambda t: t.name)
def test_low_precision_rounding_matches_torch(dt):
    values = np.random.default_rng(0).standard_normal(257).astype(np.float32) * 3  # (257,)
    ours = llaisys.Tensor.from_numpy(values, dtype=dt)
    ref = torch.from_numpy(values).to(TORCH[dt])
    assert ours.numpy().tobytes() == ref.view(torch.uint8).numpy().tobytes()


def test_types_without_numpy_equivalent_say_so():
    with pytest.raises(TypeError, match="C16 has no NumPy equivalent"):
        DataType.C16.numpy


@pytest.mark.parametrize("name, expected", [
    ("f32", DataType.F32), ("F16", DataType.F16), ("bfloat16", DataType.BF16), ("float16", DataType.F16),
    ("i64", DataType.I64), ("int64", DataType.I64), ("<f4", DataType.F32), ("bool", DataType.BOOL),
])
def test_names(name, expected):
    assert as_dtype(name) is expected


def test_numpy_inputs():
    assert as_dtype(np.float32) is DataType.F32
    assert as_dtype(np.dtype(">f4")) is DataType.F32  # byte order is a storage detail
    assert as_dtype(np.dtype(np.int64)) is DataType.I64


@pytest.mark.parametrize("bad, exc, message", [
    ("floaty", ValueError, "unknown data type 'floaty'"),
    (None, TypeError, "got None"),
    (np.dtype("U5"), TypeError, "has no llaisys data type"),
    (object(), TypeError, "cannot interpret"),
])
def test_bad_data_types(bad, exc, message):
    with pytest.raises(exc, match=message):
        as_dtype(bad)


def test_memcpy_kinds_match_header():
    assert {k.name: int(k) for k in MemcpyKind} == {"H2H": 0, "H2D": 1, "D2H": 2, "D2D": 3}


def test_builtin_device_types():
    assert (DeviceType.CPU.id, DeviceType.CPU.name) == (0, "cpu")
    assert (DeviceType.NVIDIA.id, DeviceType.NVIDIA.name) == (1, "nvidia")
    assert lookup_device_type("CPU") is DeviceType.CPU


def test_custom_device_type_by_name():
    dt = register_device_type("Test_Accel")
    try:
        assert dt.name == "test_accel" and dt.id >= 2
        assert lookup_device_type("test_accel") is dt
        assert as_device("test_accel:3").type is dt and as_device("test_accel:3").index == 3
        with pytest.raises(ValueError, match="already registered"):
            register_device_type("test_accel")
    finally:
        unregister_device_type("test_accel")
    with pytest.raises(ValueError, match="unknown device type 'test_accel'; known device types: cpu, nvidia"):
        lookup_device_type("test_accel")


@pytest.mark.parametrize("bad", ["", "a:b", "sp ace"])
def test_bad_device_type_names(bad):
    with pytest.raises(ValueError, match="invalid device type name"):
        register_device_type(bad)


@pytest.mark.parametrize("text, message", [("cpu:x", "expected 'type' or 'type:index'"), ("cpu:-1", "must be >= 0")])
def test_bad_device_names(text, message):
    with pytest.raises(ValueError, match=message):
        as_device(text)


def test_the_table_of_ggml_types_is_ggmls():
    """runtime.block_formats, which every other view of the GGML types reads, against the gguf
    package's ids and sizes."""
    import gguf

    from llaisys.runtime.block_formats import BLOCK_FORMATS, block_format

    for f in BLOCK_FORMATS:
        ggml = gguf.GGMLQuantizationType[f.name]
        assert f.type_id == int(ggml) and (f.block_size, f.block_bytes) == gguf.GGML_QUANT_SIZES[ggml], f.name
    assert block_format("q4_k") is block_format(12) is block_format(gguf.GGMLQuantizationType.Q4_K)
    with pytest.raises(KeyError, match="unknown GGML type 99"):
        block_format(99)
