"""Request bodies parsed and checked off the event loop.

A body of megabytes costs seconds of Python (JSON parsing, the walk of ``load_json_body``,
pydantic's validation, building a request from it); on the event loop that time would hold up
every other request, ``/health`` included. ``off_loop`` runs such work in one thread of its
own, ``BODY_THREAD``: the event loop takes the GIL back between the thread's steps. One thread,
not several: the C parts (``json.loads``, pydantic's core) hold the GIL until they return, and
with several threads the loop could wait for several of them back to back.

The work runs with Python's cyclic garbage collector paused (``gc_paused``): a parser making
millions of lists would otherwise trigger collections that walk every object made so far,
inside the same C call, several times the parse's own time with the GIL held.

Also the small pieces of JSON bodies the other modules share: media types, ``render_json``, and
Anthropic's error body (``error_body``: for the Messages API's errors, answered or streamed).
"""
from __future__ import annotations

import asyncio
import gc
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import bad_request, validation_error
from .protocol import load_json_body

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# Anthropic's error type by HTTP status (other 4xx: invalid_request_error, other 5xx: api_error)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
                         529: "overloaded_error"}
INLINE_BODY = 64 << 10  # bodies up to this size are parsed on the event loop (a few milliseconds)
BODY_THREAD = ThreadPoolExecutor(1, thread_name_prefix="llaisys-body")

_gc_lock = threading.Lock()
_gc_pauses = 0  # pauses under way (the collector runs again when the last ends)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (of the whole process) for the block, unless it was off
    already; reference counting still frees whatever has no cycle."""
    global _gc_pauses
    with _gc_lock:
        if _gc_pauses == 0 and not gc.isenabled():  # someone else turned it off: leave it so
            paused = False
        else:
            paused = True
            _gc_pauses += 1
            gc.disable()
    try:
        yield
    finally:
        if paused:
            with _gc_lock:
                _gc_pauses -= 1
                if _gc_pauses == 0:
                    gc.enable()


def _paused(work: Callable[..., T], *args: Any) -> T:
    with gc_paused():
        return work(*args)


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)``, in BODY_THREAD for a body of more than INLINE_BODY bytes (``size``), else here."""
    if size <= INLINE_BODY:
        return work(*args)
    return await asyncio.wrap_future(BODY_THREAD.submit(_paused, work, *args))


async def parse_body(raw: bytes, content_type: str | None, model: type[M]) -> M:
    """``parse_model`` of a request's body, off the event loop when it is large."""
    return await off_loop(len(raw), parse_model, raw, content_type, model)


def media_type(content_type: str | None) -> str:
    """The media type of a Content-Type header, lowercased, without parameters ('' when absent)."""
    return (content_type or "").split(";")[0].strip().lower()


def is_json_type(media: str) -> bool:
    """Whether ``media`` is JSON's (application/json or some ``+json``)."""
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def parse_model(raw: bytes, content_type: str | None, model: type[M]) -> M:
    """The request ``model`` of the JSON body ``raw``; a 400 APIError naming the field for a body
    that is empty, not JSON, refused by ``load_json_body``, sent as another media type than JSON
    (no Content-Type is taken as JSON), or not a valid ``model``."""
    if not raw.strip():
        raise bad_request("the request has no body; send a JSON object")
    try:
        value = load_json_body(raw)
    except ValueError as exc:  # malformed JSON, or bytes that are not UTF-8
        raise bad_request(f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    media = media_type(content_type)
    if media and not is_json_type(media):
        raise bad_request(f"send the JSON body with Content-Type: application/json, not {media!r}")
    if not isinstance(value, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_kind(value)}")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (an array, a string...)."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def render_json(value: Any) -> bytes:
    """``value`` as Starlette's JSONResponse writes it (UTF-8, compact, no NaN)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape, its type chosen by the HTTP ``status``."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
