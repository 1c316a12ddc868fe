"""``llaisys serve``: the OpenAI-compatible HTTP server (see docs/server.md).

The server starts listening at once and loads the model in the background: GET /health
answers 503 until it is ready, then 200. SIGINT/SIGTERM stop it gracefully.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any

from ..generation.config import MAX_SPECULATIVE_TOKENS
from .common import (UsageError, add_model_options, byte_size, following_rank, load_from_args, load_plugins,
                     non_negative_float, non_negative_int, port_number, positive_int)

API_KEY_VAR = "LLAISYS_API_KEY"


def speculative_count(text: str) -> int:
    """--speculative-tokens: a whole number in [0, MAX_SPECULATIVE_TOKENS]."""
    value = non_negative_int(text)
    if value > MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"expected a number in [0, {MAX_SPECULATIVE_TOKENS}], got {text}")
    return value


def reasoning_budget(text: str) -> int | None:
    """--reasoning-budget: a whole number of thinking tokens, or -1 for unlimited (None), as
    llama-server takes it."""
    if text.strip() == "-1":
        return None
    return non_negative_int(text)


def host_list(text: str) -> list[str]:
    """--allowed-image-hosts: host names or IP addresses separated by commas."""
    from ..server.options import image_host

    try:
        hosts = [image_host(h) for h in text.split(",") if h.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not hosts:
        raise argparse.ArgumentTypeError("expected HOST[,HOST...]")
    return hosts


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` sub-command."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, "
                                          "/v1/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, "
                                          "/version, and a chat page at /.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on the API routes (default: ${API_KEY_VAR}, else none)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="require the API key on /metrics too (by default it answers without one, for scrapers, "
                        "as vLLM's does)")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins browsers may call the API from (CORS), e.g. http://localhost:3000 or '*' "
                        "(default: none, CORS off)")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST",
                   help="Host header names accepted besides localhost, IP addresses and --host, e.g. myhost.lan, "
                        "'*.example.com' or '*' (default: none; guards against DNS rebinding)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own (needed for a model without one)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the model file's name)")
    p.add_argument("--max-seqs", type=positive_int, default=64, metavar="N",
                   help="requests running at once (default 64); more wait in a queue")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens the KV cache holds for all requests together (default: 1 GiB worth, at least one "
                        "full context)")
    p.add_argument("--speculative-tokens", type=speculative_count, default=0, metavar="K",
                   help="draft K tokens by prompt lookup for each decoding step and check them in the same pass, "
                        "for requests that do not set speculative_tokens: the same text, faster when replies copy "
                        "from the prompt; CPU only (default: 0, off)")
    p.add_argument("--speculative-max-seqs", type=positive_int, default=None, metavar="N",
                   help="no drafts while more than N requests run, where a batch gains nothing from them "
                        "(default: no limit)")
    p.add_argument("--reasoning-budget", type=reasoning_budget, default=None, metavar="N",
                   help="thinking tokens a reasoning model may write before </think> is forced, for requests "
                        "that do not set reasoning_budget (0: none; default: -1, unlimited)")
    p.add_argument("--db", default=None, metavar="PATH", help="SQLite file for the chat page's conversations")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long running requests may take to finish (default 30)")
    p.add_argument("--max-choices", type=positive_int, default=None, metavar="N",
                   help="engine requests one API call may make, prompts × n (default: max(--max-seqs, 128))")
    p.add_argument("--max-body-bytes", type=positive_int, default=8 << 20, metavar="N",
                   help="largest request body, in bytes (default 8 MiB); larger ones get 413 (images sent as data: "
                        "URLs count, base64)")
    p.add_argument("--header-timeout", type=non_negative_float, default=10.0, metavar="SECONDS",
                   help="time a connection has to send a request's headers before it is closed (default 10)")
    p.add_argument("--body-timeout", type=non_negative_float, default=60.0, metavar="SECONDS",
                   help="time a request has to send its whole body before it gets 408 (default 60)")
    p.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="open connections at most (default: 3/4 of the descriptor limit, less 64)")
    p.add_argument("--grammar-timeout", type=non_negative_float, default=10.0, metavar="SECONDS",
                   help="time one grammar (structured output, forced tool call) may take to compile; slower ones "
                        "get 400 (default 10)")
    p.add_argument("--grammar-cache-bytes", type=positive_int, default=512 << 20, metavar="N",
                   help="memory the compiled grammars kept for reuse may hold; a grammar that needs more gets 400 "
                        "(default 512 MiB)")
    p.add_argument("--max-grammar-bytes", type=positive_int, default=128 << 10, metavar="N",
                   help="largest grammar, regular expression, JSON schema or set of choices, in bytes "
                        "(default 128 KiB)")
    p.add_argument("--max-grammar-choices", type=positive_int, default=4096, metavar="N",
                   help="most strings a guided choice may list (default 4096)")
    p.add_argument("--max-grammar-depth", type=positive_int, default=128, metavar="N",
                   help="deepest a grammar may nest: a schema's levels plus the $refs it follows, a grammar's "
                        "chain of rules (default 128)")
    p.add_argument("--allowed-image-hosts", type=host_list, action="extend", default=[], metavar="HOST[,HOST]",
                   help="fetch http(s) image URLs of messages from these hosts (exact names; no redirects followed, "
                        "10 s and --max-image-bytes at most). By default image URLs are refused, since fetching any "
                        "URL a client names lets it reach addresses only this server can (request forgery): "
                        "clients send images inline as data: URLs")
    p.add_argument("--max-images", type=positive_int, default=8, metavar="N",
                   help="images one request may carry (default 8)")
    p.add_argument("--max-image-bytes", type=positive_int, default=20 << 20, metavar="N",
                   help="largest encoded image, in bytes (default 20 MiB). An image sent as a data: URL travels in "
                        "the request body, base64 (4/3 of its size), so --max-body-bytes (default 8 MiB: about 6 MiB "
                        "of image) limits it first; raise both for larger images")
    p.add_argument("--max-image-pixels", type=positive_int, default=50_000_000, metavar="N",
                   help="largest image, width times height as its header states it, refused before any pixel is "
                        "decoded: the guard against decompression bombs (default 50000000)")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish the prefix cache's block events (stored, removed) on this ZeroMQ endpoint in "
                        "vLLM's KV-event format, for routers that index them: tcp://*:5557 binds every interface, "
                        "tcp://10.0.0.5:5557 one of this machine's, tcp://collector:5557 connects out "
                        "(needs pip install 'llaisys[events]'; default: off)")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="also answer replay requests for missed event messages on this endpoint (a ROUTER socket)")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="the topic frame of every event message (default: empty)")
    many = p.add_argument_group("several models", "Repeat --model, or give --models-dir, to serve several models: "
                                "a request's `model` picks one, loaded on first use; models `llaisys list` shows are "
                                "served by their names too. The least recently used idle model is unloaded to make "
                                "room.")
    many.add_argument("--models-dir", default=None, metavar="DIR",
                      help="serve the .gguf files and model folders in DIR, by their names")
    many.add_argument("--max-models", type=positive_int, default=None, metavar="N",
                      help="models loaded at once (default: no limit but memory)")
    many.add_argument("--models-memory", type=byte_size, default=None, metavar="SIZE",
                      help="memory the loaded models may hold together, weights and KV caches, e.g. 8G "
                           "(default: 90%% of this machine's)")
    many.add_argument("--idle-unload", type=non_negative_float, default=None, metavar="SECONDS",
                      help="unload a model unused this long (default: never)")
    many.add_argument("--pin", action="append", default=[], metavar="NAME",
                      help="load this model at start and never unload it to make room or when idle; may be repeated")
    many.add_argument("--load-timeout", type=non_negative_float, default=600.0, metavar="SECONDS",
                      help="how long a request waits for its model to load before a 503 (default 600)")
    cache = p.add_argument_group("KV cache")
    cache.add_argument("--kv-cache-dtype", choices=("auto", "int8", "q8_0"), default="auto",
                       help="keys and values in the model's dtype (auto), or in 8 bits with a scale per head of "
                            "each token (int8; q8_0 is llama.cpp's name): a quarter of f32's memory, half of "
                            "f16's, close to lossless (docs/engine.md)")
    cache.add_argument("--prefix-cache-ram", type=byte_size, default=0, metavar="SIZE",
                       help="keep prefix-cache blocks evicted from the KV cache in this much host memory, e.g. 2G, "
                            "to restore rather than recompute them (default: 0, off)")
    cache.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                       help="keep prefix-cache blocks in DIR too, so cached prompts outlive a restart (default: off)")
    cache.add_argument("--prefix-cache-dir-size", type=byte_size, default=None, metavar="SIZE",
                       help="the most --prefix-cache-dir may hold, oldest dropped first (default: the engine's)")
    add_model_options(p, many=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 1 if the model failed to load."""
    from ..server import ServerOptions, create_app, serve

    models = model_specs(args)
    args.model = models[0][1] if len(models) == 1 and args.models_dir is None else None
    if following_rank(args):  # a tensor-parallel rank other than 0: no server, only its part of the model
        load_from_args(args)
        return 0
    many = len(models) > 1 or args.models_dir is not None
    if many:
        check_many_options(args)
    elif args.pin or args.max_models or args.models_memory or args.idle_unload is not None:
        raise UsageError("--pin, --max-models, --models-memory and --idle-unload are for several models "
                         "(repeat --model or give --models-dir)")

    api_key = args.api_key or os.environ.get(API_KEY_VAR) or None
    if args.metrics_require_key and api_key is None:
        raise UsageError(f"--metrics-require-key needs an API key: give --api-key or set ${API_KEY_VAR}")
    check_events_options(args)
    options = ServerOptions(model=args.model, dtype=args.dtype, device=args.device, host=args.host, port=args.port,
                            api_key=api_key, metrics_require_key=args.metrics_require_key,
                            allowed_origins=tuple(args.allowed_origins), chat_template=args.chat_template,
                            served_model_name=args.served_model_name, max_seqs=args.max_seqs,
                            kv_cache_tokens=args.kv_cache_tokens, db_path=args.db,
                            shutdown_timeout_s=args.shutdown_timeout, allowed_hosts=tuple(args.allowed_hosts),
                            max_choices=args.max_choices, header_timeout_s=args.header_timeout,
                            body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                            max_body_bytes=args.max_body_bytes, speculative_tokens=args.speculative_tokens,
                            speculative_max_seqs=args.speculative_max_seqs,
                            reasoning_budget=args.reasoning_budget, grammar_timeout_s=args.grammar_timeout,
                            grammar_cache_bytes=args.grammar_cache_bytes, max_grammar_bytes=args.max_grammar_bytes,
                            max_grammar_choices=args.max_grammar_choices, max_grammar_depth=args.max_grammar_depth,
                            kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
                            kv_events_topic=args.kv_events_topic,
                            allowed_image_hosts=tuple(args.allowed_image_hosts), max_images=args.max_images,
                            max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                            models=tuple(models) if many else (), models_dir=args.models_dir,
                            max_models=args.max_models, models_memory_bytes=args.models_memory,
                            idle_unload_s=args.idle_unload or None, pinned=tuple(args.pin),
                            load_timeout_s=args.load_timeout or 600.0, kv_cache_dtype=args.kv_cache_dtype,
                            prefix_cache_host_bytes=args.prefix_cache_ram, prefix_cache_dir=args.prefix_cache_dir,
                            prefix_cache_dir_bytes=args.prefix_cache_dir_size)
    url = base_url(args.host, args.port)
    if many:
        load_plugins(args.plugin)  # once, for every model
        args.plugin = []
        try:
            app = create_app(options, load_source=lambda source: load_from_args(args, source))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        names = ", ".join(app.state.models.services)
        print(f"llaisys serve: serving {names} (each loaded on its first request); API at {url}v1",
              file=sys.stderr)
        print(f"llaisys serve: chat page at {url}", file=sys.stderr, flush=True)
        return serve(app, options)
    app = create_app(options, loader=lambda: load_from_args(args))
    service = app.state.service
    print(f"llaisys serve: loading {args.model or 'the bundled SmolLM2-135M'} as {service.model_name!r}; "
          f"API at {url}v1 (/health answers 503 until the model is ready)", file=sys.stderr)
    print(f"llaisys serve: chat page at {url}", file=sys.stderr, flush=True)
    announce_ready(service, url)
    return serve(app, options)


def model_specs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The --model options as (name, source) pairs: ``NAME=SOURCE``, or a source named after
    its file (the stem of a .gguf, a folder's name, a listed name as given). UsageError for
    two models under one name."""
    from ..server.fleet import model_name_for
    from ..server.options import ServerOptions

    specs: list[tuple[str, str]] = []
    for given in args.model or []:
        name, eq, source = given.partition("=")
        if not eq or not name or "/" in name or os.path.exists(given):
            name, source = "", given
        if len(args.model) == 1 and args.served_model_name:
            name = args.served_model_name
        name = name or model_name_for(ServerOptions(), source)
        if any(name == n for n, _ in specs):
            raise UsageError(f"--model: two models are named {name!r}; name one with --model NAME=PATH")
        specs.append((name, source))
    return specs


def check_many_options(args: argparse.Namespace) -> None:
    """UsageError for options that serve one model only, given with several."""
    if args.tensor_parallel > 1:
        raise UsageError("--tensor-parallel serves one model; give one --model")
    if args.mmproj is not None:
        raise UsageError("--mmproj names one model's vision tower; with several models put each mmproj*.gguf beside "
                         "its model file")
    if args.served_model_name is not None:
        raise UsageError("--served-model-name names one model; with several use --model NAME=PATH")
    if args.models_dir is not None and not os.path.isdir(args.models_dir):
        raise UsageError(f"--models-dir {args.models_dir}: no such folder")


def check_events_options(args: argparse.Namespace) -> None:
    """UsageError for --kv-events options that cannot work: a malformed endpoint, a replay
    endpoint without events, pyzmq or msgpack missing."""
    if args.kv_events is None:
        if args.kv_events_replay is not None:
            raise UsageError("--kv-events-replay needs --kv-events (the endpoint events are published on)")
        return
    from ..engine.kv_events import check_endpoint, require_modules

    try:
        for endpoint in (args.kv_events, args.kv_events_replay):
            if endpoint is not None:
                check_endpoint(endpoint)
        require_modules()
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"--kv-events: {exc}") from None


def base_url(host: str, port: int) -> str:
    """``http://host:port/``; a wildcard address (0.0.0.0, ::) as the loopback one a browser here can open."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def announce_ready(service: Any, url: str) -> None:
    """Print ``llaisys serve: ready: NAME at URL`` on stderr once ``service`` has its model
    loaded and its engine running (from a daemon thread waiting for that)."""
    def wait() -> None:
        service.ready.wait()
        print(f"llaisys serve: ready: {service.model_name} at {url}", file=sys.stderr, flush=True)

    threading.Thread(target=wait, name="llaisys-serve-ready", daemon=True).start()
