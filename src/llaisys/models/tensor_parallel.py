"""Tensor parallelism, Megatron-style: which part of each weight a rank holds, and the file
reads that give it only that part.

Of N ranks, rank r holds:
  - q/k/v (and their biases): its H/N query heads and KH/N key/value heads, rows of each
    (column-parallel: each rank computes its heads' attention on its own);
  - o: the columns of its query heads; down: its I/N columns of the MLP width (row-parallel:
    each rank's product is a partial sum, added over ranks by one all-reduce per block);
  - gate/up: its I/N rows of each;
  - a mixture of experts' stacks, each expert split like the dense MLP (I the experts' width):
    gate/up (E*I, D) the rows e*I + [r*I/N, (r+1)*I/N) of every expert e, stacked (E*I/N, D)
    with expert e's at e*I/N; down (E*D, I) the same I/N columns of every row, (E*D, I/N). Its
    ``moe_mlp`` output is a partial sum, added over ranks by the all-reduce the dense MLP uses;
    the router whole on every rank (each rank routes every token identically);
  - the output bias on rank 0 only (added once by the all-reduce); the norms whole;
  - the embedding table and the output head split by vocabulary: rows [r*c, (r+1)*c) with
    c = ceil(V/N), the last rank's padded with zero rows. The embedding table gets one more
    zero row, which every token of another rank's range looks up, so the all-reduce of the
    embedded rows gives each token its row. Splitting rather than replicating: the head is read
    on every token (a quarter of a small model's bytes), and a large vocabulary would make each
    rank hold it whole. Logits are all-gathered, (N, R, c) -> (R, N*c) -> the first V columns.
The KV cache holds each rank's KV heads only. N must divide the query heads, the KV heads, the
MLP width and the experts' width; anything else is refused with the numbers (replicating KV
heads is left out).

Reads: a row range of a matrix reads only those rows; a stack's expert rows read E row ranges,
one per expert (block-quantized rows as their raw blocks, so the stack stays quantized); a
column range reads each row's slice (for a block-quantized matrix or stack, whole blocks: the
bounds must fall on block edges, else that shard is dequantized to floats, which the load logs).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..runtime.block_formats import block_format
from .config import ModelConfig
from .errors import ModelLoadError
from .weights import WeightSource

log = logging.getLogger(__name__)



class TensorParallelError(ValueError):
    """A rank count that does not fit the model."""


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``, for a model of ``config`` (checked to divide evenly)."""

    rank: int
    size: int
    config: ModelConfig

    def __post_init__(self) -> None:
        check_fits(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank {self.rank} is not in 0 .. {self.size - 1}")

    @property
    def heads(self) -> tuple[int, int]:
        """This rank's query heads [start, stop)."""
        return self.part(self.config.num_attention_heads)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's key/value heads [start, stop)."""
        return self.part(self.config.num_key_value_heads)

    @property
    def ffn(self) -> tuple[int, int]:
        """This rank's columns of the MLP width [start, stop)."""
        return self.part(self.config.intermediate_size)

    def part(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of ``n`` (a width ``check_fits`` found ``size`` divides)."""
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    @property
    def vocab_rows(self) -> int:
        """c = ceil(V / N): the rows of the vocabulary each rank holds (padded on the last)."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """This rank's real vocabulary rows [start, stop) (stop - start < c on a padded rank)."""
        c, v = self.vocab_rows, self.config.vocab_size
        return min(v, self.rank * c), min(v, (self.rank + 1) * c)

    def local_config(self) -> ModelConfig:
        """The config of this rank's part: its heads, KV heads, MLP width and the architecture's
        own widths (``ArchArgs.sharded``: the experts' width); the vocabulary its c rows (the
        hidden size, the experts and everything else as the model's)."""
        c = self.config
        return dataclasses.replace(
            c, num_attention_heads=c.num_attention_heads // self.size,
            num_key_value_heads=c.num_key_value_heads // self.size,
            intermediate_size=c.intermediate_size // self.size, head_dim=c.head_dim,
            vocab_size=self.vocab_rows, arch_args=c.arch_args.sharded(self.size))

    def local_ids(self, ids: np.ndarray) -> np.ndarray:
        """Token ids (S,) as rows of this rank's embedding table: its own range shifted to
        0 .. c-1, every other id the zero row c."""
        start, stop = self.vocab
        mine = (ids >= start) & (ids < stop)
        return np.where(mine, ids - start, self.vocab_rows).astype(np.int64)

    def gather_logits(self, gathered: np.ndarray) -> np.ndarray:
        """Logits (R, V) from every rank's (N, R, c) in rank order."""
        n, r, c = gathered.shape
        return gathered.transpose(1, 0, 2).reshape(r, n * c)[:, :self.config.vocab_size]

    def shard_weights(self, weights: Mapping[str, WeightSource]) -> dict[str, WeightSource]:
        """This rank's part of every weight (by our names), read lazily like the originals."""
        c = self.config
        dh = c.head_dim
        q_rows = tuple(h * dh for h in self.heads)
        kv_rows = tuple(h * dh for h in self.kv_heads)
        out: dict[str, WeightSource] = {}
        for name, src in weights.items():
            short = name.rpartition(".")[2]
            if name == "embed":
                out[name] = padded_rows(src, *self.vocab, self.vocab_rows + 1)
            elif name == "lm_head":
                out[name] = padded_rows(src, *self.vocab, self.vocab_rows)
            elif short in ("q", "q_bias"):
                out[name] = row_range(src, *q_rows)
            elif short in ("k", "v", "k_bias", "v_bias"):
                out[name] = row_range(src, *kv_rows)
            elif short in ("gate", "up"):
                out[name] = row_range(src, *self.ffn)
            elif short == "o":
                out[name] = column_range(src, *q_rows)
            elif short == "down":
                out[name] = column_range(src, *self.ffn)
            elif short in ("gate_exps", "up_exps"):  # (E, I, D)
                out[name] = expert_rows(src, *self.part(src.shape[1]))
            elif short == "down_exps":  # (E, D, I)
                out[name] = column_range(src, *self.part(src.shape[2]))
            elif short == "o_bias":
                if self.rank == 0:
                    out[name] = src
            else:  # the norms and the routers
                out[name] = src
        return out


def check_fits(config: ModelConfig, size: int) -> None:
    """Raise TensorParallelError unless ``size`` ranks divide the model's query heads, KV heads,
    MLP width and the architecture's own widths (``ArchArgs.shard_widths``: a mixture of
    experts' width of every expert), naming the numbers."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise TensorParallelError(f"tensor-parallel size must be a positive integer, got {size!r}")
    parts = {"key/value heads": config.num_key_value_heads, "attention heads": config.num_attention_heads,
             "MLP width (intermediate_size)": config.intermediate_size}
    parts.update(config.arch_args.shard_widths())
    for what, n in parts.items():
        if n % size:
            fits = [d for d in range(1, n + 1) if all(m % d == 0 for m in parts.values())]
            raise TensorParallelError(
                f"tensor-parallel size {size} does not divide the model's {n} {what}; this model splits over "
                f"{', '.join(map(str, fits))} ranks")


def _check_rows(src: WeightSource, start: int, stop: int) -> None:
    m = src.row_multiple
    if start % m or stop % m:
        raise ModelLoadError(f"{src.file}: tensor {src.file_name!r} is read in blocks of {m} rows; rows "
                             f"{start}:{stop} do not fall on them")


def row_range(src: WeightSource, start: int, stop: int) -> WeightSource:
    """Rows [start, stop) of ``src`` (a matrix or a vector)."""
    _check_rows(src, start, stop)
    shape = (stop - start, *src.shape[1:])
    if src.read_rows is not None:
        read_rows = src.read_rows
        read = lambda: read_rows(start, stop)  # noqa: E731
        rows = lambda a, b: read_rows(start + a, start + b)  # noqa: E731
    else:
        whole = src.read
        read, rows = (lambda: whole()[start:stop]), None
    raw, mapped = None, None
    if src.read_raw_rows is not None:
        read_raw = src.read_raw_rows
        raw = lambda a, b: read_raw(start + a, start + b)  # noqa: E731
        if src.mapped is not None:  # whole rows lie back to back: still a view of the map
            fmt = block_format(src.kind)
            block, nbytes = fmt.block_size, fmt.block_bytes
            data, offset = src.mapped
            mapped = (data, offset + start * (src.shape[1] // block * nbytes))
    return dataclasses.replace(src, shape=shape, read=read, read_rows=rows, read_raw_rows=raw, mapped=mapped,
                               read_matrix_rows=None)


def expert_rows(src: WeightSource, start: int, stop: int) -> WeightSource:
    """Rows [start, stop) of every matrix of the stack ``src`` (E, N, K): a stack (E, n, K),
    n = stop - start, reading only those rows. Block-quantized rows stay raw blocks (each row
    is whole blocks), read from the E*N rows as E runs; floats through the source's
    ``read_matrix_rows``, else a whole matrix at a time, cut."""
    e, rows, k = src.shape
    _check_rows(src, start, stop)
    n = stop - start
    matrix_rows = None
    if src.read_matrix_rows is not None:
        of_matrix = src.read_matrix_rows
        matrix_rows = lambda x, a, b: of_matrix(x, start + a, start + b)  # noqa: E731
        floats = lambda a, b: np.stack([of_matrix(x, start, stop) for x in range(a, b)])  # noqa: E731
    elif src.read_rows is not None:
        read_experts = src.read_rows
        floats = lambda a, b: np.stack([read_experts(x, x + 1)[0, start:stop] for x in range(a, b)])  # noqa: E731
    else:
        whole = src.read
        floats = lambda a, b: whole()[a:b, start:stop]  # noqa: E731
    by_experts = floats if src.read_rows is not None or matrix_rows is not None else None
    raw = None
    if src.read_raw_rows is not None:
        read_raw = src.read_raw_rows
        raw = lambda a, b: _gather_raw(read_raw, rows, start, n, a, b)  # noqa: E731
    return dataclasses.replace(src, shape=(e, n, k), read=lambda: floats(0, e).reshape(e, n, k), read_rows=by_experts,
                               read_raw_rows=raw, mapped=None, read_matrix_rows=matrix_rows)


def _gather_raw(read_raw: Callable[[int, int], np.ndarray], rows: int, start: int, n: int, a: int,
                b: int) -> np.ndarray:
    """Rows [a, b) of the gathered E*n rows, uint8 (b - a, row_bytes): row j is row start + j % n
    of expert j // n, row (j // n) * rows + start + j % n of the stored E*N."""
    parts = []
    for x in range(a // n, -(-b // n)):
        lo, hi = max(a, x * n) - x * n, min(b, (x + 1) * n) - x * n
        parts.append(read_raw(x * rows + start + lo, x * rows + start + hi))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def column_range(src: WeightSource, start: int, stop: int) -> WeightSource:
    """Columns [start, stop) of the last dimension of ``src``, a matrix (M, K) or a stack of
    them (E, M, K): raw blocks when the bounds fall on the block edges of its format, else
    floats."""
    shape = (*src.shape[:-1], stop - start)
    if src.read_rows is not None:
        read_rows = src.read_rows
        rows = lambda a, b: read_rows(a, b)[..., start:stop]  # noqa: E731
        read = lambda: rows(0, src.shape[0])  # noqa: E731
    else:
        whole = src.read
        read, rows = (lambda: whole()[..., start:stop]), None
    raw = None
    if src.read_raw_rows is not None:
        fmt = block_format(src.kind)
        block, nbytes = fmt.block_size, fmt.block_bytes
        if start % block == 0 and stop % block == 0:
            read_raw, b0, b1 = src.read_raw_rows, start // block * nbytes, stop // block * nbytes
            raw = lambda a, b: np.ascontiguousarray(read_raw(a, b)[:, b0:b1])  # noqa: E731
        else:
            log.info("%s: columns %d:%d of %s (%s) do not fall on its %d-element blocks; that shard is dequantized",
                     src.file, start, stop, src.file_name, src.kind, block)
    matrix_rows = None
    if src.read_matrix_rows is not None:
        of_matrix = src.read_matrix_rows
        matrix_rows = lambda x, a, b: of_matrix(x, a, b)[:, start:stop]  # noqa: E731
    return dataclasses.replace(src, shape=shape, read=read, read_rows=rows, read_raw_rows=raw, mapped=None,
                               read_matrix_rows=matrix_rows)


def padded_rows(src: WeightSource, start: int, stop: int, total: int) -> WeightSource:
    """Rows [start, stop) of matrix ``src`` followed by zero rows up to ``total`` rows (a
    block-quantized zero row is all zero bytes: zero scales, so zero values)."""
    real, width = stop - start, src.shape[1:]
    part = row_range(src, start, stop)

    def padded(read: Callable[[int, int], np.ndarray], a: int, b: int, zero_row: np.ndarray) -> np.ndarray:
        """Rows [a, b) of the padded matrix from ``read`` of the real rows."""
        have = max(0, min(b, real) - a)
        rows = read(a, a + have) if have else zero_row[:0]
        return np.concatenate([rows, np.broadcast_to(zero_row, (b - a - have, *zero_row.shape[1:]))])

    floats = part.read_rows or (lambda a, b: part.read()[a:b])
    zero_float = np.zeros((1, *width), np.float32)
    raw = None
    if src.read_raw_rows is not None:
        fmt = block_format(src.kind)
        block, nbytes = fmt.block_size, fmt.block_bytes
        zero_raw = np.zeros((1, width[0] // block * nbytes), np.uint8)
        raw = lambda a, b: padded(part.read_raw_rows, a, b, zero_raw)  # noqa: E731
    return dataclasses.replace(src, shape=(total, *width), read=lambda: padded(floats, 0, total, zero_float),
                               read_rows=lambda a, b: padded(floats, a, b, zero_float), read_raw_rows=raw,
                               row_multiple=1, mapped=None, read_matrix_rows=None)


class Leader:
    """Rank 0's side of tensor parallelism: names each cache it makes for the other ranks,
    tells them which caches it dropped, and sends each call before running it (the other ranks
    run it in ``follow``). ``lock`` is the runner's (one pass at a time); ``released`` once
    ``release`` told the other ranks to stop."""

    def __init__(self, comm, lock) -> None:
        self.comm, self.lock = comm, lock
        self.released = False
        self._keys = itertools.count()
        self._dropped: list[int] = []  # caches dropped since the last call, for the other ranks to drop too

    def name(self, cache, spec: tuple) -> None:
        """Key ``cache`` (made from ``spec``) for the other ranks; they drop theirs when it goes."""
        cache.tp_key, cache.tp_spec = next(self._keys), spec
        weakref.finalize(cache, self._dropped.append, cache.tp_key)

    def send(self, *message) -> None:
        """Send the other ranks the call they are to run (with the caches dropped since)."""
        if self.released:
            raise RuntimeError("this model's other tensor-parallel ranks were released (tensor_parallel.release); "
                               "it runs no more passes")
        dropped, self._dropped[:] = list(self._dropped), []
        self.comm.broadcast_object((dropped, *message))


def follow(model) -> None:
    """Run rank 0's calls on this rank's part of ``model`` (a ``CausalLM`` loaded with the
    same communicator) until rank 0 sends ``stop``; keeps a cache for each of rank 0's.

    A failure here cannot be reported to rank 0's caller, and going on would leave the ranks
    out of step, so it ends the whole group (``Communicator.abort``) after saying why."""
    comm, caches = model.comm, {}
    while True:
        dropped, kind, *args = comm.broadcast_object(None)
        for key in dropped:
            caches.pop(key, None)
        if kind == "stop":
            return
        try:
            key, spec = args[0], args[1]
            cache = caches.get(key)
            if cache is None:
                cache = caches[key] = (model.new_cache(spec[1]) if spec[0] == "kv"
                                       else model.new_paged_cache(*spec[1:]))
            if kind == "forward":
                cache.length = args[2]
                model.forward(args[3], cache, all_logits=args[4])
            elif kind == "batch":
                model.forward_batch(args[2], cache)
            else:
                raise ValueError(f"unknown call {kind!r} from rank 0")
        except Exception as e:  # noqa: BLE001 (any failure: the group cannot go on)
            log.error("tensor-parallel rank %d of %d failed running %s: %s", comm.rank, comm.size, kind, e)
            import sys
            print(f"llaisys: tensor-parallel rank {comm.rank} of {comm.size} failed running {kind}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            comm.abort(1)
            raise


def release(model, timeout: float = 2.0) -> None:
    """On rank 0 of several: tell the other ranks to leave ``follow``, once no pass is in
    flight. Waits up to ``timeout`` seconds for the model's lock, from a thread of its own, so
    a pass this thread left half done (an interrupt inside a collective) counts as in flight;
    when the lock does not come, the other ranks may be inside a collective that will never
    complete, and the whole group is ended (``Communicator.abort``). Later passes are refused."""
    leader = getattr(getattr(model, "runner", None), "leader", None)
    if leader is None or leader.released:
        return
    said = []

    def say_stop() -> None:
        if leader.lock.acquire(timeout=timeout):
            try:
                leader.released = True
                leader.comm.broadcast_object(([], "stop"))
                said.append(True)
            finally:
                leader.lock.release()

    thread = threading.Thread(target=say_stop, name="llaisys-tp-release", daemon=True)
    thread.start()
    thread.join()
    if not said:
        log.error("a tensor-parallel pass was still running; ending all %d ranks", model.comm.size)
        model.comm.abort(1)
