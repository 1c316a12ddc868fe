"""Every NVIDIA kernel against the CPU kernels (the NumPy reference) on the same inputs, per
dtype, through Triton's interpreter (the backend's simulated mode) or on the GPU where torch
sees one. Strided views, aliasing, quantized weights and index errors included."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llaisys import DataType, Tensor, ops
from llaisys.kernels import find_kernel

from conftest import TOLERANCE, dtype_params

gguf = pytest.importorskip("gguf")

FLOATS = (DataType.F32, DataType.F16, DataType.BF16)
OPS = ("add", "add_rms_norm", "argmax", "embedding", "kv_cache_write", "linear", "paged_attention", "rearrange",
       "rms_norm", "rope", "rope_freqs", "self_attention", "swiglu")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(2024)


def pair(host: np.ndarray, dtype: DataType, device: str) -> tuple[Tensor, Tensor]:
    """The same values as a CPU tensor and as a tensor on ``device``."""
    cpu = Tensor.from_numpy(host, dtype=dtype)
    return cpu, Tensor.from_numpy(cpu.numpy(), device=device)


def close(got: Tensor, want: Tensor, dtype: DataType, scale: float = 1.0, what: str = "") -> None:
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(got.numpy().astype(np.float64), want.numpy().astype(np.float64),
                               atol=atol * scale, rtol=rtol * scale, err_msg=what)


def test_every_op_is_registered_for_every_float_type(nvidia_device):
    for name in OPS:
        for dt in FLOATS:
            assert find_kernel(name, "nvidia", dt) is not None, (name, dt)
    for wt in (DataType.Q4_0, DataType.Q4_1, DataType.Q8_0, DataType.Q6_K):
        assert find_kernel("linear", "nvidia", DataType.BF16, weight_dtype=wt) is not None
        assert find_kernel("embedding", "nvidia", DataType.F32, weight_dtype=wt) is not None


@pytest.mark.parametrize("dtype", dtype_params())
def test_add_and_swiglu_strided(nvidia_device, rng, dtype):
    a_c, a_n = pair(rng.standard_normal((6, 5)), dtype, nvidia_device)
    b_c, b_n = pair(rng.standard_normal((5, 6)), dtype, nvidia_device)
    for a, b, dev in ((a_c, b_c, "cpu"), (a_n, b_n, nvidia_device)):
        out = Tensor.empty((6, 5), dtype, dev)
        ops.add(out, a, b.permute(1, 0))  # a transposed view
        if dev == "cpu":
            want = out
        else:
            close(out, want, dtype, what="add")
    gu_c, gu_n = pair(rng.standard_normal((4, 66)) * 3, dtype, nvidia_device)
    outs = []
    for gu, dev in ((gu_c, "cpu"), (gu_n, nvidia_device)):
        out = Tensor.empty((4, 33), dtype, dev)
        ops.swiglu(out, gu.slice(1, 0, 33), gu.slice(1, 33, 66))  # gate and up: strided halves
        outs.append(out)
    close(outs[1], outs[0], dtype, what="swiglu")


@pytest.mark.parametrize("dtype", [*dtype_params(), pytest.param(DataType.I64, id="i64")])
def test_rearrange(nvidia_device, rng, dtype):
    host = rng.integers(-1000, 1000, (2, 3, 4)) if dtype is DataType.I64 else rng.standard_normal((2, 3, 4))
    c, n = pair(host, dtype, nvidia_device)
    out = Tensor.empty((4, 3, 2), dtype, nvidia_device)
    ops.rearrange(out, n.permute(2, 1, 0))
    np.testing.assert_array_equal(out.numpy(), c.numpy().transpose(2, 1, 0))
    dense = Tensor.empty((2, 3, 4), dtype, nvidia_device)
    ops.rearrange(dense, n)
    np.testing.assert_array_equal(dense.numpy(), c.numpy())
    strided_out = Tensor.zeros((2, 3, 8), dtype, nvidia_device).slice(2, 2, 6)  # gaps survive
    ops.rearrange(strided_out, n)
    full = strided_out.storage  # the whole buffer: zeros around the copied block
    back = Tensor(full, 0, (2, 3, 8), (24, 8, 1), dtype).numpy()
    np.testing.assert_array_equal(back[:, :, 2:6], c.numpy())
    assert not back[:, :, :2].any() and not back[:, :, 6:].any()


@pytest.mark.parametrize("dtype", dtype_params())
def test_rms_norm_and_add_rms_norm(nvidia_device, rng, dtype):
    x_c, x_n = pair(rng.standard_normal((3, 70)), dtype, nvidia_device)
    b_c, b_n = pair(rng.standard_normal((3, 70)), dtype, nvidia_device)
    w_c, w_n = pair(1 + 0.1 * rng.standard_normal(70), dtype, nvidia_device)
    got, want = Tensor.empty((3, 70), dtype, nvidia_device), Tensor.empty((3, 70), dtype)
    ops.rms_norm(want, x_c, w_c, 1e-5)
    ops.rms_norm(got, x_n, w_n, 1e-5)
    close(got, want, dtype, what="rms_norm")
    # total is a itself, as in the decoder's residual stream
    out_c, out_n = Tensor.empty((3, 70), dtype), Tensor.empty((3, 70), dtype, nvidia_device)
    ops.add_rms_norm(out_c, x_c, x_c, b_c, w_c, 1e-5)
    ops.add_rms_norm(out_n, x_n, x_n, b_n, w_n, 1e-5)
    close(x_n, x_c, dtype, what="add_rms_norm total")
    close(out_n, out_c, dtype, what="add_rms_norm out")


@pytest.mark.parametrize("dtype", dtype_params())
def test_rope_on_a_strided_view(nvidia_device, rng, dtype):
    s, h, kh, d = 5, 3, 2, 16
    qkv_c, qkv_n = pair(rng.standard_normal((s, (h + 2 * kh) * d)), dtype, nvidia_device)
    pos_c, pos_n = pair(np.array([0, 1, 7, 300, 4097], np.int64), DataType.I64, nvidia_device)
    outs = []
    for qkv, pos, dev in ((qkv_c, pos_c, "cpu"), (qkv_n, pos_n, nvidia_device)):
        x = qkv.slice(1, 0, (h + kh) * d).view(s, h + kh, d)  # (S, H+KH, D) rows strided
        out = Tensor.empty((s, h + kh, d), dtype, dev)
        ops.rope(out, x, pos, 10000.0)
        outs.append(out)
    close(outs[1], outs[0], dtype, what="rope")


@pytest.mark.parametrize("dtype", dtype_params())
def test_argmax_first_index_of_ties(nvidia_device, rng, dtype):
    host = rng.standard_normal((3, 2500))
    host[1, 100] = host[1, 2000] = 50.0  # a tie across blocks: the first wins
    host[2, :] = 1.0
    c, n = pair(host, dtype, nvidia_device)
    idx, val = Tensor.empty((3,), DataType.I64, nvidia_device), Tensor.empty((3,), dtype, nvidia_device)
    ops.argmax(idx, val, n)
    want = c.numpy()
    np.testing.assert_array_equal(idx.numpy(), np.argmax(want, axis=-1))
    np.testing.assert_array_equal(val.numpy(), want.max(axis=-1))
    one_i, one_v = Tensor.empty((1,), DataType.I64, nvidia_device), Tensor.empty((1,), dtype, nvidia_device)
    ops.argmax(one_i, one_v, n.slice(0, 0, 1).view(2500))
    assert one_i.numpy()[0] == np.argmax(want[0])


@pytest.mark.parametrize("dtype", dtype_params())
def test_embedding(nvidia_device, rng, monkeypatch, dtype):
    monkeypatch.setenv("LLAISYS_NVIDIA_CHECK", "1")  # on in the simulated mode anyway; on a GPU a sync
    w_c, w_n = pair(rng.standard_normal((10, 12)), dtype, nvidia_device)
    i_c, i_n = pair(np.array([3, 0, 9, 3], np.int64), DataType.I64, nvidia_device)
    out = Tensor.empty((4, 12), dtype, nvidia_device)
    ops.embedding(out, i_n, w_n)
    np.testing.assert_array_equal(out.numpy(), w_c.numpy()[[3, 0, 9, 3]])
    with pytest.raises(ValueError, match="index 10 is out of range for a table of 10 rows"):
        ops.embedding(out, Tensor.from_numpy(np.array([1, 10, 2, 3], np.int64), device=nvidia_device), w_n)


def quantized(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw (n, row_bytes) blocks of format ``name``: gguf's quantization of normal samples, or
    random codes with small f16 scales for Q6_K."""
    if name == "Q6_K":
        from llaisys.kernels.quant.formats import get_format

        fmt = get_format(name)
        raw = rng.integers(0, 256, (n, fmt.row_bytes(k)), dtype=np.uint8)
        blocks = raw.reshape(-1, fmt.block_bytes)
        blocks[:, 208:210] = rng.uniform(1e-3, 1e-2, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
        return raw
    w = rng.standard_normal((n, k), dtype=np.float32)
    qt = getattr(gguf.GGMLQuantizationType, name)
    return np.ascontiguousarray(gguf.quants.quantize(w, qt)).view(np.uint8).reshape(n, -1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K"])
def test_dequantize_matches_the_reference(nvidia_device, rng, name):
    from llaisys.kernels.nvidia.quant import dequantized
    from llaisys.kernels.quant import reference

    k = 256 if name == "Q6_K" else 64
    raw = quantized(name, 5, k, rng)
    w = Tensor.from_raw(raw, DataType[name], nvidia_device)
    got = dequantized(w, DataType.F32).cpu().numpy()
    np.testing.assert_array_equal(got, reference.dequantize(name, raw))  # bit for bit
    half = dequantized(w, DataType.BF16).float().cpu().numpy()
    # one BF16 ulp: Triton's interpreter truncates F32 to BF16 where a GPU rounds to nearest
    np.testing.assert_allclose(half, got, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", dtype_params())
def test_linear(nvidia_device, rng, dtype):
    x_c, x_n = pair(rng.standard_normal((2, 3, 16)), dtype, nvidia_device)
    w_c, w_n = pair(rng.standard_normal((8, 16)) / 4, dtype, nvidia_device)
    b_c, b_n = pair(rng.standard_normal(8), dtype, nvidia_device)
    for bias_c, bias_n in ((b_c, b_n), (None, None)):
        want, got = Tensor.empty((2, 3, 8), dtype), Tensor.empty((2, 3, 8), dtype, nvidia_device)
        ops.linear(want, x_c, w_c, bias_c)
        ops.linear(got, x_n, w_n, bias_n)
        close(got, want, dtype, scale=2, what="linear")


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_linear_and_embedding_on_quantized_weights(nvidia_device, rng, dtype, name, f32_quant_math):
    raw = quantized(name, 12, 64, rng)
    w_c = Tensor.from_raw(raw, DataType[name]).freeze()
    w_n = Tensor.from_raw(raw, DataType[name], nvidia_device).freeze()
    x_c, x_n = pair(rng.standard_normal((3, 64)) / 8, dtype, nvidia_device)
    want, got = Tensor.empty((3, 12), dtype), Tensor.empty((3, 12), dtype, nvidia_device)
    ops.linear(want, x_c, w_c)
    ops.linear(got, x_n, w_n)
    close(got, want, dtype, scale=2, what="quantized linear")
    ops.linear(got, x_n, w_n)  # the dequantized weight is kept with the frozen one
    close(got, want, dtype, scale=2, what="quantized linear, again")
    idx_c, idx_n = pair(np.array([11, 0, 5], np.int64), DataType.I64, nvidia_device)
    e_c, e_n = Tensor.empty((3, 64), dtype), Tensor.empty((3, 64), dtype, nvidia_device)
    ops.embedding(e_c, idx_c, w_c)
    ops.embedding(e_n, idx_n, w_n)
    if dtype is DataType.F32:
        np.testing.assert_array_equal(e_n.numpy(), e_c.numpy())
    else:  # rounded to the activations' type (truncated by Triton's interpreter: within an ulp)
        close(e_n, e_c, dtype, what="quantized embedding")


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantized_gemm_on_the_stored_blocks(nvidia_device, rng, monkeypatch, dtype, name, f32_quant_math):
    monkeypatch.setenv("LLAISYS_NVIDIA_QUANT_GEMM", "1")
    raw = quantized(name, 70, 64, rng)  # N = 70: a partial column tile
    w_c = Tensor.from_raw(raw, DataType[name]).freeze()
    w_n = Tensor.from_raw(raw, DataType[name], nvidia_device).freeze()
    b_c, b_n = pair(rng.standard_normal(70), dtype, nvidia_device)
    for m in (1, 20):  # a decoding row; more rows than one tile
        x_c, x_n = pair(rng.standard_normal((m, 64)) / 8, dtype, nvidia_device)
        want, got = Tensor.empty((m, 70), dtype), Tensor.empty((m, 70), dtype, nvidia_device)
        ops.linear(want, x_c, w_c, b_c)
        ops.linear(got, x_n, w_n, b_n)
        close(got, want, dtype, scale=2, what=f"{name} GEMM, M={m}")
    assert w_n._derived is None or not any(k.startswith("nvidia.F") for k in w_n._derived)  # no 16-bit copy


def test_linear_f32_activations_on_half_weights(nvidia_device, rng):
    x_c, x_n = pair(rng.standard_normal((3, 16)), DataType.F32, nvidia_device)
    w_c, w_n = pair(rng.standard_normal((8, 16)), DataType.BF16, nvidia_device)
    want, got = Tensor.empty((3, 8), DataType.F32), Tensor.empty((3, 8), DataType.F32, nvidia_device)
    ops.linear(want, x_c, w_c)
    ops.linear(got, x_n, w_n)
    close(got, want, DataType.F32, scale=10, what="F32 x BF16 linear")


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("s,t", [(1, 9), (5, 9), (40, 40)])
def test_self_attention(nvidia_device, rng, dtype, s, t):
    h, kh, d = 6, 2, 16
    q_c, q_n = pair(rng.standard_normal((s, h, d)), dtype, nvidia_device)
    kv_c, kv_n = pair(rng.standard_normal((t, 2 * kh, d)), dtype, nvidia_device)  # k and v heads interleaved
    outs = []
    for q, kv, dev in ((q_c, kv_c, "cpu"), (q_n, kv_n, nvidia_device)):
        out = Tensor.empty((s, h, d), dtype, dev)
        ops.self_attention(out, q, kv.slice(1, 0, kh), kv.slice(1, kh, 2 * kh), 1 / math.sqrt(d))
        outs.append(out)
    close(outs[1], outs[0], dtype, scale=2, what="self_attention")


class Paged:
    """A flat batch over a shuffled block pool on the CPU and on the device: specs are
    (context_len, q_len) per sequence; table entries a sequence does not need hold -1."""

    def __init__(self, rng, specs, dtype, device, bs=4, h=6, kh=2, d=16):
        need = [math.ceil(c / bs) for c, _ in specs]
        nb = sum(need) + 2
        mb = max(need) + 1
        order = rng.permutation(nb)
        tables, at = np.full((len(specs), mb), -1, np.int64), 0
        for b, k in enumerate(need):
            tables[b, :k] = order[at:at + k]
            at += k
        starts = np.concatenate([[0], np.cumsum([q for _, q in specs])]).astype(np.int64)
        n = int(starts[-1])
        self.cpu, self.dev = {}, {}
        for name, host, dt in (("k_cache", rng.standard_normal((nb, bs, kh, d)), dtype),
                               ("v_cache", rng.standard_normal((nb, bs, kh, d)), dtype),
                               ("qkv", rng.standard_normal((n, h + 2 * kh, d)), dtype),
                               ("tables", tables, DataType.I64), ("starts", starts, DataType.I64),
                               ("lens", np.array([c for c, _ in specs], np.int64), DataType.I64)):
            self.cpu[name], self.dev[name] = pair(host, dt, device)
        # this step's slots: the last q_len positions of each sequence
        slots = [tables[b, p // bs] * bs + p % bs for b, (c, q) in enumerate(specs) for p in range(c - q, c)]
        self.cpu["slots"], self.dev["slots"] = pair(np.array(slots, np.int64), DataType.I64, device)
        self.n, self.h, self.kh, self.d, self.dtype = n, h, kh, d, dtype

    def run(self, side: dict, device: str) -> Tensor:
        qkv = side["qkv"]
        h, kh = self.h, self.kh
        ops.kv_cache_write(side["k_cache"], side["v_cache"], qkv.slice(1, h, h + kh), qkv.slice(1, h + kh, h + 2 * kh),
                           side["slots"])
        out = Tensor.empty((self.n, h, self.d), self.dtype, device)
        ops.paged_attention(out, qkv.slice(1, 0, h), side["k_cache"], side["v_cache"], side["tables"], side["starts"],
                            side["lens"], 1 / math.sqrt(self.d))
        return out


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("specs", [[(9, 1), (6, 6), (5, 0), (13, 3)],  # prompt chunks: a grid of query blocks
                                   [(9, 2), (5, 0), (13, 1)]],  # as many tokens as sequences: a program per token
                         ids=["chunks", "per-token"])
def test_paged_attention_and_kv_cache_write(nvidia_device, rng, dtype, specs):
    batch = Paged(rng, specs, dtype, nvidia_device)
    want = batch.run(batch.cpu, "cpu")
    got = batch.run(batch.dev, nvidia_device)
    np.testing.assert_array_equal(batch.dev["k_cache"].numpy(), batch.cpu["k_cache"].numpy())
    np.testing.assert_array_equal(batch.dev["v_cache"].numpy(), batch.cpu["v_cache"].numpy())
    close(got, want, dtype, scale=2, what="paged_attention")


def test_paged_decode_rows_do_not_depend_on_the_batch(nvidia_device, rng):
    batch = Paged(rng, [(9, 1), (14, 1), (3, 1)], DataType.F32, nvidia_device)
    together = batch.run(batch.dev, nvidia_device).numpy()
    alone = Paged(rng, [(9, 1)], DataType.F32, nvidia_device)
    for name in ("k_cache", "v_cache", "qkv"):  # the first sequence's data, alone
        alone.dev[name] = batch.dev[name].slice(0, 0, 1) if name == "qkv" else batch.dev[name]
    alone.dev["tables"] = batch.dev["tables"].slice(0, 0, 1)
    alone.dev["lens"] = batch.dev["lens"].slice(0, 0, 1)
    alone.dev["slots"] = batch.dev["slots"].slice(0, 0, 1)
    np.testing.assert_array_equal(alone.run(alone.dev, nvidia_device).numpy()[0], together[0])


def test_index_errors_read_as_on_the_cpu(nvidia_device, rng, monkeypatch):
    monkeypatch.setenv("LLAISYS_NVIDIA_CHECK", "1")
    batch = Paged(rng, [(9, 1), (6, 2)], DataType.F32, nvidia_device)
    bad = Tensor.from_numpy(np.array([0, 999, 1], np.int64), device=nvidia_device)
    qkv = batch.dev["qkv"]
    with pytest.raises(ValueError, match=r"slots\[1\] = 999 is outside"):
        ops.kv_cache_write(batch.dev["k_cache"], batch.dev["v_cache"], qkv.slice(1, 6, 8), qkv.slice(1, 8, 10), bad)
    lens = Tensor.from_numpy(np.array([9, 1], np.int64), device=nvidia_device)
    out = Tensor.empty((3, 6, 16), DataType.F32, nvidia_device)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 1 is less than the 2 queries"):
        ops.paged_attention(out, qkv.slice(1, 0, 6), batch.dev["k_cache"], batch.dev["v_cache"], batch.dev["tables"],
                            batch.dev["starts"], lens, 0.25)


def test_sampling_on_the_device(nvidia_device, rng):
    import torch

    from llaisys.kernels.nvidia._common import tv
    from llaisys.kernels.nvidia.sampling import sample

    host = rng.standard_normal((3, 50)).astype(np.float32)
    logits = Tensor.from_numpy(host, device=nvidia_device)
    np.testing.assert_array_equal(sample(logits), host.argmax(-1))  # greedy
    np.testing.assert_array_equal(sample(logits, temperature=0.8, top_k=1), host.argmax(-1))
    top3 = np.argsort(-host, axis=-1)[:, :3]
    g = torch.Generator(device=tv(logits).device)  # the device's own generator
    draws = []
    for seed in (0, 1, 0):
        g.manual_seed(seed)
        ids = sample(logits, temperature=[1.0, 0.0, 2.0], top_k=3, top_p=0.9, generator=g)
        assert all(ids[r] in top3[r] for r in range(3)) and ids[1] == host[1].argmax()
        draws.append(ids.tolist())
    assert draws[0] == draws[2]  # seeded: reproducible
    with pytest.raises(ValueError, match="top_p in"):
        sample(logits, temperature=1.0, top_p=0.0)



def test_unchecked_bad_indices_read_zeros_and_write_nothing(nvidia_device, rng, monkeypatch):
    monkeypatch.setenv("LLAISYS_NVIDIA_CHECK", "0")  # as on a GPU by default: no host sync
    w = Tensor.from_numpy(rng.standard_normal((4, 8)), device=nvidia_device, dtype=DataType.F32)
    out = Tensor.empty((2, 8), DataType.F32, nvidia_device)
    ops.embedding(out, Tensor.from_numpy(np.array([7, 2], np.int64), device=nvidia_device), w)
    np.testing.assert_array_equal(out.numpy(), np.stack([np.zeros(8, np.float32), w.numpy()[2]]))
    batch = Paged(rng, [(9, 1), (6, 2)], DataType.F32, nvidia_device)
    before = batch.dev["k_cache"].numpy()
    qkv = batch.dev["qkv"]
    bad = Tensor.from_numpy(np.array([-1, 999, 10**6], np.int64), device=nvidia_device)
    ops.kv_cache_write(batch.dev["k_cache"], batch.dev["v_cache"], qkv.slice(1, 6, 8), qkv.slice(1, 8, 10), bad)
    np.testing.assert_array_equal(batch.dev["k_cache"].numpy(), before)
