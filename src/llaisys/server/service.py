"""The model behind the routes: loaded in the background, run by an EngineThread, and the
steps from an API request to engine requests (prompt ids, length checks, GenerationConfig).

Every touch of the engine goes through the EngineThread's queue; this object only keeps what
the event loop needs: the model's tokenizer and limits, the requests in flight (to end them
at shutdown) and the metrics. Rendering and tokenizing prompts run in worker threads
(``in_worker``), so a long prompt does not hold up the event loop and the other requests.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..engine import AsyncRequestStream, EngineThread, LLMEngine
from ..engine.grammar import Grammar, GuidedConfig
from ..generation import GenerationConfig, encode_prompt
from ..generation.defaults import CHAT_MAX_TOKENS, sampling_defaults
from ..models.chat_template import ChatTemplate, compile_template, render_chat
from .errors import APIError, bad_request, shutting_down
from .grammars import GrammarService
from .metrics import Metrics
from .options import ServerOptions
from .protocol import ChatMessage, SamplingRequest, Tool
from .reasoning import template_reasons
from .tool_calls import template_knows_tools, template_messages, tool_format

log = logging.getLogger(__name__)

Loader = Callable[[], Any]
T = TypeVar("T")
PROMPT_THREADS = min(4, os.cpu_count() or 1)  # threads rendering and tokenizing prompts
# GenerationConfig field -> the API field that sets it
API_FIELDS = {"max_new_tokens": "max_tokens", "eos_token_ids": "stop_token_ids"}


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
    """State shared by the routes: the model (once loaded), its EngineThread, the metrics."""

    def __init__(self, options: ServerOptions, model: Any = None, loader: Loader | None = None) -> None:
        self.options = options
        self.model = model
        self.loader = loader
        self.model_name = default_model_name(options, model)
        self.chat_template = read_chat_template(options.chat_template) if options.chat_template else None
        self.metrics = Metrics(self.model_name)
        self.engine: EngineThread | None = None
        self.error: BaseException | None = None
        self.created = int(time.time())
        self.ready = threading.Event()
        self.kv_events: Any = None  # the prefix-cache events' publisher (options.kv_events)
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self.draining = False
        self.ending = asyncio.Event()  # set when the running requests are ended (shutdown)
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
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start loading (in a thread unless the model is here already) and the engine thread."""
        self._loop = loop
        self.ending = asyncio.Event()  # one of this loop's
        if self.model is not None:
            self._start_engine()
        else:
            threading.Thread(target=self._load, name="llaisys-model-load", daemon=True).start()

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
            log.error("the model failed to load: %s", exc, exc_info=not expected)  # a traceback for bugs only
            self.error = exc
            if self.on_load_failed is not None:
                self.on_load_failed(exc)

    def _start_engine(self) -> None:
        opts = self.options
        if opts.kv_events is not None:  # opened first: an endpoint that cannot be used fails the start
            from ..engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(opts.kv_events, opts.kv_events_replay, opts.kv_events_topic)
        engine = LLMEngine(self.model, kv_cache_tokens=opts.kv_cache_tokens, max_seqs=opts.max_seqs,
                           max_batched_tokens=opts.max_batched_tokens,
                           speculative_max_seqs=opts.speculative_max_seqs, kv_events=self.kv_events)
        thread = EngineThread(engine)
        thread.on_step = self.metrics.on_step
        self.engine = thread
        self.ready.set()
        log.info("serving %s as %r", getattr(self.model, "source", self.model), self.model_name)

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
        """"loading", "ready", "failed" (the model did not load, or the engine loop died) or
        "shutting_down"."""
        if self.draining:
            return "shutting_down"
        if self.error is not None or (self.engine is not None and not self.engine.alive):
            return "failed"
        return "ready" if self.ready.is_set() else "loading"

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

    def check_choices(self, prompts: int, n: int) -> None:
        """400 when ``prompts`` × ``n`` (one engine request each) is above the server's limit."""
        limit = self.options.choices_limit
        if prompts * n > limit:
            asked = f"{prompts} prompts × n = {n}, {prompts * n} choices" if prompts > 1 else f"n = {n} choices"
            raise bad_request(f"this request asks for {asked}; this server takes at most {limit} per request "
                              "(--max-choices): send fewer prompts or a smaller n", param="n" if n > 1 else "prompt",
                              code="too_many_choices")

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

    # ---- prompts -----------------------------------------------------------------------
    def template_source(self) -> Any:
        """The chat template (--chat-template, else the model's); 400 when there is none."""
        template = self.chat_template or self.tokenizer.chat_template
        if not template:
            raise bad_request(f"the model {self.model_name} has no chat template, so it cannot take messages; "
                              "start the server with --chat-template FILE, or send a plain prompt to /v1/completions",
                              param="messages", code="no_chat_template")
        return template

    def chat_text(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                  tools: Sequence[Tool] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of ``messages``, rendered with --chat-template or the model's template:
        with ``tools`` in its ``tools`` variable, or, for a template that knows no tools, in the
        fallback system block (see ``tool_calls``); ``template_kwargs`` (chat_template_kwargs,
        such as enable_thinking) are passed to the template too."""
        template = self.template_source()
        knows_tools = template_knows_tools(template)
        tok = self.tokenizer
        variables = dict(template_kwargs or {})
        variables.update(bos_token=getattr(tok, "bos_token", None) or "",
                         eos_token=getattr(tok, "eos_token", None) or "")
        if tools and knows_tools:
            variables["tools"] = [t.as_template_tool() for t in tools]
        for reserved in ("messages", "add_generation_prompt"):
            variables.pop(reserved, None)
        try:
            return render_chat(template, template_messages(messages, tools, knows_tools), add_generation_prompt,
                               **variables)
        except (TypeError, ValueError) as exc:
            raise bad_request(str(exc), param="messages") from exc

    def prompt_opens_think(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a chat prompt ends inside an open ``<think>`` block (DeepSeek-R1's template
        writes it): the reply then begins with reasoning."""
        tail = self.tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False).rstrip()
        return tail.endswith("<think>")

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of ``text`` (``Tokenizer.encode`` lets the event loop run meanwhile); 400
        for a model without a tokenizer."""
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from exc

    def refuse_overlong(self, text: str, what: str) -> None:
        """400 at once for a text that cannot fit the context whatever its tokens (more characters
        than the context's tokens can hold at the longest token's length), before tokenizing it."""
        context, longest = self.max_model_len, self.longest_token
        if longest and len(text) > context * longest:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, your {what} has "
                              f"{len(text)} characters, more than {context} tokens can hold (a token is at most "
                              f"{longest} characters). Please reduce the length of the {what}.", param=what,
                              code="context_length_exceeded")

    def chat_ids(self, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids of ``messages`` (and ``tools``, see ``chat_text``); the template writes any
        BOS, so none is added (worker thread). More messages than the context has tokens are
        refused before rendering (each message renders at least its role's marker)."""
        if len(messages) > self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"messages are {len(messages)}, and each takes at least one token. Please reduce the "
                              f"number of messages.", param="messages", code="context_length_exceeded")
        text = self.chat_text(messages, tools=tools, template_kwargs=template_kwargs)
        self.refuse_overlong(text, "messages")
        ids = self.encode(text, False, "messages")
        if not ids:
            raise bad_request("the chat template rendered an empty prompt", param="messages")
        return ids

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Ids of a text prompt (with the tokenizer's special tokens) or checked token ids (worker thread)."""
        if isinstance(prompt, str):
            self.refuse_overlong(prompt, param)
            prompt = self.encode(prompt, True, param)
        try:
            return encode_prompt(self.model, prompt)
        except (TypeError, ValueError) as exc:
            raise bad_request(str(exc), param=param) from exc

    def completion_budget(self, prompt_len: int, requested: int | None, field: str, what: str) -> int:
        """Tokens the completion may have. Refuses (400) a prompt that fills the context and a
        prompt plus ``requested`` above it; without a request (chat): CHAT_MAX_TOKENS, as the
        CLI's chat and the chat page use, less where the rest of the context (or of the KV pool;
        the engine refuses what cannot fit) is shorter."""
        context = self.max_model_len
        if prompt_len >= context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, your {what} "
                              f"resulted in {prompt_len} tokens, leaving no room for the completion. Please reduce "
                              f"the length of the {what}.", param=what, code="context_length_exceeded")
        if requested is None:
            return max(1, min(CHAT_MAX_TOKENS, context - prompt_len, self.kv_capacity + 1 - prompt_len))
        if prompt_len + requested > context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                              f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the "
                              f"completion). Please reduce the length of the {what} or the completion.",
                              param=field, code="context_length_exceeded")
        return requested

    def generation_config(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                          choice: int, grammar: Grammar | None = None) -> GenerationConfig:
        """The GenerationConfig of choice ``choice`` of ``req``: the request's values over the
        defaults the CLI and the chat page use (``sampling_defaults``: the sampling keys of the
        model's generation_config.json, else FALLBACK_SAMPLING); seed + choice when seeded;
        ``speculative_tokens`` the request's, else the server's. With a ``grammar``, a
        GuidedConfig: the output follows it. 400 for a stop token id outside the vocabulary."""
        defaults = sampling_defaults(getattr(self.model, "generation_defaults", None))
        vocab = self.vocab_size
        for i, token in enumerate(req.stop_token_ids or ()):
            if vocab is not None and token >= vocab:
                raise bad_request(f"stop_token_ids[{i}]: token id {token} is outside the vocabulary [0, {vocab})",
                                  param=f"stop_token_ids[{i}]")
        top_k = req.top_k
        if top_k == -1 or (top_k is not None and vocab is not None and top_k >= vocab):
            top_k = 0  # off: keeping the top `vocab` tokens keeps them all
        guided = {"grammar": grammar} if grammar is not None else {}
        cls = GuidedConfig if grammar is not None else GenerationConfig
        try:
            return cls.from_defaults(
                defaults, max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, seed=None if req.seed is None else req.seed + choice,
                stop=req.stops, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                eos_token_ids=tuple(req.stop_token_ids or ()),
                speculative_tokens=(self.options.speculative_tokens if req.speculative_tokens is None
                                    else req.speculative_tokens), **guided)
        except (TypeError, ValueError) as exc:
            message = str(exc)
            field = re.search(r"GenerationConfig\.(\w+)", message)
            param = API_FIELDS.get(field[1], field[1]) if field else None
            message = re.sub(r"GenerationConfig\.(\w+)", lambda m: API_FIELDS.get(m[1], m[1]), message)
            raise bad_request(message, param=param) from exc

    def capabilities(self) -> dict[str, Any]:
        """What the served model can do through the API (for /v1/models): chat needs a chat
        template; structured outputs a tokenizer; tool calls a chat template (in its own format
        when the template renders ``tools``, else the fallback); reasoning a template that
        speaks of ``<think>``; the Responses API chat; embeddings the model's hidden states (any
        decoder model)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        has_tokenizer = getattr(self.tokenizer, "backend", None) is not None
        tools = None
        if template:
            tools = {"format": tool_format(template),
                     "rendering": "template" if template_knows_tools(template) else "fallback"}
        return {"chat": bool(template), "structured_outputs": has_tokenizer, "tool_calls": tools,
                "reasoning": bool(template) and template_reasons(template), "embeddings": True,
                "responses": bool(template)}

    # ---- engine requests ---------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], config: GenerationConfig) -> AsyncRequestStream:
        """Add one request to the engine; its stream. Engine refusals become 400."""
        engine = self.require_ready()
        self.metrics.submitted(request_id)
        self._inflight.add(request_id)
        try:
            return await engine.submit_async(prompt_ids, config, request_id=request_id)
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
                engine = LLMEngine(self.model, kv_cache_tokens=self.max_model_len, max_seqs=opts.max_seqs,
                                   max_batched_tokens=opts.max_batched_tokens, prefix_caching=False)
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
