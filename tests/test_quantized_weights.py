"""Weights kept in GGUF block formats: tensors, linear and embedding on them, and models loaded
with them.

References: PyTorch in float64 on gguf's own dequantization of the same bytes. Tolerance of a
float32 linear output: |y - ref| <= 1e-5 * sum_k |x_k * w_k| + 1e-6 (float32 sums in another
order stay well inside it; a decoding slip is off by far more). Models: transformers loading the
same GGUF file (it dequantizes to f32), and the CPU for a plugin device (the CPU fallback runs
the same kernels, so results are identical).
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf

from conftest import TOLERANCE, hf_to_gguf_tensors, logits_atol, random_hf_model, write_gguf

from llaisys import DataType, Tensor, ops
from llaisys.models import load_model
from llaisys.plugins import load_plugin, unload_plugin
from llaisys.plugins.build import build_reference_plugin

F = ops.functional
Q = gguf.GGMLQuantizationType
QUANTIZED = [t for t in DataType if t.is_quantized]
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}


def quant_bytes(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row_bytes) uint8 of format ``name``: gguf's quantization of normal samples, or for the
    K-quants (which gguf cannot quantize) random codes with small f16 scales."""
    dt = DataType[name]
    if name not in K_QUANTS:
        w = rng.standard_normal((n, k)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, Q[name])).reshape(n, -1)
    raw = rng.integers(0, 256, (n, dt.nbytes_of(k)), dtype=np.uint8)
    blocks = raw.reshape(-1, dt.block_bytes)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]:  # d (and dmin)
        blocks[:, at:at + 2] = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw


def dequantized(name: str, raw: np.ndarray) -> np.ndarray:
    """gguf's dequantization of raw rows -> float64 (N, K)."""
    return np.asarray(gguf.quants.dequantize(raw, Q[name]), np.float64).reshape(raw.shape[0], -1)


def k_for(name: str) -> int:
    return 512 if name in K_QUANTS else 160


def activation_rounding(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(M, N): how far the int16 arithmetic's rounding of x can move x @ w^T: each 32-element
    block of a row of x is held as integers times amax / 32639, so each element within half
    that step, times |w| summed over the block."""
    m, k = x.shape
    step = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32).max(axis=2) / 32639  # (M, K/32)
    return (step / 2) @ np.abs(w).reshape(w.shape[0], k // 32, 32).sum(axis=2).T


def assert_linear_close(got: np.ndarray, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None,
                        block_format: bool = True) -> None:
    """got (M, N) against x (M, K) @ w (N, K)^T + bias in float64, per-output tolerance; for a
    block-format weight under the int16 arithmetic (the default where the CPU has the units)
    widened by the activations' rounding."""
    from llaisys.kernels.quant import native

    xt, wt = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(w)
    want = torch.nn.functional.linear(xt, wt, None if bias is None else torch.from_numpy(bias.astype(np.float64)))
    bound = 1e-5 * (xt.abs() @ wt.abs().T) + 1e-6  # (M, N)
    if block_format and native.available() and native.quant_math() == "int16" and x.shape[1] % 32 == 0:
        bound = bound + torch.from_numpy(1.0001 * activation_rounding(x, w))
    err = (torch.from_numpy(got.astype(np.float64)) - want).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


# ---- tensors ------------------------------------------------------------------------------
def test_quantized_tensor_holds_raw_rows():
    rng = np.random.default_rng(0)
    raw = quant_bytes("Q4_1", 6, 64, rng)  # (6, 40)
    t = Tensor.from_raw(raw, "q4_1")
    assert (t.dtype, t.shape, t.nbytes, t.raw_shape) == (DataType.Q4_1, (6, 64), 240, (6, 40))
    assert t.host_array().dtype == np.uint8 and t.host_array().shape == (6, 40)
    np.testing.assert_array_equal(t.raw_numpy(), raw)
    np.testing.assert_array_equal(t.numpy(), dequantized("Q4_1", raw).astype(np.float32))  # numpy() dequantizes
    rows = t.slice(0, 2, 5)
    assert rows.shape == (3, 64) and rows.is_contiguous()
    np.testing.assert_array_equal(rows.raw_numpy(), raw[2:5])
    np.testing.assert_array_equal(rows.clone().raw_numpy(), raw[2:5])
    assert t.view(6, 64).shape == (6, 64)


@pytest.mark.parametrize("action,error,message", [
    (lambda t: t.slice(1, 0, 32), ValueError, "sliced by rows \\(dim 0\\) only"),
    (lambda t: t.permute(1, 0), ValueError, "cannot be permuted"),
    (lambda t: t.view(12, 32), ValueError, "keeps its shape"),
    (lambda t: Tensor.empty((4, 48), "q4_0"), ValueError, "K a positive multiple of 32"),
    (lambda t: Tensor.empty((4, 2, 32), "q8_0"), ValueError, "must be 2-D"),
    (lambda t: Tensor.from_numpy(np.zeros((2, 32), np.float32), dtype="q4_0"), TypeError, "Tensor.from_raw"),
    (lambda t: Tensor.from_raw(np.zeros((2, 30), np.uint8), "q4_1"), ValueError, "not whole Q4_1 blocks of 20"),
    (lambda t: t.load(np.zeros((6, 64), np.float32)), ValueError, "takes its raw blocks, uint8 \\(6, 40\\)"),
], ids=["column slice", "permute", "view", "partial block", "3-D", "from_numpy", "from_raw", "load floats"])
def test_quantized_tensor_refuses_what_would_split_blocks(action, error, message):
    t = Tensor.from_raw(np.zeros((6, 40), np.uint8), "q4_1")
    with pytest.raises(error, match=message):
        action(t)


def test_plugin_abi_refuses_quantized_types():
    from llaisys.backends.plugin.abi import to_c_dtype

    with pytest.raises(TypeError, match="Q4_K is a block-quantized format.*CPU"):
        to_c_dtype(DataType.Q4_K)


# ---- ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 5, 130], ids=lambda m: f"M{m}")  # 130: the dequantize + BLAS path
@pytest.mark.parametrize("name", [t.name for t in QUANTIZED])
def test_linear_on_quantized_weight_matches_torch(name, m):
    rng = np.random.default_rng(len(name) + m)
    k, n = k_for(name), 37
    raw = quant_bytes(name, n, k, rng)
    w = Tensor.from_raw(raw, name).freeze()
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = Tensor.empty((m, n))
    ops.linear(out, Tensor.from_numpy(x), w, Tensor.from_numpy(bias))
    assert_linear_close(out.numpy(), x, dequantized(name, raw), bias)
    y = F.linear(Tensor.from_numpy(x[None]), w)  # (1, M, N), no bias
    assert_linear_close(y.numpy()[0], x, dequantized(name, raw), None)


def test_linear_keeps_the_prepared_weight_with_the_tensor():
    rng = np.random.default_rng(1)
    w = Tensor.from_raw(quant_bytes("Q8_0", 8, 64, rng), "q8_0").freeze()
    x = Tensor.from_numpy(rng.standard_normal((1, 64)).astype(np.float32))
    F.linear(x, w)
    prepared = w.derived("quant", lambda t: pytest.fail("prepared again"))
    F.linear(x, w)
    assert w.derived("quant", lambda t: pytest.fail("prepared again")) is prepared


@pytest.mark.parametrize("m", [1, 3], ids=lambda m: f"M{m}")
def test_repeated_linear_reads_the_inputs_of_each_call(m):
    """A linear repeated on the same tensors runs a native call bound to them the first time
    (as a replayed decoding step does): each call must still see the current input and bias."""
    rng = np.random.default_rng(8)
    raw = quant_bytes("Q4_1", 24, 96, rng)
    w = Tensor.from_raw(raw, "q4_1").freeze()
    x_t, b_t = Tensor.empty((m, 96)), Tensor.empty((24,))
    out, plan = Tensor.empty((m, 24)), ops.Plan()
    ops.linear(out, x_t, w, b_t, plan=plan)
    for step in range(3):
        x = rng.standard_normal((m, 96)).astype(np.float32)
        bias = rng.standard_normal(24).astype(np.float32)
        x_t.load(x)
        b_t.load(bias)
        plan.run()
        assert_linear_close(out.numpy(), x, dequantized("Q4_1", raw), bias)
        ops.linear(out, x_t, w, b_t)  # the same call outside the plan
        assert_linear_close(out.numpy(), x, dequantized("Q4_1", raw), bias)
    rows = Tensor.from_numpy(rng.standard_normal((2 * m, 96)).astype(np.float32))
    strided = rows.slice(0, 0, 2 * m).view(m, 192).slice(1, 0, 96)  # every other row: not one contiguous run
    ops.linear(out, strided, w, b_t)
    assert_linear_close(out.numpy(), rows.numpy()[::2], dequantized("Q4_1", raw), b_t.numpy())


@pytest.mark.parametrize("act", [DataType.F16, DataType.BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_linear_on_quantized_weight_with_low_precision_activations(name, act):
    rng = np.random.default_rng(7)
    k, n = k_for(name), 19
    raw = quant_bytes(name, n, k, rng)
    x = Tensor.from_numpy(rng.standard_normal((3, k)), dtype=act)
    bias = Tensor.from_numpy(rng.standard_normal(n), dtype=act)
    y = F.linear(x, Tensor.from_raw(raw, name), bias)
    assert y.dtype is act
    want = x.numpy().astype(np.float64) @ dequantized(name, raw).T + bias.numpy().astype(np.float64)
    atol, rtol = TOLERANCE[act]
    np.testing.assert_allclose(y.numpy().astype(np.float64), want, atol=atol * np.abs(want).max(), rtol=rtol)


@pytest.mark.parametrize("wdt", [DataType.F16, DataType.BF16], ids=["f16", "bf16"])
def test_linear_mixed_f32_activations_with_half_weights(wdt):
    rng = np.random.default_rng(3)
    w = Tensor.from_numpy(rng.standard_normal((21, 50)), dtype=wdt)
    x = rng.standard_normal((4, 50)).astype(np.float32)
    for weight in (w, w.slice(0, 3, 21), Tensor.from_numpy(rng.standard_normal((50, 21)), dtype=wdt).permute(1, 0)):
        got = F.linear(Tensor.from_numpy(x), weight)
        assert got.dtype is DataType.F32
        assert_linear_close(got.numpy(), x, weight.numpy().astype(np.float64), None, block_format=False)


def test_linear_aliasing_output_and_input_on_quantized_weight():
    rng = np.random.default_rng(4)
    raw = quant_bytes("Q4_0", 32, 32, rng)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    t = Tensor.from_numpy(x)
    ops.linear(t, t, Tensor.from_raw(raw, "q4_0"))
    assert_linear_close(t.numpy(), x, dequantized("Q4_0", raw), None)


@pytest.mark.parametrize("name", [t.name for t in QUANTIZED])
def test_embedding_on_quantized_table_dequantizes_rows(name):
    rng = np.random.default_rng(5)
    raw = quant_bytes(name, 40, k_for(name), rng)
    table = Tensor.from_raw(raw, name).freeze()
    ids = np.array([3, 0, 39, 3], np.int64)
    got = F.embedding(Tensor.from_numpy(ids), table)
    assert got.dtype is DataType.F32
    np.testing.assert_array_equal(got.numpy(), dequantized(name, raw)[ids].astype(np.float32))
    out = Tensor.empty((4, k_for(name)), "bf16")
    ops.embedding(out, Tensor.from_numpy(ids), table)
    np.testing.assert_array_equal(out.numpy(), dequantized(name, raw)[ids].astype(np.float32).astype(out.dtype.numpy))
    with pytest.raises(ValueError, match="embedding: index 40 is out of range for a table of 40 rows"):
        F.embedding(Tensor.from_numpy(np.array([1, 40])), table)


@pytest.mark.parametrize("call,error,message", [
    (lambda w, x: F.linear(Tensor.empty((2, 32), "bf16"), Tensor.empty((4, 32), "f16")), TypeError,
     "linear: out has data type BF16 but weight has F16; expected the weight in BF16, in a block-quantized type"),
    (lambda w, x: F.linear(Tensor.empty((2, 64)), w), ValueError, "expects K=32"),
    (lambda w, x: ops.embedding(Tensor.empty((1, 32), "i64"), Tensor.empty((1,), "i64"), w), TypeError,
     "embedding: out has data type I64"),
], ids=["f16 weight, bf16 activations", "K", "integer embedding output"])
def test_ops_refuse_bad_weight_types(call, error, message):
    w = Tensor.from_raw(np.zeros((4, 18), np.uint8), "q4_0")
    with pytest.raises(error, match=message):
        call(w, None)


# ---- models -------------------------------------------------------------------------------
def test_smollm2_keeps_its_matrices_quantized(smollm2_model):
    p = smollm2_model.params
    assert p.embed.dtype is DataType.Q8_0 and p.lm_head is p.embed
    for lp in p.layers:
        assert (lp.qkv.dtype, lp.o.dtype, lp.gate_up.dtype, lp.down.dtype) == (DataType.Q4_1,) * 4
        assert lp.attn_norm.dtype is lp.ffn_norm.dtype is DataType.F32
    info = smollm2_model.info()
    assert info["weights"]["qkv"] == "Q4_1" and info["weights"]["lm_head"] == "embed (tied)"
    f32_bytes = 4 * info["parameters"]  # ~538 MB
    assert info["weight_bytes"] < f32_bytes / 5


def _mapped_file(t) -> bool:
    """Whether tensor ``t``'s memory is a view of a memory-mapped file rather than its own."""
    base = t.storage.host_memory()
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


def test_smollm2_matrices_kept_as_stored_are_views_of_the_file(smollm2_model, smollm2_path):
    """Matrices the file holds as the kernels take them are frozen views of its memory map (the
    fused gate/up too: the file stores them back to back); q/k, whose rows are reordered, are copied."""
    from llaisys.models.loaders.gguf import open_gguf

    p = smollm2_model.params
    stored = {t.name: t.data.view(np.uint8).reshape(-1) for t in open_gguf(str(smollm2_path)).tensors}
    for i, lp in enumerate(p.layers):
        blk = f"blk.{i}."
        for t, names in ((lp.o, ["attn_output"]), (lp.gate_up, ["ffn_gate", "ffn_up"]), (lp.down, ["ffn_down"])):
            assert _mapped_file(t) and t.frozen and not t.host_array().flags.writeable
            want = np.concatenate([stored[blk + n + ".weight"] for n in names])
            assert np.array_equal(t.host_array().reshape(-1), want)
        assert not _mapped_file(lp.qkv)
    assert _mapped_file(p.embed) and np.array_equal(p.embed.host_array().reshape(-1), stored["token_embd.weight"])


def _hf_logits(path, ids) -> np.ndarray:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()  # (S, V)


def _write_mixed_formats(path, arch: str, tie: bool, layout: dict) -> None:
    src = random_hf_model(arch, seed=11, hidden_size=256, intermediate_size=512, vocab_size=256,
                          num_hidden_layers=2, tie_word_embeddings=tie,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    skip = {"lm_head.weight"} if tie else set()
    tensors = hf_to_gguf_tensors({k: v.detach().float().numpy() for k, v in src.state_dict().items() if k not in skip},
                                 src.config, arch)
    rng = np.random.default_rng(12)
    for name, qtype in layout.items():
        if qtype.name in K_QUANTS:  # gguf cannot quantize these: random codes, scales below 1
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows, cols = tensors[name].shape
            tensors[name] = rng.integers(0, 0x3C, size=(rows, cols // block * size), dtype=np.uint8)
    write_gguf(path, arch, tensors, config=src.config, types=layout)


LLAMA_LAYOUT = {  # layer 0 fuses matching formats, layer 1 mixes them in q/k/v
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q4_K,
    "blk.0.attn_output.weight": Q.Q5_K, "blk.0.ffn_gate.weight": Q.Q6_K, "blk.0.ffn_up.weight": Q.Q6_K,
    "blk.0.ffn_down.weight": Q.Q8_0,
    "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q4_1, "blk.1.attn_v.weight": Q.Q4_0,
    "blk.1.attn_output.weight": Q.Q5_0, "blk.1.ffn_gate.weight": Q.Q5_1, "blk.1.ffn_up.weight": Q.Q5_1,
    "blk.1.ffn_down.weight": Q.Q4_1, "token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_0,
}


@pytest.fixture(scope="module")
def mixed_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized") / "llama.gguf"
    _write_mixed_formats(path, "llama", False, LLAMA_LAYOUT)
    return path


def test_small_gguf_with_several_block_formats_matches_transformers(mixed_llama):
    model = load_model(mixed_llama)
    p = model.params
    l0, l1 = p.layers
    assert (l0.qkv.dtype, l0.o.dtype, l0.gate_up.dtype, l0.down.dtype) == (
        DataType.Q4_K, DataType.Q5_K, DataType.Q6_K, DataType.Q8_0)
    assert (l1.qkv, l1.o.dtype, l1.gate_up.dtype, l1.down.dtype) == (None, DataType.Q5_0, DataType.Q5_1, DataType.Q4_1)
    # q/k/v in three runs of formats: each run kept as stored, a product into its columns
    c = model.config
    dq, dkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    assert [(t.dtype, t.shape[0]) for t in l1.qkv_parts] == [(DataType.Q4_0, dq), (DataType.Q4_1, dkv),
                                                             (DataType.Q4_0, dkv)]
    assert (p.embed.dtype, p.lm_head.dtype) == (DataType.Q8_0, DataType.Q4_0)
    ids = np.random.default_rng(13).integers(0, 256, 12).tolist()
    want = _hf_logits(mixed_llama, ids)
    got = model.forward(ids, model.new_cache(16), all_logits=True)
    np.testing.assert_allclose(got, want, atol=logits_atol(want, 1e-5 * np.abs(want).max() + 1e-4), rtol=0)


def test_tied_quantized_embedding_serves_as_the_head(tmp_path):
    path = tmp_path / "qwen2.gguf"
    layout = {name: Q.Q8_0 for name in ("token_embd.weight",)}
    layout.update({f"blk.{i}.{n}.weight": Q.Q4_1 for i in range(2)
                   for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")})
    _write_mixed_formats(path, "qwen2", True, layout)
    model = load_model(path)
    assert model.params.lm_head is model.params.embed and model.params.embed.dtype is DataType.Q8_0
    assert model.params.layers[0].qkv_bias.dtype is DataType.F32
    ids = [5, 17, 250, 3, 99, 42]
    want = _hf_logits(path, ids)
    got = model.forward(ids, model.new_cache(8), all_logits=True)
    np.testing.assert_allclose(got, want, atol=logits_atol(want, 1e-5 * np.abs(want).max() + 1e-4), rtol=0)


def test_bf16_model_keeps_quantized_matrices(mixed_llama):
    model = load_model(mixed_llama, dtype="bf16")
    l0, l1 = model.params.layers
    assert model.dtype is DataType.BF16 and l0.qkv.dtype is DataType.Q4_K
    assert l1.qkv is None and {t.dtype for t in l1.qkv_parts} == {DataType.Q4_0, DataType.Q4_1}
    assert l0.attn_norm.dtype is DataType.BF16  # what is converted follows dtype
    logits = model.forward([1, 2, 3], model.new_cache(4))
    assert np.isfinite(logits).all()


@pytest.fixture(scope="module")
def bare_device(tmp_path_factory):
    from conftest import plugin_libraries

    source = Path(__file__).parent / "plugins" / "contract_devices.c"
    for libs in plugin_libraries(tmp_path_factory.mktemp("quant_plugin"), {"quant_bare": (source, ['DEVICE_TYPE="quant_bare"'])}):
        load_plugin(libs["quant_bare"])
        yield "quant_bare:0"


def test_quantized_tensor_moves_to_a_plugin_device_as_bytes(bare_device):
    raw = quant_bytes("Q5_1", 8, 64, np.random.default_rng(9))
    on_device = Tensor.from_raw(raw, "q5_1").to(bare_device)
    assert str(on_device.device) == bare_device and on_device.dtype is DataType.Q5_1
    np.testing.assert_array_equal(on_device.raw_numpy(), raw)
    np.testing.assert_array_equal(on_device.slice(0, 3, 8).clone().to("cpu").raw_numpy(), raw[3:8])
    np.testing.assert_array_equal(on_device.numpy(), dequantized("Q5_1", raw).astype(np.float32))
    frozen = on_device.freeze().slice(0, 2, 4).host_span()  # the fallback's view of a frozen weight
    np.testing.assert_array_equal(frozen.host_array(), raw[2:4])


def test_quantized_model_on_a_plugin_device_matches_the_cpu(mixed_llama, bare_device):
    runs = []
    for device in (bare_device, "cpu:0"):
        model = load_model(mixed_llama, device=device)
        assert model.params.layers[0].qkv.dtype is DataType.Q4_K and str(model.params.embed.device) == device
        cache = model.new_cache(12)
        logits = model.forward([3, 17, 42, 5], cache, all_logits=True)
        tokens = [int(np.argmax(logits[-1]))]
        while len(tokens) < 6:
            tokens.append(int(np.argmax(model.forward([tokens[-1]], cache))))
        runs.append((logits, tokens))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


@pytest.fixture(scope="module")
def reference_device():
    plugin = load_plugin(build_reference_plugin())
    yield "custom_cpu:0"
    unload_plugin(plugin.name)


def test_plugin_kernels_take_the_float_weights_and_the_cpu_the_quantized(mixed_llama, reference_device):
    """The reference plugin has F32 linear and embedding kernels: they serve layer 1's F32 q/k/v;
    every quantized weight goes to the CPU kernels through the fallback."""
    from llaisys.kernels import find_kernel

    assert find_kernel("linear", "custom_cpu", DataType.F32) is not None
    assert find_kernel("linear", "custom_cpu", DataType.F32, weight_dtype=DataType.Q4_K) is None
    ids = [3, 17, 42, 5]
    got = load_model(mixed_llama, device=reference_device)
    want = load_model(mixed_llama)
    np.testing.assert_allclose(got.forward(ids, got.new_cache(4), all_logits=True),
                               want.forward(ids, want.new_cache(4), all_logits=True), atol=1e-4, rtol=0)


# ---- without the native library ------------------------------------------------------------
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K", "BF16"])
def test_portable_path_without_the_native_library_matches_torch(name, monkeypatch, caplog):
    """A build without a C compiler decodes with the NumPy reference: same numbers, a warning."""
    from llaisys.kernels.quant import native

    monkeypatch.setattr(native, "available", lambda: False)
    rng = np.random.default_rng(11)
    k, n = k_for(name), 37
    if name == "BF16":
        w_np = rng.standard_normal((n, k)).astype(DataType.BF16.numpy)
        w, ref = Tensor.from_numpy(w_np).freeze(), w_np.astype(np.float64)
    else:
        raw = quant_bytes(name, n, k, rng)
        w, ref = Tensor.from_raw(raw, name).freeze(), dequantized(name, raw)
    x = rng.standard_normal((3, k)).astype(np.float32)
    with caplog.at_level("WARNING", logger="llaisys.kernels.cpu.quantized"):
        y = F.linear(Tensor.from_numpy(x), w)
    assert_linear_close(y.numpy(), x, ref, None, block_format=False)  # the NumPy path: float32
    if name != "BF16":
        ids = np.array([2, 0, 36], np.int64)
        np.testing.assert_array_equal(F.embedding(Tensor.from_numpy(ids), w).numpy(), ref[ids].astype(np.float32))


@pytest.mark.parametrize("name", [t.name for t in QUANTIZED])
def test_embedding_of_a_quantized_table_replays_as_one_native_call(name):
    """A recorded embedding of a block-quantized table (a pass's first op) runs as one C call,
    reads its index at every run, gives gguf's dequantized rows (the float32 they round to),
    the same bits as the direct call, and an index out of range raises the direct error."""
    from llaisys.kernels.cpu import native_calls
    from llaisys.ops.plan import ReplayStats

    if not native_calls.available():
        pytest.fail("the native libraries are not built; the test suite runs against a built package")
    rng = np.random.default_rng(11)
    raw = quant_bytes(name, 7, 256, rng)  # (7, row_bytes)
    table = Tensor.from_raw(raw, name)
    rows = Tensor.from_numpy(np.array([3, 0, 6, 3], np.int64))
    out = Tensor.zeros((4, 256), dtype=DataType.F32)
    plan = ops.Plan()
    ops.embedding(out, rows, table, plan=plan)
    assert plan.stats() == ReplayStats(calls=1, native=1, stretches=1, python=0)
    want_all = dequantized(name, raw).astype(np.float32)  # (7, 256)
    for index in ([3, 0, 6, 3], [5, 5, 1, 2]):
        rows.load(np.array(index, np.int64))
        plan.run()
        np.testing.assert_array_equal(out.numpy(), want_all[np.array(index)])
        np.testing.assert_array_equal(out.numpy(), F.embedding(rows, table).numpy())
    rows.load(np.array([2, 7, 0, -1], np.int64))
    with pytest.raises(ValueError, match="embedding: index 7 is out of range for a table of 7 rows"):
        plan.run()
