"""The request builder: a validated API request in, the engine requests that answer it out.

    built = await build_request(service, req)   # a ChatCompletionRequest, CompletionRequest or EmbeddingRequest
    for job in built.jobs:                      # one per choice: prompts × n (inputs, for embeddings)
        stream = await service.submit(f"{response_id}-{job.index}", job.prompt_ids, job.config, job.images)

Every protocol module calls it so, once per request: ``completions`` with its two bodies,
``responses`` and ``anthropic`` with the ChatCompletionRequest they turn theirs into,
``embeddings`` with its EmbeddingRequest. It reads the served model through ``service`` (the
lifecycle's ``ModelService``: tokenizer, context, chat template, grammars, worker threads) and
calls no protocol module, so no module is entered twice on a request's way to the engine.

The steps, each refusal a 400 naming the request's field (404 and 503 come from the service):

1. the model is ready and is the one asked for; prompts × n within --max-choices; the grammar
   asked for (``structured``), or for a forced tool call the one of a call;
2. in a worker thread: the prompt ids (messages rendered with the chat template and the tools,
   text tokenized, token ids checked; a chat's images fetched or decoded within the server's
   limits by ``images.load_image`` and encoded by the model's vision tower, their placeholders
   expanded into their tokens, the rows carried on the Job to the engine), ``max_tokens`` fitted
   to the context (``completion_budget``: the only place it is clipped), a GenerationConfig per
   choice, the grammar checked against the server's limits;
3. the grammar compiled (``service.grammars``) and put in every choice's config.

``max_tokens`` is the completion's length under one name: ``protocol`` reads it from the API's
max_tokens or max_completion_tokens (``responses`` from max_output_tokens, ``anthropic`` from
its max_tokens) and it is carried so to GenerationConfig, whose field is ``max_new_tokens``.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.grammar import GuidedConfig
from ..engine.pooling import PoolingConfig
from ..generation import GenerationConfig, encode_prompt
from ..generation.defaults import CHAT_MAX_TOKENS, sampling_defaults
from ..generation.prompts import image_prompt
from ..models.chat_template import render_chat
from .errors import bad_request
from .grammars import PendingGrammar
from .images import load_image, refuse_images
from .protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, EmbeddingRequest, ImagePart,
                       SamplingRequest, Tool)
from .reasoning import THINK_OPEN, template_reasons, think_end
from .structured import GrammarSpec, requested_constraint
from .tool_calls import forced_call_grammar, template_knows_tools, template_messages, tool_format

if TYPE_CHECKING:
    from ..models.multimodal.tower import PromptImages
    from .service import ModelService

APIRequest = ChatCompletionRequest | CompletionRequest | EmbeddingRequest


@dataclass(slots=True)
class Job:
    """One engine request: its index among the response's choices, its prompt ids, its config
    (GenerationConfig, GuidedConfig, or PoolingConfig for an embedding), the request field
    its grammar came from, if any, and where its images' rows go in the prompt (None: no images)."""

    index: int
    prompt_ids: list[int]
    config: GenerationConfig
    grammar_param: str | None = None
    images: PromptImages | None = None


@dataclass(slots=True)
class EngineRequest:
    """What one API request becomes: its jobs (one per choice), and for chat how its reply is
    read: the template's tool call format (None: no tools) and whether it writes ``<think>``."""

    jobs: list[Job]
    tool_format: str | None = None
    reasoning: bool = False


async def build_request(service: ModelService, req: APIRequest) -> EngineRequest:
    """The engine requests of the validated ``req`` (see the module's steps). Raises APIError:
    503 while the model loads or after a failure, 404 for another model's name, 400 for what
    the model or the server's limits cannot take."""
    service.require_ready()
    service.check_model(req.model)
    if isinstance(req, ChatCompletionRequest):
        return await _chat(service, req)
    if isinstance(req, CompletionRequest):
        return await _completion(service, req)
    if isinstance(req, EmbeddingRequest):
        return await _embeddings(service, req)
    raise TypeError(f"build_request takes a chat, completion or embedding request, got {type(req).__name__}")


async def chat_prompt(service: ModelService, req: ChatCompletionRequest) -> list[int]:
    """The prompt ids ``build_request`` would give ``req``, and nothing else (Anthropic's
    count_tokens): rendered and tokenized, its images decoded and expanded into their tokens,
    in a worker thread."""
    service.require_ready()
    service.check_model(req.model)
    return await service.in_worker(lambda: chat_prompt_ids(service, req)[0])


# ---- the three kinds of request -------------------------------------------------------------
async def _chat(service: ModelService, req: ChatCompletionRequest) -> EngineRequest:
    check_choices(service, 1, req.n)
    spec = requested_constraint(req)
    mode = req.tool_mode
    template = template_source(service)
    fmt = tool_format(template) if mode is not None else None
    forced = mode is not None and mode != "auto"  # a call is forced: the grammar of one
    if forced and spec is not None:
        raise bad_request(f"tool_choice: a forced tool call cannot be combined with {spec.param}",
                          param="tool_choice")

    def prepare() -> tuple[list[Job], PendingGrammar | None]:  # worker thread: renders, tokenizes, checks
        ids, placed = chat_prompt_ids(service, req)
        max_tokens = completion_budget(service, len(ids), req.max_tokens, req.max_tokens_param, "messages")
        thinking = reasoning_fields(service, req.reasoning_budget, ids, template)
        jobs = [Job(i, ids, generation_config(service, req, max_tokens, req.num_logprobs, i, thinking), images=placed)
                for i in range(req.n)]
        constraint = spec
        if forced:
            constraint = GrammarSpec("lark", forced_call_grammar(req.tools or (), mode, req.parallel_tool_calls, fmt),
                                     "tools")
        return jobs, _checked(service, constraint)

    jobs, pending = await service.in_worker(prepare)
    return EngineRequest(await _with_grammar(service, jobs, pending), fmt, template_reasons(template))


async def _completion(service: ModelService, req: CompletionRequest) -> EngineRequest:
    prompts = req.prompts
    check_choices(service, len(prompts), req.n)
    spec = requested_constraint(req)

    def prepare() -> tuple[list[Job], PendingGrammar | None]:  # worker thread: tokenizes, in the prompts' order
        pending = _checked(service, spec)
        jobs = []
        for p, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = prompt_ids(service, prompt)
                max_tokens = completion_budget(service, len(ids), req.max_tokens, req.max_tokens_param, "prompt")
            else:  # token ids: their count is known before they are checked (a long list takes a while)
                max_tokens = completion_budget(service, len(prompt), req.max_tokens, req.max_tokens_param, "prompt")
                ids = prompt_ids(service, prompt)
            jobs += [Job(p * req.n + i, ids, generation_config(service, req, max_tokens, req.num_logprobs, i))
                     for i in range(req.n)]
        return jobs, pending

    jobs, pending = await service.in_worker(prepare)
    return EngineRequest(await _with_grammar(service, jobs, pending))


async def _embeddings(service: ModelService, req: EmbeddingRequest) -> EngineRequest:
    inputs = req.inputs
    check_choices(service, len(inputs), 1)
    hidden = int(service.model.config.hidden_size)
    if req.dimensions is not None and req.dimensions != hidden:
        raise bad_request(f"dimensions: this model's embeddings have {hidden} dimensions and it was not trained to "
                          f"be cut shorter (Matryoshka); leave dimensions out or give {hidden}", param="dimensions")
    context = service.max_model_len
    config = PoolingConfig(max_new_tokens=1, pooling=req.pooling, normalize=req.normalize)

    def prepare() -> list[Job]:  # worker thread: tokenizes
        jobs = []
        for i, text in enumerate(inputs):
            param = "input" if len(inputs) == 1 else f"input[{i}]"
            ids = prompt_ids(service, text, param)
            if len(ids) >= context:
                raise bad_request(f"This model's maximum context length is {context} tokens. However, {param} has "
                                  f"{len(ids)} tokens (at most {context - 1} can be embedded).", param=param,
                                  code="context_length_exceeded")
            jobs.append(Job(i, ids, config))
        return jobs

    return EngineRequest(await service.in_worker(prepare))


# ---- prompts --------------------------------------------------------------------------------
def check_choices(service: ModelService, prompts: int, n: int) -> None:
    """400 when ``prompts`` × ``n`` (one engine request each) is above the server's limit."""
    limit = service.options.choices_limit
    if prompts * n > limit:
        asked = f"{prompts} prompts × n = {n}, {prompts * n} choices" if prompts > 1 else f"n = {n} choices"
        raise bad_request(f"this request asks for {asked}; this server takes at most {limit} per request "
                          "(--max-choices): send fewer prompts or a smaller n", param="n" if n > 1 else "prompt",
                          code="too_many_choices")


def template_source(service: ModelService) -> Any:
    """The chat template in use (--chat-template, else the model's); 400 when there is none."""
    template = service.template
    if not template:
        raise bad_request(f"the model {service.model_name} has no chat template, so it cannot take messages; "
                          "start the server with --chat-template FILE, or send a plain prompt to /v1/completions",
                          param="messages", code="no_chat_template")
    return template


def chat_text(service: ModelService, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
              tools: Sequence[Tool] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of ``messages``, rendered with the chat template in use: with ``tools`` in
    its ``tools`` variable, or, for a template that knows no tools, in the fallback system block
    (see ``tool_calls``); ``template_kwargs`` (chat_template_kwargs, such as enable_thinking) are
    passed to the template too. A vision-language model's template gets every content as a
    list of text and image parts (an image part as its placeholder's place)."""
    template = template_source(service)
    knows_tools = template_knows_tools(template)
    tok = service.tokenizer
    variables = dict(template_kwargs or {})
    variables.update(bos_token=getattr(tok, "bos_token", None) or "", eos_token=getattr(tok, "eos_token", None) or "")
    if tools and knows_tools:
        variables["tools"] = [t.as_template_tool() for t in tools]
    for reserved in ("messages", "add_generation_prompt"):
        variables.pop(reserved, None)
    try:
        return render_chat(template, template_messages(messages, tools, knows_tools), add_generation_prompt,
                           parts=vision_of(service) is not None, **variables)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), param="messages") from exc


def encode(service: ModelService, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """Token ids of ``text``; 400 (naming ``param``) for a model without a tokenizer."""
    try:
        return list(service.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from exc


def refuse_overlong(service: ModelService, text: str, what: str) -> None:
    """400 at once for a text that cannot fit the context whatever its tokens (more characters
    than the context's tokens can hold at the longest token's length), before tokenizing it."""
    context, longest = service.max_model_len, service.longest_token
    if longest and len(text) > context * longest:
        raise bad_request(f"This model's maximum context length is {context} tokens. However, your {what} has "
                          f"{len(text)} characters, more than {context} tokens can hold (a token is at most "
                          f"{longest} characters). Please reduce the length of the {what}.", param=what,
                          code="context_length_exceeded")


def chat_prompt_ids(service: ModelService, req: ChatCompletionRequest) -> tuple[list[int], PromptImages | None]:
    """Prompt ids of a chat request's messages, with its tools when it uses them (not with
    tool_choice "none") and its template kwargs, and where its images' rows go (None: no
    images); the template writes any BOS, so none is added (worker thread). More messages than
    the context has tokens are refused before rendering (each message renders at least its
    role's marker); images before any is fetched or decoded (a model without a vision
    encoder, more than --max-images)."""
    context, messages = service.max_model_len, req.messages
    if len(messages) > context:
        raise bad_request(f"This model's maximum context length is {context} tokens. However, your messages are "
                          f"{len(messages)}, and each takes at least one token. Please reduce the number of "
                          "messages.", param="messages", code="context_length_exceeded")
    images = req.image_parts()
    check_images(service, images)
    text = chat_text(service, messages, tools=req.tools if req.tool_mode is not None else None,
                     template_kwargs=req.chat_template_kwargs)
    refuse_overlong(service, text, "messages")
    ids, placed = rendered_prompt(service, text, images, False)
    if not ids:
        raise bad_request("the chat template rendered an empty prompt", param="messages")
    return ids, placed


def check_images(service: ModelService, images: Sequence[tuple[str, ImagePart]]) -> None:
    """400 for image parts (each with its request field) the served model or the server's
    limits cannot take: any, for a model without a vision encoder; more than --max-images."""
    if not images:
        return
    if vision_of(service) is None:
        raise refuse_images(service.model_name, images[0][0])
    limit = service.options.max_images
    if len(images) > limit:
        param = images[limit][0]
        raise bad_request(f"{param}: this request has {len(images)} images; this server takes at most {limit} per "
                          "request (--max-images)", param=param, code="too_many_images")


def rendered_prompt(service: ModelService, text: str, images: Sequence[tuple[str, ImagePart]],
                    add_special_tokens: bool) -> tuple[list[int], PromptImages | None]:
    """Ids of a rendered chat ``text`` and where its images' rows go (worker thread). For a
    vision-language model each image part (checked by ``check_images``) is fetched or decoded
    in order and encoded by the vision tower, here, while the engine thread steps the other
    requests; its placeholder in ``text`` becomes its tokens. A placeholder written in the text
    itself would take an image's place, so the placeholders must match the image parts."""
    vision = vision_of(service)
    marks = text.count(vision.placeholder) if vision is not None else 0
    if marks != len(images) and (marks or not images):
        raise bad_request(f"the rendered messages hold the image placeholder {vision.placeholder!r} {marks} times for "
                          f"{len(images)} image parts; it stands for an image and cannot be written as text",
                          param="messages", code="invalid_image_placeholder")
    if not images:
        return encode(service, text, add_special_tokens, "messages"), None
    pictures = [load_image(part.image_url.url, param, service.options) for param, part in images]
    try:
        return image_prompt(service.model, text, pictures, add_special_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from exc


def vision_of(service: ModelService) -> Any:
    """The served model's vision tower (None: the model takes text only)."""
    return getattr(service.model, "vision", None)


def prompt_ids(service: ModelService, prompt: str | list[int], param: str = "prompt") -> list[int]:
    """Ids of a text prompt (with the tokenizer's special tokens) or checked token ids (worker thread)."""
    if isinstance(prompt, str):
        refuse_overlong(service, prompt, param)
        prompt = encode(service, prompt, True, param)
    try:
        return encode_prompt(service.model, prompt)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), param=param) from exc


# ---- the completion's length and sampling -----------------------------------------------------
def completion_budget(service: ModelService, prompt_len: int, max_tokens: int | None, param: str, what: str) -> int:
    """Tokens the completion may have: the one place ``max_tokens`` meets the context. Refuses
    (400) a prompt that fills the context and a prompt plus ``max_tokens`` above it (naming
    ``param``, the API field it came from); without ``max_tokens`` (chat): CHAT_MAX_TOKENS, as
    the CLI's chat and the chat page use, less where the rest of the context (or of the KV pool;
    the engine refuses what cannot fit) is shorter."""
    context = service.max_model_len
    if prompt_len >= context:
        raise bad_request(f"This model's maximum context length is {context} tokens. However, your {what} "
                          f"resulted in {prompt_len} tokens, leaving no room for the completion. Please reduce "
                          f"the length of the {what}.", param=what, code="context_length_exceeded")
    if max_tokens is None:
        return max(1, min(CHAT_MAX_TOKENS, context - prompt_len, service.kv_capacity + 1 - prompt_len))
    if prompt_len + max_tokens > context:
        raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the "
                          f"completion). Please reduce the length of the {what} or the completion.",
                          param=param, code="context_length_exceeded")
    return max_tokens


def reasoning_fields(service: ModelService, budget: int | None, prompt_ids: list[int], template: Any
                     ) -> dict[str, Any]:
    """The GenerationConfig fields of a reasoning budget for a chat prompt ``prompt_ids``:
    ``budget`` (the request's; None: the server's) with the tokens that open the think block
    (none when the prompt opened it) and those that end it (``think_end`` of the ``template``);
    {} when no budget applies or the template does not reason."""
    if budget is None:
        budget = service.options.reasoning_budget
    if budget is None or not template_reasons(template):
        return {}
    encode = service.tokenizer.encode
    opened = service.prompt_opens_think(prompt_ids)
    return {"reasoning_budget": budget,
            "reasoning_open": () if opened else tuple(encode(THINK_OPEN, add_special_tokens=False)),
            "reasoning_end": tuple(encode(think_end(template), add_special_tokens=False))}


def generation_config(service: ModelService, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                      choice: int, reasoning: dict[str, Any] | None = None) -> GenerationConfig:
    """The GenerationConfig of choice ``choice`` of ``req``, generating ``max_tokens`` at most:
    the request's values over the defaults the CLI and the chat page use (``sampling_defaults``:
    the sampling keys of the model's generation_config.json, else FALLBACK_SAMPLING); seed +
    choice when seeded; ``speculative_tokens`` the request's, else the server's; ``reasoning``:
    the fields of a reasoning budget (``reasoning_fields``). 400 for a stop
    token id outside the vocabulary, and for values GenerationConfig refuses (naming the API field)."""
    defaults = sampling_defaults(getattr(service.model, "generation_defaults", None))
    vocab = service.vocab_size
    for i, token in enumerate(req.stop_token_ids or ()):
        if vocab is not None and token >= vocab:
            raise bad_request(f"stop_token_ids[{i}]: token id {token} is outside the vocabulary [0, {vocab})",
                              param=f"stop_token_ids[{i}]")
    top_k = req.top_k
    if top_k == -1 or (top_k is not None and vocab is not None and top_k >= vocab):
        top_k = 0  # off: keeping the top `vocab` tokens keeps them all
    speculative = service.options.speculative_tokens if req.speculative_tokens is None else req.speculative_tokens
    try:
        return GenerationConfig.from_defaults(
            defaults, max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=None if req.seed is None else req.seed + choice,
            stop=req.stops, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
            eos_token_ids=tuple(req.stop_token_ids or ()), speculative_tokens=speculative, **(reasoning or {}))
    except (TypeError, ValueError) as exc:
        api = {"max_new_tokens": req.max_tokens_param, "eos_token_ids": "stop_token_ids"}  # config field -> API's
        message = str(exc)
        found = re.search(r"GenerationConfig\.(\w+)", message)
        param = api.get(found[1], found[1]) if found else None
        message = re.sub(r"GenerationConfig\.(\w+)", r"\1", message)
        message = re.sub(r"\b(max_new_tokens|eos_token_ids)\b", lambda m: api[m[1]], message)  # the API's names
        raise bad_request(message, param=param) from exc


# ---- grammars -------------------------------------------------------------------------------
def _checked(service: ModelService, spec: GrammarSpec | None) -> PendingGrammar | None:
    """``spec`` checked against the server's limits (worker thread); 400 naming its field."""
    return service.grammars.prepare(spec.kind, spec.value, spec.param) if spec is not None else None


async def _with_grammar(service: ModelService, jobs: list[Job], pending: PendingGrammar | None) -> list[Job]:
    """``jobs`` with the compiled grammar of ``pending`` in their configs (unchanged without one)."""
    if pending is None:
        return jobs
    grammar = await service.grammars.compile(pending)
    return [Job(j.index, j.prompt_ids, GuidedConfig.of(j.config, grammar), pending.param, j.images) for j in jobs]
