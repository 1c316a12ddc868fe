"""ops.Plan: recorded op calls replay as the direct calls did; a model's recorded passes
(decoding over moving cache rows, several caches, truncation) give the logits of a fresh pass."""
from __future__ import annotations

import numpy as np
import pytest

from llaisys import DataType, ops
from llaisys.ops.plan import ReplayStats
from llaisys.tensor import Tensor


def _t(a: np.ndarray) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def test_plan_records_instead_of_running_and_replays():
    rng = np.random.default_rng(0)
    a, b, w = rng.standard_normal((4, 8)), rng.standard_normal((4, 8)), rng.standard_normal(8)
    ta, tb, tw = _t(a), _t(b), _t(w)
    s, y = Tensor.zeros((4, 8)), Tensor.zeros((4, 8))
    plan = ops.Plan()
    ops.add(s, ta, tb, plan=plan)
    ops.rms_norm(y, s, tw, 1e-6, plan=plan)
    assert len(plan) == 2 and not s.numpy().any()  # recorded, not run
    plan.run()
    ref = ops.functional.rms_norm(ops.functional.add(ta, tb), tw, 1e-6).numpy()
    np.testing.assert_array_equal(y.numpy(), ref)
    plan.rebind(0, inputs=(ta, ta))
    plan.run()
    np.testing.assert_array_equal(y.numpy(), ops.functional.rms_norm(ops.functional.add(ta, ta), tw, 1e-6).numpy())


@pytest.fixture
def native_ops_registered():
    """The native small-op kernels registered for the test (LLAISYS_NATIVE_OPS=0 leaves the
    NumPy ones), and the registration there was before put back."""
    from llaisys import DataType
    from llaisys.kernels import find_kernel
    from llaisys.kernels.cpu import native_ops

    was_native = find_kernel("rms_norm", "cpu", DataType.F32) is native_ops.rms_norm
    native_ops.register(native=True)
    yield
    native_ops.register(native=was_native)


@pytest.mark.usefixtures("native_ops_registered")
def test_native_stretches_replay_the_bits_of_the_direct_calls():
    """Kernels with a native form run a stretch at a time in one native call; the results are
    the direct calls' bits, rebinding moves a copy's destination, and a call without a native
    form (argmax) splits the stretch."""
    from llaisys.kernels.cpu import native_calls

    if not native_calls.available():
        pytest.fail("the native ops library is not built; the test suite runs against a built package")
    rng = np.random.default_rng(1)
    x, proj, w = _t(rng.standard_normal((1, 64))), _t(rng.standard_normal((1, 64))), _t(rng.standard_normal(64))
    qk = _t(rng.standard_normal((1, 6, 16)))
    pos = Tensor.from_numpy(np.array([7], dtype=np.int64))
    h, total, roped, s = Tensor.zeros((1, 64)), Tensor.zeros((1, 64)), Tensor.zeros((1, 6, 16)), Tensor.zeros((1, 64))
    cache = Tensor.zeros((4, 2, 16))
    plan = ops.Plan()
    ops.add_rms_norm(h, total, x, proj, w, 1e-6, plan=plan)
    ops.rope(roped, qk, pos, 1e4, plan=plan)
    ops.rearrange(cache.slice(0, 0, 1), roped.slice(1, 4, 6), plan=plan)
    ops.add(s, h, x, plan=plan)
    idx, val = Tensor.zeros((1,), dtype=DataType.I64), Tensor.zeros((1,))
    ops.argmax(idx, val, s, plan=plan)  # no native form: the stretch ends here
    ops.rms_norm(h, s, w, 1e-6, plan=plan)
    plan.run()
    assert len(plan._program) == 3  # [add_rms_norm, rope, rearrange, add], argmax, [rms_norm]
    assert plan.stats() == ReplayStats(calls=6, native=5, stretches=2, python=1)
    want_h1 = ops.functional.add_rms_norm(x, proj, w, 1e-6)[0]
    want_rope = ops.functional.rope(qk, pos, 1e4)
    want_h = ops.functional.rms_norm(ops.functional.add(want_h1, x), w, 1e-6)
    np.testing.assert_array_equal(h.numpy(), want_h.numpy())
    assert idx.numpy()[0] == np.argmax(ops.functional.add(want_h1, x).numpy())
    import torch  # and against PyTorch: rms_norm(rms_norm(x + proj) + x)

    def norm(a):
        return a / torch.sqrt((a * a).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(w.numpy()).double()

    xd, pd = torch.from_numpy(x.numpy()).double(), torch.from_numpy(proj.numpy()).double()
    np.testing.assert_allclose(h.numpy(), norm(norm(xd + pd) + xd).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(roped.numpy(), want_rope.numpy())
    np.testing.assert_array_equal(cache.numpy()[0], want_rope.numpy()[0, 4:6])
    pos.load(np.array([9], dtype=np.int64))  # the next step: another position, another cache row
    plan.rebind(2, outputs=(cache.slice(0, 2, 3),))
    plan.run()
    np.testing.assert_array_equal(cache.numpy()[2], ops.functional.rope(qk, pos, 1e4).numpy()[0, 4:6])


def test_plan_checks_arguments_when_recording():
    plan = ops.Plan()
    with pytest.raises(ValueError, match="add"):
        ops.add(Tensor.zeros((2, 3)), Tensor.zeros((2, 3)), Tensor.zeros((3, 2)), plan=plan)
    assert len(plan) == 0


@pytest.fixture(scope="module")
def model():
    from llaisys.models import load_model
    return load_model()


def test_replayed_decoding_matches_one_pass(model):
    ids = [1, 504, 3458, 314, 260, 1789, 28, 2, 5, 17]
    full = model.forward(ids, model.new_cache(), all_logits=True)  # (S, V), one recorded pass
    a, b = model.new_cache(), model.new_cache()
    model.forward(ids[:3], a)
    model.forward(ids[:5], b)
    for i in range(3, len(ids)):  # two caches take turns: each keeps its own recorded passes
        np.testing.assert_allclose(model.forward([ids[i]], a), full[i], rtol=1e-4, atol=1e-4)
        if 5 + i - 3 < len(ids):
            np.testing.assert_allclose(model.forward([ids[5 + i - 3]], b), full[5 + i - 3], rtol=1e-4, atol=1e-4)
    a.truncate(4)  # a replay after a truncation writes and reads the rows it should
    np.testing.assert_allclose(model.forward([ids[4]], a), full[4], rtol=1e-4, atol=1e-4)


def test_stretch_goes_on_after_a_status_its_call_accepts():
    """A nonzero status goes to the failing call's ``fail`` hook (a plugin's C_WARNING is logged
    and accepted there): the stretch goes on with the next call; without a hook it raises,
    naming the call."""
    import ctypes

    from llaisys import _native
    from llaisys.kernels.cpu import native_calls

    if not native_calls.available():
        pytest.fail("the native ops library is not built; the test suite runs against a built package")
    seen: list[int] = []
    copy_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
        lambda device, dst, src, n: seen.append(n) or (1 if n == 1 else 0))  # the first returns C_WARNING
    trampoline = native_calls.address(_native.load("ops"), "llaisys_ops_plugin_copy_call")

    def call(n: int, fail=None) -> native_calls.NativeCall:
        block = native_calls._CopyCall(ctypes.cast(copy_fn, ctypes.c_void_p).value, 0, 0, 0, n)
        return native_calls.NativeCall(f"copy {n}", trampoline, block, fail=fail)

    accepted: list[int] = []
    native_calls.batch([call(1, fail=accepted.append), call(2), call(3)])()
    assert seen == [1, 2, 3] and accepted == [1]
    with pytest.raises(RuntimeError, match="copy 1 failed with status 1 in a replayed plan"):
        native_calls.batch([call(1), call(2)])()
    assert seen == [1, 2, 3, 1]


@pytest.fixture(scope="module")
def half_weights_model(tmp_path_factory):
    """A random 3-layer Llama with F16 weights computed in f32: every kernel of its layers has
    a native form (the F16 linear is the quantized library's)."""
    from conftest import random_hf_model
    from llaisys.models import load_model

    hf = random_hf_model("llama", 5, vocab_size=300, num_hidden_layers=3, max_position_embeddings=128).half()
    folder = tmp_path_factory.mktemp("llama-f16")
    hf.save_pretrained(folder)
    return load_model(folder, dtype="f32")


def _serve_sixteen(model) -> tuple[list[np.ndarray], ReplayStats, list[str]]:
    """Sixteen sequences: a mixed prefill pass, then three decoding steps over a new paged
    cache; their logits, and how the decoding pass replays (stats, the kernels run from Python)."""
    from llaisys.models.paged_cache import TokenBatch

    rng = np.random.default_rng(7)
    bs = 4
    cache = model.new_paged_cache(num_blocks=96, block_size=bs)
    prompts = [list(rng.integers(0, 300, 3 + i % 7)) for i in range(16)]
    tables = [list(range(6 * i, 6 * i + 6))[::-1] for i in range(16)]  # disjoint, out of order
    logits = [model.forward_batch(TokenBatch.build([(p, 0, t, True) for p, t in zip(prompts, tables)], bs,
                                                   cache.max_blocks), cache)]
    for step in range(3):
        chunks = [([int(rng.integers(0, 300))], len(p) + step, t, True) for p, t in zip(prompts, tables)]
        logits.append(model.forward_batch(TokenBatch.build(chunks, bs, cache.max_blocks), cache))
    plan = cache.passes[(16, 16, 16)].plan
    python = [getattr(c[0], "__name__", "?") for c, native in zip(plan.calls, plan._native) if not native]
    return logits, plan.stats(), python


@pytest.mark.usefixtures("native_ops_registered")
def test_batched_decoding_step_is_one_native_stretch(half_weights_model, monkeypatch):
    """A recorded batched pass replays as one native stretch, every layer's kv_cache_write and
    paged_attention and the head's row gather included; its logits are the bits of today's replay (the paged
    kernels called from Python between stretches) and of the kernel-by-kernel one."""
    from llaisys.kernels.cpu import native_calls, paged_native

    if not native_calls.available():
        pytest.fail("the native ops library is not built; the test suite runs against a built package")
    logits, stats, python = _serve_sixteen(half_weights_model)
    layers = half_weights_model.config.num_hidden_layers
    assert stats == ReplayStats(calls=stats.calls, native=stats.calls, stretches=1, python=0), python
    assert stats.calls >= 10 * layers
    with monkeypatch.context() as m:  # today's replay: the paged kernels from Python, once per layer
        m.delattr(paged_native.paged_attention, "native_call")
        m.delattr(paged_native.kv_cache_write, "native_call")
        before, before_stats, _ = _serve_sixteen(half_weights_model)
    assert before_stats.stretches == layers + 1 and before_stats.python == stats.python + 2 * layers
    with monkeypatch.context() as m:  # every kernel called from Python
        m.setattr(native_calls, "available", lambda: False)
        one_by_one, one_stats, _ = _serve_sixteen(half_weights_model)
    assert one_stats.stretches == 0
    for got, today, plain in zip(logits, before, one_by_one):
        assert np.array_equal(got, today) and np.array_equal(got, plain)


@pytest.mark.parametrize("dtype,table_dtype", [(DataType.F32, DataType.F32), (DataType.F16, DataType.F16),
                                               (DataType.F32, DataType.F16), (DataType.F32, DataType.BF16)])
def test_embedding_replays_as_a_native_gather(dtype, table_dtype):
    """A recorded embedding (a pass's gather of its logit rows) runs in C with np.take's
    bytes (an F16/BF16 table's rows widened to F32 exactly, as NumPy widens them), reads its
    index at every run, and an index out of range raises the direct error."""
    from llaisys.kernels.cpu import native_calls

    if not native_calls.available():
        pytest.fail("the native ops library is not built; the test suite runs against a built package")
    rng = np.random.default_rng(3)
    values = rng.standard_normal((9, 24)).astype(np.float32)
    values[0, :4] = [6e-8, -1e-39, np.inf, np.nan]  # an F16 subnormal, a BF16 subnormal, inf, nan
    table = Tensor.from_numpy(values, dtype=table_dtype)
    rows = Tensor.from_numpy(np.array([4, 0, 8], np.int64))
    out = Tensor.zeros((3, 24), dtype=dtype)
    plan = ops.Plan()
    ops.embedding(out, rows, table, plan=plan)
    assert plan.stats() == ReplayStats(calls=1, native=1, stretches=1, python=0)
    for index in ([4, 0, 8], [1, 1, 7]):
        rows.load(np.array(index, np.int64))
        plan.run()
        want = table.numpy()[np.array(index)].astype(np.float32)  # NumPy's (ml_dtypes') widening
        assert np.array_equal(out.numpy().astype(np.float32), want, equal_nan=True)
        assert np.array_equal(out.numpy(), ops.functional.embedding(rows, table).numpy(), equal_nan=True)
    rows.load(np.array([2, 9, -1], np.int64))
    with pytest.raises(ValueError, match="embedding: index 9 is out of range for a table of 9 rows"):
        plan.run()
