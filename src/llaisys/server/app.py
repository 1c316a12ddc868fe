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
requests at shutdown). An API route checks the key first, then parses its JSON body with
``protocol.load_json_body`` and validates it, off the event loop when it is large
(``bodies.off_loop``). ``/metrics`` wants the key only with ``options.metrics_require_key``.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from . import anthropic, completions, embeddings, responses, ui, worker_info
from .bodies import off_loop, parse_body, render_json
from .errors import APIError, install_error_handlers, shutting_down
from .options import ServerOptions
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest
from .requests import chat_text, encode
from .service import Loader, ModelService

log = logging.getLogger(__name__)

ALL_INTERFACES = ("0.0.0.0", "::", "")
M = TypeVar("M", bound=BaseModel)
BODY_SCHEMAS: dict[str, Any] = {}  # the request bodies' JSON schemas, for /openapi.json


def service_of(request: Request) -> ModelService:
    """The app's ModelService."""
    return request.app.state.service


def check_api_key(request: Request) -> None:
    """401 unless the request carries the server's key (when it has one) as a Bearer token, or
    in an ``x-api-key`` header as Anthropic's clients send it."""
    key = service_of(request).options.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    given += request.headers.getlist("x-api-key")
    if not any(secrets.compare_digest(k.encode(), key.encode()) for k in given):
        what = "no API key was given" if not (token or given) else "the API key is not valid"
        raise APIError(401, f"{what}; send the server's key as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key")


def json_body(model: type[M]) -> Any:
    """A route parameter: the request's body as ``model``, parsed and validated by
    ``bodies.parse_body`` (off the event loop when large). The route's other dependencies,
    the API key first, are checked before it."""
    async def parse(request: Request) -> M:
        return await parse_body(await request.body(), request.headers.get("content-type"), model)

    return Depends(parse)


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route taking ``model`` as its JSON body (its schema is added to
    /openapi.json's components by ``openapi_with_bodies``)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    BODY_SCHEMAS.update(schema.pop("$defs", {}))
    BODY_SCHEMAS[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_with_bodies(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """``app.openapi``: FastAPI's document, with the schemas of the bodies ``json_body`` parses."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(BODY_SCHEMAS)
            app.openapi_schema = doc
        return app.openapi_schema

    return openapi


api = APIRouter(dependencies=[Depends(check_api_key)])
public = APIRouter()
worker_info.install(api)  # /server_info, /model_info: what a gateway in front of replicas reads


@api.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
async def chat_completions(request: Request,
                           body: ChatCompletionRequest = json_body(ChatCompletionRequest)) -> Response:
    """OpenAI's chat completions, streamed or not."""
    return await completions.chat_completion(service_of(request), body, request)


@api.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
async def text_completions(request: Request, body: CompletionRequest = json_body(CompletionRequest)) -> Response:
    """OpenAI's (legacy) text completions, streamed or not."""
    return await completions.completion(service_of(request), body, request)


@api.post("/v1/responses", openapi_extra=body_doc(responses.ResponsesRequest))
async def create_response(request: Request,
                          body: responses.ResponsesRequest = json_body(responses.ResponsesRequest)) -> Response:
    """OpenAI's Responses API, stateless: text or items in, output items out, streamed or not."""
    chat = await off_loop(len(await request.body()), responses.chat_request, body)
    return await responses.create_response(service_of(request), body, chat, request)


@api.post("/v1/messages", openapi_extra=body_doc(anthropic.AnthropicMessagesRequest))
async def create_message(request: Request, body: anthropic.AnthropicMessagesRequest =
                         json_body(anthropic.AnthropicMessagesRequest)) -> Response:
    """Anthropic's Messages API: content blocks in and out, streamed or not."""
    chat = await off_loop(len(await request.body()), anthropic.chat_request, body)
    return await anthropic.create_message(service_of(request), body, chat, request)


@api.post("/v1/messages/count_tokens", openapi_extra=body_doc(anthropic.AnthropicCountTokensRequest))
async def count_message_tokens(request: Request, body: anthropic.AnthropicCountTokensRequest =
                               json_body(anthropic.AnthropicCountTokensRequest)) -> dict[str, int]:
    """Anthropic's token counting: the prompt tokens of a Messages request."""
    chat = await off_loop(len(await request.body()), anthropic.chat_request, body)
    return await anthropic.count_tokens(service_of(request), chat)


@api.post("/v1/embeddings", openapi_extra=body_doc(EmbeddingRequest))
async def create_embeddings(request: Request, body: EmbeddingRequest = json_body(EmbeddingRequest)) -> Response:
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


@api.post("/tokenize", openapi_extra=body_doc(TokenizeRequest))
async def tokenize(request: Request, body: TokenizeRequest = json_body(TokenizeRequest)) -> Response:
    """vLLM's /tokenize: token ids of a prompt, or of chat messages rendered with the template
    (in a worker thread: a long text does not hold up other requests)."""
    service = service_of(request)
    service.require_ready()
    service.check_model(body.model)

    def work() -> bytes:  # the answer rendered here too: millions of ids take a while to write
        if body.messages is not None:
            text = chat_text(service, body.messages, body.add_generation_prompt, tools=body.tools)
            ids = encode(service, text, bool(body.add_special_tokens), "messages")
        else:
            ids = encode(service, body.prompt or "", body.add_special_tokens is not False, "prompt")
        strs = [service.token_text(i) for i in ids] if body.return_token_strs else None
        return render_json({"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids,
                            "token_strs": strs})

    return Response(await service.in_worker(work), media_type="application/json")


@api.post("/detokenize", openapi_extra=body_doc(DetokenizeRequest))
async def detokenize(request: Request, body: DetokenizeRequest = json_body(DetokenizeRequest)) -> dict[str, Any]:
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
    """Prometheus metrics (vLLM's names); with ``options.metrics_require_key``, behind the API key."""
    service = service_of(request)
    if service.options.metrics_require_key:
        check_api_key(request)
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
    app.openapi = openapi_with_bodies(app)
    install_error_handlers(app)
    app.include_router(api)
    app.include_router(public)
    ui.mount(app, options)
    app.add_middleware(BodyGuard, service=service)
    app.add_middleware(HostCheck, listen_host=options.host, allowed=options.allowed_hosts)
    app.add_middleware(anthropic.AnthropicErrors)  # the Messages API's errors, all of them, in Anthropic's shape
    if options.allowed_origins:  # outermost: its headers go on every answer, the refusals included
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in options.allowed_origins)
    return app
