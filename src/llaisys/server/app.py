"""The FastAPI app: routes, API key, CORS, Host check, request bodies, and the model service's
life with the app's.

    app = create_app(ServerOptions(api_key="secret"))          # loads the bundled model in the background
    app = create_app(options, model=model)                     # a model loaded already (tests)
    app = create_app(options, loader=lambda: load_model(path))  # how to load it (the CLI: plugins first)

``app.state.service`` is the ``ModelService`` (model, engine thread, metrics) for other modules
mounted on the app, such as the chat UI.

Every request passes, outermost first: CORS (when asked for), ``HostCheck`` (421 for a Host
header naming another site: DNS rebinding) and ``BodyGuard`` (the whole body read before the
app runs: 413 above ``max_body_bytes``, 408 after ``body_timeout_s``, 503 when the server ends
requests at shutdown). The API routes parse their JSON with ``protocol.load_json_body``.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from . import completions, embeddings, responses, ui
from .errors import APIError, install_error_handlers, shutting_down
from .options import ServerOptions
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest,
                       load_json_body)
from .service import Loader, ModelService

log = logging.getLogger(__name__)

LARGE_BODY = 256 << 10  # bodies above this are parsed in a worker thread
ALL_INTERFACES = ("0.0.0.0", "::", "")


def service_of(request: Request) -> ModelService:
    """The app's ModelService."""
    return request.app.state.service


def check_api_key(request: Request) -> None:
    """401 unless the request carries the server's key (when it has one) as a Bearer token."""
    key = service_of(request).options.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        what = "no API key was given" if not token else "the API key is not valid"
        raise APIError(401, f"{what}; send the server's key as 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


class JSONRoute(APIRoute):
    """An API route whose JSON body is parsed by ``load_json_body`` (a lone surrogate or deep
    nesting is a 400 naming the field) before FastAPI validates it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_then_handle(request: Request) -> Response:
            raw = await request.body()
            if raw:
                try:
                    parsed = await asyncio.to_thread(load_json_body, raw) if len(raw) > LARGE_BODY \
                        else load_json_body(raw)
                except ValueError:  # malformed JSON: FastAPI's own parse reports it
                    pass
                else:
                    request._json = parsed  # where Starlette keeps the parsed body, which FastAPI reads
            return await handler(request)

        return parse_then_handle


api = APIRouter(dependencies=[Depends(check_api_key)], route_class=JSONRoute)
public = APIRouter()


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions, streamed or not."""
    return await completions.chat_completion(service_of(request), body, request)


@api.post("/v1/completions")
async def text_completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's (legacy) text completions, streamed or not."""
    return await completions.completion(service_of(request), body, request)


@api.post("/v1/responses")
async def create_response(body: responses.ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API, stateless: text or items in, output items out, streamed or not."""
    return await responses.create_response(service_of(request), body, request)


@api.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings: pooled, normalized final hidden states of each input."""
    return await embeddings.create_embeddings(service_of(request), body, request)


@api.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The served model."""
    service = service_of(request)
    service.require_ready()
    return {"object": "list", "data": [{
        "id": service.model_name, "object": "model", "created": service.created, "owned_by": "llaisys",
        "root": str(getattr(service.model, "source", service.model_name)), "parent": None,
        "max_model_len": service.max_model_len, "capabilities": service.capabilities()}]}


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """vLLM's /tokenize: token ids of a prompt, or of chat messages rendered with the template
    (in a worker thread: a long text does not hold up other requests)."""
    service = service_of(request)
    service.require_ready()
    service.check_model(body.model)

    def work() -> dict[str, Any]:
        if body.messages is not None:
            text = service.chat_text(body.messages, body.add_generation_prompt, tools=body.tools)
            ids = service.encode(text, bool(body.add_special_tokens), "messages")
        else:
            ids = service.encode(body.prompt or "", body.add_special_tokens is not False, "prompt")
        strs = [service.token_text(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids, "token_strs": strs}

    return JSONResponse(await service.in_worker(work))


@api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """vLLM's /detokenize: the text of token ids."""
    service = service_of(request)
    service.require_ready()
    service.check_model(body.model)
    try:
        return {"prompt": await service.in_worker(lambda: service.tokenizer.decode(body.tokens))}
    except ValueError as exc:
        raise APIError(400, str(exc), param="tokens") from exc


@public.get("/health")
async def health(request: Request) -> Response:
    """200 once the model is loaded and the engine runs; 503 while loading or after a failure."""
    service = service_of(request)
    status = service.status
    if status == "ready":
        return JSONResponse({"status": "ok", "model": service.model_name})
    body = {"status": status, "model": service.model_name}
    if status == "failed":
        body["error"] = service.failure()
    return JSONResponse(body, status_code=503)


@public.get("/version")
async def version() -> dict[str, str]:
    """The llaisys version."""
    return {"version": __version__}


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics (vLLM's names)."""
    service = service_of(request)
    await service.stats()
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


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

    def __init__(self, app: ASGIApp, service: ModelService) -> None:
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


def create_app(options: ServerOptions | None = None, model: Any = None, loader: Loader | None = None) -> FastAPI:
    """The app serving ``model`` (or what ``loader()`` returns, or ``options.model``, loaded in a
    background thread when the app starts: /health answers 503 until it is ready).

    Raises FileNotFoundError/ValueError for a --chat-template file that is missing or bad.
    """
    options = options or ServerOptions()
    service = ModelService(options, model, loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(service.stop)

    app = FastAPI(title="llaisys", version=__version__, lifespan=lifespan,
                  description="An OpenAI-compatible API over the llaisys serving engine.")
    app.state.service = service
    install_error_handlers(app)
    app.include_router(api)
    app.include_router(public)
    ui.mount(app, options)
    app.add_middleware(BodyGuard, service=service)
    app.add_middleware(HostCheck, listen_host=options.host, allowed=options.allowed_hosts)
    if options.allowed_origins:  # outermost: its headers go on every answer, the refusals included
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in options.allowed_origins)
    return app
