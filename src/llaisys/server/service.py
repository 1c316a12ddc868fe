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
from ..generation import GenerationConfig, encode_prompt
from ..models.chat_template import ChatTemplate, compile_template, render_chat
from .errors import APIError, bad_request, shutting_down
from .metrics import Metrics
from .options import ServerOptions
from .protocol import ChatMessage, SamplingRequest

log = logging.getLogger(__name__)

Loader = Callable[[], Any]
T = TypeVar("T")
PROMPT_THREADS = min(4, os.cpu_count() or 1)  # threads rendering and tokenizing prompts
# GenerationConfig field -> the API field that sets it
API_FIELDS = {"max_new_tokens": "max_tokens", "eos_token_ids": "stop_token_ids"}
# OpenAI's default sampling, under the model's generation_config.json (as vLLM does)
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


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
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self.draining = False
        self.ending = asyncio.Event()  # set when the running requests are ended (shutdown)
        self._inflight: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token_text: dict[int, str] = {}
        self._longest_token: int | None = None
        self._workers = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="llaisys-prompt")

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
        engine = LLMEngine(self.model, kv_cache_tokens=opts.kv_cache_tokens, max_seqs=opts.max_seqs,
                           max_batched_tokens=opts.max_batched_tokens)
        thread = EngineThread(engine)
        thread.on_step = self.metrics.on_step
        self.engine = thread
        self.ready.set()
        log.info("serving %s as %r", getattr(self.model, "source", self.model), self.model_name)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still in it end with reason "abort") and the workers."""
        if self.engine is not None:
            self.engine.stop(timeout)
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
    def chat_text(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages``, rendered with --chat-template or the model's template."""
        template = self.chat_template or self.tokenizer.chat_template
        if not template:
            raise bad_request(f"the model {self.model_name} has no chat template, so it cannot take messages; "
                              "start the server with --chat-template FILE, or send a plain prompt to /v1/completions",
                              param="messages", code="no_chat_template")
        tok = self.tokenizer
        try:
            return render_chat(template, [m.as_template_message() for m in messages], add_generation_prompt,
                               bos_token=getattr(tok, "bos_token", None) or "",
                               eos_token=getattr(tok, "eos_token", None) or "")
        except (TypeError, ValueError) as exc:
            raise bad_request(str(exc), param="messages") from exc

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

    def chat_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Prompt ids of ``messages``; the template writes any BOS, so none is added (worker thread)."""
        text = self.chat_text(messages)
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
        prompt plus ``requested`` above it; without a request: the rest of the context (less if
        the KV pool is smaller; the engine refuses what cannot fit)."""
        context = self.max_model_len
        if prompt_len >= context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, your {what} "
                              f"resulted in {prompt_len} tokens, leaving no room for the completion. Please reduce "
                              f"the length of the {what}.", param=what, code="context_length_exceeded")
        if requested is None:
            return max(1, min(context - prompt_len, self.kv_capacity + 1 - prompt_len))
        if prompt_len + requested > context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                              f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the "
                              f"completion). Please reduce the length of the {what} or the completion.",
                              param=field, code="context_length_exceeded")
        return requested

    def generation_config(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                          choice: int) -> GenerationConfig:
        """The GenerationConfig of choice ``choice`` of ``req``: the request's values over the
        model's generation_config.json over OpenAI's defaults; seed + choice when seeded."""
        defaults = {**OPENAI_DEFAULTS, **(getattr(self.model, "generation_defaults", None) or {})}
        top_k = 0 if req.top_k == -1 else req.top_k
        try:
            return GenerationConfig.from_defaults(
                defaults, max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, seed=None if req.seed is None else req.seed + choice,
                stop=req.stops, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                eos_token_ids=tuple(req.stop_token_ids or ()))
        except (TypeError, ValueError) as exc:
            message = str(exc)
            field = re.search(r"GenerationConfig\.(\w+)", message)
            param = API_FIELDS.get(field[1], field[1]) if field else None
            message = re.sub(r"GenerationConfig\.(\w+)", lambda m: API_FIELDS.get(m[1], m[1]), message)
            raise bad_request(message, param=param) from exc

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
        if self.engine is None:
            return
        ids = list(self._inflight)
        if ids:
            log.warning("ending %d running request(s): the server is shutting down", len(ids))
        for rid in ids:
            self.engine.abort(rid)
            self._record_abort(rid)

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
