"""Tensor parallelism: communicators (``comm``: the interface; ``mpi``, ``xccl``: backends)."""
from .comm import CommError, Communicator, SingleProcess

__all__ = ["CommError", "Communicator", "SingleProcess"]
