"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with a fitting
HTTP status, for our own errors, request validation, unknown routes and anything unexpected."""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

# OpenAI's error types by status
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
         421: "invalid_request_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """An error the API reports to the client: status, message, and what OpenAI calls the
    error's type, the parameter it is about and a short code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        # a lone surrogate from the request (say, in an unknown model's name) could not be sent as UTF-8
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {...}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, close: bool = False) -> JSONResponse:
        """The error as a JSON response with its status; ``close``: with ``Connection: close``
        (a request whose body is left unread)."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if close:
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        """The error as a server-sent event (for a stream that already started)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 error."""
    return APIError(400, message, param=param, code=code)


def shutting_down() -> APIError:
    """The 503 error of a request the server ended because it is shutting down."""
    return APIError(503, "the server is shutting down; the request was not completed", code="server_shutting_down")


# ---- request validation ----------------------------------------------------------------------
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|list)$|[\[\-]|^[A-Z]")


def param_path(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ``messages[0].content``.
    "body" and the tags pydantic adds for union members (``str``, ``list[int]``) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part != "body" and not _TYPE_TAG.search(part):
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first validation error, in words, naming the parameter."""
    first = errors[0]
    kind = first.get("type")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "not valid JSON")
        return bad_request(f"malformed JSON in the request body: {detail}", code="invalid_json")
    param = param_path(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    named = re.match(r"(\w+): ", msg) if kind == "value_error" else None  # a check across fields names its own
    if named:
        param = f"{param}.{named[1]}" if param else named[1]
        msg = msg[named.end():]
    if param is None:
        if kind == "missing":
            return bad_request("the request has no body; send a JSON object")
        if kind == "value_error":
            return bad_request(msg)
        raw = first.get("input")
        if isinstance(raw, bytes):  # a body sent without Content-Type: application/json (a str is a JSON string)
            try:
                json.loads(raw)
            except ValueError as exc:
                return bad_request(f"malformed JSON in the request body: {exc}", code="invalid_json")
            return bad_request("send the JSON body with Content-Type: application/json")
        return bad_request("the request body must be a JSON object")
    if kind != "missing" and "input" in first and not isinstance(first["input"], (dict, list)):
        msg += f" (got {json.dumps(first['input'])[:80]})"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return bad_request(f"{param}: {msg}{more}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error response of ``app`` OpenAI-shaped."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code)
        response = err.response()
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()
