"""Runtime layer: data types, devices, backends, streams, events and memory."""
from .allocator import AllocatorStats, CachingAllocator
from .backends import available_backends, get_backend, register_backend, unregister_backend
from .context import current_device, set_device
from .device import Device, DeviceType, as_device, device_types, lookup_device_type, register_device_type
from .dtypes import DataType, MemcpyKind, as_dtype
from .errors import DeviceError, KernelNotFoundError, LlaisysError, OutOfMemoryError
from .interface import DEFAULT_ALLOCATOR_SIZES, AllocatorSizes, DeviceBackend
from .runtime import Runtime, get_runtime, synchronize
from .stream import Event, Stream
