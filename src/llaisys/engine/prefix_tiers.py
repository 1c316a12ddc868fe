"""Prefix cache tiers: the contents of full KV blocks kept beyond the pool, in host memory and
in files under a directory, so a prompt's prefix (an agent's system prompt and tools, a chat's
earlier turns) outlives its blocks' reuse for other content, and the process.

**Keys are exact.** A block is found by a BLAKE2b digest of (the model's identity, the cache
layout, the block's chained prefix hash). The prefix hash (``blocks.block_hash``) names every
token before the block's end, image tokens standing for their picture's digest. The model's
identity names its source files (absolute path, size, mtime_ns and a digest of each file's first
and last MiB) and how it computes (its ``info()``: architecture, dtype, weight types, projector),
and the device type; the layout names each store's dtype and shape per block (``stores()``: k, v,
and whatever else a layout keeps, such as int8 scales) and the block size. Another model, file,
dtype, layout, token or image gives another key: a miss, never a wrong block. A model without a
source file (built in memory) has no identity that survives the process: it gets the host tier only.

**Policy.** The host tier is filled when the pool hands a block out for new content and forgets
its hash (``BlockPool.take_new``): only blocks leaving the pool are copied, so its byte budget
holds blocks beyond the pool instead of duplicates of it, and a block that is never evicted
costs nothing; a block already there is not copied again. The disk tier is written through when
a block's hash is committed (``KVBlockManager.commit``): a restart, even an abrupt one, finds
every block that was computed, which an evict-time write would lose for all blocks still in the
pool at the crash. Copies are taken lazily but always before the block is overwritten: the
engine calls ``capture`` before each forward pass, and ``restore`` before it writes restored
contents, so the blocks pending since the last pass are read in one ``read_blocks`` call. The
disk writer is a background thread fed by a queue bounded in bytes (``MAX_QUEUED_BYTES``): the
engine never waits on the disk; when the queue is full a block is not written (counted).

**Lookup.** ``KVBlockManager.match_prefix`` takes the blocks the pool still holds, then asks
``restore`` for the following hashes: host tier first, then disk; each hit is written into a new
block of the pool (``write_blocks``) and registered as if computed, its tokens counted as
prefix-cache hits and as restored (``restored_host``, ``restored_disk``).

**Files.** One file per block, ``<key hex>.kvblock``: magic ``LLKVBLK\\0``, format version (u32),
header length (u32), a JSON header (the key, the model identity, the layout, the prefix hash, the
payload's size and CRC32), then the payload, each store's bytes (L, 1, ...) in order. Written to
a temporary file and renamed, so a reader never sees half a file. The directory's byte budget
drops the least recently used files first (a hit refreshes a file's mtime, which orders them
after a restart). On start the directory is indexed by reading each file's header.

**Never loaded**: a file whose magic, version or header cannot be read, whose size is not what
its header says (truncated), whose name is not its header's key, whose key is not the one this
model, layout and prefix give (a file renamed or from another model or layout), or whose payload
fails its checksum. Each is ignored with one warning naming the file and why; a damaged file is
deleted, another model's or layout's is left for it. The checksum guards against damage; the key
against confusion (the directory is trusted as much as the model file).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

import numpy as np

from ..runtime.dtypes import DataType

if TYPE_CHECKING:
    from ..models.paged_cache import PagedKVCache
    from .blocks import BlockHash, BlockPool

log = logging.getLogger(__name__)

MAGIC = b"LLKVBLK\0"
FORMAT_VERSION = 1
SUFFIX = ".kvblock"
DEFAULT_DIR_BYTES = 8 << 30  # the directory's budget when none is given
MAX_QUEUED_BYTES = 256 << 20  # block contents waiting for the disk writer, at most
_PREAMBLE = struct.Struct("<8sII")  # magic, format version, header length
_MAX_HEADER = 1 << 16
_FINGERPRINT = 1 << 20  # bytes digested at each end of a model file
_STALE_TMP_S = 3600.0  # a temporary file older than this was left by a process that died


@dataclass(frozen=True)
class CacheLayout:
    """What a block's contents are: each store's dtype name and shape per block (L, BS, ...),
    and the block size."""

    block_size: int
    stores: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, cache: "PagedKVCache") -> "CacheLayout":
        """The layout of ``cache``'s stores (block axis second, taken out)."""
        return cls(cache.block_size, tuple((t.dtype.name, (t.shape[0], *t.shape[2:])) for t in cache.stores()))

    def describe(self) -> dict[str, Any]:
        """The layout as JSON values (as a file's header holds it)."""
        return {"block_size": self.block_size, "stores": [[name, list(shape)] for name, shape in self.stores]}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's contents in all stores."""
        return sum(DataType[name].itemsize * int(np.prod(shape)) for name, shape in self.stores)

    def split(self, payload: memoryview) -> list[np.ndarray]:
        """One block's arrays (L, 1, ...) per store over ``payload`` (read-only, no copy)."""
        out, at = [], 0
        for name, shape in self.stores:
            dtype = DataType[name].numpy
            n = int(np.prod(shape))
            out.append(np.frombuffer(payload, dtype, n, at).reshape(shape[0], 1, *shape[1:]))
            at += n * dtype.itemsize
        return out


def tier_key(identity: bytes, layout: CacheLayout, prefix_hash: "BlockHash") -> bytes:
    """The 32-byte key of a block: a BLAKE2b digest of the model's identity, the cache layout
    and the block's chained prefix hash."""
    h = hashlib.blake2b(b"llaisys-kv-block", digest_size=32)
    h.update(len(identity).to_bytes(4, "little") + identity)
    h.update(json.dumps(layout.describe(), sort_keys=True).encode())
    h.update(prefix_hash)
    return h.digest()


def file_fingerprint(path: Path) -> dict[str, Any]:
    """A file's absolute path, size, mtime_ns and a digest of its first and last MiB."""
    st = path.stat()
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT))
        if st.st_size > _FINGERPRINT:
            f.seek(max(_FINGERPRINT, st.st_size - _FINGERPRINT))
            h.update(f.read(_FINGERPRINT))
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": h.hexdigest()}


def model_identity(model: Any) -> bytes | None:
    """A 32-byte digest naming ``model``'s source files (``model.source``: a GGUF file, or a
    folder's safetensors, JSON and GGUF files; its ``mmproj`` file too) and how it computes
    (``info()``, the device type); None for a model without a source file on disk."""
    source = getattr(model, "source", None)
    if not source:
        return None
    path = Path(source)
    try:
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json", ".gguf"))
        else:
            return None
        info = dict(model.info()) if hasattr(model, "info") else {}
        if info.get("mmproj"):
            files.append(Path(info["mmproj"]))
        info["device"] = getattr(getattr(model, "device", None), "type", None)
        facts = {"files": [file_fingerprint(p) for p in files], "info": info}
    except OSError as exc:
        log.warning("prefix cache: cannot read the model's files for its identity (%s); no disk tier", exc)
        return None
    return hashlib.blake2b(json.dumps(facts, sort_keys=True, default=str).encode(), digest_size=32).digest()


def _nbytes(arrays: list[np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays)


def _raw(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` in C order, uint8 (nbytes,) (any dtype, bfloat16 included)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class HostTier:
    """Block contents in host memory by key, least recently used dropped beyond ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes = 0
        self.entries: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()
        self.dropped = 0  # blocks dropped for the budget

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> list[np.ndarray] | None:
        """The arrays (L, 1, ...) per store of ``key``, made the most recently used; or None."""
        arrays = self.entries.get(key)
        if arrays is not None:
            self.entries.move_to_end(key)
        return arrays

    def put(self, key: bytes, arrays: list[np.ndarray]) -> None:
        """Keep ``arrays`` under ``key`` (a block larger than the whole budget is not kept)."""
        size = _nbytes(arrays)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if size > self.budget:
            return
        self.entries[key] = arrays
        self.nbytes += size
        while self.nbytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= _nbytes(old)
            self.dropped += 1


class _Files:
    """The directory of a disk tier: its index (key -> (path, bytes), least recently used
    first) and byte count, shared by the engine thread (reads) and the writer (writes)."""

    def __init__(self, directory: Path, budget: int, identity: bytes, layout: CacheLayout) -> None:
        self.directory = directory
        self.budget = budget
        self.identity = identity
        self.layout = layout
        self.lock = threading.Condition()
        self.index: OrderedDict[bytes, tuple[Path, int]] = OrderedDict()
        self.nbytes = 0
        self.queued: dict[bytes, int] = {}  # key -> bytes of blocks waiting for the writer
        self.queued_bytes = 0
        self.written = 0
        self.dropped = 0  # not written: the queue was full
        self.failed = 0  # not written: an OSError
        self.removed = 0  # deleted for the budget

    # ---- headers ------------------------------------------------------------------------
    def header(self, key: bytes, prefix_hash: bytes, payload_bytes: int, crc: int) -> bytes:
        """A file's preamble and JSON header."""
        body = json.dumps({"key": key.hex(), "identity": self.identity.hex(), "layout": self.layout.describe(),
                           "prefix_hash": prefix_hash.hex(), "payload_bytes": payload_bytes, "crc32": crc},
                          sort_keys=True).encode()
        return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(body)) + body

    def read_header(self, f: Any, path: Path) -> tuple[dict, int, str | None, bool]:
        """(header, payload offset, why it is unusable or None, whether that is damage rather
        than a file of another model, layout or format) of the open file ``f``."""
        pre = f.read(_PREAMBLE.size)
        if len(pre) < _PREAMBLE.size:
            return {}, 0, "shorter than its preamble (truncated)", True
        magic, version, size = _PREAMBLE.unpack(pre)
        if magic != MAGIC:
            return {}, 0, "not a llaisys KV block file (bad magic)", True
        if version != FORMAT_VERSION:
            return {}, 0, f"format version {version}, this llaisys reads {FORMAT_VERSION}", False
        if size > _MAX_HEADER:
            return {}, 0, f"a header of {size} bytes (damaged)", True
        try:
            header = json.loads(f.read(size))
            identity, layout = header["identity"], header["layout"]
            key, prefix_hash = bytes.fromhex(header["key"]), bytes.fromhex(header["prefix_hash"])
            payload_bytes, crc = int(header["payload_bytes"]), int(header["crc32"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return {}, 0, "an unreadable header (damaged or truncated)", True
        if identity != self.identity.hex():
            return header, 0, "written for another model (its identity differs)", False
        if layout != self.layout.describe():
            return header, 0, f"written for another cache layout {layout}", False
        if path.stem != key.hex():
            return header, 0, "its name is not the key its header names (renamed?)", True
        if key != tier_key(self.identity, self.layout, prefix_hash):
            return header, 0, "its key does not match its model, layout and prefix (damaged)", True
        if payload_bytes != self.layout.block_bytes:
            return header, 0, (f"a payload of {payload_bytes} bytes, the layout's blocks have "
                               f"{self.layout.block_bytes}"), True
        header["crc32"] = crc
        return header, _PREAMBLE.size + size, None, False

    def ignore(self, path: Path, why: str, damaged: bool) -> None:
        """Log once that ``path`` is not used, and delete it when it is damaged."""
        log.warning("prefix cache: ignoring %s: %s%s", path, why, "; deleted" if damaged else "")
        if damaged:
            try:
                path.unlink()
            except OSError:
                pass

    # ---- the index ----------------------------------------------------------------------
    def scan(self) -> None:
        """Index the directory's block files of this model and layout (headers only, oldest
        first); damaged ones deleted, others' left, each with one warning."""
        found: list[tuple[int, bytes, Path, int]] = []
        now = time.time()
        for entry in os.scandir(self.directory):
            path = Path(entry.path)
            if entry.name.endswith(".tmp") and entry.name.startswith("."):
                try:  # a temporary file of a writer that died before its rename
                    if now - entry.stat().st_mtime > _STALE_TMP_S:
                        path.unlink()
                except OSError:
                    pass
                continue
            if not entry.name.endswith(SUFFIX) or not entry.is_file():
                continue
            try:
                st = entry.stat()
                with open(path, "rb") as f:
                    header, offset, why, damaged = self.read_header(f, path)
            except OSError as exc:
                log.warning("prefix cache: ignoring %s: cannot read it (%s)", path, exc)
                continue
            if why is None and st.st_size != offset + self.layout.block_bytes:
                why = f"{st.st_size} bytes, its header says {offset + self.layout.block_bytes} (truncated)"
                damaged = True
            if why is not None:
                self.ignore(path, why, damaged)
                continue
            found.append((st.st_mtime_ns, bytes.fromhex(header["key"]), path, st.st_size))
        for _, key, path, size in sorted(found):
            self.index[key] = (path, size)
            self.nbytes += size
        self.trim()

    def trim(self, keep: bytes | None = None) -> None:
        """Delete the least recently used files while the directory is over its budget."""
        while self.nbytes > self.budget and self.index:
            key, (path, size) = next(iter(self.index.items()))
            if key == keep and len(self.index) == 1:
                break
            del self.index[key]
            self.nbytes -= size
            self.removed += 1
            try:
                path.unlink()
            except OSError:
                pass

    def forget(self, key: bytes) -> None:
        entry = self.index.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1]

    # ---- reading and writing --------------------------------------------------------------
    def read(self, key: bytes, prefix_hash: bytes) -> list[np.ndarray] | None:
        """The arrays (L, 1, ...) of the block ``key``, checked; None when absent or unusable."""
        with self.lock:
            entry = self.index.get(key)
        if entry is None:
            return None
        path = entry[0]
        try:
            with open(path, "rb") as f:
                header, offset, why, damaged = self.read_header(f, path)
                payload = f.read() if why is None else b""
        except FileNotFoundError:  # dropped for the budget meanwhile
            with self.lock:
                self.forget(key)
            return None
        except OSError as exc:
            why, damaged = f"cannot read it ({exc})", False
        if why is None and len(payload) != self.layout.block_bytes:
            why = f"a payload of {len(payload)} bytes, its header says {self.layout.block_bytes} (truncated)"
            damaged = True
        if why is None and zlib.crc32(payload) != header["crc32"]:
            why, damaged = "its payload fails its checksum (damaged)", True
        if why is None and bytes.fromhex(header["prefix_hash"]) != prefix_hash:
            why, damaged = "it holds another prefix", True
        if why is not None:
            with self.lock:
                self.forget(key)
            self.ignore(path, why, damaged)
            return None
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
        try:
            os.utime(path)  # the least recently used go first, after a restart too
        except OSError:
            pass
        return self.layout.split(memoryview(payload))

    def write(self, key: bytes, prefix_hash: bytes, arrays: list[np.ndarray]) -> None:
        """Write one block's file: a temporary file, then renamed (atomic); then keep the
        directory within its budget."""
        raw = [_raw(a) for a in arrays]
        crc = 0
        for r in raw:
            crc = zlib.crc32(r, crc)
        head = self.header(key, prefix_hash, _nbytes(arrays), crc)
        final = self.directory / f"{key.hex()}{SUFFIX}"
        tmp = self.directory / f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                for r in raw:
                    f.write(r)
            os.replace(tmp, final)
        except OSError as exc:
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                log.warning("prefix cache: cannot write %s (%s); %d blocks not written so far", final, exc, self.failed)
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        with self.lock:
            self.forget(key)
            self.index[key] = (final, len(head) + _nbytes(arrays))
            self.nbytes += len(head) + _nbytes(arrays)
            self.written += 1
            self.trim(keep=key)


def _write_loop(queue: SimpleQueue, files: _Files) -> None:
    """The writer thread: block files from ``queue`` until None."""
    while True:
        item = queue.get()
        if item is None:
            return
        key, prefix_hash, arrays = item
        try:
            files.write(key, prefix_hash, arrays)
        except Exception:  # noqa: BLE001  (a writer that stopped would leave the engine's puts waiting forever)
            log.exception("prefix cache: writing a block failed")
        finally:
            with files.lock:
                files.queued_bytes -= files.queued.pop(key, 0)
                files.lock.notify_all()


class DiskTier:
    """Block files under ``directory`` for one model identity and cache layout, at most
    ``budget`` bytes of them: an index made on start, reads on the caller's thread, writes by
    a background thread behind a queue of at most ``max_queued`` bytes."""

    def __init__(self, directory: "str | os.PathLike[str]", budget: int, identity: bytes, layout: CacheLayout,
                 max_queued: int = MAX_QUEUED_BYTES) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_queued = max_queued
        self.files = _Files(self.directory, budget, identity, layout)
        self.files.scan()
        self._queue: SimpleQueue = SimpleQueue()
        self._thread = threading.Thread(target=_write_loop, args=(self._queue, self.files),
                                        name="llaisys-prefix-writer", daemon=True)
        self._thread.start()
        self._stop = weakref.finalize(self, self._queue.put, None)  # the thread ends with its tier
        self.closed = False

    def __contains__(self, key: bytes) -> bool:
        with self.files.lock:
            return key in self.files.index or key in self.files.queued

    def get(self, key: bytes, prefix_hash: bytes) -> list[np.ndarray] | None:
        """The checked arrays (L, 1, ...) per store of ``key``; None when absent or unusable."""
        return self.files.read(key, prefix_hash)

    def put(self, key: bytes, prefix_hash: bytes, arrays: list[np.ndarray]) -> bool:
        """Queue a block for writing without waiting; False when it is not queued (written or
        queued already, the queue full, the tier closed)."""
        size = _nbytes(arrays)
        with self.files.lock:
            if self.closed or key in self.files.index or key in self.files.queued:
                return False
            if self.files.queued_bytes + size > self.max_queued:
                self.files.dropped += 1
                return False
            self.files.queued[key] = size
            self.files.queued_bytes += size
        self._queue.put((key, prefix_hash, arrays))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (at most ``timeout`` s); True when none is left."""
        with self.files.lock:
            return self.files.lock.wait_for(lambda: not self.files.queued, timeout)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Write what is queued (waiting at most ``timeout`` s) and stop the writer; later
        puts are refused. True when everything queued was written."""
        done = self.flush(timeout)
        with self.files.lock:
            self.closed = True
        self._stop()
        if done:
            self._thread.join(1.0)
        return done

    @property
    def nbytes(self) -> int:
        """Bytes of this model's block files in the directory."""
        return self.files.nbytes


class PrefixTiers:
    """One engine's tiers over its ``cache``: the host tier (``host_bytes``; 0: none) and the
    disk tier (``directory``, ``dir_bytes``; needs the model's ``identity``). The block manager
    tells it of commits (``committed``) and evictions (``forgot``) and asks it to ``restore``;
    the engine calls ``capture`` before each pass and ``close`` at shutdown."""

    def __init__(self, cache: "PagedKVCache", host_bytes: int = 0, directory: "str | os.PathLike[str] | None" = None,
                 dir_bytes: int | None = None, identity: bytes | None = None) -> None:
        self.cache = cache
        self.layout = CacheLayout.of(cache)
        self.identity = identity if identity is not None else b"in-memory"
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = None
        if directory is not None and identity is not None:
            self.disk = DiskTier(directory, DEFAULT_DIR_BYTES if dir_bytes is None else dir_bytes, identity,
                                 self.layout)
        self._committed: list[tuple[int, BlockHash]] = []  # blocks made findable since the last capture
        self._evicted: list[tuple[int, BlockHash]] = []  # blocks handed out for new content since then
        self._keys: dict[BlockHash, bytes] = {}  # a small memo of tier_key
        self.restored_host = 0  # tokens restored from each tier
        self.restored_disk = 0

    def key(self, prefix_hash: "BlockHash") -> bytes:
        """The tiers' key of the block named by ``prefix_hash``."""
        key = self._keys.get(prefix_hash)
        if key is None:
            if len(self._keys) > 1 << 16:
                self._keys.clear()
            key = self._keys[prefix_hash] = tier_key(self.identity, self.layout, prefix_hash)
        return key

    # ---- told by the block manager --------------------------------------------------------
    def committed(self, block: int, prefix_hash: "BlockHash") -> None:
        """``block`` now holds the prefix ``prefix_hash``: written through to disk at the next capture."""
        if self.disk is not None:
            self._committed.append((block, prefix_hash))

    def forgot(self, block: int, prefix_hash: "BlockHash") -> None:
        """``block`` (holding ``prefix_hash``) was handed out for new content: copied to the host
        tier at the next capture, before anything overwrites it."""
        if self.host is not None and self.key(prefix_hash) not in self.host:
            self._evicted.append((block, prefix_hash))

    def capture(self) -> None:
        """Copy the blocks committed or evicted since the last call (one ``read_blocks``) into
        their tiers. Call before anything writes into the pool."""
        if not self._committed and not self._evicted:
            return
        order: dict[int, BlockHash] = {}
        for block, h in self._committed + self._evicted:
            order.setdefault(block, h)
        blocks = list(order)
        arrays = self.cache.read_blocks(blocks)  # per store (L, n, ...)
        at = {b: i for i, b in enumerate(blocks)}
        for block, h in self._evicted:
            self.host.put(self.key(h), [np.ascontiguousarray(a[:, at[block]:at[block] + 1]) for a in arrays])
        for block, h in self._committed:
            self.disk.put(self.key(h), h, [np.ascontiguousarray(a[:, at[block]:at[block] + 1]) for a in arrays])
        self._committed.clear()
        self._evicted.clear()

    def restore(self, pool: "BlockPool", hashes: "list[BlockHash]") -> list[int]:
        """New blocks of ``pool`` holding the leading prefixes of ``hashes`` found in the tiers
        (host, then disk), each made findable by its hash, as many as the pool's free blocks
        allow; stops at a hash the pool itself holds (for the caller to take) or that no tier has."""
        found: list[tuple[BlockHash, list[np.ndarray], bool]] = []
        for h in hashes:
            if len(found) >= pool.num_free or h in pool.by_hash:
                break
            key = self.key(h)
            arrays = self.host.get(key) if self.host is not None else None
            from_host = arrays is not None
            if arrays is None and self.disk is not None:
                arrays = self.disk.get(key, h)
            if arrays is None:
                break
            found.append((h, arrays, from_host))
        if not found:
            return []
        blocks = [pool.take_new() for _ in found]
        self.capture()  # what those blocks (and any others pending) held, before it is overwritten
        self.cache.write_blocks(blocks, [np.concatenate([f[1][s] for f in found], axis=1)
                                         for s in range(len(self.layout.stores))])
        for block, (h, _, from_host) in zip(blocks, found):
            pool.remember(block, h)
            if from_host:
                self.restored_host += self.cache.block_size
            else:
                self.restored_disk += self.cache.block_size
        return blocks

    def close(self, timeout: float | None = 10.0) -> bool:
        """Capture what is pending and write the disk tier's queue (at most ``timeout`` s);
        True when nothing was left unwritten."""
        self.capture()
        return self.disk.close(timeout) if self.disk is not None else True


def open_tiers(model: Any, cache: "PagedKVCache", prefix_caching: bool, host_bytes: int = 0,
               directory: "str | os.PathLike[str] | None" = None, dir_bytes: int | None = None) -> PrefixTiers | None:
    """The tiers an engine's options ask for, or None (none asked, prefix caching off, or a
    tensor-parallel model, whose other ranks hold the rest of each block). Raises ValueError
    for a bad option."""
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
        raise ValueError(f"prefix_cache_host_bytes must be an integer >= 0 (0: no host tier), got {host_bytes!r}")
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"prefix_cache_dir must be a path or None, got {type(directory).__name__}")
    if dir_bytes is not None and (isinstance(dir_bytes, bool) or not isinstance(dir_bytes, int) or dir_bytes < 1):
        raise ValueError(f"prefix_cache_dir_bytes must be a positive integer or None, got {dir_bytes!r}")
    if not prefix_caching or (host_bytes == 0 and directory is None):
        return None
    if getattr(model, "shard", None) is not None:
        log.warning("prefix cache tiers are off under tensor parallelism (each rank holds part of a block)")
        return None
    identity = model_identity(model) if directory is not None else None
    if directory is not None and identity is None:
        log.warning("prefix_cache_dir %s: the model has no source file to name its blocks by; no disk tier", directory)
        if host_bytes == 0:
            return None
    return PrefixTiers(cache, host_bytes, directory, dir_bytes, identity)
