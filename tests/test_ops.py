"""The nine ops against PyTorch (float64 references from the exact input values), over F32,
F16 and BF16 with the tolerances of ``conftest.TOLERANCE``; argument errors; the kernel
registry and its CPU fallback."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from llaisys import DataType, Tensor, ops
from llaisys.kernels import Layout, dispatch, register_kernel, registered_kernels, unregister_kernels
from llaisys.ops import functional as F
from llaisys.runtime import KernelNotFoundError

from conftest import assert_close, dtype_params, random_tensor, to_torch

DTYPES = dtype_params()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def permuted(shape, dtype, rng, scale=1.0) -> Tensor:
    """A non-contiguous tensor of ``shape``: the transpose of a contiguous (reversed) one."""
    base = random_tensor(shape[::-1], dtype, rng, scale)
    out = base.permute(*range(len(shape) - 1, -1, -1))
    assert not out.is_contiguous() or len(shape) < 2
    return out


def sliced(shape, dtype, rng, scale=1.0) -> Tensor:
    """A non-contiguous tensor of ``shape``: a slice of a wider one along the last dim."""
    wider = random_tensor(shape[:-1] + (shape[-1] + 3,), dtype, rng, scale)
    return wider.slice(-1, 1, 1 + shape[-1])


LAYOUTS = {"contiguous": random_tensor, "permuted": permuted, "sliced": sliced}


# ---- add --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 7)])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "sliced"])
def test_add(dtype, shape, layout, rng):
    a = LAYOUTS[layout](shape, dtype, rng)
    b = random_tensor(shape, dtype, rng)
    c = Tensor.empty(shape, dtype)
    ops.add(c, a, b)
    assert_close(c, to_torch(a) + to_torch(b))
    assert_close(F.add(a, b), to_torch(a) + to_torch(b))


def test_add_in_place(rng):
    a, b = random_tensor((4, 6), DataType.F32, rng), random_tensor((4, 6), DataType.F32, rng)
    expected = to_torch(a) + to_torch(b)
    ops.add(a, a, b)
    assert_close(a, expected)


# ---- argmax -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (17,), (3, 11)])
def test_argmax(dtype, shape, rng):
    vals = random_tensor(shape, dtype, rng)
    out_shape = shape[:-1] if len(shape) > 1 else (1,)
    idx, val = Tensor.empty(out_shape, "i64"), Tensor.empty(out_shape, dtype)
    ops.argmax(idx, val, vals)
    ref_val, ref_idx = torch.max(to_torch(vals), dim=-1)
    np.testing.assert_array_equal(idx.numpy().reshape(-1), ref_idx.numpy().reshape(-1))
    np.testing.assert_array_equal(val.numpy().astype(np.float64).reshape(-1), ref_val.numpy().reshape(-1))
    fidx, fval = F.argmax(vals)
    np.testing.assert_array_equal(fidx.numpy(), idx.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_and_strides(dtype):
    host = np.array([[1.0, 3.0, 3.0, -2.0], [5.0, 5.0, 0.0, 5.0], [-1.0, -1.0, -1.0, -1.0]])
    vals = Tensor.from_numpy(host.T.copy(), dtype=dtype).permute(1, 0)  # non-contiguous (3, 4)
    idx, val = F.argmax(vals)
    ref = torch.argmax(torch.from_numpy(host), dim=-1)  # the first maximum on ties
    np.testing.assert_array_equal(idx.numpy(), ref.numpy())
    np.testing.assert_array_equal(val.numpy().astype(np.float64), host.max(axis=-1))


# ---- embedding --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, dim, n", [(1, 3, 1), (13, 7, 9), (50, 16, 4)])
def test_embedding(dtype, vocab, dim, n, rng):
    weight = random_tensor((vocab, dim), dtype, rng)
    index = Tensor.from_numpy(rng.integers(0, vocab, n), dtype="i64")
    out = Tensor.empty((n, dim), dtype)
    ops.embedding(out, index, weight)
    ref = TF.embedding(to_torch(index), to_torch(weight))
    np.testing.assert_array_equal(out.numpy().astype(np.float64), ref.numpy())
    np.testing.assert_array_equal(F.embedding(index, weight).numpy(), out.numpy())


def test_embedding_strided_table_and_index(rng):
    weight = sliced((10, 6), DataType.F32, rng)
    index = Tensor.from_numpy(np.array([[3, 0], [9, 3], [1, 1]], dtype=np.int64)).permute(1, 0).slice(0, 0, 1).view(3)
    out = F.embedding(index, weight)
    np.testing.assert_array_equal(out.numpy(), TF.embedding(to_torch(index), to_torch(weight)).numpy())


@pytest.mark.parametrize("bad", [-1, 5])
def test_embedding_index_out_of_range(bad):
    weight = Tensor.zeros((5, 2))
    index = Tensor.from_numpy(np.array([0, bad], np.int64))
    with pytest.raises(ValueError, match=f"embedding: index {bad} is out of range for a table of 5 rows"):
        F.embedding(index, weight)


# ---- linear -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_shape, n", [((1, 7), 5), ((3, 17), 9), ((2, 3, 64), 33), ((5,), 4)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear(dtype, in_shape, n, bias, rng):
    k = in_shape[-1]
    x = random_tensor(in_shape, dtype, rng)
    w = random_tensor((n, k), dtype, rng, scale=1 / math.sqrt(k))
    b = random_tensor((n,), dtype, rng) if bias else None
    out = Tensor.empty(in_shape[:-1] + (n,), dtype)
    ops.linear(out, x, w, b)
    ref = TF.linear(to_torch(x), to_torch(w), None if b is None else to_torch(b))
    assert_close(out, ref)
    assert_close(F.linear(x, w, b), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_strided_operands(dtype, rng):
    x = permuted((4, 12), dtype, rng)  # (M, K) stored as its transpose
    w = permuted((6, 12), dtype, rng, scale=0.3)  # weight given as a transposed (K, N) tensor
    b = sliced((6,), dtype, rng)
    out_base = Tensor.empty((6, 4), dtype)
    out = out_base.permute(1, 0)  # a non-contiguous output
    ops.linear(out, x, w, b)
    assert_close(out, TF.linear(to_torch(x), to_torch(w), to_torch(b)))


@pytest.mark.parametrize("dtype", [DataType.F16, DataType.BF16], ids=["f16", "bf16"])
def test_linear_low_precision_weight_in_several_blocks(dtype, rng):
    # More than 4 MiB of F32 weight: widened and multiplied a block of rows at a time.
    n, k = 1800, 640
    x = random_tensor((2, k), dtype, rng)
    w = random_tensor((n, k), dtype, rng, scale=1 / math.sqrt(k))
    b = random_tensor((n,), dtype, rng)
    assert_close(F.linear(x, w, b), TF.linear(to_torch(x), to_torch(w), to_torch(b)))


def test_linear_with_no_in_features():
    x, w = Tensor.zeros((2, 0)), Tensor.zeros((3, 0))
    b = Tensor.from_numpy(np.array([1.0, 2.0, 3.0], np.float32))
    np.testing.assert_array_equal(F.linear(x, w, b).numpy(), TF.linear(torch.zeros(2, 0), torch.zeros(3, 0), torch.tensor([1.0, 2.0, 3.0])).numpy())


# ---- rearrange --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", dtype_params((DataType.F32, DataType.F16, DataType.BF16, DataType.I64, DataType.U8)))
def test_rearrange_into_any_layout(dtype, rng):
    host = rng.integers(0, 100, (3, 4, 5)).astype(dtype.numpy)
    src = Tensor.from_numpy(host).permute(2, 0, 1)  # (5, 3, 4), strided
    dst = Tensor.zeros((4, 5, 3), dtype).permute(1, 2, 0)  # (5, 3, 4), strided differently
    ops.rearrange(dst, src)
    expected = torch.from_numpy(host.astype(np.float64)).permute(2, 0, 1)
    np.testing.assert_array_equal(dst.numpy().astype(np.float64), expected.numpy())
    out = F.rearrange(src)
    assert out.is_contiguous()
    np.testing.assert_array_equal(out.numpy().astype(np.float64), expected.numpy())


# ---- rms_norm ---------------------------------------------------------------------------
def rms_norm_ref(x, w, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (5, 33), (2, 3, 16)])
@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
def test_rms_norm(dtype, shape, layout, rng):
    x = LAYOUTS[layout](shape, dtype, rng, scale=3.0)
    w = random_tensor(shape[-1:], dtype, rng)
    out = Tensor.empty(shape, dtype)
    ops.rms_norm(out, x, w, 1e-5)
    ref = rms_norm_ref(to_torch(x), to_torch(w), 1e-5)
    assert_close(out, ref)
    assert_close(out, TF.rms_norm(to_torch(x), shape[-1:], to_torch(w), 1e-5))
    assert_close(F.rms_norm(x, w, 1e-5), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (5, 33), (2, 3, 16)])
def test_add_rms_norm_is_add_then_rms_norm(dtype, shape, rng):
    a, b = random_tensor(shape, dtype, rng), random_tensor(shape, dtype, rng)
    w = random_tensor(shape[-1:], dtype, rng)
    total = to_torch(F.add(a, b))  # the sum rounded to dtype, as the fused op keeps it
    out, s = F.add_rms_norm(a, b, w, 1e-5)
    assert_close(s, to_torch(a) + to_torch(b))
    assert_close(out, TF.rms_norm(total, shape[-1:], to_torch(w), 1e-5))
    np.testing.assert_array_equal(out.numpy(), F.rms_norm(F.add(a, b), w, 1e-5).numpy())
    ops.add_rms_norm(out, a, a, b, w, 1e-5)  # the sum written over an input, as a residual add does
    np.testing.assert_array_equal(a.numpy(), s.numpy())


def test_rms_norm_eps_matters_for_tiny_inputs():
    x = Tensor.from_numpy(np.full((1, 4), 1e-3, np.float32))
    w = Tensor.from_numpy(np.ones(4, np.float32))
    for eps in (0.0, 1e-6, 1e-2):
        assert_close(F.rms_norm(x, w, eps), rms_norm_ref(to_torch(x), to_torch(w), eps))


# ---- rope -------------------------------------------------------------------------------
def rope_ref(x, pos, theta):
    """The seed formula in float64: halves (a, b) rotated by pos / theta^(2j/D)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    phi = pos.double()[:, None, None] * inv  # (S, 1, D/2)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * phi.cos() - b * phi.sin(), b * phi.cos() + a * phi.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s, h, d", [(1, 1, 2), (5, 3, 8), (7, 4, 64)])
@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_rope(dtype, s, h, d, theta, rng):
    x = random_tensor((s, h, d), dtype, rng)
    pos = Tensor.from_numpy(rng.permutation(4096)[:s].astype(np.int64))  # any order, large values
    out = Tensor.empty((s, h, d), dtype)
    ops.rope(out, x, pos, theta)
    assert_close(out, rope_ref(to_torch(x), to_torch(pos), theta))
    assert_close(F.rope(x, pos, theta), rope_ref(to_torch(x), to_torch(pos), theta))


def test_rope_matches_transformers_rotate_half(rng):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    s, h, d, theta = 6, 3, 16, 10000.0
    q, k = random_tensor((s, h, d), DataType.F32, rng), random_tensor((s, h, d), DataType.F32, rng)
    pos = Tensor.from_numpy(np.arange(10, 10 + s, dtype=np.int64))
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = to_torch(pos).double()[:, None] * inv  # (S, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # (1, S, D)
    ref_q, ref_k = apply_rotary_pos_emb(to_torch(q).permute(1, 0, 2)[None], to_torch(k).permute(1, 0, 2)[None],
                                        emb.cos(), emb.sin())  # (1, H, S, D)
    assert_close(F.rope(q, pos, theta), ref_q[0].permute(1, 0, 2))
    assert_close(F.rope(k, pos, theta), ref_k[0].permute(1, 0, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_strided_input_and_in_place(dtype, rng):
    qkv = random_tensor((4, 3, 3 * 8), dtype, rng)  # a fused projection; q is a slice of it
    q = qkv.slice(2, 8, 16)
    pos = Tensor.from_numpy(np.array([0, 1, 2, 3], np.int64))
    expected = rope_ref(to_torch(q), to_torch(pos), 500.0)
    ops.rope(q, q, pos, 500.0)
    assert_close(q, expected)


# ---- self_attention ---------------------------------------------------------------------
def attention_ref(q, k, v, scale):
    """Causal attention in float64 with the mask offset by T - S and KV heads repeated."""
    s, h, _ = q.shape
    t, kh, _ = k.shape
    k = k.repeat_interleave(h // kh, dim=1)  # (T, H, D)
    v = v.repeat_interleave(h // kh, dim=1)  # (T, H, Dv)
    scores = torch.einsum("shd,thd->hst", q, k) * scale  # (H, S, T)
    mask = torch.arange(t)[None, :] <= torch.arange(s)[:, None] + (t - s)  # (S, T)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hst,thd->shd", scores.softmax(dim=-1), v)  # (S, H, Dv)


ATTENTION_CASES = {  # (S, T, H, KH, D, Dv)
    "single": (1, 1, 1, 1, 4, 4),
    "equal lengths": (3, 3, 4, 2, 8, 8),
    "kv longer, dv differs": (2, 7, 6, 2, 16, 8),
    "smollm2 heads": (5, 9, 9, 3, 64, 64),
    "decode mqa": (1, 33, 4, 1, 8, 8),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_self_attention(dtype, case, rng):
    s, t, h, kh, d, dv = ATTENTION_CASES[case]
    q, k, v = random_tensor((s, h, d), dtype, rng), random_tensor((t, kh, d), dtype, rng), random_tensor((t, kh, dv), dtype, rng)
    scale = 1 / math.sqrt(d)
    out = Tensor.empty((s, h, dv), dtype)
    ops.self_attention(out, q, k, v, scale)
    ref = attention_ref(to_torch(q), to_torch(k), to_torch(v), scale)
    assert_close(out, ref)
    assert_close(F.self_attention(q, k, v, scale), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_attention_matches_sdpa_on_a_strided_kv_cache(dtype, rng):
    s, t, t_max, h, kh, d = 3, 10, 16, 6, 2, 8
    cache_k = random_tensor((t_max, kh, d), dtype, rng)
    cache_v = random_tensor((t_max, kh, d), dtype, rng)
    k, v = cache_k.slice(0, 0, t), cache_v.slice(0, 0, t)  # the filled part of a cache
    q = permuted((s, h, d), dtype, rng)
    scale = 0.3
    out = F.self_attention(q, k, v, scale)
    tq, tk, tv = (to_torch(x).permute(1, 0, 2) for x in (q, k, v))  # (heads, len, dim)
    mask = torch.arange(t)[None, :] <= torch.arange(s)[:, None] + (t - s)  # (S, T)
    ref = TF.scaled_dot_product_attention(tq, tk.repeat_interleave(h // kh, 0), tv.repeat_interleave(h // kh, 0),
                                          attn_mask=mask, scale=scale)  # (H, S, D)
    assert_close(out, ref.permute(1, 0, 2))


def test_self_attention_extreme_scores_stay_finite():
    q = Tensor.from_numpy(np.full((2, 1, 4), 300.0, np.float32))
    k = Tensor.from_numpy(np.array([[[1, 1, 1, 1]], [[-1, -1, -1, -1]], [[1, 0, 0, 0]]], np.float32))
    v = Tensor.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 1, 4))
    out = F.self_attention(q, k, v, 1.0)
    assert np.isfinite(out.numpy()).all()
    assert_close(out, attention_ref(to_torch(q), to_torch(k), to_torch(v), 1.0))


# ---- swiglu -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (4, 13), (2, 3, 5)])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_swiglu(dtype, shape, layout, rng):
    gate = LAYOUTS[layout](shape, dtype, rng, scale=4.0)
    up = random_tensor(shape, dtype, rng)
    out = Tensor.empty(shape, dtype)
    ops.swiglu(out, gate, up)
    ref = to_torch(up) * TF.silu(to_torch(gate))
    assert_close(out, ref)
    assert_close(F.swiglu(gate, up), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_large_gates(dtype):
    gate = Tensor.from_numpy(np.array([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4]), dtype=dtype)
    up = Tensor.from_numpy(np.full(7, 0.5), dtype=dtype)
    out = F.swiglu(gate, up)
    assert np.isfinite(out.numpy().astype(np.float64)).all()
    assert_close(out, to_torch(up) * TF.silu(to_torch(gate)))


# ---- outputs that are also inputs -------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_may_alias_inputs(dtype, rng):
    x, g, u = (random_tensor((3, 8), dtype, rng) for _ in range(3))
    w = random_tensor((8, 8), dtype, rng, scale=0.3)
    nw = random_tensor((8,), dtype, rng)
    refs = {
        "linear": TF.linear(to_torch(x), to_torch(w)),
        "rms_norm": rms_norm_ref(to_torch(g), to_torch(nw), 1e-6),
        "swiglu": to_torch(u) * TF.silu(to_torch(u)),
    }
    ops.linear(x, x, w)
    ops.rms_norm(g, g, nw, 1e-6)
    ops.swiglu(u, u, u)
    for name, out in (("linear", x), ("rms_norm", g), ("swiglu", u)):
        assert_close(out, refs[name], what=name)


# ---- empty inputs -----------------------------------------------------------------------
def test_ops_on_empty_tensors():
    e = Tensor.empty((0, 4))
    assert F.add(e, e).shape == (0, 4)
    assert F.rms_norm(Tensor.empty((3, 0)), Tensor.empty((0,)), 1e-5).shape == (3, 0)
    assert F.swiglu(e, e).shape == (0, 4)
    assert F.linear(e, Tensor.empty((5, 4))).shape == (0, 5)
    assert F.embedding(Tensor.empty((0,), "i64"), Tensor.empty((3, 2))).shape == (0, 2)
    assert F.self_attention(Tensor.empty((0, 2, 4)), Tensor.empty((0, 1, 4)), Tensor.empty((0, 1, 4)), 1.0).shape == (0, 2, 4)
    assert F.rope(Tensor.empty((0, 2, 4)), Tensor.empty((0,), "i64"), 1e4).shape == (0, 2, 4)


# ---- argument errors --------------------------------------------------------------------
def t(shape, dtype="f32") -> Tensor:
    return Tensor.zeros(shape, dtype)


BAD_CALLS = {
    "add not a tensor": (lambda: ops.add(t((2,)), t((2,)), np.zeros(2)), TypeError, "add: b must be a llaisys Tensor, got ndarray"),
    "add dtype mismatch": (lambda: ops.add(t((2,)), t((2,), "f16"), t((2,))), TypeError, "add: a has data type F16 but c has F32"),
    "add shape": (lambda: ops.add(t((2, 3)), t((2, 3)), t((3, 2))), ValueError, "add: b has shape \\(3, 2\\); expected \\(2, 3\\)"),
    "add int dtype": (lambda: ops.add(t((2,), "i64"), t((2,), "i64"), t((2,), "i64")), TypeError, "add: c has data type I64; expected one of BF16, F16, F32"),
    "argmax index dtype": (lambda: ops.argmax(t((1,), "i32"), t((1,)), t((5,))), TypeError, "argmax: max_idx has data type I32; expected one of I64"),
    "argmax value dtype": (lambda: ops.argmax(t((1,), "i64"), t((1,), "f16"), t((5,))), TypeError, "argmax: max_val has data type F16 but vals has F32"),
    "argmax shape": (lambda: ops.argmax(t((2,), "i64"), t((2,)), t((5,))), ValueError, "argmax: max_idx has shape \\(2,\\); expected \\(1,\\)"),
    "argmax empty": (lambda: ops.argmax(t((1,), "i64"), t((1,)), t((0,))), ValueError, "argmax: vals must have a non-empty last dimension"),
    "embedding index dtype": (lambda: ops.embedding(t((2, 3)), t((2,), "i32"), t((5, 3))), TypeError, "embedding: index has data type I32; expected one of I64"),
    "embedding index ndim": (lambda: ops.embedding(t((2, 3)), t((2, 1), "i64"), t((5, 3))), ValueError, "embedding: index must be 1-D"),
    "embedding out shape": (lambda: ops.embedding(t((2, 4)), t((2,), "i64"), t((5, 3))), ValueError, "embedding: out has shape \\(2, 4\\); expected \\(2, 3\\)"),
    "embedding out dtype": (lambda: ops.embedding(t((2, 3), "bf16"), t((2,), "i64"), t((5, 3))), TypeError, "embedding: out has data type BF16 but weight has F32"),
    "linear in features": (lambda: ops.linear(t((2, 4)), t((2, 5)), t((4, 6))), ValueError, "linear: in has shape \\(2, 5\\) but weight \\(4, 6\\) expects K=6"),
    "linear weight ndim": (lambda: ops.linear(t((2, 4)), t((2, 6)), t((4, 6, 1))), ValueError, "linear: weight must be 2-D"),
    "linear out shape": (lambda: ops.linear(t((2, 5)), t((2, 6)), t((4, 6))), ValueError, "linear: out has shape \\(2, 5\\); expected \\(2, 4\\)"),
    "linear bias shape": (lambda: ops.linear(t((2, 4)), t((2, 6)), t((4, 6)), t((6,))), ValueError, "linear: bias has shape \\(6,\\); expected \\(4,\\)"),
    "linear bias dtype": (lambda: ops.linear(t((2, 4)), t((2, 6)), t((4, 6)), t((4,), "f16")), TypeError, "linear: bias has data type F16 but out has F32"),
    "linear bias type": (lambda: ops.linear(t((2, 4)), t((2, 6)), t((4, 6)), 1.0), TypeError, "linear: bias must be a llaisys Tensor, got float"),
    "rearrange shape": (lambda: ops.rearrange(t((2, 3)), t((3, 2))), ValueError, "rearrange: in has shape \\(3, 2\\); expected \\(2, 3\\)"),
    "rearrange dtype": (lambda: ops.rearrange(t((2, 3)), t((2, 3), "i64")), TypeError, "rearrange: in has data type I64 but out has F32"),
    "rms_norm weight shape": (lambda: ops.rms_norm(t((2, 4)), t((2, 4)), t((2,)), 1e-5), ValueError, "rms_norm: weight has shape \\(2,\\); expected \\(4,\\)"),
    "rms_norm out shape": (lambda: ops.rms_norm(t((2, 3)), t((2, 4)), t((4,)), 1e-5), ValueError, "rms_norm: out has shape \\(2, 3\\); expected \\(2, 4\\)"),
    "rms_norm negative eps": (lambda: ops.rms_norm(t((2, 4)), t((2, 4)), t((4,)), -1.0), ValueError, "rms_norm: eps must be >= 0, got -1.0"),
    "rms_norm eps type": (lambda: ops.rms_norm(t((2, 4)), t((2, 4)), t((4,)), "1e-5"), TypeError, "rms_norm: eps must be a real number, got str"),
    "rope pos dtype": (lambda: ops.rope(t((2, 1, 4)), t((2, 1, 4)), t((2,), "i32"), 1e4), TypeError, "rope: pos_ids has data type I32; expected one of I64"),
    "rope pos shape": (lambda: ops.rope(t((2, 1, 4)), t((2, 1, 4)), t((3,), "i64"), 1e4), ValueError, "rope: pos_ids has shape \\(3,\\); expected \\(2,\\)"),
    "rope odd dim": (lambda: ops.rope(t((2, 1, 5)), t((2, 1, 5)), t((2,), "i64"), 1e4), ValueError, "rope: head dim D must be even; got D=5"),
    "rope ndim": (lambda: ops.rope(t((2, 4)), t((2, 4)), t((2,), "i64"), 1e4), ValueError, "rope: in must be 3-D \\(S, H, D\\)"),
    "rope theta": (lambda: ops.rope(t((2, 1, 4)), t((2, 1, 4)), t((2,), "i64"), 0.0), ValueError, "rope: theta must be > 0, got 0.0"),
    "attention head dim": (lambda: ops.self_attention(t((1, 2, 4)), t((1, 2, 4)), t((3, 1, 8)), t((3, 1, 4)), 1.0), ValueError, "self_attention: k has head dim 8"),
    "attention gqa": (lambda: ops.self_attention(t((1, 3, 4)), t((1, 3, 4)), t((3, 2, 4)), t((3, 2, 4)), 1.0), ValueError, "self_attention: q has 3 heads, not a multiple of the 2 key/value heads"),
    "attention kv shorter": (lambda: ops.self_attention(t((4, 2, 4)), t((4, 2, 4)), t((3, 1, 4)), t((3, 1, 4)), 1.0), ValueError, "self_attention: k and v hold 3 positions, fewer than the 4 queries"),
    "attention v shape": (lambda: ops.self_attention(t((1, 2, 4)), t((1, 2, 4)), t((3, 1, 4)), t((2, 1, 4)), 1.0), ValueError, "self_attention: v has shape \\(2, 1, 4\\); expected \\(3, 1, Dv\\)"),
    "attention out shape": (lambda: ops.self_attention(t((1, 2, 5)), t((1, 2, 4)), t((3, 1, 4)), t((3, 1, 4)), 1.0), ValueError, "self_attention: attn_val has shape \\(1, 2, 5\\); expected \\(1, 2, 4\\)"),
    "attention dtype": (lambda: ops.self_attention(t((1, 2, 4)), t((1, 2, 4)), t((3, 1, 4), "bf16"), t((3, 1, 4)), 1.0), TypeError, "self_attention: k has data type BF16 but q has F32"),
    "attention scale": (lambda: ops.self_attention(t((1, 2, 4)), t((1, 2, 4)), t((3, 1, 4)), t((3, 1, 4)), float("nan")), ValueError, "self_attention: scale must be finite"),
    "swiglu shape": (lambda: ops.swiglu(t((2, 3)), t((2, 3)), t((2, 4))), ValueError, "swiglu: up has shape \\(2, 4\\); expected \\(2, 3\\)"),
    "swiglu dtype": (lambda: ops.swiglu(t((2, 3), "f16"), t((2, 3), "f16"), t((2, 3), "bf16")), TypeError, "swiglu: up has data type BF16 but out has F16"),
    "functional not a tensor": (lambda: F.linear([1.0], t((2, 1))), TypeError, "linear: in must be a llaisys Tensor, got list"),
    "functional embedding ndim": (lambda: F.embedding(t((2,), "i64"), t((5,))), ValueError, "embedding: weight must be 2-D"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_argument_errors_name_the_argument(case):
    call, exc, message = BAD_CALLS[case]
    with pytest.raises(exc, match=message):
        call()


def test_device_mismatch_is_named(fake_device):
    a = t((2,))
    b = t((2,)).to("fakedev:0")
    with pytest.raises(ValueError, match="add: b is on fakedev:0 but c is on cpu:0; all must share a device"):
        ops.add(t((2,)), a, b)


# ---- kernel registry --------------------------------------------------------------------
def test_missing_kernel_names_the_key_and_lists_the_registered_ones():
    x = t((2,), "f64")
    with pytest.raises(KernelNotFoundError) as info:
        dispatch("add", DataType.F64, (x,), (x, x), {})
    message = str(info.value)
    assert "no kernel (add, cpu, ANY, F64)" in message
    for dt in ("F16", "F32", "BF16"):
        assert f"(add, cpu, ANY, {dt})" in message
    with pytest.raises(KernelNotFoundError, match="no kernel \\(no_such_op, cpu, ANY, F32\\); registered for 'no_such_op': nothing"):
        dispatch("no_such_op", DataType.F32, (t((1,)),), (), {})


def test_every_op_has_cpu_kernels_for_the_three_float_types():
    for name in ("add", "add_rms_norm", "argmax", "embedding", "linear", "rearrange", "rms_norm", "rope",
                 "self_attention", "swiglu"):
        keys = {(k[1], k[2], k[3]) for k in registered_kernels(name)}
        for dt in (DataType.F32, DataType.F16, DataType.BF16):
            assert ("cpu", Layout.ANY, dt) in keys, (name, dt)


def test_registered_kernel_is_dispatched_by_device_type_and_dtype(fake_device, rng):
    calls: list[tuple[str, DataType]] = []

    @register_kernel("add", "fakedev", Layout.ANY, [DataType.F32])
    def fake_add(outputs, inputs, attrs):
        calls.append(("add", outputs[0].dtype))
        # Device memory is opaque: move it through the host like a real backend's kernel would.
        a, b = (x.numpy() for x in inputs)
        outputs[0].load(a + b)

    try:
        with pytest.raises(ValueError, match="kernel \\(add, fakedev, ANY, F32\\) is already registered"):
            register_kernel("add", "fakedev", Layout.ANY, [DataType.F32], kernel=fake_add)
        a, b = (random_tensor((3,), DataType.F32, rng).to("fakedev:0") for _ in range(2))
        out = F.add(a, b)
        assert calls == [("add", DataType.F32)] and str(out.device) == "fakedev:0"
        assert_close(out, to_torch(a) + to_torch(b))
    finally:
        unregister_kernels("fakedev")
    assert registered_kernels("add") and all(k[1] != "fakedev" for k in registered_kernels("add"))


def test_register_needs_a_dtype():
    with pytest.raises(ValueError, match="give at least one dtype"):
        register_kernel("add", "cpu", Layout.ANY, [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_on_a_device_without_kernels_fall_back_to_the_cpu(fake_device, dtype, rng):
    x = random_tensor((3, 2, 8), dtype, rng)
    w = random_tensor((5, 8), dtype, rng)
    pos = Tensor.from_numpy(np.array([4, 0, 9], np.int64))
    dx, dw, dpos = (v.to("fakedev:1") for v in (x, w, pos))
    assert_close(F.linear(dx, dw), TF.linear(to_torch(x), to_torch(w)))
    roped = F.rope(dx.slice(1, 0, 1), dpos, 1e4)  # a strided view on the device
    assert str(roped.device) == "fakedev:1"
    assert_close(roped, rope_ref(to_torch(x)[:, :1], to_torch(pos), 1e4))


def test_fallback_can_be_switched_off(fake_device, monkeypatch):
    monkeypatch.setenv("LLAISYS_KERNEL_FALLBACK", "0")
    a = t((2,)).to("fakedev:0")
    with pytest.raises(KernelNotFoundError, match="no kernel \\(add, fakedev, ANY, F32\\) and CPU fallback is off"):
        F.add(a, a)
