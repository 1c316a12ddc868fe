"""``llaisys serve`` with the prefix cache's tiers and the 8-bit KV cache, through the official
openai client: a restart with --prefix-cache-dir takes a cached prompt from the folder (its
metrics say so) and answers as a cold server does; concurrent conversations sharing a prefix
answer each as it does alone, with the tiers and with the KV cache in 8 bits.
"""
from __future__ import annotations

import concurrent.futures

import pytest
from test_server import client_for, get, running
from test_server_models import metric

from llaisys.server import ServerOptions, create_app

pytestmark = pytest.mark.timeout(300)

SYSTEM = ("You are a careful assistant for a small bakery. " * 40).strip()  # a long shared prefix (~400 tokens)
QUESTIONS = [f"Question {i}: how many loaves fit in {i + 2} baskets of {i + 3}?" for i in range(16)]


def chat(base: str, question: str, max_tokens: int = 8) -> str:
    """A greedy chat answer's text (no repetition penalty)."""
    client = client_for(base)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=max_tokens, temperature=0, frequency_penalty=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return reply.choices[0].message.content


def serve(model, **options):
    """A running server of ``model`` (a context manager yielding its URL)."""
    return running(create_app(ServerOptions(**options), model=model))


def test_a_restart_takes_the_prompt_from_the_cache_folder(smollm2_model, tmp_path):
    with serve(smollm2_model, kv_cache_tokens=2048) as base:
        cold = chat(base, QUESTIONS[0])
    folder = tmp_path / "prefixes"
    with serve(smollm2_model, kv_cache_tokens=2048, prefix_cache_dir=str(folder)) as base:
        assert chat(base, QUESTIONS[0]) == cold
        assert metric(base, "llaisys:prefix_cache_disk_hits_total", "SmolLM2-135M-Instruct.Q4_1") == 0
    assert any(folder.iterdir()), "nothing was written to the prefix cache's folder"
    with serve(smollm2_model, kv_cache_tokens=2048, prefix_cache_dir=str(folder)) as base:  # the restart
        assert chat(base, QUESTIONS[0]) == cold
        name = "SmolLM2-135M-Instruct.Q4_1"
        restored = metric(base, "llaisys:prefix_cache_disk_hits_total", name)
        assert restored >= 400 and metric(base, "vllm:prefix_cache_hits_total", name) >= restored
        assert get(f"{base}/health").status_code == 200


@pytest.mark.parametrize("options", [
    {"prefix_cache_host_bytes": 64 << 20},  # a pool of 1024 tokens: the prefix leaves it and comes back
    {"kv_cache_dtype": "int8"},
], ids=["host-tier", "int8"])
def test_concurrent_conversations_sharing_a_prefix_answer_as_alone(smollm2_model, options):
    with serve(smollm2_model, kv_cache_tokens=4096, **{k: v for k, v in options.items() if k == "kv_cache_dtype"}) as base:
        alone = [chat(base, q) for q in QUESTIONS]  # one at a time (the same KV dtype)
    with serve(smollm2_model, kv_cache_tokens=1024, **options) as base:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda q: chat(base, q), QUESTIONS))
        assert together == alone
        if "prefix_cache_host_bytes" in options:
            assert metric(base, "llaisys:prefix_cache_host_hits_total", "SmolLM2-135M-Instruct.Q4_1") > 0
