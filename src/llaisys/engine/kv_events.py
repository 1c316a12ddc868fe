"""Prefix-cache events: the full KV blocks an engine stores and drops, published for routers
that index them (the message format of vLLM's KV-cache events, which llm-d's precise
prefix-cache scorer reads), so a router can send a request to the replica that holds its
prefix exactly.

On the wire (ZeroMQ, msgpack; nothing is pickled): every step that changed the prefix cache
sends one message of three frames on a PUB socket:

    topic (bytes) | sequence number (8 bytes, big-endian, from 0) | payload

    payload = [timestamp (float seconds), [event, ...], data-parallel rank (0)]
    event   = ["BlockStored", [hash, ...], parent hash or nil, [token id, ...], block size,
               nil (LoRA id), "CPU" (medium), nil (LoRA name)]
            | ["BlockRemoved", [hash, ...], "CPU"]

A BlockStored event covers consecutive full blocks of one sequence: its token ids are theirs,
``block size`` ids each, and its parent hash names the block before the first (nil for a
sequence's first block). A hash is the first 8 bytes, read big-endian, of the engine's 16-byte
chained block hash (``blocks.block_hash``), so equal hashes mean equal prefixes. With a replay
endpoint, a ROUTER socket answers a request ``[b"", start sequence (8 bytes)]`` with every
kept message from that number on, each as ``[b"", sequence, payload]``, then ``[b"", -1, b""]``.

``KVEventLog`` collects a step's events in the engine thread; ``KVEventPublisher`` sends them
from a thread of its own (it needs ``pip install 'llaisys[events]'``: pyzmq and msgpack).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

MEDIUM = "CPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def external_hash(h: bytes) -> int:
    """A block hash as the events carry it: its first 8 bytes as an unsigned big-endian integer."""
    return int.from_bytes(h[:8], "big")


class KVEventLog:
    """The prefix-cache events of the engine since the last ``drain``, in order."""

    def __init__(self) -> None:
        self.events: list[list[Any]] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int], block_size: int) -> None:
        """Consecutive full blocks ``hashes`` of one sequence became findable; ``token_ids``
        are theirs (``block_size`` each), ``parent`` the hash of the block before (None: none)."""
        self.events.append(["BlockStored", [external_hash(h) for h in hashes],
                            None if parent is None else external_hash(parent), [int(t) for t in token_ids],
                            block_size, None, MEDIUM, None])

    def removed(self, hashes: Sequence[bytes]) -> None:
        """Blocks ``hashes`` no longer hold their prefix (their memory went to new content)."""
        self.events.append(["BlockRemoved", [external_hash(h) for h in hashes], MEDIUM])

    def drain(self) -> list[list[Any]]:
        """The events collected so far (the log is empty after)."""
        events, self.events = self.events, []
        return events


def require_modules() -> tuple[Any, Any]:
    """(zmq, msgpack); RuntimeError saying how to install them when either is missing."""
    try:
        import msgpack
        import zmq
    except ImportError as exc:
        raise RuntimeError(f"prefix-cache events need pyzmq and msgpack ({exc.name} is missing): "
                           f"pip install 'llaisys[events]'") from None
    return zmq, msgpack


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a ZeroMQ address events can go to (tcp://host:port, ipc://path);
    ValueError naming what is expected otherwise."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc") or not rest or (scheme == "tcp" and ":" not in rest):
        raise ValueError(f"{endpoint!r} is not an events endpoint; expected tcp://HOST:PORT (bind: tcp://*:5557 "
                         f"or tcp://10.0.0.5:5557; connect: tcp://router-host:5557) or ipc:///path")
    return endpoint


def _binds(endpoint: str) -> bool:
    """Whether to bind ``endpoint`` (a wildcard, an address of this machine, ipc) rather than connect."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        return True
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))  # an address of this machine: listen there
        return True
    except OSError:
        return False


class KVEventPublisher:
    """Sends batches of events on a ZeroMQ PUB socket (bound, or connected to a collector:
    ``_binds``), from a thread of its own, keeping the last ``keep`` messages for replay.

    endpoint: where the PUB socket binds or connects; replay_endpoint: where a ROUTER socket
    binds for replay requests (None: no replay); topic: the first frame of every message."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 keep: int = 10_000, high_water_mark: int = 100_000) -> None:
        zmq, msgpack = require_modules()
        self._zmq, self._pack = zmq, msgpack.packb
        self.endpoint, self.replay_endpoint, self.topic = check_endpoint(endpoint), replay_endpoint, topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(high_water_mark)
        self._replay = None
        try:
            (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(check_endpoint(replay_endpoint))
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise RuntimeError(f"cannot open the events endpoint {endpoint!r}: {exc}") from None
        self._queue: queue.Queue[list | None] = queue.Queue()
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=keep)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="llaisys-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[list[Any]]) -> None:
        """Queue one step's events to be sent as one message (nothing when empty)."""
        if events:
            self._queue.put([time.time(), events, 0])

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._pack(batch, use_bin_type=True)
            seq = self._seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self.topic, seq, payload))
            except self._zmq.ZMQError as exc:  # a full queue to a slow subscriber drops, never blocks
                log.warning("prefix-cache event %d not sent: %s", self._seq, exc)
            self._kept.append((self._seq, payload))
            self._seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a replay request of %d frames (expected [identity, b'', 8-byte start])", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
