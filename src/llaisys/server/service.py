"""The model's lifecycle behind the routes: loaded in the background, held, run by an
EngineThread (and a second one for embeddings, started on first use), and what the routes
read about it (name, tokenizer, context, chat template, capabilities).

Every touch of the engine goes through the EngineThread's queue; this object only keeps what
the event loop needs: the model and its facts, the requests in flight (to end them at
shutdown), the metrics, the grammar service and the worker threads that render and tokenize
prompts (``in_worker``), so a long prompt does not hold up the event loop and the other
requests. Turning an API request into engine requests is ``requests.build_request``'s job: it
reads the model through this object; nothing here calls it on a request's way (the two of its
steps kept as methods are for older callers).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..engine import AsyncRequestStream, EngineThread, LLMEngine
from ..generation import GenerationConfig
from ..models.chat_template import ChatTemplate, compile_template
from . import requests
from .errors import APIError, bad_request, shutting_down
from .grammars import GrammarService
from .metrics import Metrics
from .options import ServerOptions
from .protocol import SamplingRequest
from .reasoning import template_reasons
from .tool_calls import template_knows_tools, tool_format

log = logging.getLogger(__name__)

Loader = Callable[[], Any]
T = TypeVar("T")
PROMPT_THREADS = min(4, os.cpu_count() or 1)  # threads rendering and tokenizing prompts


def default_model_name(options: ServerOptions, model: Any = None) -> str:
    """The name clients use: --served-model-name, else the model file's or folder's name."""
    if options.served_model_name:
        return options.served_model_name
    source = options.model or getattr(model, "source", None)
    if source is None:
        from ..models import default_model_path

        try:
            source = str(default_model_path())
        except FileNotFoundError:
            return "llaisys"
    path = Path(source)
    return path.stem if path.suffix.lower() == ".gguf" else path.name or str(source)


def read_chat_template(path: str) -> ChatTemplate:
    """The Jinja template in ``path``, checked to compile. Raises FileNotFoundError or ValueError."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--chat-template {path}: no such file")
    template = ChatTemplate(file.read_text(encoding="utf-8"), str(file))
    compile_template(template)
    return template


class ModelService:
    """One served model's lifecycle and the state shared by the routes: the model (once loaded),
    its engine threads and the requests in them, the facts the request builder reads, the
    metrics.

    States: "unloaded" (nothing in memory), "loading" (a thread reads it), "ready", "failed"
    (the load raised: ``error``), "unloading" (its engines stop). A server of several models
    (``fleet.ModelFleet``) moves each through them; a server of one loads it at start and
    keeps it. ``leases`` counts the HTTP requests using the model (the fleet never unloads a
    leased one); ``last_used`` orders the idle ones for eviction."""

    def __init__(self, options: ServerOptions, model: Any = None, loader: Loader | None = None, *,
                 name: str | None = None, metrics: Metrics | None = None, pinned: bool = False) -> None:
        self.options = options
        self.model = model
        self.loader = loader
        self.model_name = name or default_model_name(options, model)
        self.chat_template = read_chat_template(options.chat_template) if options.chat_template else None
        self.metrics = metrics or Metrics(self.model_name)
        self.engine: EngineThread | None = None
        self.error: BaseException | None = None
        self.failed_at = 0.0  # time.monotonic() of the last failed load
        self.created = int(time.time())
        self.ready = threading.Event()
        self.state = "loading" if model is not None else "unloaded"  # a model given starts its engine in start()
        self.pinned = pinned or (model is not None and loader is None)  # a model given, not loadable again
        self.leases = 0
        self.last_used = time.monotonic()
        self.loaded_bytes: int | None = None  # memory the model took when last loaded (weights + KV pools)
        self.kv_events: Any = None  # the prefix-cache events' publisher (options.kv_events)
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self.draining = False
        self.ending = asyncio.Event()  # set when the running requests are ended (shutdown)
        self._settled: asyncio.Event | None = None  # set when a load or an unload ends (event loop)
        self._inflight: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token_text: dict[int, str] = {}
        self._longest_token: int | None = None
        self._workers = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="llaisys-prompt")
        self.grammars = GrammarService(options, lambda: self.model)  # structured outputs, forced tool calls
        self._embedder: EngineThread | None = None  # a second engine, for embeddings (started on first use)
        self._embedding_inflight: set[str] = set()
        self._embedder_lock = threading.Lock()

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, load: bool = True) -> None:
        """Attach to the event loop; unless ``load`` is False, start loading (in a thread) or,
        with the model here already, the engine thread."""
        self.attach(loop)
        if self.model is not None:
            self._start_engine()
        elif load:
            self.begin_load()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the asyncio parts to ``loop`` (the app's, at startup)."""
        self._loop = loop
        self.ending = asyncio.Event()  # one of this loop's
        self._settled = asyncio.Event()

    def begin_load(self) -> None:
        """Start reading the model in a thread (state "loading"); event loop or before it runs."""
        self.state, self.error = "loading", None
        if self._settled is not None:
            self._settled.clear()
        threading.Thread(target=self._load, name=f"llaisys-load-{self.model_name}"[:60], daemon=True).start()

    async def settled(self) -> None:
        """Wait until no load or unload is under way (event loop)."""
        while self.state in ("loading", "unloading"):
            assert self._settled is not None, "attach() the service to the event loop first"
            await self._settled.wait()
            if self.state in ("loading", "unloading"):
                self._settled.clear()

    def _notify_settled(self) -> None:
        loop, event = self._loop, self._settled
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    def _load(self) -> None:
        try:
            if self.loader is not None:
                self.model = self.loader()
            else:
                from ..models import load_model

                opts = self.options
                self.model = load_model(opts.model, dtype=opts.dtype, device=opts.device)
            self._start_engine()
        except BaseException as exc:  # noqa: BLE001  (reported by /health and the callback)
            expected = isinstance(exc, (FileNotFoundError, PermissionError, ValueError, TypeError))
            log.error("%s failed to load: %s", self.model_name, exc, exc_info=not expected)  # a traceback for bugs only
            self.model, self.error, self.failed_at = None, exc, time.monotonic()
            self.state = "failed"
            self.metrics.load_failed()
            if self.on_load_failed is not None:
                self.on_load_failed(exc)
        finally:
            self._notify_settled()

    def _start_engine(self) -> None:
        opts = self.options
        if opts.kv_events is not None and self.kv_events is None:  # opened first: an unusable endpoint fails the start
            from ..engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(opts.kv_events, opts.kv_events_replay, opts.kv_events_topic)
        engine = LLMEngine(self.model, kv_cache_tokens=opts.kv_cache_tokens, max_seqs=opts.max_seqs,
                           max_batched_tokens=opts.max_batched_tokens,
                           speculative_max_seqs=opts.speculative_max_seqs, kv_events=self.kv_events,
                           **opts.engine_extras())
        thread = EngineThread(engine)
        thread.on_step = self.metrics.on_step
        self.engine = thread
        self.loaded_bytes = self.memory_bytes()
        self.state = "ready"
        self.metrics.loaded(self.loaded_bytes)
        self.ready.set()
        log.info("serving %s as %r", getattr(self.model, "source", self.model), self.model_name)

    def memory_bytes(self) -> int:
        """Bytes the loaded model holds: its weights and its engines' KV pools (0 when unloaded)."""
        if self.model is None:
            return 0
        weights = getattr(self.model, "weight_bytes", None)
        total = int(weights()) if callable(weights) else 0
        for thread in (self.engine, self._embedder):
            if thread is not None:
                total += int(thread.engine.cache.nbytes)
        return total

    def unload(self, timeout: float = 10.0) -> None:
        """Stop the engine threads (requests still in them end with reason "abort") and drop the
        model, so its memory goes back (any thread but the event loop's: it waits for them)."""
        self.ready.clear()
        for thread in (self.engine, self._embedder):
            if thread is not None:
                thread.stop(timeout)
        self.engine = self._embedder = None
        self.model = None
        self._token_text.clear()
        self._longest_token = None
        self.state = "unloaded"
        self.metrics.unloaded()
        gc.collect()  # the weights' cycles (plans, caches) go now, not at some later collection
        self._notify_settled()
        log.info("unloaded %s", self.model_name)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still in it end with reason "abort") and the workers."""
        if self.engine is not None:
            self.engine.stop(timeout)
        if self.kv_events is not None:
            self.kv_events.close()
        if self._embedder is not None:
            self._embedder.stop(timeout)
        self.grammars.close()
        self._workers.shutdown(wait=False, cancel_futures=True)

    @property
    def status(self) -> str:
        """"unloaded", "loading", "ready", "unloading", "failed" (the model did not load, or
        the engine loop died) or "shutting_down"."""
        if self.draining:
            return "shutting_down"
        if self.error is not None or (self.engine is not None and not self.engine.alive):
            return "failed"
        return self.state

    def failure(self) -> str:
        """Why the service is not serving, in words (after ``status`` said "failed")."""
        if self.error is not None:
            return f"the model failed to load: {self.error}"
        engine_error = self.engine.error if self.engine is not None else None
        return f"the engine failed: {engine_error!r}" if engine_error else "the engine has stopped"

    def require_ready(self) -> EngineThread:
        """The engine thread, or a 503 APIError while loading, after a failure or when draining."""
        status = self.status
        if status == "loading":
            raise APIError(503, "the model is still loading; try again shortly (GET /health answers 200 when ready)",
                           code="model_loading")
        if status in ("unloaded", "unloading"):
            raise APIError(503, f"the model `{self.model_name}` is not loaded; try again (a request naming it loads "
                           "it)", code="model_unloaded")
        if status == "failed":
            raise APIError(503, self.failure(), code="engine_unavailable")
        if status == "shutting_down":
            raise shutting_down()
        assert self.engine is not None
        return self.engine

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` (None: the default) is the served model."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    async def in_worker(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread (rendering, tokenizing), the event loop serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn)

    # ---- model facts -------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.model.tokenizer

    @property
    def max_model_len(self) -> int:
        """Tokens of context: prompt plus completion."""
        assert self.engine is not None
        return self.engine.engine.context_length

    @property
    def kv_capacity(self) -> int:
        """Tokens the engine's KV pool holds."""
        assert self.engine is not None
        return self.engine.engine.blocks.capacity_tokens

    @property
    def vocab_size(self) -> int | None:
        """Rows of the model's embedding: token ids are below it (None: the model does not say)."""
        size = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return int(size) if isinstance(size, int) and not isinstance(size, bool) else None

    @property
    def longest_token(self) -> int:
        """Characters of the vocabulary's longest token (0: unknown): no token holds more text."""
        if self._longest_token is None:
            get_vocab = getattr(getattr(self.tokenizer, "backend", None), "get_vocab", None)
            try:
                self._longest_token = max(map(len, get_vocab(with_added_tokens=True)), default=0) if get_vocab else 0
            except (TypeError, ValueError):
                self._longest_token = 0
        return self._longest_token

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (special tokens written out), as logprobs show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    @property
    def template(self) -> Any:
        """The chat template in use: --chat-template, else the model's (None: neither has one)."""
        return self.chat_template or getattr(self.tokenizer, "chat_template", None)

    def prompt_opens_think(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a chat prompt ends inside an open ``<think>`` block (DeepSeek-R1's template
        writes it): the reply then begins with reasoning."""
        tail = self.tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False).rstrip()
        return tail.endswith("<think>")

    def capabilities(self) -> dict[str, Any]:
        """What the served model can do through the API (for /v1/models): chat needs a chat
        template; structured outputs a tokenizer; tool calls a chat template (in its own format
        when the template renders ``tools``, else the fallback); reasoning a template that
        speaks of ``<think>``; the Responses API chat; embeddings the model's hidden states (any
        decoder model); vision (image parts in messages) a vision encoder."""
        template = self.template
        has_tokenizer = getattr(self.tokenizer, "backend", None) is not None
        tools = None
        if template:
            tools = {"format": tool_format(template),
                     "rendering": "template" if template_knows_tools(template) else "fallback"}
        return {"chat": bool(template), "structured_outputs": has_tokenizer, "tool_calls": tools,
                "reasoning": bool(template) and template_reasons(template), "embeddings": True,
                "responses": bool(template), "vision": getattr(self.model, "vision", None) is not None}

    # ---- two steps of the request builder, for callers of the older API ----------------------
    def completion_budget(self, prompt_len: int, max_tokens: int | None, param: str, what: str) -> int:
        """``requests.completion_budget`` for this model."""
        return requests.completion_budget(self, prompt_len, max_tokens, param, what)

    def generation_config(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                          choice: int) -> GenerationConfig:
        """``requests.generation_config`` for this model."""
        return requests.generation_config(self, req, max_tokens, logprobs, choice)

    # ---- engine requests ---------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], config: GenerationConfig,
                     images: Any = None) -> AsyncRequestStream:
        """Add one request to the engine; its stream. ``images``: where the prompt's image rows go
        (``PromptImages``, from the request builder; None: no images). Engine refusals become 400."""
        engine = self.require_ready()
        self.metrics.submitted(request_id)
        self._inflight.add(request_id)
        try:
            return await engine.submit_async(prompt_ids, config, request_id=request_id, images=images)
        except (TypeError, ValueError) as exc:
            self._forget(request_id)
            raise bad_request(str(exc)) from exc
        except BaseException:
            self._forget(request_id)
            if self.engine is not None and not self.engine.alive:
                raise APIError(503, self.failure(), code="engine_unavailable") from None
            raise

    # ---- embeddings ----------------------------------------------------------------------
    def embedder(self) -> EngineThread:
        """The engine thread of embedding requests: a second engine over the same model, without
        prefix caching (mean pooling needs every token's hidden state), its KV pool one context
        long; started on first use."""
        self.require_ready()
        with self._embedder_lock:
            if self._embedder is None:
                opts = self.options
                kv_dtype = {"kv_cache_dtype": opts.kv_cache_dtype} if opts.kv_cache_dtype != "auto" else {}
                engine = LLMEngine(self.model, kv_cache_tokens=self.max_model_len, max_seqs=opts.max_seqs,
                                   max_batched_tokens=opts.max_batched_tokens, prefix_caching=False, **kv_dtype)
                self._embedder = EngineThread(engine, name="llaisys-embed")
            return self._embedder

    async def submit_embedding(self, request_id: str, prompt_ids: list[int],
                               config: GenerationConfig) -> AsyncRequestStream:
        """Add one embedding request (a PoolingConfig) to the embedding engine; its stream."""
        engine = self.embedder()
        self._embedding_inflight.add(request_id)
        try:
            return await engine.submit_async(prompt_ids, config, request_id=request_id)
        except (TypeError, ValueError) as exc:
            self._embedding_inflight.discard(request_id)
            raise bad_request(str(exc)) from exc
        except BaseException:
            self._embedding_inflight.discard(request_id)
            raise

    def release_embeddings(self, streams: Sequence[AsyncRequestStream]) -> None:
        """Done with embedding ``streams``: abort those not finished."""
        for stream in streams:
            self._embedding_inflight.discard(stream.request_id)
            if not stream.finished:
                stream.close()

    def _forget(self, request_id: str) -> None:
        self._inflight.discard(request_id)
        self.metrics.discard(request_id)

    def release(self, streams: Sequence[AsyncRequestStream]) -> None:
        """Done with ``streams``: abort those not finished (their blocks are freed within a step)."""
        for stream in streams:
            rid = stream.request_id
            self._inflight.discard(rid)
            if not stream.finished:
                stream.close()
                self._record_abort(rid)

    def _record_abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.call(lambda: self.metrics.aborted(request_id))

    def abort_all(self) -> None:
        """End every request in flight with reason "abort" (their streams see it), and the waits
        for request bodies (event loop)."""
        self.ending.set()
        self.grammars.close()  # a grammar compiling ends now too (its request gets the 503)
        if self.engine is None:
            return
        ids = list(self._inflight)
        if ids:
            log.warning("ending %d running request(s): the server is shutting down", len(ids))
        for rid in ids:
            self.engine.abort(rid)
            self._record_abort(rid)
        if self._embedder is not None:
            for rid in list(self._embedding_inflight):
                self._embedder.abort(rid)

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests; after ``timeout`` s abort those still running. Any thread."""
        self.draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.call_later, timeout, self.abort_all)

    def end_now(self) -> None:
        """Refuse new requests and abort the running ones now (a second signal). Any thread."""
        self.draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.abort_all)

    async def stats(self) -> None:
        """Refresh the metrics' gauges from the engine (between two steps)."""
        if self.engine is None or not self.engine.alive:
            return
        try:
            stats = await asyncio.wrap_future(self.engine.call(self.engine.engine.stats))
        except Exception:  # noqa: BLE001  (stopped meanwhile: keep the last values)
            return
        self.metrics.refresh(stats)
