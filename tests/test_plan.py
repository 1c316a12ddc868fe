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
