"""``MPICommunicator``: the collectives over MPI (``mpi4py``), for ranks whose tensors live in
host memory (the CPU device). Install with the ``mpi`` extra (``pip install llaisys[mpi]``:
mpi4py and MPICH from PyPI); start ranks with ``mpiexec -n N`` or let ``--tensor-parallel N``
start them.

Sums are MPI's (``MPI_Allreduce``); MPICH reduces in a fixed order for a given size and rank
count, so every rank holds bitwise the same result.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..tensor import Tensor
from .comm import CommError, Communicator, check_gather, check_root


CONTROL_TAG = 7  # the tag of control messages (broadcast_object), apart from any other traffic
SPIN_S = 0.002  # a rank waiting for a control message polls without sleeping this long first
IDLE_POLL_S = 0.01  # then sleeps between polls, doubling up to this


def import_mpi():
    """The ``mpi4py.MPI`` module, or an ImportError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # mpi4py absent, or its MPI library missing
        raise ImportError(f"tensor parallelism over MPI needs mpi4py and an MPI library ({e}); install them with "
                          "`pip install 'llaisys[mpi]'` (mpi4py and MPICH from PyPI)") from None
    return MPI


def world_size() -> int:
    """The number of ranks this process was started with (1 outside ``mpiexec``, or without
    mpi4py). Does not initialise MPI when the environment shows no launcher."""
    import os
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                return 1
    return 1


class MPICommunicator(Communicator):
    """The ranks of an MPI communicator (default ``MPI.COMM_WORLD``); CPU tensors only."""

    def __init__(self, comm: Any = None):
        MPI = import_mpi()
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def _host(self, tensor: Tensor, what: str) -> np.ndarray:
        if not tensor.device.is_cpu:
            raise ValueError(f"{what}: MPICommunicator works on CPU tensors; got one on {tensor.device} "
                             "(use the device plugin's collectives, XcclCommunicator)")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the tensor must be contiguous")
        return tensor.host_array().reshape(-1)

    def all_reduce(self, tensor: Tensor) -> None:
        buf = self._host(tensor, "all_reduce")
        try:
            self.comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._mpi.SUM)
        except self._mpi.Exception as e:
            raise CommError(f"rank {self.rank}: MPI all_reduce of {buf.size} elements failed: {e}") from None

    def all_gather(self, out: Tensor, tensor: Tensor) -> None:
        check_gather(out, tensor, self.size)
        send, recv = self._host(tensor, "all_gather"), self._host(out, "all_gather")
        try:
            self.comm.Allgather(send, recv)
        except self._mpi.Exception as e:
            raise CommError(f"rank {self.rank}: MPI all_gather of {send.size} elements failed: {e}") from None

    def broadcast(self, tensor: Tensor, root: int = 0) -> None:
        check_root(root, self.size)
        buf = self._host(tensor, "broadcast")
        try:
            self.comm.Bcast(buf, root=root)
        except self._mpi.Exception as e:
            raise CommError(f"rank {self.rank}: MPI broadcast of {buf.size} elements failed: {e}") from None

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Root sends ``obj`` to each rank; a receiving rank waits by polling, spinning for
        a moment and then sleeping up to ``IDLE_POLL_S``: MPI's blocking calls spin, and a
        rank waiting for the next request of an idle server would keep a core busy."""
        check_root(root, self.size)
        if self.rank == root:
            for dest in range(self.size):
                if dest != root:
                    self.comm.send(obj, dest=dest, tag=CONTROL_TAG)
            return obj
        start, delay = time.perf_counter(), 0.0
        while (message := self.comm.improbe(source=root, tag=CONTROL_TAG)) is None:
            if time.perf_counter() - start > SPIN_S:
                time.sleep(delay)
                delay = min(IDLE_POLL_S, max(1e-4, 2 * delay))
        return message.recv()
