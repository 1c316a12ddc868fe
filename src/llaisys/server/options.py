"""ServerOptions: what ``llaisys serve`` was asked for, in one object the app and the UI read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerOptions:
    """Settings of one server.

    model: a Hugging Face folder or .gguf file (None: the bundled SmolLM2), loaded with
    ``dtype`` and ``device`` unless the app is given a model or a loader. api_key: when set,
    the API routes want ``Authorization: Bearer <api_key>``. allowed_origins: origins CORS lets
    in (none: CORS off; "*" any). chat_template: a Jinja file used instead of the model's own.
    served_model_name: the name clients pass as ``model`` (default: the model file's name).
    max_seqs / kv_cache_tokens / max_batched_tokens: the engine's (see docs/engine.md).
    db_path: the SQLite file of the chat UI's conversations (None: the UI's default).
    shutdown_timeout_s: on SIGINT/SIGTERM, how long running requests may go on before they
    are ended with an error saying the server is shutting down.
    """

    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    chat_template: str | None = None
    served_model_name: str | None = None
    max_seqs: int = 64
    kv_cache_tokens: int | None = None
    max_batched_tokens: int = 512
    db_path: str | None = None
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.allowed_origins, str):
            self.allowed_origins = (self.allowed_origins,)
        self.allowed_origins = tuple(self.allowed_origins)
        for name in ("max_seqs", "max_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServerOptions.{name} must be a positive integer, got {value!r}")
        if self.kv_cache_tokens is not None and (not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < 1):
            raise ValueError(f"ServerOptions.kv_cache_tokens must be a positive integer or None, "
                             f"got {self.kv_cache_tokens!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerOptions.port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("ServerOptions.api_key must not be empty (None: no key)")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"ServerOptions.shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
