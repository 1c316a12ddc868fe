"""Gemma 3 and Qwen2.5-VL with images through ``llaisys serve`` and the official ``openai``
client: a greedy reply to an image, whole and streamed, equals the in-process engine's for the
same picture (tests/test_vision_gemma3.py and tests/test_vision_qwen_model.py hold the engine
to transformers); ``/v1/models`` says the model takes images."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from test_server import get, running

from conftest import random_image
from llaisys.engine import chat
from llaisys.generation import GenerationConfig
from llaisys.models import load_model
from llaisys.server import ServerOptions, create_app

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["tiny_gemma3_vlm", "tiny_qwen25_vl"])
def served(request):
    model = load_model(str(request.getfixturevalue(request.param)))
    with running(create_app(ServerOptions(), model=model)) as base:
        yield model, base


def test_image_chat_whole_and_streamed_equal_the_engine(served):
    model, base = served
    image = random_image(np.random.default_rng(3), 75, 50)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    want = chat(model, [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "What is it?"}]}],
                GenerationConfig(max_new_tokens=MAX_TOKENS, temperature=0.0))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
    # greedy, no penalty: the server's own defaults (a small frequency penalty) would change the text
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           frequency_penalty=0)
    assert whole.choices[0].message.content == want.text
    assert whole.usage.prompt_tokens == want.prompt_tokens
    pieces = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            frequency_penalty=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == want.text
    listed = get(f"{base}/v1/models").json()["data"][0]
    assert listed["capabilities"]["vision"] is True
