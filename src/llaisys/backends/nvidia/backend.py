"""The device interface of NVIDIA GPUs over torch's CUDA runtime, and its CPU-simulated mode.

Memory: ``allocate`` makes a ``torch.empty(n, dtype=torch.uint8, device="cuda:i")`` and keeps
it; the pointer it returns is that tensor's address, opaque to everything above. The caching
allocator of the runtime carves tensors out of these blocks, so kernels find the block that
holds a pointer (``block_at``) and build a torch view of it (``torch_view``) from (pointer,
dtype, shape, strides). Pinned host memory comes the same way from ``pin_memory=True``.

Simulated mode (``LLAISYS_NVIDIA_SIMULATE=1``, or ``=N`` for N devices; tests only): the same
class over torch CPU tensors. Copies are torch copies, streams and events are synchronous,
and the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton is imported). Device memory is still opaque: ``host_view`` refuses it, so every path
above is the one a GPU takes.
"""
from __future__ import annotations

import bisect
import ctypes
import logging
import os
import sys
import threading
from typing import Any, Callable

import torch

from ...runtime.device import DeviceType
from ...runtime.dtypes import MemcpyKind
from ...runtime.errors import OutOfMemoryError
from ...runtime.interface import MiB, AllocatorSizes, DeviceBackend

log = logging.getLogger(__name__)

SIMULATE_ENV = "LLAISYS_NVIDIA_SIMULATE"
TF32_ENV = "LLAISYS_NVIDIA_TF32"


def simulated() -> int:
    """Number of simulated devices asked for by ``LLAISYS_NVIDIA_SIMULATE`` (0: real GPUs)."""
    value = os.environ.get(SIMULATE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return 0
    if value in ("true", "yes", "on"):
        return 1
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{SIMULATE_ENV}={value!r}: expected a device count (1, 2, ...) or 0") from None
    if count < 0:
        raise ValueError(f"{SIMULATE_ENV}={value!r}: expected a device count (1, 2, ...) or 0")
    return count


def _enable_interpreter() -> None:
    """Make Triton interpret kernels on the CPU. Triton reads ``TRITON_INTERPRET`` when it is
    imported (its own library functions are decorated then), so it must not be imported yet;
    afterwards its knob keeps the setting whatever the environment says."""
    if "triton" in sys.modules:
        from triton import knobs

        if not knobs.runtime.interpret:
            raise RuntimeError("the simulated nvidia backend needs TRITON_INTERPRET=1 before triton is imported; "
                               "set it in the environment of the process")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton import knobs

    knobs.runtime.interpret = True


def prepare_triton() -> None:
    """Called before the kernels import Triton: under the simulated mode, the interpreter."""
    if simulated():
        _enable_interpreter()


class _Blocks:
    """Memory blocks (torch uint8 tensors) by base address, to find the block holding a pointer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tensors: dict[int, "torch.Tensor"] = {}
        self._bases: list[int] = []  # sorted

    def add(self, t: "torch.Tensor") -> int:
        ptr = t.data_ptr()
        with self._lock:
            self._tensors[ptr] = t
            bisect.insort(self._bases, ptr)
        return ptr

    def pop(self, ptr: int) -> "torch.Tensor":
        with self._lock:
            t = self._tensors.pop(ptr)
            del self._bases[bisect.bisect_left(self._bases, ptr)]
        return t

    def find(self, ptr: int, nbytes: int) -> "tuple[torch.Tensor, int] | None":
        """(block, byte offset) of the block holding [ptr, ptr + nbytes), or None."""
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                return None
            base = self._bases[i]
            block = self._tensors[base]
        offset = ptr - base
        return (block, offset) if offset + nbytes <= block.numel() else None

    def __len__(self) -> int:
        return len(self._tensors)


class SimStream:
    """A stream of the simulated mode: work runs at once, so it is always complete."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class SimEvent:
    """An event of the simulated mode: complete once recorded (work runs at once)."""

    __slots__ = ("recorded",)

    def __init__(self) -> None:
        self.recorded = False


class NvidiaBackend(DeviceBackend):
    """NVIDIA GPUs through torch.cuda (or, simulated, torch CPU tensors)."""

    device_type = DeviceType.NVIDIA

    def __init__(self, simulate: int = 0, interpret: bool = True):
        self.simulate = simulate
        if simulate:
            if interpret:  # (False: kernels are recorded, never run; see kernels.nvidia.aot)
                _enable_interpreter()
            self.origin = f"cuda-simulated ({simulate} device(s) over torch CPU tensors, Triton interpreter)"
            self._count = simulate
        else:
            if not torch.cuda.is_available():
                build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
                raise RuntimeError(f"no NVIDIA GPU is visible to torch {torch.__version__} ({build}); run on a machine "
                                   "with a GPU and `pip install 'llaisys[cuda]'`, or use --device cpu")
            self._count = torch.cuda.device_count()
            self.origin = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
            # F32 means F32: TF32 GEMMs would round the inputs to 10 bits (LLAISYS_NVIDIA_TF32=1 allows it).
            allow_tf32 = os.environ.get(TF32_ENV, "0") == "1"
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            torch.backends.cudnn.allow_tf32 = allow_tf32
        self._blocks = _Blocks()
        self._host_blocks = _Blocks()
        self._current = 0
        log.info("nvidia backend: %d device(s), %s", self._count, self.origin)

    # ---- helpers for the kernels -----------------------------------------------------
    def torch_device(self, index: int) -> "torch.device":
        """The torch device that holds device ``index``'s memory."""
        return torch.device("cpu") if self.simulate else torch.device("cuda", index)

    def block_at(self, ptr: int, nbytes: int) -> "tuple[torch.Tensor, int]":
        """(block, byte offset) of the device memory [ptr, ptr + nbytes); ValueError when no
        block from ``allocate`` holds it."""
        found = self._blocks.find(ptr, nbytes)
        if found is None:
            raise ValueError(f"{nbytes} bytes at {ptr:#x} are not nvidia device memory from this backend")
        return found

    def torch_view(self, ptr: int, dtype: "torch.dtype", shape: tuple, strides: tuple) -> "torch.Tensor":
        """A torch tensor over device memory at ``ptr`` (``shape``, ``strides`` in elements)."""
        item = torch.empty((), dtype=dtype).element_size()
        span = item * (1 + sum((d - 1) * s for d, s in zip(shape, strides))) if all(shape) else 0
        block, offset = self.block_at(ptr, span)
        if offset % item:
            raise ValueError(f"pointer {ptr:#x} is not aligned to {item} bytes for {dtype}")
        view = torch.empty(0, dtype=dtype, device=block.device)
        return view.set_(block.untyped_storage(), offset // item, shape, strides)

    def _device_bytes(self, ptr: int, nbytes: int) -> "torch.Tensor":
        block, offset = self.block_at(ptr, nbytes)
        return block[offset:offset + nbytes]

    def _host_bytes(self, ptr: int, nbytes: int) -> "torch.Tensor":
        """A uint8 tensor over host memory at ``ptr``: a view of pinned memory from
        ``host_allocate`` when it lies there, else of the plain address."""
        found = self._host_blocks.find(ptr, nbytes)
        if found is not None:
            block, offset = found
            return block[offset:offset + nbytes]
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)

    # ---- device ----------------------------------------------------------------------
    def device_count(self) -> int:
        return self._count

    def set_device(self, index: int) -> None:
        self._current = index
        if not self.simulate:
            torch.cuda.set_device(index)

    def synchronize_device(self, index: int) -> None:
        if not self.simulate:
            torch.cuda.synchronize(index)

    # ---- streams and events ------------------------------------------------------------
    def create_stream(self, index: int) -> Any:
        return SimStream(index) if self.simulate else torch.cuda.Stream(device=index)

    def destroy_stream(self, index: int, stream: Any) -> None:
        if stream is not None and not self.simulate:
            stream.synchronize()

    def synchronize_stream(self, index: int, stream: Any) -> None:
        if self.simulate:
            return
        (torch.cuda.current_stream(index) if stream is None else stream).synchronize()

    def query_stream(self, index: int, stream: Any) -> bool:
        if self.simulate:
            return True
        return (torch.cuda.current_stream(index) if stream is None else stream).query()

    def create_event(self, index: int) -> Any:
        return SimEvent() if self.simulate else torch.cuda.Event()

    def record_event(self, index: int, stream: Any, event: Any) -> None:
        if self.simulate:
            event.recorded = True
        else:
            event.record(torch.cuda.current_stream(index) if stream is None else stream)

    def query_event(self, index: int, event: Any) -> bool:
        return True if self.simulate else event.query()

    def synchronize_event(self, index: int, event: Any) -> None:
        if not self.simulate:
            event.synchronize()

    def stream_wait_event(self, index: int, stream: Any, event: Any) -> None:
        if not self.simulate:
            (torch.cuda.current_stream(index) if stream is None else stream).wait_event(event)

    # ---- memory ------------------------------------------------------------------------
    def allocate(self, index: int, nbytes: int) -> int:
        try:
            t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.torch_device(index))
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "allocate" not in str(exc):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise OutOfMemoryError(f"nvidia:{index}", "allocate", f"no room for {nbytes} bytes ({first})") from None
        return self._blocks.add(t)

    def deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        self._blocks.pop(ptr)

    def host_allocate(self, index: int, nbytes: int) -> int:
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=not self.simulate)
        return self._host_blocks.add(t)

    def host_deallocate(self, index: int, ptr: int, nbytes: int) -> None:
        self._host_blocks.pop(ptr)

    def copy_h2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        self._device_bytes(dst, nbytes).copy_(self._host_bytes(src, nbytes))

    def copy_d2h(self, index: int, dst: int, src: int, nbytes: int) -> None:
        self._host_bytes(dst, nbytes).copy_(self._device_bytes(src, nbytes))

    def copy_d2d(self, index: int, dst: int, src: int, nbytes: int) -> None:
        self._device_bytes(dst, nbytes).copy_(self._device_bytes(src, nbytes))

    def copy(self, index: int, dst: int, src: int, nbytes: int, kind: MemcpyKind) -> None:
        if kind == MemcpyKind.H2H:
            self._host_bytes(dst, nbytes).copy_(self._host_bytes(src, nbytes))
        else:
            super().copy(index, dst, src, nbytes, kind)

    def copy_async(self, index: int, dst: int, src: int, nbytes: int, kind: MemcpyKind, stream: Any) -> None:
        if self.simulate:
            self.copy(index, dst, src, nbytes, kind)
            return
        dev = self._device_bytes
        host = self._host_bytes
        d, s = {MemcpyKind.H2D: (dev, host), MemcpyKind.D2H: (host, dev), MemcpyKind.D2D: (dev, dev)}.get(
            MemcpyKind(kind), (host, host))
        with torch.cuda.stream(torch.cuda.current_stream(index) if stream is None else stream):
            d(dst, nbytes).copy_(s(src, nbytes), non_blocking=True)

    def memset(self, index: int, ptr: int, value: int, nbytes: int) -> None:
        self._device_bytes(ptr, nbytes).fill_(value)

    def memory_stats(self, index: int) -> tuple[int, int]:
        if not self.simulate:
            free, total = torch.cuda.mem_get_info(index)
            return total, free
        try:
            size = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_PHYS_PAGES") * size, os.sysconf("SC_AVPHYS_PAGES") * size
        except (ValueError, OSError, AttributeError):
            return 0, 0

    def allocator_sizes(self, index: int) -> AllocatorSizes:
        # 512-byte rounding as cudaMalloc's; weights above 64 MiB get their own blocks.
        chunk = 16 * MiB if self.simulate else 256 * MiB
        return AllocatorSizes(min_chunk_size=512, max_chunk_size=64 * MiB, max_alloc_size=0,
                              extra_padding_size=0, init_alloc_size=chunk, realloc_size=chunk)

    def fallbacks(self) -> list[str]:
        # torch has no cudaLaunchHostFunc: a callback waits for its stream, then runs.
        return ["stream_add_callback"]

    # ---- CUDA graphs -------------------------------------------------------------------
    def capture(self, index: int, fn: Callable[[], None], warmup: int = 1) -> Callable[[], None]:
        """``fn`` (kernel launches on the device, no host syncs) recorded as a CUDA graph;
        returns the replay. ``fn`` runs ``warmup`` times first on a side stream (Triton
        compiles there). Simulated mode (tests only) has no graphs: a ``SimulatedGraph`` keeps
        ``fn`` and its replay calls it (no warm-up: the interpreter compiles nothing)."""
        if self.simulate:
            from .graphs import SimulatedGraph

            return SimulatedGraph(fn).replay
        side = torch.cuda.Stream(device=index)
        side.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(index).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a server's) do not break this capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        return graph.replay

    def graph_cache(self, index: int) -> "Any":
        """A new ``graphs.GraphCache`` for device ``index`` to replay decoding steps from, or
        None when ``LLAISYS_NVIDIA_GRAPHS=0`` turns graphs off."""
        from .graphs import GraphCache, graphs_enabled

        return GraphCache(self, index) if graphs_enabled() else None

    def is_capturing(self) -> bool:
        """True while a CUDA graph is being captured on the current stream (no host syncs then)."""
        return not self.simulate and torch.cuda.is_current_stream_capturing()


def create_backend() -> NvidiaBackend:
    """Entry point used by the backend registry: real GPUs, or simulated ones when
    ``LLAISYS_NVIDIA_SIMULATE`` asks for them."""
    return NvidiaBackend(simulate=simulated())
