"""ctypes bindings of ``include/llaisys/device_ext.h`` and ``kernel_ext.h``.

The structures here mirror the headers field for field; each is registered with
``llaisys._native`` as a mirror of the structure ``csrc/host/layouts.c`` describes (compiled
against these headers), so loading the host library, which the plugin loader does before it
opens any plugin, compares their sizes and offsets with the C compiler's. The tables below
are the ABI's contract: which APIs a plugin must provide, and what llaisys does in place of
each optional one it leaves NULL.
"""
from __future__ import annotations

import ctypes
from ctypes import CFUNCTYPE, POINTER, c_char_p, c_double, c_float, c_int, c_int32, c_int64, c_size_t, c_uint64, c_void_p

from ... import _native
from ...runtime.dtypes import DataType

MAJOR_VERSION, MINOR_VERSION, PATCH_VERSION = 0, 1, 1
KERNEL_ABI_VERSION = 1


def version_number(major: int, minor: int, patch: int) -> int:
    """The one number PaddlePaddle compares runtime versions by: 0.1.1 is 101. A plugin below
    ``version_number(MAJOR_VERSION, MINOR_VERSION, PATCH_VERSION)`` is refused."""
    return major * 10000 + minor * 100 + patch


# ---- C_Status ------------------------------------------------------------------------------
C_SUCCESS, C_WARNING, C_FAILED, C_ERROR, C_INTERNAL_ERROR = range(5)
STATUS_NAMES = {C_SUCCESS: "C_SUCCESS", C_WARNING: "C_WARNING", C_FAILED: "C_FAILED",
                C_ERROR: "C_ERROR", C_INTERNAL_ERROR: "C_INTERNAL_ERROR"}


def status_name(status: int) -> str:
    """``C_ERROR`` for 3; an unknown value as ``C_Status(17)``."""
    return STATUS_NAMES.get(status, f"C_Status({status})")


# ---- C_DataType and C_DataLayout -------------------------------------------------------------
C_DATA_TYPES = ("UNDEFINED", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                "INT64", "FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16", "COMPLEX64", "COMPLEX128")
C_DATA_LAYOUTS = ("ANY", "NHWC", "NCHW", "NCDHW", "NDHWC", "STRIDED")  # ALL_LAYOUT = ANY

_TO_C_DTYPE = {
    DataType.BOOL: 1, DataType.BYTE: 2, DataType.U8: 2, DataType.U16: 3, DataType.U32: 4,
    DataType.U64: 5, DataType.I8: 6, DataType.I16: 7, DataType.I32: 8, DataType.I64: 9,
    DataType.F16: 10, DataType.F32: 11, DataType.F64: 12, DataType.BF16: 13,
    DataType.C64: 14, DataType.C128: 15,
}


def to_c_dtype(dtype: DataType) -> int:
    """The ``C_DataType`` value of ``dtype``; TypeError for types the plugin ABI lacks (F8, C16,
    C32, and the block-quantized formats, which plugins never see)."""
    try:
        return _TO_C_DTYPE[dtype]
    except KeyError:
        if dtype.is_quantized:
            raise TypeError(f"data type {dtype.name} is a block-quantized format, which the plugin ABI does not "
                            "carry: ops on quantized tensors run on the CPU (the kernel fallback)") from None
        raise TypeError(f"data type {dtype.name} has no C_DataType in the plugin ABI") from None


def from_c_dtype(value: int) -> tuple[DataType, ...]:
    """The llaisys data types a ``C_DataType`` value stands for (UINT8 is both U8 and BYTE)."""
    found = tuple(t for t, v in _TO_C_DTYPE.items() if v == value)
    if not found:
        raise ValueError(f"C_DataType {value} is not a known element type")
    return found


def c_dtype_name(value: int) -> str:
    """``FLOAT32`` for 11."""
    return C_DATA_TYPES[value] if 0 <= value < len(C_DATA_TYPES) else f"C_DataType({value})"


# ---- device ABI --------------------------------------------------------------------------------
@_native.mirror("host", "C_Device_st")
class C_Device_st(ctypes.Structure):
    _fields_ = [("id", c_int)]


C_Device = POINTER(C_Device_st)
C_Stream = c_void_p
C_Event = c_void_p
Status = c_int
size_p = POINTER(c_size_t)
C_Callback = CFUNCTYPE(None, C_Device, c_void_p, c_void_p, POINTER(c_int))


@_native.mirror("host", "C_CCLRootId")
class C_CCLRootId(ctypes.Structure):
    _fields_ = [("sz", c_size_t), ("data", c_void_p)]


def _fn(*argtypes) -> type:
    return CFUNCTYPE(Status, *argtypes)


_COPY = (C_Device, c_void_p, c_void_p, c_size_t)
_ASYNC_COPY = (C_Device, C_Stream, c_void_p, c_void_p, c_size_t)
_SIZE_QUERY = (C_Device, size_p)
_CCL = (c_void_p, c_void_p, c_size_t, c_int)

# (name, argument types) in header order; an int is a reserved array of that many pointers.
INTERFACE_LAYOUT: tuple[tuple[str, "tuple | int"], ...] = (
    ("initialize", ()), ("finalize", ()),
    ("init_device", (C_Device,)), ("set_device", (C_Device,)), ("get_device", (C_Device,)),
    ("deinit_device", (C_Device,)),
    ("create_stream", (C_Device, POINTER(C_Stream))), ("destroy_stream", (C_Device, C_Stream)),
    ("query_stream", (C_Device, C_Stream)),
    ("stream_add_callback", (C_Device, C_Stream, C_Callback, c_void_p)),
    ("create_event", (C_Device, POINTER(C_Event))), ("record_event", (C_Device, C_Stream, C_Event)),
    ("destroy_event", (C_Device, C_Event)), ("query_event", (C_Device, C_Event)),
    ("synchronize_device", (C_Device,)), ("synchronize_stream", (C_Device, C_Stream)),
    ("synchronize_event", (C_Device, C_Event)), ("stream_wait_event", (C_Device, C_Stream, C_Event)),
    ("reserved_dev_api", 8),
    ("device_memory_allocate", (C_Device, POINTER(c_void_p), c_size_t)),
    ("device_memory_deallocate", (C_Device, c_void_p, c_size_t)),
    ("device_memory_set", (C_Device, c_void_p, ctypes.c_ubyte, c_size_t)),
    ("host_memory_allocate", (C_Device, POINTER(c_void_p), c_size_t)),
    ("host_memory_deallocate", (C_Device, c_void_p, c_size_t)),
    ("unified_memory_allocate", (C_Device, POINTER(c_void_p), c_size_t)),
    ("unified_memory_deallocate", (C_Device, c_void_p, c_size_t)),
    ("memory_copy_h2d", _COPY), ("memory_copy_d2h", _COPY), ("memory_copy_d2d", _COPY),
    ("memory_copy_p2p", (C_Device, C_Device, c_void_p, c_void_p, c_size_t)),
    ("async_memory_copy_h2d", _ASYNC_COPY), ("async_memory_copy_d2h", _ASYNC_COPY),
    ("async_memory_copy_d2d", _ASYNC_COPY),
    ("async_memory_copy_p2p", (C_Device, C_Device, C_Stream, c_void_p, c_void_p, c_size_t)),
    ("reserved_mem_api", 8),
    ("get_device_count", (size_p,)), ("get_device_list", (size_p,)),
    ("device_memory_stats", (C_Device, size_p, size_p)),
    ("device_min_chunk_size", _SIZE_QUERY), ("device_max_chunk_size", _SIZE_QUERY),
    ("device_max_alloc_size", _SIZE_QUERY), ("device_extra_padding_size", _SIZE_QUERY),
    ("device_init_alloc_size", _SIZE_QUERY), ("device_realloc_size", _SIZE_QUERY),
    ("get_compute_capability", (size_p,)), ("get_runtime_version", (size_p,)),
    ("get_driver_version", (size_p,)),
    ("reserved_info_api", 8),
    ("xccl_get_unique_id_size", (size_p,)), ("xccl_get_unique_id", (POINTER(C_CCLRootId),)),
    ("xccl_comm_init_rank", (c_size_t, POINTER(C_CCLRootId), c_size_t, POINTER(c_void_p))),
    ("xccl_destroy_comm", (c_void_p,)),
    ("xccl_all_reduce", _CCL + (c_int, c_void_p, C_Stream)),
    ("xccl_broadcast", (c_void_p, c_size_t, c_int, c_size_t, c_void_p, C_Stream)),
    ("xccl_reduce", _CCL + (c_int, c_size_t, c_void_p, C_Stream)),
    ("xccl_all_gather", _CCL + (c_void_p, C_Stream)),
    ("xccl_reduce_scatter", _CCL + (c_int, c_void_p, C_Stream)),
    ("xccl_group_start", ()), ("xccl_group_end", ()),
    ("xccl_send", (c_void_p, c_size_t, c_int, c_size_t, c_void_p, C_Stream)),
    ("xccl_recv", (c_void_p, c_size_t, c_int, c_size_t, c_void_p, C_Stream)),
    ("xccl_all_to_all", (POINTER(c_void_p), size_p, POINTER(c_int), POINTER(c_void_p), size_p,
                         POINTER(c_int), c_size_t, c_size_t, c_void_p, C_Stream)),
    ("reserved_ccl_api", 8),
    ("profiler_initialize", (c_void_p, POINTER(c_void_p))),
    ("profiler_finalize", (c_void_p, c_void_p)), ("profiler_prepare_tracing", (c_void_p, c_void_p)),
    ("profiler_start_tracing", (c_void_p, c_void_p)), ("profiler_stop_tracing", (c_void_p, c_void_p)),
    ("profiler_collect_trace_data", (c_void_p, c_uint64, c_void_p)),
    ("reserved_profiler_api", 8),
    ("blas_axpby", (C_Device, C_Stream, c_int, c_size_t, c_float, c_void_p, c_float, c_void_p)),
    ("reserved_other_api", 7),
)

API_NAMES = tuple(name for name, spec in INTERFACE_LAYOUT if not isinstance(spec, int))


@_native.mirror("host", "C_DeviceInterface")
class C_DeviceInterface(ctypes.Structure):
    _fields_ = [("size", c_size_t)] + [
        (name, c_void_p * spec if isinstance(spec, int) else _fn(*spec)) for name, spec in INTERFACE_LAYOUT
    ]


@_native.mirror("host", "CustomRuntimeVersion")
class CustomRuntimeVersion(ctypes.Structure):
    _fields_ = [("major", c_size_t), ("minor", c_size_t), ("patch", c_size_t)]


@_native.mirror("host", "CustomRuntimeParams")
class CustomRuntimeParams(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("interface", POINTER(C_DeviceInterface)),
        ("version", CustomRuntimeVersion),
        ("device_type", c_char_p),
        ("sub_device_type", c_char_p),
        ("reserved", ctypes.c_char * 32),
    ]


InitPluginFn = CFUNCTYPE(None, POINTER(CustomRuntimeParams))

# ---- which APIs are required, and the fallback of each optional one -----------------------------
# Required as the memory seed marks them, plus what llaisys needs to enumerate and select devices.
REQUIRED_APIS = (
    "set_device", "get_device", "get_device_count", "get_device_list",
    "device_memory_allocate", "device_memory_deallocate",
)

# Each copy direction needs its synchronous API or the asynchronous one (run on a private
# stream, then synchronized); a missing D2D copy may also go through the host.
COPY_APIS = {
    "memory_copy_h2d": "async_memory_copy_h2d",
    "memory_copy_d2h": "async_memory_copy_d2h",
    "memory_copy_d2d": "async_memory_copy_d2d",
}

# What PaddlePaddle's loader refuses a plugin without: llaisys's required APIs and the events,
# which have fallbacks here.
PADDLE_REQUIRED_APIS = REQUIRED_APIS + ("create_event", "record_event", "destroy_event", "synchronize_event")

FALLBACKS = {
    "initialize": "nothing to initialise",
    "finalize": "nothing to finalise",
    "init_device": "logical ids are the physical ids",
    "deinit_device": "nothing to release",
    "create_stream": "no streams: work is synchronous (with destroy_stream and a synchronize API)",
    "destroy_stream": "no streams: work is synchronous",
    "query_stream": "synchronize the stream, then report it done",
    "stream_add_callback": "synchronize the stream, then call on the host",
    "create_event": "no events: recording synchronizes the stream (with record, destroy, synchronize)",
    "record_event": "no events: recording synchronizes the stream",
    "destroy_event": "no events",
    "synchronize_event": "no events: a recorded event is already complete",
    "query_event": "synchronize the event, then report it done",
    "stream_wait_event": "the host waits for the event, then queues the work",
    "synchronize_device": "synchronize each stream llaisys made on the device",
    "synchronize_stream": "synchronize the device",
    "device_memory_set": "H2D copy of a host buffer filled with the value",
    "host_memory_allocate": "ordinary (pageable) host memory",
    "host_memory_deallocate": "ordinary (pageable) host memory",
    "async_memory_copy_h2d": "synchronize the stream, then copy synchronously",
    "async_memory_copy_d2h": "synchronize the stream, then copy synchronously",
    "async_memory_copy_d2d": "synchronize the stream, then copy synchronously",
    "memory_copy_h2d": "the asynchronous copy on a private stream, then synchronize it",
    "memory_copy_d2h": "the asynchronous copy on a private stream, then synchronize it",
    "memory_copy_d2d": "the asynchronous copy on a private stream, or D2H then H2D through the host",
    "device_memory_stats": "total and free memory unknown: reported as 0",
    "device_min_chunk_size": "256 bytes",
    "device_max_chunk_size": "64 MiB, or max_alloc_size if smaller",
    "device_max_alloc_size": "no cap: the device reports when it is full",
    "device_extra_padding_size": "0",
    "device_init_alloc_size": "64 MiB, capped at the max chunk size",
    "device_realloc_size": "64 MiB, capped at the max chunk size",
}

# ---- kernel ABI --------------------------------------------------------------------------------
@_native.mirror("host", "LlaisysTensorDesc")
class LlaisysTensorDesc(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("dtype", c_int), ("ndim", c_int32), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64))]


@_native.mirror("host", "LlaisysKernelAttr")
class LlaisysKernelAttr(ctypes.Structure):
    _fields_ = [("name", c_char_p), ("value", c_double)]


# The descriptor arrays (const LlaisysTensorDesc *const *) and the attributes pass as addresses.
LlaisysKernelFn = CFUNCTYPE(Status, C_Device, C_Stream, c_void_p, c_size_t, c_void_p, c_size_t, c_void_p, c_size_t)
RegisterKernelFn = CFUNCTYPE(Status, c_void_p, c_char_p, c_char_p, c_int, c_int, c_void_p)


@_native.mirror("host", "LlaisysKernelRegistrar")
class LlaisysKernelRegistrar(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("abi_version", c_size_t), ("context", c_void_p),
                ("register_kernel", RegisterKernelFn)]


InitPluginKernelsFn = CFUNCTYPE(Status, POINTER(LlaisysKernelRegistrar))
