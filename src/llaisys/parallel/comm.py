"""The communicator interface of tensor parallelism: the few collectives a sharded decoder
needs, over tensors on the ranks' devices, and a host channel for control messages.

Ranks are numbered 0 .. size-1; rank 0 drives (it runs the scheduler and the sampler, and
sends every other rank the inputs of each pass). Backends: ``SingleProcess`` (size 1, every
collective the identity), ``MPICommunicator`` (``mpi4py``, CPU tensors) and
``XcclCommunicator`` (a device plugin's ``xccl_*`` functions, bootstrapped over MPI).

Every tensor argument is contiguous and on the communicator's device; collectives are
blocking: when a call returns, the result is in the output tensor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ..tensor import Tensor


class CommError(RuntimeError):
    """A collective failed: a peer died, timed out, or a library returned an error."""


class Communicator(ABC):
    """A group of ``size`` ranks; this process is ``rank``."""

    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, tensor: Tensor) -> None:
        """Sum ``tensor`` over all ranks, in place: afterwards every rank holds the sum."""

    @abstractmethod
    def all_gather(self, out: Tensor, tensor: Tensor) -> None:
        """out = every rank's ``tensor`` (n elements) one after another in rank order
        (size * n elements; ``out`` is typically shaped (size, *tensor.shape))."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, root: int = 0) -> None:
        """Every rank's ``tensor`` = root's ``tensor``."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    @abstractmethod
    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Root's picklable ``obj`` on every rank (other ranks pass anything, usually None);
        the host channel that carries control messages and each pass's inputs."""

    def close(self) -> None:
        """Release the communicator's resources (idempotent)."""

    def abort(self, code: int = 1) -> None:
        """End every rank of the group now (a rank that cannot go on); the default exits this
        process only."""
        import os
        os._exit(code)

    @property
    def is_driver(self) -> bool:
        """Whether this rank drives the others (rank 0)."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class SingleProcess(Communicator):
    """A group of one: every collective leaves its data as it is."""

    rank, size = 0, 1

    def all_reduce(self, tensor: Tensor) -> None:
        pass

    def all_gather(self, out: Tensor, tensor: Tensor) -> None:
        out.view(*tensor.shape).copy_(tensor)

    def broadcast(self, tensor: Tensor, root: int = 0) -> None:
        check_root(root, 1)

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        check_root(root, 1)
        return obj


def check_root(root: int, size: int) -> None:
    """Raise ValueError unless ``root`` names a rank of a group of ``size``."""
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root {root!r} is not a rank of this group of {size}; expected 0 .. {size - 1}")


def check_gather(out: Tensor, tensor: Tensor, size: int) -> None:
    """Raise ValueError unless ``out`` has room for ``size`` copies of ``tensor``, both
    contiguous and of one dtype."""
    if out.dtype is not tensor.dtype:
        raise ValueError(f"all_gather: out is {out.dtype.name}, tensor is {tensor.dtype.name}; expected one dtype")
    if out.numel() != size * tensor.numel():
        raise ValueError(f"all_gather: out holds {out.numel()} elements; expected {size} x {tensor.numel()}")
    if not (out.is_contiguous() and tensor.is_contiguous()):
        raise ValueError("all_gather: out and tensor must be contiguous")


def record_all_reduce(plan, comm: Communicator, tensor: Tensor) -> None:
    """Append an in-place all-reduce of ``tensor`` over ``comm`` to ``plan`` (an ``ops.Plan``),
    so replaying the plan sums a row-parallel layer's partial products where the op calls put them."""
    plan.append(_all_reduce_call, (tensor,), (), {"comm": comm})


def _all_reduce_call(outputs: tuple, inputs: tuple, attrs: dict) -> None:
    attrs["comm"].all_reduce(outputs[0])
