"""Tensor parallelism: a model split over 2 or 3 MPI ranks gives the tokens of one process and
logits within 1e-5 (scaled by the logits' size), through the single-sequence loop and the
engine; the shard reads are checked against NumPy slices of the dequantized weights; a rank
count that does not fit is refused with its numbers; a rank that dies ends the others.

Multi-rank runs start ``tests/tp_ranks.py`` under ``mpiexec`` (MPICH from PyPI, installed by
the test extra); the one-rank reference is the same script under ``mpiexec -n 1``.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from llaisys.models.config import ModelConfig
from llaisys.runtime.block_formats import block_format  # noqa: E402
from llaisys.models.tensor_parallel import (Shard, TensorParallelError, check_fits, column_range,
                                            padded_rows, row_range)
from llaisys.models.weights import WeightSource
from llaisys.parallel.launch import STOP_GRACE_S, find_mpiexec

sys.path.insert(0, str(Path(__file__).parent))
from conftest import logits_atol, random_hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RANKS_SCRIPT = Path(__file__).parent / "tp_ranks.py"
RUN_TIMEOUT = 240


def run_ranks(n: int, *args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """``mpiexec -n n python tests/tp_ranks.py args``, with this source tree first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([find_mpiexec(), "-n", str(n), sys.executable, str(RANKS_SCRIPT), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def split_and_compare(model: str, ranks: int, tmp_path: Path, *extra: str) -> None:
    outs = {}
    for n in (1, ranks):
        out = tmp_path / f"ranks{n}.npz"
        proc = run_ranks(n, model, str(out), *extra)
        assert proc.returncode == 0, f"{n} ranks failed:\n{proc.stdout}\n{proc.stderr}"
        outs[n] = np.load(out)
    one, split = outs[1], outs[ranks]
    np.testing.assert_array_equal(split["loop"], one["loop"])
    np.testing.assert_array_equal(split["engine"], one["engine"])
    scale = max(1.0, float(np.abs(one["logits"]).max()))
    # in the int16 arithmetic a rank's partial sums, rounded differently, can move an activation
    # across a rounding step of the next layer: then within that arithmetic's logits tolerance
    np.testing.assert_allclose(split["logits"], one["logits"], rtol=0, atol=logits_atol(one["logits"], 1e-5 * scale))


# ---- what each rank reads --------------------------------------------------------------------
def smollm2_like(**changes) -> ModelConfig:
    values = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    values.update(changes)
    return ModelConfig(**values)


def test_a_rank_count_that_does_not_divide_the_heads_is_refused_with_the_numbers():
    with pytest.raises(TensorParallelError, match=r"size 2 does not divide the model's 3 key/value heads.*1, 3 ranks"):
        check_fits(smollm2_like(), 2)
    with pytest.raises(TensorParallelError, match="MLP width"):
        check_fits(smollm2_like(intermediate_size=1537), 3)
    check_fits(smollm2_like(), 3)


def test_vocabulary_split_ids_and_gathered_logits():
    cfg = smollm2_like(vocab_size=10)
    shards = [Shard(r, 3, cfg) for r in range(3)]
    assert [s.vocab for s in shards] == [(0, 4), (4, 8), (8, 10)] and shards[0].vocab_rows == 4
    ids = np.array([0, 3, 4, 9, 8])
    np.testing.assert_array_equal(shards[1].local_ids(ids), [4, 4, 0, 4, 4])  # 4: the zero row
    np.testing.assert_array_equal(shards[2].local_ids(ids), [4, 4, 4, 1, 0])
    logits = np.random.default_rng(0).standard_normal((2, 10)).astype(np.float32)
    padded = np.concatenate([logits, np.zeros((2, 2), np.float32)], axis=1)
    parts = np.stack([padded[:, 4 * r:4 * r + 4] for r in range(3)])  # (N, R, c) as all_gather gives them
    np.testing.assert_array_equal(shards[0].gather_logits(parts), logits)
    local = shards[2].local_config()
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.vocab_size,
            local.head_dim) == (3, 1, 512, 4, 64)


def float_source(w: np.ndarray) -> WeightSource:
    return WeightSource("f.gguf", "w", w.shape, "F32", read=lambda: w, read_rows=lambda a, b: w[a:b])


def quant_source(w: np.ndarray, kind: str) -> tuple[WeightSource, np.ndarray]:
    """A block-quantized source of ``w`` (random codes with small scales for Q4_K, which gguf
    cannot quantize) and the values it stands for (gguf's own dequantization)."""
    if kind == "Q4_K":
        block, nbytes = block_format(kind).block_size, block_format(kind).block_bytes
        rng = np.random.default_rng(7)
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block * nbytes), dtype=np.uint8)
        blocks = raw.reshape(-1, nbytes)
        blocks[:, 0:4] = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)  # d, dmin
    else:
        raw = quantize(w, Q[kind])  # (rows, row_bytes)
    values = dequantize(raw, Q[kind]).reshape(w.shape)
    src = WeightSource("q.gguf", "w", w.shape, kind, read=lambda: values,
                       read_rows=lambda a, b: dequantize(raw[a:b], Q[kind]).reshape(b - a, -1),
                       read_raw_rows=lambda a, b: raw[a:b])
    return src, values


def test_row_and_column_ranges_read_the_slices():
    w = np.random.default_rng(1).standard_normal((12, 512)).astype(np.float32)
    np.testing.assert_array_equal(row_range(float_source(w), 4, 8).read(), w[4:8])
    np.testing.assert_array_equal(column_range(float_source(w), 64, 192).read_rows(2, 5), w[2:5, 64:192])
    src, values = quant_source(w, "Q4_1")
    part = column_range(src, 64, 192)  # on block edges: raw blocks of the columns
    raw = part.read_raw_rows(0, 12)
    assert raw.shape == (12, 4 * block_format("Q4_1").block_bytes)
    np.testing.assert_array_equal(dequantize(raw, Q.Q4_1).reshape(12, 128), values[:, 64:192])
    np.testing.assert_array_equal(row_range(src, 3, 9).read_raw_rows(1, 4), src.read_raw_rows(4, 7))


def test_column_range_off_the_block_edges_falls_back_to_floats():
    w = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    src, values = quant_source(w, "Q4_K")  # 256-element blocks; 192 columns a rank do not fall on them
    part = column_range(src, 192, 384)
    assert part.read_raw_rows is None and part.shape == (4, 192)
    np.testing.assert_allclose(part.read_rows(0, 4), values[:, 192:384], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_padded_rows_end_in_zero_rows(kind):
    w = np.random.default_rng(3).standard_normal((10, 64)).astype(np.float32)
    src, values = (float_source(w), w) if kind == "F32" else quant_source(w, kind)
    part = padded_rows(src, 8, 10, 5)  # the last rank of 3 over 10 rows: 2 real rows, 2 pad rows, the zero row
    want = np.concatenate([values[8:10], np.zeros((3, 64), np.float32)])
    np.testing.assert_array_equal(part.read_rows(0, 5), want)
    if kind != "F32":
        np.testing.assert_array_equal(dequantize(part.read_raw_rows(0, 5), Q[kind]).reshape(5, 64), want)


# ---- split models equal one process ----------------------------------------------------------
@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    """Random-weight Qwen2 (tied embeddings, q/k/v biases) and Llama (untied) with 4 KV heads."""
    root = tmp_path_factory.mktemp("tp_models")
    shape = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=128, intermediate_size=192,
                 vocab_size=301)  # 301: the vocabulary splits unevenly
    random_hf_model("qwen2", 3, tie_word_embeddings=True, **shape).save_pretrained(root / "qwen2")
    random_hf_model("llama", 4, tie_word_embeddings=False, attention_bias=True, **shape).save_pretrained(root / "llama")
    gemma3(shape).save_pretrained(root / "gemma3")
    return root


def gemma3(shape: dict):
    """A random-weight Gemma 3 text model: sliding layers (a window of 4 keys) among global
    ones, per-head q/k norms, post-norms, GeGLU, scaled embeddings."""
    import torch
    import transformers

    torch.manual_seed(5)
    config = transformers.Gemma3TextConfig(
        **shape, head_dim=16, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_two_ranks_equal_one(random_models, arch, tmp_path):
    split_and_compare(str(random_models / arch), 2, tmp_path)


def test_bundled_smollm2_over_three_ranks_equals_one(smollm2_path, tmp_path):
    split_and_compare(str(smollm2_path), 3, tmp_path)


def test_two_ranks_on_a_plugin_device_with_its_collectives_equal_one(random_models, tmp_path):
    from llaisys.plugins.build import build_reference_plugin

    library = str(build_reference_plugin())
    split_and_compare(str(random_models / "llama"), 2, tmp_path, "--device", "custom_cpu:0", "--plugin", library)


def test_a_rank_that_dies_ends_the_others(random_models, tmp_path):
    start = time.perf_counter()
    proc = run_ranks(2, str(random_models / "qwen2"), str(tmp_path / "out.npz"), "--die-after", "3", timeout=60)
    assert proc.returncode != 0
    assert time.perf_counter() - start < 60
    assert not (tmp_path / "out.npz").exists()


# ---- the command line ------------------------------------------------------------------------
def llaisys(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "llaisys", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_cli_starts_its_own_ranks_and_prints_the_same_text(smollm2_path):
    args = ("generate", "--model", str(smollm2_path), "--greedy", "--max-new-tokens", "12", "The capital of France is")
    one, three = llaisys(*args), llaisys(*args, "--tensor-parallel", "3")
    assert one.returncode == 0 and three.returncode == 0, three.stderr
    assert three.stdout == one.stdout and one.stdout.strip()


def test_cli_refuses_a_rank_count_the_model_cannot_split_over(smollm2_path):
    proc = llaisys("generate", "--model", str(smollm2_path), "--tensor-parallel", "2", "hi")
    assert proc.returncode == 1
    assert proc.stderr.count("does not divide the model's 3 key/value heads") == 1, proc.stderr


# ---- serving -----------------------------------------------------------------------------------
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_pids(marker: str) -> dict[int, int]:
    """{MPI rank: pid} of the processes whose command line holds ``marker``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"PMI_RANK=")]
        if marker in cmdline and rank and "mpiexec" not in cmdline:
            found[int(rank[0])] = int(entry.name)
    return found


def test_serve_over_three_ranks_answers_and_ends_when_a_rank_dies(smollm2_path):
    import signal
    import urllib.request

    import openai

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, "-m", "llaisys", "serve", "--model", str(smollm2_path), "--port",
                               str(port), "--tensor-parallel", "3"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answers = [client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                             max_tokens=8, temperature=0).choices[0].text for _ in range(2)]
        assert answers[0] == answers[1] and answers[0].strip()
        pids = rank_pids(f"--port {port}")
        assert sorted(pids) == [0, 1, 2], pids
        os.kill(pids[2], signal.SIGKILL)
        output, _ = server.communicate(timeout=60)  # ends rather than hangs
        assert server.returncode != 0
        assert "tensor-parallel rank ended abnormally" in output, output
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


def descendants(pid: int) -> set[int]:
    """The processes under ``pid`` (children, theirs, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"


@pytest.mark.parametrize("sig,status", [("SIGTERM", 0), ("SIGINT", 130)])
def test_a_stop_signal_to_the_launcher_stops_mpiexec_and_every_rank(random_models, tmp_path, sig, status):
    import signal
    import socket
    import urllib.request

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("LLAISYS_API_KEY", None)
    log, started = tmp_path / "serve.log", set()
    with open(log, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "llaisys", "serve", "--model", str(random_models / "qwen2"),
                                     "--port", str(port), "--tensor-parallel", "2"], stdout=out, stderr=out, env=env)
    try:
        deadline, healthy = time.time() + 120, False
        while time.time() < deadline and launcher.poll() is None and not healthy:
            try:
                healthy = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                time.sleep(0.5)
        assert healthy, log.read_text()
        ranks = rank_pids(f"--port {port}")
        started = descendants(launcher.pid)  # mpiexec, its proxy, the ranks
        assert sorted(ranks) == [0, 1] and set(ranks.values()) <= started, (ranks, started)
        launcher.send_signal(getattr(signal, sig))
        try:  # the launcher kills what is left STOP_GRACE_S after the signal
            code = launcher.wait(timeout=STOP_GRACE_S + 15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not end {STOP_GRACE_S + 15:g} s after {sig}:\n{log.read_text()}")
        assert code == status, log.read_text()
        end = time.time() + 15
        while time.time() < end and any(alive(p) for p in started):
            time.sleep(0.2)
        assert not [p for p in started if alive(p)], log.read_text()
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in (p for p in started if alive(p)):  # what the launcher failed to stop
            os.kill(pid, signal.SIGKILL)
