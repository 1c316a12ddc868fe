"""The FastAPI app: routes, API key, CORS, and the model service's life with the app's.

    app = create_app(ServerOptions(api_key="secret"))          # loads the bundled model in the background
    app = create_app(options, model=model)                     # a model loaded already (tests)
    app = create_app(options, loader=lambda: load_model(path))  # how to load it (the CLI: plugins first)

``app.state.service`` is the ``ModelService`` (model, engine thread, metrics) for other modules
mounted on the app, such as the chat UI.
"""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from . import completions, ui
from .errors import APIError, install_error_handlers
from .options import ServerOptions
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .service import Loader, ModelService


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


api = APIRouter(dependencies=[Depends(check_api_key)])
public = APIRouter()


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions, streamed or not."""
    return await completions.chat_completion(service_of(request), body, request)


@api.post("/v1/completions")
async def text_completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's (legacy) text completions, streamed or not."""
    return await completions.completion(service_of(request), body, request)


@api.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The served model."""
    service = service_of(request)
    service.require_ready()
    return {"object": "list", "data": [{
        "id": service.model_name, "object": "model", "created": service.created, "owned_by": "llaisys",
        "root": str(getattr(service.model, "source", service.model_name)), "parent": None,
        "max_model_len": service.max_model_len}]}


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """vLLM's /tokenize: token ids of a prompt, or of chat messages rendered with the template."""
    service = service_of(request)
    service.require_ready()
    service.check_model(body.model)
    if body.messages is not None:
        text = service.chat_text(body.messages, body.add_generation_prompt)
        special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        special = body.add_special_tokens is not False
    try:
        ids = list(service.tokenizer.encode(text, add_special_tokens=special))
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    strs = [service.token_text(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids, "token_strs": strs}


@api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """vLLM's /detokenize: the text of token ids."""
    service = service_of(request)
    service.require_ready()
    service.check_model(body.model)
    try:
        return {"prompt": service.tokenizer.decode(body.tokens)}
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
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in options.allowed_origins)
    return app
