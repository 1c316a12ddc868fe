"""Request bodies of the API as pydantic models, checked strictly.

As in OpenAI's API, a value of the wrong type is an error (no "0.5" for a number, no 1 for a
boolean) and fields the server does not know are ignored. Ranges are OpenAI's (vLLM's for
the fields it adds: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids; ours: speculative_tokens). Responses are plain dicts built in ``llaisys.server.completions``.

The completion's length has one name from here on, ``max_tokens``: a chat request's
``max_completion_tokens`` is read into it (``max_tokens_param`` remembers which field it was, for
errors), a completion request's is 16 when not given; ``requests.completion_budget`` fits it to
the context.

Bodies are parsed by ``load_json_body``, which also refuses what strict JSON does not allow
or nothing downstream can take: ``NaN``, ``Infinity`` and numbers too large for a double (every
float is finite), strings with a lone UTF-16 surrogate (``"\\ud800"``, which cannot be encoded
as UTF-8) and nesting deeper than ``MAX_JSON_DEPTH``.

Every list fails fast (``FastList``: its first bad item is the error, not one error per item,
which for a list of millions would take pydantic seconds to collect, all holding the GIL),
and no field is a dict of typed values, for the same reason; prompts are checked by
``_check_prompt`` alone.
"""
from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SkipValidation, field_validator, model_validator

from ..generation.config import MAX_LOGPROBS  # top tokens per step: 20, as OpenAI
from ..generation.config import MAX_SPECULATIVE_TOKENS  # draft tokens per step: 64
from .errors import APIError, bad_request

MAX_N = 128  # choices per request, as OpenAI
MAX_TOOLS = 128  # functions per request, as OpenAI
MAX_JSON_DEPTH = 64  # nesting of a request body; OpenAI's bodies need fewer than 10 levels
MAX_TOKEN_ID = 2**31  # token ids are below this whatever the vocabulary (the server checks the model's)

T = TypeVar("T")
FastList = Annotated[list[T], Field(fail_fast=True)]  # a list whose first bad item is its error
PositiveInt = Annotated[int, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TokenId = Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)]


_SURROGATE = re.compile("[\ud800-\udfff]")


class NonFinite(str):
    """A number literal the parser met that is not a finite double (``NaN``, ``-Infinity``,
    ``1e999``): kept as its text until ``_check_json`` reports where it is."""


def _parse_float(text: str) -> float | NonFinite:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(text)


def load_json_body(raw: bytes | str) -> Any:
    """The JSON value of a request body. Raises ValueError (json.JSONDecodeError, or
    UnicodeDecodeError for bytes that are not UTF-8) for malformed JSON, and a 400 APIError for
    nesting deeper than MAX_JSON_DEPTH, a number that is not a finite double, or a string (or
    key) with a lone surrogate, naming where (``messages[0].content``)."""
    try:
        value = json.loads(raw, parse_constant=NonFinite, parse_float=_parse_float)
    except RecursionError:  # nested deeper than the interpreter's stack allows
        raise bad_request(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                          code="json_too_deep") from None
    _check_json(value)
    return value


def _check_json(value: Any) -> None:
    """Walk ``value`` without recursion; a 400 APIError at the first problem found."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, NonFinite):
            where = path or "the body"
            raise bad_request(f"{where}: {node} is not a number JSON allows; numbers must be finite and fit a "
                              "double (about 1.8e308)", param=path or None, code="invalid_number")
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise _surrogate_error(path)
            continue
        if not isinstance(node, (dict, list)):  # a number, true, false or null
            continue
        if depth > MAX_JSON_DEPTH:
            field = re.match(r"[^.\[]*", path)[0] or None  # the top-level field it is under
            raise bad_request(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)"
                              + (f" under {field}" if field else ""), param=field, code="json_too_deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            if isinstance(key, str):
                if _SURROGATE.search(key):
                    raise _surrogate_error(path, key)
                where = f"{path}.{key}" if path else key
            else:
                where = f"{path}[{key}]"
            if isinstance(item, (str, dict, list)):
                stack.append((item, where, depth + 1))


def _surrogate_error(path: str, key: str | None = None) -> APIError:
    if key is not None:  # shown escaped: the key itself cannot be written as UTF-8
        path = f"{path}.{key}" if path else key
        path = path.encode("utf-8", "backslashreplace").decode("utf-8")
    what = f"the key '{path}'" if key is not None else path or "the body"
    return bad_request(f"{what}: the text has a lone UTF-16 surrogate (such as \"\\ud800\" without its pair), "
                       "which is not valid Unicode; send UTF-8 text", param=path or None, code="invalid_unicode")


class Strict(BaseModel):
    """A request model: wrong types are errors, unknown fields are dropped."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


IMAGE_DETAILS = ("auto", "low", "high")


def _check_content(value: Any) -> Any:
    """A message's content: a str, None, or a list of text parts and image parts
    (``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``; an ``image_url`` given
    as a bare string is taken as its url)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be a string or a list of content parts, got {type(value).__name__}")
    out = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part)
        elif kind == "image_url":
            out.append(_image_part(part, j))
        else:
            what = f"a {kind!r} part" if isinstance(kind, str) else f"{type(part).__name__} {part!r:.40}"
            raise ValueError(f"part {j} is {what}; expected a text part {{'type': 'text', 'text': '...'}} or an image "
                             "part {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}")
    return out


def _image_part(part: dict[str, Any], j: int) -> dict[str, Any]:
    """An image part checked, its ``image_url`` an object {url, detail}."""
    image = part.get("image_url")
    if isinstance(image, str):
        image = {"url": image}
    if not isinstance(image, dict) or not isinstance(image.get("url"), str) or not image["url"]:
        raise ValueError(f"part {j} is an 'image_url' part without a url; expected {{'type': 'image_url', "
                         "'image_url': {'url': 'data:image/png;base64,...'}}")
    detail = image.get("detail", "auto")
    if detail not in IMAGE_DETAILS:
        raise ValueError(f"part {j}: image_url.detail must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r:.40}")
    return {"type": "image_url", "image_url": {"url": image["url"], "detail": detail}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    """Where an image part's picture is: a data: URL, or an http(s) URL (fetched only from the
    server's --allowed-image-hosts); ``detail`` is accepted and left to the model's processor."""

    model_config = ConfigDict(strict=True, extra="ignore")
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    """An image in a user message (OpenAI's ``image_url`` content part)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    """The function an assistant message called: its name and its arguments as JSON text."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """One call of an assistant message's ``tool_calls`` (history sent back by the client)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_call(self) -> dict[str, Any]:
        """The call as chat templates take it: arguments parsed into an object (as vLLM does)."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(Strict):
    """One message. "developer" is OpenAI's newer name for "system" and is treated as one; a
    "tool" message is a tool's result (``tool_call_id``: the call it answers); an assistant
    message may carry the ``tool_calls`` it made; a user message's content may hold image
    parts (fetched, decoded and limited by the request builder, for a vision model only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | FastList[ContentPart] | None = None
    name: str | None = None
    tool_calls: FastList[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _check_content(value)

    @model_validator(mode="after")
    def _content_needed(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (a string or a list of text parts)")
        if self.role != "user" and self.images:
            raise ValueError(f"content: image parts go in user messages, not in a {self.role} message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has tool calls, not a {self.role} message")
        return self

    @property
    def text(self) -> str:
        """The content's text as one string (text parts joined with newlines, None as "")."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    @property
    def images(self) -> list[tuple[int, ImagePart]]:
        """The image parts of the content, each with its index in it."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]

    def as_template_message(self) -> dict[str, Any]:
        """The dict a chat template renders (an image part as ``{"type": "image"}``)."""
        content = self.content if not isinstance(self.content, list) else \
            [{"type": "image"} if isinstance(p, ImagePart) else p.model_dump() for p in self.content]
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_call() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "tool" and self.name is not None:
            out["name"] = self.name
        return out


def message_images(messages: list[ChatMessage]) -> list[tuple[str, ImagePart]]:
    """The image parts of ``messages`` in order, each with its field (``messages[1].content[0]``)."""
    return [(f"messages[{i}].content[{j}]", part) for i, m in enumerate(messages) for j, part in m.images]


class FunctionDefinition(BaseModel):
    """A function of ``tools``: its name (OpenAI's rule: letters, digits, ``_ . -``, at most 64),
    what it does and its ``parameters`` (a JSON schema its arguments follow)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One tool of ``tools``: a function the model may call."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_tool(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape, empty fields left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: that function must be called."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: dict[str, Any]

    @field_validator("function")
    @classmethod
    def _name(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value.get("name") or not isinstance(value["name"], str):
            raise ValueError("must be {'name': ...} naming one of the tools")
        return value


class SamplingRequest(Strict):
    """The fields /v1/chat/completions and /v1/completions share."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 and 0: off (vLLM)
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: FastList[TokenId] | None = None
    logit_bias: dict[str, Any] | None = None  # refused when not empty
    # structured outputs (checked and compiled in llaisys.server.structured): OpenAI's, vLLM's
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: FastList[str] | None = None
    guided_grammar: str | None = None
    # ours: speculative decoding's draft tokens per step (None: the server's --speculative-tokens)
    speculative_tokens: Annotated[int, Field(ge=0, le=MAX_SPECULATIVE_TOKENS)] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value or None
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise ValueError("must be a string or a list of non-empty strings")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by this server")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def max_tokens_param(self) -> str:
        """The API field ``max_tokens`` was read from (errors about the completion's length name it)."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[FastList[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[FastList[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_budget: Annotated[int, Field(ge=0)] | None = None  # thinking tokens before </think> is forced
    _image_fields: list[str] | None = PrivateAttr(default=None)  # see name_images

    @model_validator(mode="after")
    def _chat_checks(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function["name"] not in names:
            raise ValueError(f"tool_choice: names the function {choice.function['name']!r}, which is not among "
                             f"the tools ({', '.join(names) or 'none given'})")
        if choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins; max_tokens carries it on
            self.max_tokens = self.max_completion_tokens
        return self

    def name_images(self, fields: list[str]) -> "ChatCompletionRequest":
        """Name the image parts, in order, by the fields they came from in another API's request
        (Responses' ``input[0].content[1]``, Anthropic's ``messages[0].content[2]``), so errors
        about them name what the client sent; returns the request."""
        self._image_fields = list(fields)
        return self

    def image_parts(self) -> list[tuple[str, ImagePart]]:
        """Every image part of the messages, in order, with the request field it came from
        (``messages[1].content[0]``, or the names ``name_images`` gave)."""
        found = message_images(self.messages)
        names = self._image_fields
        if names is not None and len(names) == len(found):
            found = [(name, part) for name, (_, part) in zip(names, found)]
        return found

    @property
    def tool_mode(self) -> str | None:
        """How tools are used: None (no tools, or tool_choice "none"), "auto", "required", or
        "function:NAME" for the function the model must call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function:" + self.tool_choice.function["name"]
        return self.tool_choice or "auto"

    @property
    def max_tokens_param(self) -> str:
        """The API field ``max_tokens`` was read from: max_completion_tokens when given."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """Top tokens per step for GenerationConfig.logprobs (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def _check_prompt(value: Any) -> Any:
    """A prompt: text, token ids, or a non-empty list of either (several prompts); each id in
    [0, MAX_TOKEN_ID) (the model's vocabulary is checked when the prompt is encoded)."""
    def ids_error(v: Any) -> str | None:  # why ``v`` is not a list of token ids (None: it is one)
        if not isinstance(v, list) or not v:
            return "not a non-empty list"
        for i, t in enumerate(v):
            if not isinstance(t, int) or isinstance(t, bool):
                return f"item {i} is {type(t).__name__} {t!r:.40}, not a token id"
            if not 0 <= t < MAX_TOKEN_ID:
                return f"token id {t} at {i} is outside [0, {MAX_TOKEN_ID})"
        return None

    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and not isinstance(value[0], (str, list)):  # one prompt of ids
        why = ids_error(value)
        if why is None:
            return value
        raise ValueError(f"must be a string, a list of token ids, or a non-empty list of strings or of token id "
                         f"lists: {why}")
    if isinstance(value, list) and value:
        for p, item in enumerate(value):
            why = None if isinstance(item, str) else ids_error(item)
            if why is not None:
                raise ValueError(f"prompt {p} must be a string or a non-empty list of token ids: {why}")
        return value
    raise ValueError("must be a string, a list of token ids, or a non-empty list of strings or of token id lists")


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], SkipValidation]  # _check_prompt's
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    @model_validator(mode="after")
    def _completion_checks(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo: not supported by this server")
        if self.suffix:
            raise ValueError("suffix: not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of equal to n is supported")
        if self.max_tokens is None:
            self.max_tokens = 16  # as OpenAI and vLLM do
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class EmbeddingRequest(Strict):
    """POST /v1/embeddings: OpenAI's, with vLLM-style extensions ``pooling`` and ``normalize``."""

    model: str | None = None
    input: Annotated[str | list[int] | list[str] | list[list[int]], SkipValidation]  # _check_prompt's
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        return _check_prompt(value)

    @property
    def inputs(self) -> list[str | list[int]]:
        """The inputs, one or several."""
        p = self.input
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(Strict):
    """POST /tokenize (vLLM's): a ``prompt`` or chat ``messages`` (rendered with the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: FastList[ChatMessage] | None = None
    tools: Annotated[FastList[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(Strict):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: FastList[TokenId]
