"""Embeddings: the engine's pooled final hidden states against transformers' on a random-weight
model (chunked prefill, several requests batched), and /v1/embeddings through the official
openai client against a live server on the bundled SmolLM2."""
from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from conftest import random_hf_model
from llaisys.engine import LLMEngine
from llaisys.engine.pooling import PoolingConfig
from llaisys.models import load_model
from llaisys.server import ServerOptions, create_app
from test_server import client_for, post, running

pytestmark = pytest.mark.timeout(180)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEXTS = ["Hello world", "The capital of France is Paris.", "x"]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_engine_embeddings_match_transformers(tmp_path, pooling):
    hf = random_hf_model("qwen2", 5, vocab_size=300, num_hidden_layers=2, max_position_embeddings=128)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 300, n)] for n in (3, 21, 45)]
    engine = LLMEngine(model, prefix_caching=False, max_batched_tokens=16)  # long prompts run in chunks
    ids = [engine.add_request(None, p, PoolingConfig(max_new_tokens=1, pooling=pooling)) for p in prompts]
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "stop" and out.completion_tokens == 0
                got[out.request_id] = out.embedding
    for rid, p in zip(ids, prompts):
        with torch.no_grad():
            h = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0].double().numpy()  # (S, D)
        want = h[-1] if pooling == "last" else h.mean(axis=0)
        want /= np.linalg.norm(want)
        np.testing.assert_allclose(got[rid], want, atol=2e-5)


def test_mean_pooling_wants_no_prefix_cache(tmp_path):
    hf = random_hf_model("qwen2", 5, vocab_size=300, num_hidden_layers=1, max_position_embeddings=64)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="prefix caching"):
        LLMEngine(load_model(tmp_path)).add_request(None, [1, 2, 3], PoolingConfig(pooling="mean"))


@pytest.fixture(scope="module")
def url(smollm2_model):
    with running(create_app(ServerOptions(), model=smollm2_model)) as base:
        yield base


def test_embeddings_api(url):
    client = client_for(url)
    batched = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in batched.data])  # (3, D)
    assert vectors.shape == (3, 576) and [d.index for d in batched.data] == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    np.testing.assert_array_equal(np.array([d.embedding for d in floats.data]), vectors)
    alone = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(alone.data[0].embedding, vectors[1], atol=1e-6)
    tokens = post(f"{url}/tokenize", json_body={"prompt": TEXTS[1]}).json()["count"]
    assert alone.usage.prompt_tokens == alone.usage.total_tokens == tokens
    mean = post(f"{url}/v1/embeddings", json_body={"input": [[1, 2, 3], [4, 5]], "pooling": "mean"}).json()
    assert mean["usage"]["prompt_tokens"] == 5 and len(mean["data"][1]["embedding"]) == 576
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="hi", dimensions=64)
    assert info.value.param == "dimensions"
    assert client.embeddings.create(model=MODEL, input="hi", dimensions=576).data
