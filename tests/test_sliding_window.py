"""Sliding-window attention in the ops: ``self_attention`` and ``paged_attention`` with
``window=W`` against torch's attention under transformers' mask (a query sees keys
pos - W + 1 .. pos), on the CPU and the nvidia kernels (interpreted without a GPU), paged
batches with blocks the window has left behind, and the dispatch that keeps a windowed call
away from kernels that know no window."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import llaisys
from llaisys import DataType, Tensor, ops

H, KH, D = 4, 2, 16


def torch_window_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int) -> np.ndarray:
    """q (S, H, D) at positions T-S .. T-1 over k, v (T, KH, D), each query seeing its last
    ``window`` keys: (S, H, D), by torch's scaled_dot_product_attention with an explicit mask."""
    s, t = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    qt = torch.from_numpy(q).permute(1, 0, 2)  # (H, S, D)
    kt = torch.from_numpy(k).repeat_interleave(g, dim=1).permute(1, 0, 2)  # (H, T, D)
    vt = torch.from_numpy(v).repeat_interleave(g, dim=1).permute(1, 0, 2)
    pos = torch.arange(s)[:, None] + (t - s)
    key = torch.arange(t)[None, :]
    mask = (key <= pos) & (key > pos - window)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.permute(1, 0, 2).numpy()


@pytest.fixture(params=["cpu", "nvidia"])
def device(request):
    return request.getfixturevalue("nvidia_device") if request.param == "nvidia" else "cpu"


@pytest.mark.parametrize("s, t, window", [(1, 20, 5), (6, 20, 5), (20, 20, 7), (3, 9, 1), (4, 10, 64)])
def test_self_attention_window_matches_torch(device, s, t, window):
    rng = np.random.default_rng(s * 100 + t)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((s, H, D), (t, KH, D), (t, KH, D)))
    out = Tensor.empty((s, H, D), DataType.F32, device)
    ops.self_attention(out, Tensor.from_numpy(q, device), Tensor.from_numpy(k, device), Tensor.from_numpy(v, device),
                       0.25, window=window)
    np.testing.assert_allclose(out.numpy(), torch_window_attention(q, k, v, 0.25, window), atol=2e-5, rtol=1e-5)


def test_paged_attention_window_matches_torch_per_sequence(device):
    """Three sequences with shuffled blocks of 4 slots, one prefilling 9 queries and two
    decoding, windows of 6: each sequence's rows equal torch's over its own keys."""
    rng = np.random.default_rng(5)
    bs, nb, window = 4, 24, 6
    k_pool = rng.standard_normal((nb, bs, KH, D)).astype(np.float32)
    v_pool = rng.standard_normal((nb, bs, KH, D)).astype(np.float32)
    lens, q_lens = [17, 9, 23], [1, 9, 1]
    tables = np.full((3, 6), -1, np.int64)
    free = list(rng.permutation(nb))
    for b, n in enumerate(lens):
        tables[b, :-(-n // bs)] = [free.pop() for _ in range(-(-n // bs))]
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    q = rng.standard_normal((int(starts[-1]), H, D)).astype(np.float32)
    out = Tensor.empty(q.shape, DataType.F32, device)
    t = lambda a: Tensor.from_numpy(np.ascontiguousarray(a), device)  # noqa: E731
    ops.paged_attention(out, t(q), t(k_pool), t(v_pool), t(tables), t(starts), t(np.array(lens, np.int64)), 0.3,
                        window=window)
    got = out.numpy()
    for b, n in enumerate(lens):
        keys = np.concatenate([k_pool[i] for i in tables[b, :-(-n // bs)]])[:n]  # (T, KH, D)
        vals = np.concatenate([v_pool[i] for i in tables[b, :-(-n // bs)]])[:n]
        want = torch_window_attention(q[starts[b]:starts[b + 1]], keys, vals, 0.3, window)
        np.testing.assert_allclose(got[starts[b]:starts[b + 1]], want, atol=2e-5, rtol=1e-5, err_msg=f"sequence {b}")


def test_window_zero_is_the_plain_op_and_a_bad_window_is_refused():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((3, H, D)).astype(np.float32), rng.standard_normal((8, KH, D)).astype(np.float32)
    a, b = Tensor.empty((3, H, D), DataType.F32), Tensor.empty((3, H, D), DataType.F32)
    ops.self_attention(a, Tensor.from_numpy(q), Tensor.from_numpy(k), Tensor.from_numpy(k), 0.2)
    ops.self_attention(b, Tensor.from_numpy(q), Tensor.from_numpy(k), Tensor.from_numpy(k), 0.2, window=0)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="window must be an integer >= 0"):
            ops.self_attention(a, Tensor.from_numpy(q), Tensor.from_numpy(k), Tensor.from_numpy(k), 0.2, window=bad)


def test_a_windowed_call_never_reaches_a_kernel_without_windows():
    """A windowed call dispatches under its own name: a kernel registered only for the plain
    op (as a plugin's self_attention is) is not handed it."""
    from llaisys.kernels.registry import find_kernel

    assert find_kernel("self_attention_window", "cpu", DataType.F32) is not find_kernel(
        "self_attention", "cpu", DataType.F32)
    plan = llaisys.ops.Plan()
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, H, D)).astype(np.float32), rng.standard_normal((5, KH, D)).astype(np.float32)
    out = Tensor.empty((2, H, D), DataType.F32)
    ops.self_attention(out, Tensor.from_numpy(q), Tensor.from_numpy(k), Tensor.from_numpy(k), 0.2, window=2, plan=plan)
    assert plan.calls[0][0] is find_kernel("self_attention_window", "cpu", DataType.F32)


def test_native_window_rows_are_batch_invariant_and_equal_at_every_level():
    """The native windowed kernel: a decoding row alone equals the same row inside a batch
    with a prefill, bit for bit, and every SIMD level gives the same bits."""
    from llaisys.kernels.cpu import paged_native

    if not paged_native.available():
        pytest.fail("the native kernels are not built; the test suite runs against a built package")
    rng = np.random.default_rng(9)
    bs, nb, window = 8, 16, 11
    k_pool = rng.standard_normal((nb, bs, KH, D)).astype(np.float32)
    v_pool = rng.standard_normal((nb, bs, KH, D)).astype(np.float32)
    tables = np.array([[3, 7, 1, 0, 2, 4], [5, 6, 8, 9, 10, 11]], np.int64)
    q = rng.standard_normal((1 + 13, H, D)).astype(np.float32)

    def run(qs, lens, rows, tbl):
        out = Tensor.empty((rows.shape[0], H, D), DataType.F32)
        ops.paged_attention(out, Tensor.from_numpy(rows), Tensor.from_numpy(k_pool), Tensor.from_numpy(v_pool),
                            Tensor.from_numpy(tbl), Tensor.from_numpy(np.array(qs, np.int64)),
                            Tensor.from_numpy(np.array(lens, np.int64)), 0.3, window=window)
        return out.numpy()

    alone = run([0, 1], [37], q[:1], tables[:1])
    batched = run([0, 1, 14], [37, 40], q, tables)
    np.testing.assert_array_equal(alone[0], batched[0])
    level = paged_native.set_simd(-1)
    try:
        for other in range(level + 1):
            paged_native.set_simd(other)
            np.testing.assert_array_equal(run([0, 1, 14], [37, 40], q, tables), batched, err_msg=f"level {other}")
    finally:
        paged_native.set_simd(level)
