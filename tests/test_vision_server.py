"""Images through ``llaisys serve``: a random-weight SmolVLM folder served on loopback, talked to
with the official ``openai`` and ``anthropic`` clients.

Greedy replies to an image (OpenAI chat whole and streamed, Responses ``input_image``,
Anthropic ``image`` blocks, an image fetched from an allowed host) equal the in-process
engine's for the same picture (``tests/test_vision_models.py`` holds the engine to
transformers). Hostile payloads (not an image, truncated, a decompression bomb, too many,
too large, URLs the server must not fetch, bad base64) are each a 400 naming the part and
the problem, the server healthy after each; a text model refuses images with a 400.
"""
from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import numpy as np
import openai
import pytest
from test_server import client_for, get, post, running

from conftest import random_image
from llaisys.engine import chat
from llaisys.generation import GenerationConfig
from llaisys.models import load_model
from llaisys.server import ServerOptions, create_app

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 8
MAX_IMAGE_BYTES = 200_000  # the module server's --max-image-bytes: a 400x400 random PNG is above it
QUESTION = "Describe this."


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb(width: int, height: int) -> bytes:
    """A real 8x8 PNG whose IHDR states ``width`` x ``height`` (its CRC fixed to match)."""
    data = bytearray(png(random_image(np.random.default_rng(0), 8, 8)))
    assert data[12:16] == b"IHDR"
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


IMAGE = random_image(np.random.default_rng(7), 90, 53)
IMAGE_PNG = png(IMAGE)
IMAGE_URL = data_url(IMAGE_PNG)


def openai_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                                         {"type": "text", "text": QUESTION}]}]


# ---- servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm(tiny_smolvlm):
    return load_model(str(tiny_smolvlm))


@pytest.fixture(scope="module")
def url(vlm) -> Iterator[str]:
    with running(create_app(ServerOptions(max_image_bytes=MAX_IMAGE_BYTES), model=vlm)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return client_for(url)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def expected(vlm) -> tuple[str, int]:
    """The in-process engine's greedy reply to IMAGE and QUESTION, and its prompt's length."""
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": QUESTION}]}]
    result = chat(vlm, messages, GenerationConfig(max_new_tokens=MAX_TOKENS, temperature=0.0))
    return result.text, result.prompt_tokens


class ImageHost(BaseHTTPRequestHandler):
    """/img.png: IMAGE_PNG; /moved: a redirect to it; anything else: 404."""

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        if self.path == "/img.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGE_PNG)))
            self.end_headers()
            self.wfile.write(IMAGE_PNG)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/img.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def image_host() -> Iterator[str]:
    """A local HTTP server of ImageHost on 127.0.0.1; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


# ---- the same reply through every API ----------------------------------------------------------
def test_chat_whole_and_streamed_equal_the_engine(client, model_name, expected):
    text, prompt_tokens = expected
    whole = client.chat.completions.create(model=model_name, messages=openai_messages(IMAGE_URL),
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == prompt_tokens
    chunks = client.chat.completions.create(model=model_name, messages=openai_messages(IMAGE_URL),
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_choices_share_the_image_and_tokenize_counts_it(url, client, model_name, expected):
    text, prompt_tokens = expected
    r = client.chat.completions.create(model=model_name, messages=openai_messages(IMAGE_URL), n=2,
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert [c.message.content for c in r.choices] == [text, text]
    r = post(f"{url}/tokenize", json_body={"messages": openai_messages(IMAGE_URL)})
    assert r.status_code == 200 and r.json()["count"] == prompt_tokens, r.text


def test_responses_input_image_and_anthropic_image_block(url, client, model_name, expected):
    text, prompt_tokens = expected
    r = client.responses.create(model=model_name, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": IMAGE_URL, "detail": "auto"},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == text
    assert r.usage.input_tokens == prompt_tokens

    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE_PNG).decode()}
    messages = [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}]
    message = claude.messages.create(model=model_name, max_tokens=MAX_TOKENS, messages=messages,
                                     extra_body={"temperature": 0})
    assert "".join(b.text for b in message.content if b.type == "text") == text
    assert claude.messages.count_tokens(model=model_name, messages=messages).input_tokens == prompt_tokens


def test_models_lists_vision(client):
    assert client.models.list().data[0].model_extra["capabilities"]["vision"] is True


# ---- hostile inputs --------------------------------------------------------------------------
HOSTILE = [  # (image URLs of one message, the part named, words the message holds)
    ([data_url(b"hello, I am not an image at all")], 0, "not a PNG, JPEG"),
    ([data_url(IMAGE_PNG[:len(IMAGE_PNG) // 2])], 0, "truncated or corrupt"),
    ([data_url(bomb(8000, 8000))], 0, "more than the limit of 50000000 pixels"),
    ([data_url(bomb(100_000, 100_000))], 0, "pixels"),
    ([IMAGE_URL] * 9, 8, "this server takes at most 8"),
    ([data_url(png(random_image(np.random.default_rng(1), 400, 400)))], 0,
     f"more than the limit of {MAX_IMAGE_BYTES} bytes"),
    (["http://127.0.0.1:9/cat.png"], 0, "does not fetch image URLs"),
    (["https://example.com/cat.png"], 0, "--allowed-image-hosts"),
    (["file:///etc/passwd"], 0, "not accepted"),
    (["data:image/png;base64,@@not base64@@"], 0, "not valid base64"),
    (["data:text/plain;base64,aGVsbG8="], 0, "media type"),
    ([IMAGE_URL, "ftp://example.com/cat.png"], 1, "not accepted"),
]


@pytest.mark.parametrize("urls, part, words", HOSTILE,
                         ids=["not-image", "truncated", "bomb", "bomb-side", "too-many", "oversized", "http",
                              "https", "file", "bad-base64", "not-image-type", "second-ftp"])
def test_hostile_images_are_400_and_the_server_stays_up(url, urls, part, words):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "?"}]
    r = post(f"{url}/v1/chat/completions", json_body={"messages": [{"role": "user", "content": content}],
                                                      "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"messages[0].content[{part}]" and words in error["message"], error
    assert error["message"].startswith(error["param"] + ":"), error
    assert get(f"{url}/health").status_code == 200


def test_image_errors_name_each_apis_field(url, model_name):
    bad = data_url(b"not an image")
    r = post(f"{url}/v1/responses", json_body={"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "?"}, {"type": "input_image", "image_url": bad}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[1]", r.text
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"not an image").decode()}
    r = post(f"{url}/v1/messages", json_body={"model": model_name, "max_tokens": 2, "messages": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "?"}, {"type": "image", "source": source}]}]})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error", body
    assert body["error"]["message"].startswith("messages[2].content[1]: payload is not a PNG"), body
    r = post(f"{url}/v1/messages", json_body={"model": model_name, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "text/html",
                                                                  "data": "aGk="}}]}]})
    assert r.status_code == 400 and "messages[0].content[0].source.media_type" in r.json()["error"]["message"]
    r = post(f"{url}/v1/chat/completions", json_body={"messages": [
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}}]},
        {"role": "user", "content": "?"}]})
    assert r.status_code == 400 and "image parts go in user messages" in r.json()["error"]["message"]
    r = post(f"{url}/v1/chat/completions", json_body={"messages": [
        {"role": "user", "content": "What does <image> mean in a template?"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image_placeholder", r.text
    assert get(f"{url}/health").status_code == 200


# ---- image URLs: refused unless their host is allowed ------------------------------------------
def test_allowed_host_is_fetched_and_redirects_refused(vlm, client, model_name, expected):
    text, _ = expected
    with image_host() as host:
        with pytest.raises(openai.BadRequestError) as info:  # the module's server allows no host
            client.chat.completions.create(model=model_name, messages=openai_messages(f"{host}/img.png"),
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert "does not fetch image URLs" in info.value.message
        options = ServerOptions(allowed_image_hosts=("127.0.0.1",))
        with running(create_app(options, model=vlm)) as url:
            allowed = client_for(url)
            r = allowed.chat.completions.create(model=model_name, messages=openai_messages(f"{host}/img.png"),
                                                max_tokens=MAX_TOKENS, temperature=0)
            assert r.choices[0].message.content == text
            claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
            image = {"type": "image", "source": {"type": "url", "url": f"{host}/img.png"}}
            message = claude.messages.create(model=model_name, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                             messages=[{"role": "user", "content": [image, {"type": "text",
                                                                                           "text": QUESTION}]}])
            assert "".join(b.text for b in message.content if b.type == "text") == text
            for target, words in ((f"{host}/moved", "redirects are not followed"), (f"{host}/gone.png", "HTTP 404"),
                                  (f"{host.replace('127.0.0.1', 'localhost')}/img.png", "is not one this server")):
                with pytest.raises(openai.BadRequestError) as info:
                    allowed.chat.completions.create(model=model_name, messages=openai_messages(target), max_tokens=2)
                assert words in info.value.message and info.value.param == "messages[0].content[0]"
            assert get(f"{url}/health").status_code == 200


# ---- a text model ------------------------------------------------------------------------------
def test_text_model_refuses_images(smollm2_model):
    with running(create_app(ServerOptions(), model=smollm2_model)) as url:
        client = client_for(url)
        (entry,) = client.models.list().data
        assert entry.model_extra["capabilities"]["vision"] is False
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=entry.id, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}])
        assert info.value.param == "messages[0].content[1]"
        assert "has no vision encoder" in info.value.message and "takes text only" in info.value.message
        r = post(f"{url}/v1/responses", json_body={"input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": IMAGE_URL}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]", r.text
        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE_PNG).decode()}
        r = post(f"{url}/v1/messages/count_tokens", json_body={"messages": [
            {"role": "user", "content": [{"type": "image", "source": source}]}]})
        assert r.status_code == 400 and "has no vision encoder" in r.json()["error"]["message"], r.text
        assert get(f"{url}/health").status_code == 200
