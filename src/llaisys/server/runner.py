"""Running the app under uvicorn: connection limits, and a graceful shutdown.

Connections: one that has not sent a request's headers within ``options.header_timeout_s``
(from its opening, or from the end of its last response) is closed. At most
``options.max_connections`` are open (default: 3/4 of the process's descriptor limit, less
three times the connections accepted in one go, ACCEPT_BATCH): a new one above that closes the one that
has waited longest without a request (a stalled client, or an idle keep-alive), or, when every
connection has a request running, is answered 503 and closed. So stalled clients can neither
use up the descriptors nor keep others out. Should the process run out of descriptors anyway,
the log says so once a minute, not once per connection. Bodies are bounded by the app
(``middleware.BodyGuard``).

Shutdown: on SIGINT or SIGTERM uvicorn stops accepting connections and waits for the open
ones; we also refuse new requests on connections still open, give the running ones
``options.shutdown_timeout_s`` to finish, then end them (a stream gets a last error event
saying the server is shutting down, a waiting client a 503), and the engine thread stops
when the app does. A second signal ends the running requests so at once; a third quits
without waiting for anything. After a SIGTERM the process exits with status 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import signal
import socket
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .errors import APIError
from .options import ServerOptions
from .fleet import ModelFleet
from .service import ModelService

log = logging.getLogger(__name__)

ACCEPT_BATCH = 64  # connections asyncio accepts in one go (uvicorn's backlog), before any can be closed


class Notices:
    """Warnings about conditions that repeat (descriptors exhausted, connections refused): each
    logged once, then again only after ``interval_s``."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def warn(self, key: str, message: str, *args: Any) -> None:
        """Log ``message % args`` unless the warning under ``key`` went out less than ``interval_s`` ago."""
        now = time.monotonic()
        if key not in self._last or now - self._last[key] >= self.interval_s:
            self._last[key] = now
            log.warning(message, *args)


def descriptor_limit() -> int | None:
    """The process's soft limit on open file descriptors (None: unlimited or unknown)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(options: ServerOptions) -> int:
    """Open connections the server keeps: ``options.max_connections``, else 3/4 of the
    descriptor limit less 3 * ACCEPT_BATCH, at least 16 (the rest for the model's files, the
    database, the event loop). Three bursts: a burst's connections evict waiting ones as they
    are made, a loop turn after their accept, and an evicted socket closes a turn later, while
    each turn may accept another burst."""
    if options.max_connections is not None:
        return options.max_connections
    limit = descriptor_limit()
    return 65536 if limit is None else max(16, limit * 3 // 4 - 3 * ACCEPT_BATCH)


def _refusal(status_line: str, err: APIError) -> bytes:
    body = json.dumps(err.body()).encode()
    return (f"HTTP/1.1 {status_line}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


TOO_MANY_CONNECTIONS = _refusal("503 Service Unavailable", APIError(
    503, "the server has too many open connections; try again shortly", code="too_many_connections"))


class GuardedProtocol:
    """Mixed into uvicorn's HTTP protocol (h11 or httptools): the connection cap and the header
    timeout, over its ``connections``, ``cycle``, ``transport`` and ``loop``. Class attributes
    set by ``guarded_protocol``; ``waiting`` holds the server's connections that wait for a
    request's headers, oldest first."""

    max_connections: int
    header_timeout_s: float
    notices: Notices
    waiting: dict[GuardedProtocol, None]
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            if self.waiting:
                self.notices.warn("evicting", "%d connections are open (--max-connections): closing those "
                                  "that wait longest without a request", self.max_connections)
                next(iter(self.waiting))._close_waiting()
            else:
                self.notices.warn("refusing", "%d connections are open, all with a request running "
                                  "(--max-connections): refusing new ones", self.max_connections)
                transport.write(TOO_MANY_CONNECTIONS)
                transport.close()
                return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are in
            self._stop_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle  # a pipelined request's, if one came
        if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
            self._await_headers()  # of the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._close_waiting)
        self.waiting[self] = None

    def _stop_timer(self) -> None:
        self.waiting.pop(self, None)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _close_waiting(self) -> None:
        """Close this connection, which has no request (its header time is up, or room is needed)."""
        self._stop_timer()
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(options: ServerOptions, notices: Notices) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with ``options``' connection cap and header timeout."""
    return type("GuardedHTTPProtocol", (GuardedProtocol, AutoHTTPProtocol), {
        "max_connections": connection_cap(options), "header_timeout_s": options.header_timeout_s,
        "notices": notices, "waiting": {}})


class Server(uvicorn.Server):
    """uvicorn's server, draining the models' requests on exit."""

    def __init__(self, config: uvicorn.Config, service: "ModelFleet | ModelService", shutdown_timeout_s: float,
                 notices: Notices | None = None) -> None:
        super().__init__(config)
        self.service = service
        self.shutdown_timeout_s = shutdown_timeout_s
        self.notices = notices or Notices()
        self.exit_signals = 0
        service.on_load_failed = lambda exc: setattr(self, "should_exit", True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal (or a call from any thread): the first starts the graceful shutdown, the
        second ends the running requests at once, the third quits without waiting."""
        self.exit_signals += 1
        if self.exit_signals == 1:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                log.info("shutting down: running requests have %g s to finish (signal again to end them now)",
                         self.shutdown_timeout_s)
                self.service.begin_drain(self.shutdown_timeout_s)
        elif self.exit_signals == 2:
            log.warning("ending the running requests now (signal again to quit at once)")
            self.service.end_now()
        else:
            self.force_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, with running out of file descriptors logged once a minute (asyncio logs
        each failed accept with a traceback)."""
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()

        def on_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                self.notices.warn("descriptors", "out of file descriptors (%s; limit %s): new connections wait "
                                  "until some close; raise the limit (ulimit -n) or lower --max-connections",
                                  exc.strerror, descriptor_limit())
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(on_error)
        await super().serve(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that a SIGTERM the server shut down for is not raised again at the
        end: the process exits with status 0, not 143 (SIGINT is: KeyboardInterrupt)."""
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", [])
                captured[:] = [s for s in captured if s != signal.SIGTERM]


def make_server(app: FastAPI, options: ServerOptions, *, log_level: str = "info", access_log: bool = True) -> Server:
    """A Server for ``app`` on ``options.host``:``options.port`` (not started)."""
    notices = Notices()
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=options.shutdown_timeout_s + 5.0, lifespan="on",
                            http=guarded_protocol(options, notices), backlog=ACCEPT_BATCH)
    return Server(config, app.state.models, options.shutdown_timeout_s, notices)


def serve(app: FastAPI, options: ServerOptions, sock: socket.socket | None = None) -> int:
    """Serve until SIGINT/SIGTERM; 0, or 1 when the model failed to load."""
    server = make_server(app, options)
    server.run(sockets=[sock] if sock is not None else None)
    return 1 if app.state.models.error is not None else 0
