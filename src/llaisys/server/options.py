"""ServerOptions: what ``llaisys serve`` was asked for, in one object the app and the UI read."""
from __future__ import annotations

from dataclasses import dataclass

from ..generation.config import MAX_SPECULATIVE_TOKENS
from .protocol import MAX_N

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: 128 prompts of 8k token ids as JSON fit; a 10 MB upload does not
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20
DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # one encoded image; as a data: URL it also counts against max_body_bytes
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
KV_CACHE_DTYPES = ("auto", "int8", "q8_0")  # q8_0: llama.cpp's name for the 8-bit cache  # width * height from the header: the decompression-bomb guard


def image_host(text: str) -> str:
    """``text`` as an entry of ``allowed_image_hosts``: a host name or IP address, lowercased,
    without brackets or a final dot. ValueError for a URL, a port, a path or a wildcard
    (hosts are matched exactly)."""
    name = text.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    name = name.rstrip(".")
    if not name or any(c in name for c in "/*@?#[] \t") or (name.count(":") == 1):
        raise ValueError(f"{text!r} is not a host name or IP address (give example.com or 10.0.0.5: no scheme, "
                         "port, path or wildcard; hosts are matched exactly)")
    return name


@dataclass(slots=True)
class ServerOptions:
    """Settings of one server.

    model: a Hugging Face folder or .gguf file (None: the bundled SmolLM2), loaded with
    ``dtype`` and ``device`` unless the app is given a model or a loader. api_key: when set,
    the API routes want ``Authorization: Bearer <api_key>``. allowed_origins: origins CORS lets
    in (none: CORS off; "*" any). allowed_hosts: Host header names accepted besides localhost,
    IP addresses and ``host`` ("*": any; "*.example.com": its subdomains). chat_template: a
    Jinja file used instead of the model's own. served_model_name: the name clients pass as
    ``model`` (default: the model file's name).
    max_seqs / kv_cache_tokens / max_batched_tokens: the engine's (see docs/engine.md).
    speculative_tokens: draft tokens per decoding step for requests that do not set their own
    ``speculative_tokens`` (0: off; see docs/engine.md, "Speculative decoding");
    speculative_max_seqs: no drafts while more requests than this run (None: no limit).
    reasoning_budget: thinking tokens a reasoning model may write before ``</think>`` is forced,
    for requests that do not set their own (None: unlimited; see docs/server.md, "Reasoning").
    max_choices: engine requests one API call may make, prompts × n (None: max(max_seqs, 128)).
    db_path: the SQLite file of the chat UI's conversations (None: the UI's default).
    shutdown_timeout_s: on SIGINT/SIGTERM, how long running requests may go on before they
    are ended with an error saying the server is shutting down.
    max_body_bytes: largest request body (413 above). header_timeout_s: time a connection has
    to send a request's headers (then it is closed). body_timeout_s: time a request has to
    send its whole body (408 after). max_connections: open connections at most (more are
    refused with 503 at once; None: 7/8 of the process's descriptor limit).
    grammar_timeout_s: how long one grammar (structured output, forced tool call) may take to
    compile. grammar_cache_bytes: memory the compiled grammars kept for reuse may hold (a grammar
    that needs more is refused). max_grammar_bytes / max_grammar_choices / max_grammar_depth: a
    grammar's text size, its choices, and the depth of its nesting and references (see
    docs/server.md, "Structured outputs").
    metrics_require_key: /metrics wants the API key too (by default it answers without one, as
    vLLM's does, for scrapers); needs ``api_key``.
    kv_events: a ZeroMQ endpoint the engine's prefix-cache events are published on (None: off;
    ``engine.kv_events``); kv_events_replay: one that answers replay requests; kv_events_topic:
    the first frame of every message.
    allowed_image_hosts: hosts whose ``http(s)`` image URLs are fetched (exact names; none: image
    URLs are refused and images come as ``data:`` URLs, see ``server.images``). max_images:
    images one request may carry; max_image_bytes: one encoded image's size (a data: URL is
    also held to max_body_bytes, 8 MiB by default); max_image_pixels: one image's width times
    height, read from its header before any pixel is decoded.
    models: several models served at once, (name, source) pairs (source: what ``--model``
    takes); with it, or with ``models_dir``, the server loads each on its first request (see
    ``fleet``), ``model`` and ``served_model_name`` unused. models_dir: a folder whose .gguf
    files and model folders are served by their names. max_models: models loaded at once
    (None: no limit); models_memory_bytes: the memory they may hold together (None: 90% of the
    machine's); idle_unload_s: a model unused this long is unloaded (None: never); pinned:
    names never unloaded (loaded at start); load_timeout_s: how long a request waits for its
    model to load before a 503.
    kv_cache_dtype: "auto" (the model's) or "int8" (keys and values quantized per head).
    prefix_cache_host_bytes: host memory holding prefix-cache blocks evicted from the KV pool
    (0: off); prefix_cache_dir: a folder they are also kept in across restarts (None: off),
    up to prefix_cache_dir_bytes (None: the engine's default).
    """

    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    chat_template: str | None = None
    served_model_name: str | None = None
    max_seqs: int = 64
    kv_cache_tokens: int | None = None
    max_batched_tokens: int = 512
    speculative_tokens: int = 0
    speculative_max_seqs: int | None = None
    reasoning_budget: int | None = None
    max_choices: int | None = None
    db_path: str | None = None
    shutdown_timeout_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int | None = None
    grammar_timeout_s: float = 10.0
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    max_grammar_bytes: int = 128 << 10
    max_grammar_choices: int = 4096
    max_grammar_depth: int = 128
    metrics_require_key: bool = False
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    allowed_image_hosts: tuple[str, ...] = ()
    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    models: tuple[tuple[str, str], ...] = ()
    models_dir: str | None = None
    max_models: int | None = None
    models_memory_bytes: int | None = None
    idle_unload_s: float | None = None
    pinned: tuple[str, ...] = ()
    load_timeout_s: float = 600.0
    kv_cache_dtype: str = "auto"
    prefix_cache_host_bytes: int = 0
    prefix_cache_dir: str | None = None
    prefix_cache_dir_bytes: int | None = None

    def __post_init__(self) -> None:
        self.models = tuple((str(name), str(source)) for name, source in self.models)
        self.pinned = (self.pinned,) if isinstance(self.pinned, str) else tuple(self.pinned)
        names = [name for name, _ in self.models]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ServerOptions.models: the name {twice[0]!r} is given to two models; give each its own "
                             "(NAME=PATH)")
        for name in ("allowed_origins", "allowed_hosts", "allowed_image_hosts"):
            value = getattr(self, name)
            setattr(self, name, (value,) if isinstance(value, str) else tuple(value))
        try:
            self.allowed_image_hosts = tuple(image_host(h) for h in self.allowed_image_hosts)
        except (AttributeError, ValueError) as exc:
            raise ValueError(f"ServerOptions.allowed_image_hosts: {exc}") from None
        for name in ("max_seqs", "max_batched_tokens", "max_body_bytes", "grammar_cache_bytes", "max_grammar_bytes",
                     "max_grammar_choices", "max_grammar_depth", "max_images", "max_image_bytes", "max_image_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServerOptions.{name} must be a positive integer, got {value!r}")
        for name in ("kv_cache_tokens", "max_choices", "max_connections", "speculative_max_seqs", "max_models",
                     "models_memory_bytes", "prefix_cache_dir_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"ServerOptions.{name} must be a positive integer or None, got {value!r}")
        k = self.speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"ServerOptions.speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {k!r}")
        budget = self.reasoning_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"ServerOptions.reasoning_budget must be a non-negative integer or None (unlimited), "
                             f"got {budget!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerOptions.port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("ServerOptions.api_key must not be empty (None: no key)")
        if self.metrics_require_key and self.api_key is None:
            raise ValueError("ServerOptions.metrics_require_key needs an api_key (--api-key or $LLAISYS_API_KEY)")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"ServerOptions.shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("ServerOptions.kv_events_replay needs kv_events (the endpoint events are published on)")
        for name in ("kv_events", "kv_events_replay"):
            if getattr(self, name) is not None:
                from ..engine.kv_events import check_endpoint

                check_endpoint(getattr(self, name))
        if self.idle_unload_s is not None and not self.idle_unload_s > 0:
            raise ValueError(f"ServerOptions.idle_unload_s must be > 0 or None (never), got {self.idle_unload_s}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"ServerOptions.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        host_bytes = self.prefix_cache_host_bytes
        if not isinstance(host_bytes, int) or isinstance(host_bytes, bool) or host_bytes < 0:
            raise ValueError(f"ServerOptions.prefix_cache_host_bytes must be a non-negative integer, got {host_bytes!r}")
        for name in ("header_timeout_s", "body_timeout_s", "grammar_timeout_s", "load_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerOptions.{name} must be > 0, got {getattr(self, name)}")

    @property
    def many_models(self) -> bool:
        """Whether the server serves several models, each loaded on demand (``models`` or
        ``models_dir`` given), rather than the one of ``model``."""
        return bool(self.models) or self.models_dir is not None

    def engine_extras(self) -> dict[str, object]:
        """The engine's keywords for the KV cache's dtype and the prefix cache's tiers, those set only."""
        extras: dict[str, object] = {}
        if self.kv_cache_dtype != "auto":
            extras["kv_cache_dtype"] = self.kv_cache_dtype
        if self.prefix_cache_host_bytes:
            extras["prefix_cache_host_bytes"] = self.prefix_cache_host_bytes
        if self.prefix_cache_dir is not None:
            extras["prefix_cache_dir"] = self.prefix_cache_dir
            if self.prefix_cache_dir_bytes is not None:
                extras["prefix_cache_dir_bytes"] = self.prefix_cache_dir_bytes
        return extras

    @property
    def choices_limit(self) -> int:
        """Engine requests (prompts × n) one API call may make."""
        return self.max_choices if self.max_choices is not None else max(self.max_seqs, MAX_N)
