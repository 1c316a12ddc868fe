"""The FastAPI app: routes, API key, CORS, and the model service's life with the app's.

    app = create_app(ServerOptions(api_key="secret"))          # loads the bundled model in the background
    app = create_app(options, model=model)                     # a model loaded already (tests)
    app = create_app(options, loader=lambda: load_model(path))  # how to load it (the CLI: plugins first)

``app.state.models`` is the ``fleet.ModelFleet`` (the models by name, loaded on demand when
there are several); ``app.state.service`` the default model's ``ModelService`` (model, engine
thread, metrics; None when a server of several has no default) for other modules mounted on
the app, such as the chat UI. A route takes its model with ``acquire(request, name)``, which
loads it when needed and keeps it from being unloaded until the response ends.

Every request passes the middlewares of ``middleware.py`` first, outermost first: CORS (when
asked for), ``AnthropicErrors`` (the Messages API's errors in Anthropic's shape), ``HostCheck``
(421 for a Host header naming another site: DNS rebinding) and ``BodyGuard`` (the whole body
read before the app runs: 413 above ``max_body_bytes``, 408 after ``body_timeout_s``, 503 when
the server ends requests at shutdown). An API route checks the key first, then parses its JSON
body with ``protocol.load_json_body`` and validates it, off the event loop when it is large
(``bodies.off_loop``). ``/metrics`` wants the key only with ``options.metrics_require_key``.
"""
from __future__ import annotations

import asyncio
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

from .. import __version__
from . import anthropic, completions, embeddings, responses, ui, worker_info
from .bodies import off_loop, parse_body, render_json
from .errors import APIError, install_error_handlers
from .middleware import AnthropicErrors, BodyGuard, HostCheck, ModelLeases
from .options import ServerOptions
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest,
                       message_images)
from .requests import chat_text, check_images, encode, rendered_prompt
from .fleet import ModelFleet
from .service import Loader, ModelService

M = TypeVar("M", bound=BaseModel)
BODY_SCHEMAS: dict[str, Any] = {}  # the request bodies' JSON schemas, for /openapi.json


def fleet_of(request: Request) -> ModelFleet:
    """The app's models."""
    return request.app.state.models


async def acquire(request: Request, name: str | None) -> ModelService:
    """The service of the model ``name`` (None: the default), loaded, held until the response ends."""
    return await fleet_of(request).acquire(request.scope, name)


def check_api_key(request: Request) -> None:
    """401 unless the request carries the server's key (when it has one) as a Bearer token, or
    in an ``x-api-key`` header as Anthropic's clients send it."""
    key = fleet_of(request).options.api_key
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
    return await completions.chat_completion(await acquire(request, body.model), body, request)


@api.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
async def text_completions(request: Request, body: CompletionRequest = json_body(CompletionRequest)) -> Response:
    """OpenAI's (legacy) text completions, streamed or not."""
    return await completions.completion(await acquire(request, body.model), body, request)


@api.post("/v1/responses", openapi_extra=body_doc(responses.ResponsesRequest))
async def create_response(request: Request,
                          body: responses.ResponsesRequest = json_body(responses.ResponsesRequest)) -> Response:
    """OpenAI's Responses API, stateless: text or items in, output items out, streamed or not."""
    chat = await off_loop(len(await request.body()), responses.chat_request, body)
    return await responses.create_response(await acquire(request, chat.model), body, chat, request)


@api.post("/v1/messages", openapi_extra=body_doc(anthropic.AnthropicMessagesRequest))
async def create_message(request: Request, body: anthropic.AnthropicMessagesRequest =
                         json_body(anthropic.AnthropicMessagesRequest)) -> Response:
    """Anthropic's Messages API: content blocks in and out, streamed or not."""
    chat = await off_loop(len(await request.body()), anthropic.chat_request, body)
    return await anthropic.create_message(await acquire(request, chat.model), body, chat, request)


@api.post("/v1/messages/count_tokens", openapi_extra=body_doc(anthropic.AnthropicCountTokensRequest))
async def count_message_tokens(request: Request, body: anthropic.AnthropicCountTokensRequest =
                               json_body(anthropic.AnthropicCountTokensRequest)) -> dict[str, int]:
    """Anthropic's token counting: the prompt tokens of a Messages request."""
    chat = await off_loop(len(await request.body()), anthropic.chat_request, body)
    return await anthropic.count_tokens(await acquire(request, chat.model), chat)


@api.post("/v1/embeddings", openapi_extra=body_doc(EmbeddingRequest))
async def create_embeddings(request: Request, body: EmbeddingRequest = json_body(EmbeddingRequest)) -> Response:
    """OpenAI's embeddings: pooled, normalized final hidden states of each input."""
    return await embeddings.create_embeddings(await acquire(request, body.model), body, request)


@api.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The served models: a server of one, its model once ready (503 while it loads); a server
    of several, every model it knows with its state (loaded, loading, unloaded, failed)."""
    fleet = fleet_of(request)
    if not fleet.options.many_models:
        fleet.default.require_ready()
    return {"object": "list", "data": [fleet.describe(s) for s in fleet.services.values()]}


class ModelAction(BaseModel):
    """The body of /models/load and /models/unload: the model's name; pin: keep it loaded
    (never unloaded to make room or when idle) until it is unloaded by name."""

    model: str
    pin: bool = False


@api.post("/models/load", openapi_extra=body_doc(ModelAction))
async def load_model(request: Request, body: ModelAction = json_body(ModelAction)) -> dict[str, Any]:
    """Load a model now (as a request naming it would), optionally pinned; its /v1/models entry."""
    fleet = fleet_of(request)
    service = fleet.lookup(body.model)
    if body.pin:
        service.pinned = True
    await fleet.acquire(request.scope, body.model)
    return {"success": True, **fleet.describe(service)}


@api.post("/models/unload", openapi_extra=body_doc(ModelAction))
async def unload_model(request: Request, body: ModelAction = json_body(ModelAction)) -> dict[str, Any]:
    """Unload a model now and unpin it (409 while requests use it); its /v1/models entry."""
    fleet = fleet_of(request)
    service = await fleet.unload(body.model)
    return {"success": True, **fleet.describe(service)}


@api.post("/tokenize", openapi_extra=body_doc(TokenizeRequest))
async def tokenize(request: Request, body: TokenizeRequest = json_body(TokenizeRequest)) -> Response:
    """vLLM's /tokenize: token ids of a prompt, or of chat messages rendered with the template,
    their images expanded into their tokens (in a worker thread: a long text or an image does
    not hold up other requests)."""
    service = await acquire(request, body.model)

    def work() -> bytes:  # the answer rendered here too: millions of ids take a while to write
        if body.messages is not None:
            images = message_images(body.messages)
            check_images(service, images)
            text = chat_text(service, body.messages, body.add_generation_prompt, tools=body.tools)
            ids, _ = rendered_prompt(service, text, images, bool(body.add_special_tokens))
        else:
            ids = encode(service, body.prompt or "", body.add_special_tokens is not False, "prompt")
        strs = [service.token_text(i) for i in ids] if body.return_token_strs else None
        return render_json({"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids,
                            "token_strs": strs})

    return Response(await service.in_worker(work), media_type="application/json")


@api.post("/detokenize", openapi_extra=body_doc(DetokenizeRequest))
async def detokenize(request: Request, body: DetokenizeRequest = json_body(DetokenizeRequest)) -> dict[str, Any]:
    """vLLM's /detokenize: the text of token ids."""
    service = await acquire(request, body.model)
    service.require_ready()
    try:
        return {"prompt": await service.in_worker(lambda: service.tokenizer.decode(body.tokens))}
    except ValueError as exc:
        raise APIError(400, str(exc), param="tokens") from exc


@public.get("/health")
async def health(request: Request) -> Response:
    """A server of one model: 200 once it is loaded and its engine runs, 503 while it loads or
    after a failure. A server of several: 200 with each model's state (they load on demand),
    503 only while shutting down."""
    fleet = fleet_of(request)
    if fleet.options.many_models:
        states = {name: s.status for name, s in fleet.services.items() if s.status != "unloaded"}
        ok = not fleet.draining
        return JSONResponse({"status": "ok" if ok else "shutting_down", "models": states},
                            status_code=200 if ok else 503)
    service = fleet.default
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
    fleet = fleet_of(request)
    if fleet.options.metrics_require_key:
        check_api_key(request)
    for service in list(fleet.services.values()):
        await service.stats()
    return Response(fleet.families.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(options: ServerOptions | None = None, model: Any = None, loader: Loader | None = None,
               load_source: Callable[[str], Any] | None = None) -> FastAPI:
    """The app serving ``model`` (or what ``loader()`` returns, or ``options.model``, loaded in a
    background thread when the app starts: /health answers 503 until it is ready); with
    ``options.models`` or ``options.models_dir``, several models, each loaded on its first
    request by ``load_source(source)`` (default: ``load_model`` with the options' dtype and
    device).

    Raises FileNotFoundError/ValueError for a --chat-template file that is missing or bad, or
    a pinned model that is not served.
    """
    options = options or ServerOptions()
    if load_source is None and options.many_models:
        def load_source(source: str) -> Any:
            from ..models import load_model as load

            return load(source, dtype=options.dtype, device=options.device)
    fleet = ModelFleet(options, model, loader, load_source)
    service = fleet.default

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        fleet.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(fleet.stop)

    app = FastAPI(title="llaisys", version=__version__, lifespan=lifespan,
                  description="An OpenAI-compatible API over the llaisys serving engine.")
    app.state.models = fleet
    app.state.service = service
    app.openapi = openapi_with_bodies(app)
    install_error_handlers(app)
    app.include_router(api)
    app.include_router(public)
    ui.mount(app, options)
    app.add_middleware(ModelLeases)
    app.add_middleware(BodyGuard, service=fleet)
    app.add_middleware(HostCheck, listen_host=options.host, allowed=options.allowed_hosts)
    app.add_middleware(AnthropicErrors)  # the Messages API's errors, all of them, in Anthropic's shape
    if options.allowed_origins:  # outermost: its headers go on every answer, the refusals included
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in options.allowed_origins)
    return app
