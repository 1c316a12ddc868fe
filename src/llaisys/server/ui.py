"""The chat UI served at ``/``: static files shipped in the package and the conversation store
API behind them.

``mount(app, options)`` adds

* ``GET /``: the chat page (``static/index.html``), and ``/ui/*``: its script and style;
* ``/api/conversations...``: the REST API over ``store.ConversationStore`` (see docs/server.md); a
  user message may carry ``images`` (``[{"url": "data:image/png;base64,..."}]``, at most
  ``store.MAX_IMAGES`` of ``store.MAX_IMAGE_BYTES`` each), which the page sends to the model as
  OpenAI ``image_url`` parts;
* ``GET /api/settings``: the sampling defaults the page sends unless the user sets its own (the
  loaded model's, as the CLI uses them; 503 while the model loads).

The page itself talks to the server's ``/v1/chat/completions`` (streamed) and saves what it
sends and receives through the API. With ``options.api_key`` set, every ``/api`` call needs
``Authorization: Bearer <key>`` (the page asks for the key once); the page and its files do not.
Errors are the server's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 bad JSON (as
``protocol.load_json_body`` refuses it: nested deeper than MAX_JSON_DEPTH, NaN or Infinity, a lone
surrogate) or field, 401 missing or wrong key, 404 unknown id, 415 a body that is not sent as
JSON, 503 no model (yet) for ``/api/settings``.

The key is checked before the body is read; a large body is parsed, and every answer built and
written as JSON, off the event loop (``bodies.off_loop``, the store's calls in the thread pool):
a conversation of thousands of messages takes a while to read or write.
"""
from __future__ import annotations

import functools
import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from ..generation.defaults import CHAT_MAX_TOKENS, sampling_defaults
from .bodies import is_json_type, json_kind, media_type, off_loop, render_json
from .errors import APIError
from .protocol import load_json_body
from .store import ConversationStore, NotFoundError

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
# The page renders model output: no inline script, no foreign origin, nothing but this server.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")

Handler = Callable[..., Awaitable[Any]]


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


_ERROR_CODES = {401: "invalid_api_key", 404: "not_found", 415: "unsupported_media_type"}


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    """The server's error shape (OpenAI's): {"error": {"message", "type", "param", "code"}}."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None, "code": code or _ERROR_CODES.get(status)}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _key_matches(request: Request, key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _json_body(request: Request, empty: Any = None) -> dict[str, Any]:
    """The request's JSON object (``empty`` when there is no body), parsed by ``load_json_body``
    (off the event loop when large); 400 for anything else.

    The body must be sent as application/json: a page of another site cannot send that without
    the browser asking the server first (CORS), so it cannot write here behind the user's back.
    """
    raw = await request.body()
    if not raw.strip():
        if empty is None:
            raise _HTTPError(400, "the request needs a JSON object body")
        return empty
    media = media_type(request.headers.get("content-type"))
    if not is_json_type(media):
        raise _HTTPError(415, f"send the body as Content-Type: application/json, not {media or 'no type'!r}")
    return await off_loop(len(raw), _parse_object, raw)


def _parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = load_json_body(raw)
    except ValueError as exc:  # malformed JSON, or bytes that are not UTF-8
        raise _HTTPError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _HTTPError(400, f"the body must be a JSON object, got {json_kind(body)}")
    return body


async def _answer(work: Callable[[], Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``work()`` (a store call) and its result written as JSON, in the thread pool."""
    body = await run_in_threadpool(lambda: render_json(work()))
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _fields(body: dict[str, Any], allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise _HTTPError(400, f"unknown field(s) {', '.join(unknown)}; expected some of {', '.join(allowed)}")
    missing = [k for k in required if k not in body]
    if missing:
        raise _HTTPError(400, f"missing field(s) {', '.join(missing)}")
    return body


def page_defaults(service: Any) -> dict[str, Any]:
    """What the page sends when the user sets nothing: the sampling defaults of the model that
    ``service`` (the app's ModelService) serves, as the CLI takes them (its generation_config.json,
    else FALLBACK_SAMPLING), ``max_tokens`` CHAT_MAX_TOKENS and ``max_model_len`` (the context, or
    None). Raises a 503 _HTTPError while there is no model."""
    status = getattr(service, "status", None)
    if service is None or status is None:
        raise _HTTPError(503, "this server serves no model, so it has no sampling defaults", "no_model")
    if status == "failed":
        raise _HTTPError(503, service.failure(), "engine_unavailable")
    if status == "loading" or getattr(service, "model", None) is None:
        raise _HTTPError(503, "the model is still loading; try again shortly", "model_loading")
    out: dict[str, Any] = {"temperature": None, "top_p": None}  # None: the server's default
    out.update(sampling_defaults(getattr(service.model, "generation_defaults", None)))
    out["max_tokens"] = CHAT_MAX_TOKENS
    no_engine = hasattr(service, "engine") and service.engine is None  # the context is the engine's
    out["max_model_len"] = None if no_engine else getattr(service, "max_model_len", None)
    return out


def _attachment_name(title: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", title).strip("-.")[:60] or "conversation"
    return f"{stem}.json"


def mount(app: Any, options: Any) -> None:
    """Add the chat page, its static files and the conversation API to the FastAPI ``app``.

    ``options.db_path`` (a path, or None for ``store.default_path()``) is the SQLite file, opened on
    first use; ``options.api_key`` (a string, or None) guards ``/api``. The store is kept as
    ``app.state.conversation_store``.
    """
    db_path = getattr(options, "db_path", None)
    api_key = getattr(options, "api_key", None) or None
    store = ConversationStore(db_path)
    app.state.conversation_store = store

    def endpoint(handler: Handler) -> Handler:
        """Check the key, run ``handler``, and turn the store's errors into JSON error responses."""
        @functools.wraps(handler)
        async def wrapped(request: Request, *args: Any, **kwargs: Any) -> Any:
            if api_key is not None and not _key_matches(request, api_key):
                return _error(401, "missing or wrong API key: send the server's key as 'Authorization: Bearer <key>'")
            try:
                return await handler(request, *args, **kwargs)
            except _HTTPError as exc:
                return _error(exc.status, str(exc), exc.code)
            except APIError as exc:  # a body load_json_body refused
                return _error(exc.status, exc.message, exc.code)
            except NotFoundError as exc:
                return _error(404, exc.args[0] if exc.args else "not found")
            except (ValueError, TypeError) as exc:
                return _error(400, str(exc))
        return wrapped

    router = APIRouter(prefix="/api/conversations", tags=["chat UI"])

    @router.get("", response_model=None)
    @endpoint
    async def list_conversations(request: Request) -> Any:
        q = request.query_params.get("q", "")
        try:
            limit = int(request.query_params.get("limit", "500"))
        except ValueError:
            raise _HTTPError(400, f"limit must be an integer, got {request.query_params.get('limit')!r}") from None
        if not 1 <= limit <= 5000:
            raise _HTTPError(400, f"limit must be in [1, 5000], got {limit}")
        return await _answer(lambda: {"data": store.list_conversations(q, limit)})

    @router.post("", status_code=201, response_model=None)
    @endpoint
    async def create_conversation(request: Request) -> Any:
        body = _fields(await _json_body(request, empty={}), ("title", "system_prompt", "settings"))
        return await _answer(lambda: store.create_conversation(body.get("title", ""), body.get("system_prompt", ""),
                                                               body.get("settings")), 201)

    @router.post("/import", status_code=201, response_model=None)
    @endpoint
    async def import_conversations(request: Request) -> Any:
        body = await _json_body(request)
        return await _answer(lambda: {"data": store.import_conversations(body)}, 201)

    @router.get("/{cid}", response_model=None)
    @endpoint
    async def get_conversation(request: Request, cid: str) -> Any:
        return await _answer(lambda: store.get_conversation(cid))

    @router.patch("/{cid}", response_model=None)
    @endpoint
    async def update_conversation(request: Request, cid: str) -> Any:
        body = _fields(await _json_body(request), ("title", "system_prompt", "settings", "active_leaf"))
        return await _answer(lambda: store.update_conversation(cid, body))

    @router.delete("/{cid}", status_code=204, response_model=None)
    @endpoint
    async def delete_conversation(request: Request, cid: str) -> Any:
        await run_in_threadpool(store.delete_conversation, cid)
        return Response(status_code=204)

    @router.post("/{cid}/messages", status_code=201, response_model=None)
    @endpoint
    async def add_message(request: Request, cid: str) -> Any:
        body = _fields(await _json_body(request), ("role", "content", "parent_id", "meta", "activate", "images"),
                       required=("role", "content"))
        return await _answer(lambda: store.add_message(cid, body["role"], body["content"], body.get("parent_id"),
                                                       body.get("meta"), body.get("activate", True),
                                                       body.get("images")), 201)

    @router.patch("/{cid}/messages/{mid}", response_model=None)
    @endpoint
    async def update_message(request: Request, cid: str, mid: str) -> Any:
        body = _fields(await _json_body(request), ("content", "meta"))
        return await _answer(lambda: store.update_message(cid, mid, body))

    @router.get("/{cid}/export", response_model=None)
    @endpoint
    async def export_conversation(request: Request, cid: str) -> Any:
        document = await run_in_threadpool(store.export_conversation, cid)
        name = _attachment_name(document["conversation"]["title"])
        return await _answer(lambda: document, headers={"Content-Disposition": f'attachment; filename="{name}"'})

    app.include_router(router)

    @app.get("/api/settings", tags=["chat UI"], response_model=None)
    @endpoint
    async def settings_defaults(request: Request) -> Any:
        name = request.query_params.get("model")
        fleet = getattr(request.app.state, "models", None)
        if name and fleet is not None:  # the model the page's picker chose: loaded for it
            return page_defaults(await fleet.acquire(request.scope, name))
        return page_defaults(getattr(request.app.state, "service", None))

    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                            headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                     "Cache-Control": "no-cache"})

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui-static")
