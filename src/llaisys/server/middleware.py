"""The ASGI middlewares every request passes before its route, outermost first (``create_app``
adds them; CORS, when asked for, sits outside them all):

- ``AnthropicErrors``: on the Messages API's paths, error answers reshaped into Anthropic's
  ``{"type": "error", "error": {"type", "message"}}``, those of the middlewares below included;
- ``HostCheck``: 421 for a Host header naming another site (DNS rebinding);
- ``BodyGuard``: the whole body read before the app runs: 413 above ``max_body_bytes``, 408
  after ``body_timeout_s``, 503 when the server ends requests at shutdown;
- ``ModelLeases``: the models a request took (``fleet.ModelFleet.acquire``) are given back when
  its response has been sent, so no model is unloaded under a request.

They live apart from the routes so that a request's way enters each server module once: this
module as it comes in, then ``app.py`` for its route, then the protocol module.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .bodies import error_body, is_json_type, media_type, render_json
from .errors import APIError, shutting_down
from .service import ModelService

if TYPE_CHECKING:
    from .fleet import ModelFleet

log = logging.getLogger(__name__)

LEASES = "llaisys.leases"  # the ASGI scope key of the model services a request holds (fleet.acquire)

ALL_INTERFACES = ("0.0.0.0", "::", "")
MESSAGES_PATH = "/v1/messages"


# ---- the Host header -------------------------------------------------------------------------
def host_name(header: str) -> str:
    """The name in a Host header: lowercased, without port, brackets or a final dot."""
    value = header.strip().lower()
    if value.startswith("["):
        value = value[1:value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def is_ip_address(name: str) -> bool:
    """Whether ``name`` is an IPv4 or IPv6 address (not a name to look up)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheck:
    """421 for a request whose Host header is not a name this server answers to.

    A page of another site can reach a server on this machine by DNS rebinding (its own name,
    made to resolve to 127.0.0.1), and then read the answers; its requests carry its name as
    Host. Accepted: any IP address (a rebinding needs a name), ``localhost``, the ``--host``
    name, and ``--allowed-hosts`` (``*``: any; ``*.example.com``: its subdomains). Listening on
    all interfaces, the names clients use are not known, so any Host is accepted except on the
    chat UI's ``/api`` routes, which hold the stored conversations.
    """

    def __init__(self, app: ASGIApp, listen_host: str, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.any = "*" in allowed
        self.all_interfaces = listen_host in ALL_INTERFACES
        self.names = {"localhost", host_name(listen_host)} | {host_name(h) for h in allowed if not h.startswith("*.")}
        self.suffixes = tuple(h[1:].lower().rstrip(".") for h in allowed if h.startswith("*."))
        self.logged: set[str] = set()  # names refused and logged (each once: a page can send many)

    def trusted(self, name: str) -> bool:
        """Whether Host ``name`` (see ``host_name``) is one the server answers to on every route."""
        return name in self.names or bool(self.suffixes and name.endswith(self.suffixes)) or is_ip_address(name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        header = Headers(scope=scope).get("host")
        path = scope["path"]
        ui_data = path == "/api" or path.startswith("/api/")
        if header is None or self.trusted(host_name(header)) or (self.all_interfaces and not ui_data):
            return await self.app(scope, receive, send)
        name = host_name(header)
        where = " (the chat UI's /api routes want a known name even when the server listens on all interfaces)" \
            if self.all_interfaces else ""
        err = APIError(421, f"the Host header {header!r} is not a name this server answers to{where}; it answers "
                            f"to localhost, IP addresses and the names given with --allowed-hosts: start it with "
                            f"--allowed-hosts {name} (or '*' for any) if that is how clients reach it",
                       code="invalid_host")
        if name not in self.logged and len(self.logged) < 100:
            self.logged.add(name)
            log.warning("refused requests for Host %r: DNS rebinding, or a name missing from --allowed-hosts", name)
        await err.response(close=True)(scope, receive, send)


# ---- request bodies --------------------------------------------------------------------------
class BodyGuard:
    """Reads each request's whole body before the app runs, and bounds it: 413 when
    Content-Length, or the chunks counted as they come, pass ``options.max_body_bytes``; 408 when
    the body is not all in after ``options.body_timeout_s``; 503 when the server ends the running
    requests (shutdown) meanwhile. These answers close the connection (the rest of the body is
    not read). A request the server cut off at shutdown ends with a 503 rather than a traceback."""

    def __init__(self, app: ASGIApp, service: "ModelService | ModelFleet") -> None:
        self.app = app
        self.service = service
        self.limit = service.options.max_body_bytes
        self.timeout = service.options.body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length == "0" or (length is None and "chunked" not in headers.get("transfer-encoding", "").lower()):
            return await self._run(scope, receive, send)
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(413, scope, receive, send, f"Content-Length {length}")
        reader = asyncio.ensure_future(self._read(receive))
        ending = asyncio.ensure_future(self.service.ending.wait())
        try:
            await asyncio.wait({reader, ending}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, ending):
                task.cancel()
        if not reader.done() or reader.cancelled():
            return await self._refuse(503 if ending.done() else 408, scope, receive, send)
        body = reader.result()
        if body is None:  # the client went away
            return
        if isinstance(body, int):
            return await self._refuse(413, scope, receive, send, f"{body} bytes so far")
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self._run(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | int | None:
        """The body; its size so far once it passes the limit; None if the client disconnected."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, status: int, scope: Scope, receive: Receive, send: Send, size: str = "") -> None:
        if status == 413:
            err = APIError(413, f"the request body is larger than this server takes ({size} > {self.limit} bytes); "
                                "send less, or start the server with a larger --max-body-bytes",
                           code="request_too_large")
        elif status == 408:
            err = APIError(408, f"the request body did not arrive within {self.timeout:g} s "
                                "(--body-timeout)", code="request_timeout")
        else:
            err = shutting_down()
        await err.response(close=True)(scope, receive, send)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not self.service.draining:
                raise
            # uvicorn cancels what still runs when its shutdown wait is over: answer, quietly
            log.info("%s %s was cut off by the shutdown", scope.get("method"), scope.get("path"))
            if not started:
                await shutting_down().response(close=True)(scope, receive, send)


# ---- models held by a request ----------------------------------------------------------------
class ModelLeases:
    """ASGI middleware: the model services a request acquired are released when its response
    has been sent (a stream's last byte included), so a model is never unloaded under a request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            for service in scope.get(LEASES, ()):
                service.leases -= 1
                service.last_used = time.monotonic()


# ---- Anthropic's error shape -----------------------------------------------------------------
def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of the Messages API's (its errors take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def reshape_error(status: int, raw: bytes) -> bytes:
    """An error answer's JSON body in Anthropic's shape (one that has it already, unchanged)."""
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if isinstance(value, dict) and value.get("type") == "error":
        return raw
    error = value.get("error") if isinstance(value, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        message = raw.decode("utf-8", "replace") or f"HTTP {status}"
    return render_json(error_body(status, message))


class AnthropicErrors:
    """Gives the Messages API's error answers Anthropic's shape: an answer of status 400 or more
    with a JSON body, on a path under /v1/messages, is held and rewritten (``reshape_error``); an
    unexpected exception there is answered with an ``api_error`` 500 before it goes on up (to
    be logged). Other paths, and successful answers (streams), pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            return await self.app(scope, receive, send)
        held: Message | None = None  # the start of an error answer, sent once its body is rewritten
        chunks: list[bytes] = []
        started = False

        async def reshaping(message: Message) -> None:
            nonlocal held, started
            if message["type"] == "http.response.start":
                started = True
                content_type = Headers(raw=message.get("headers", [])).get("content-type")
                if message["status"] >= 400 and is_json_type(media_type(content_type)):
                    held = message
                    return
            elif held is not None and message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = reshape_error(held["status"], b"".join(chunks))
                headers = MutableHeaders(raw=list(held.get("headers", [])))
                headers["content-length"] = str(len(body))
                await send({**held, "headers": headers.raw})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        try:
            await self.app(scope, receive, reshaping)
        except Exception as exc:
            if not started:
                body = render_json(error_body(500, f"internal error: {type(exc).__name__}: {exc}"))
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            raise
