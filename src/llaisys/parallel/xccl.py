"""``XcclCommunicator``: the collectives of a device plugin (its ``xccl_*`` functions), for
ranks whose tensors live on that plugin's device.

A bootstrap communicator (``MPICommunicator``) gives the ranks and carries the unique id from
rank 0 to the others; every rank then joins the plugin's communicator. Collectives run on a
stream the communicator owns and are synchronized before a call returns, so they are blocking
like every ``Communicator``'s. The reference plugin (``plugins/custom_cpu``) serves ranks in
several processes of one host through shared memory.
"""
from __future__ import annotations

import ctypes
from typing import Any

from ..backends.plugin import abi
from ..backends.plugin.backend import PluginBackend
from ..backends.plugin.errors import PluginError
from ..runtime import DataType, get_runtime
from ..runtime.device import Device, as_device
from ..tensor import Tensor
from .comm import CommError, Communicator, check_gather, check_root

REQUIRED_APIS = ("xccl_get_unique_id_size", "xccl_get_unique_id", "xccl_comm_init_rank", "xccl_destroy_comm",
                 "xccl_all_reduce", "xccl_all_gather", "xccl_broadcast")
_SUM = 0  # C_CCLReduceOp SUM


class XcclCommunicator(Communicator):
    """The ranks of ``bootstrap`` joined in a communicator of the plugin device ``device``
    (a Device or a name such as ``"custom_cpu:0"``); this process is ``bootstrap.rank``."""

    def __init__(self, device: "Device | str", bootstrap: Communicator):
        self.device = as_device(device)
        self.bootstrap = bootstrap
        self.rank, self.size = bootstrap.rank, bootstrap.size
        backend = get_runtime(self.device).backend
        if not isinstance(backend, PluginBackend):
            raise ValueError(f"XcclCommunicator needs a plugin device; {self.device} is served by "
                             f"{type(backend).__name__} (use MPICommunicator for CPU tensors)")
        missing = [api for api in REQUIRED_APIS if not backend.has_api(api)]
        if missing:
            raise PluginError(f"plugin {backend.library}: the collectives of {self.device.type.name} need "
                              f"{', '.join(missing)}, which the plugin does not provide")
        self._backend = backend
        self._table = backend.table
        self._comm: int | None = None
        self._stream: Any = None
        self._barrier_buf: Tensor | None = None
        uid = self._unique_id()
        root = abi.C_CCLRootId(len(uid), ctypes.cast(uid, ctypes.c_void_p))
        comm = ctypes.c_void_p()
        self._check("xccl_comm_init_rank", self._table.xccl_comm_init_rank(self.size, ctypes.byref(root), self.rank,
                                                                          ctypes.byref(comm)))
        self._comm = comm.value
        try:
            self._stream = backend.create_stream(self.device.index)
        except BaseException:
            self.close()
            raise

    def _unique_id(self) -> ctypes.Array:
        """Rank 0's unique id, as a buffer on every rank. A failure on rank 0 reaches the other
        ranks too, so that none waits for a communicator that will not come."""
        size = ctypes.c_size_t(0)
        self._check("xccl_get_unique_id_size", self._table.xccl_get_unique_id_size(ctypes.byref(size)))
        payload: "bytes | str | None" = None
        if self.rank == 0:
            buf = ctypes.create_string_buffer(size.value)
            root = abi.C_CCLRootId(size.value, ctypes.cast(buf, ctypes.c_void_p))
            status = self._table.xccl_get_unique_id(ctypes.byref(root))
            ok = status in (abi.C_SUCCESS, abi.C_WARNING)
            payload = buf.raw if ok else self._message("xccl_get_unique_id", status)
        payload = self.bootstrap.broadcast_object(payload, root=0)
        if isinstance(payload, str):
            raise CommError(payload)
        return ctypes.create_string_buffer(payload, len(payload))

    # ---- status and arguments ------------------------------------------------------------
    def _message(self, api: str, status: int) -> str:
        return f"rank {self.rank} of {self.size}: {api} on {self.device} returned {abi.status_name(status)}"

    def _check(self, api: str, status: int) -> None:
        if status not in (abi.C_SUCCESS, abi.C_WARNING):
            raise CommError(self._message(api, status))

    def _run(self, api: str, *args: Any) -> None:
        """Call collective ``api`` on the communicator's stream and wait for it."""
        if self._comm is None:
            raise CommError(f"rank {self.rank}: {api} on a closed communicator")
        self._check(api, getattr(self._table, api)(*args, self._comm, self._stream))
        self._backend.synchronize_stream(self.device.index, self._stream)

    def _buffer(self, tensor: Tensor, what: str, written: bool = True) -> tuple[int, int, int]:
        """(address, elements, C_DataType) of ``tensor``, which must be contiguous and on this
        communicator's device."""
        if tensor.device != self.device:
            raise ValueError(f"{what}: the tensor is on {tensor.device}; this communicator works on {self.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the tensor must be contiguous")
        if written:
            tensor.check_writable(what)
        return tensor.data_ptr, tensor.numel(), abi.to_c_dtype(tensor.dtype)

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor) -> None:
        """Sum ``tensor`` over all ranks, in place (the plugin's ``xccl_all_reduce``, SUM)."""
        ptr, n, dtype = self._buffer(tensor, "all_reduce")
        self._run("xccl_all_reduce", ptr, ptr, n, dtype, _SUM)

    def all_gather(self, out: Tensor, tensor: Tensor) -> None:
        """out = every rank's ``tensor`` one after another in rank order (``xccl_all_gather``)."""
        check_gather(out, tensor, self.size)
        src, n, dtype = self._buffer(tensor, "all_gather", written=False)
        dst, _, _ = self._buffer(out, "all_gather")
        self._run("xccl_all_gather", src, dst, n, dtype)

    def broadcast(self, tensor: Tensor, root: int = 0) -> None:
        """Every rank's ``tensor`` = root's ``tensor`` (``xccl_broadcast``)."""
        check_root(root, self.size)
        ptr, n, dtype = self._buffer(tensor, "broadcast", written=self.rank != root)
        self._run("xccl_broadcast", ptr, n, dtype, root)

    def barrier(self) -> None:
        """Return once every rank has called it: an all-reduce of one element on the device."""
        if self._barrier_buf is None:
            self._barrier_buf = Tensor.zeros((1,), DataType.I32, self.device)
        self.all_reduce(self._barrier_buf)

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Root's picklable ``obj`` on every rank, over the bootstrap communicator."""
        return self.bootstrap.broadcast_object(obj, root=root)

    def abort(self, code: int = 1) -> None:
        """End every rank, through the bootstrap communicator."""
        self.bootstrap.abort(code)

    def close(self) -> None:
        """Destroy the plugin's communicator and the stream (idempotent)."""
        comm, self._comm = self._comm, None
        stream, self._stream = self._stream, None
        self._barrier_buf = None
        if stream is not None:
            self._backend.destroy_stream(self.device.index, stream)
        if comm is not None:
            self._check("xccl_destroy_comm", self._table.xccl_destroy_comm(comm))
