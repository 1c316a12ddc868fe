"""Tensor creation, host transfer and strided views, checked against NumPy semantics."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import llaisys
from llaisys import DataType, Tensor
from llaisys.tensor import FrozenTensorError
from llaisys.runtime import get_runtime

NUMPY_TYPES = [t for t in DataType if t not in (DataType.INVALID, DataType.C16, DataType.C32) and not t.is_quantized]


def arange(shape, dtype=np.float32) -> tuple[Tensor, np.ndarray]:
    """A tensor holding 0, 1, 2, ... and the same NumPy array."""
    host = np.arange(math.prod(shape)).astype(dtype).reshape(shape)
    return Tensor.from_numpy(host), host


def shares_storage(a: Tensor, b: Tensor) -> bool:
    return a.storage is b.storage


def as_cpu() -> llaisys.Device:
    return llaisys.runtime.as_device("cpu:0")


# ---- creation ---------------------------------------------------------------------------
@pytest.mark.parametrize("dt", NUMPY_TYPES, ids=lambda t: t.name)
def test_from_numpy_round_trip_every_type(dt):
    host = (np.arange(24) % 7).reshape(2, 3, 4).astype(dt.numpy)
    t = Tensor.from_numpy(host, dtype=dt)  # BYTE is only chosen explicitly (uint8 reads as U8)
    assert (t.shape, t.dtype, t.strides, str(t.device)) == ((2, 3, 4), dt, (12, 4, 1), "cpu:0")
    assert t.numpy().dtype == dt.numpy
    assert t.numpy().tobytes() == host.tobytes()


def test_from_numpy_converts_to_the_requested_type():
    host = np.array([[0.1, -2.5], [3.25, 1e4]])  # float64
    t = Tensor.from_numpy(host, dtype="bf16")
    assert t.dtype is DataType.BF16
    np.testing.assert_array_equal(t.numpy(), host.astype(DataType.BF16.numpy))


def test_from_numpy_copies():
    host = np.ones(3, np.float32)
    t = Tensor.from_numpy(host)
    host[:] = 5
    np.testing.assert_array_equal(t.numpy(), np.ones(3))


def test_from_numpy_of_a_non_contiguous_array():
    host = np.arange(20, dtype=np.float32).reshape(4, 5)[:, 1::2].T  # strided and transposed
    t = Tensor.from_numpy(host)
    assert t.is_contiguous()
    np.testing.assert_array_equal(t.numpy(), host)


@pytest.mark.parametrize("dt", [DataType.F32, DataType.BF16, DataType.I64, DataType.BOOL], ids=lambda t: t.name)
def test_zeros(dt):
    Tensor.empty((64,), dt).load(np.ones(64, dt.numpy))  # leave non-zero bytes in the cache
    t = Tensor.zeros((3, 5), dt)
    np.testing.assert_array_equal(t.numpy(), np.zeros((3, 5), dt.numpy))


def test_empty_takes_shape_dtype_and_device_in_several_spellings():
    a = Tensor.empty(5)
    b = llaisys.empty([2, 3], "f16", "cpu")
    c = llaisys.zeros((np.int64(2), 1), DataType.I32, llaisys.Device(llaisys.DeviceType.CPU, 0))
    assert (a.shape, a.dtype) == ((5,), DataType.F32)
    assert (b.shape, b.dtype, b.device) == ((2, 3), DataType.F16, as_cpu())
    assert (c.shape, c.dtype) == ((2, 1), DataType.I32)
    assert type(c.shape[0]) is int


def test_zero_sized_and_scalar_tensors():
    z = Tensor.empty((0, 4))
    assert z.numel() == 0 and z.numpy().shape == (0, 4)
    zp = z.permute(1, 0)
    assert zp.is_contiguous() == np.empty((0, 4)).T.flags.c_contiguous
    assert zp.view(2, 0, 2).shape == (2, 0, 2)
    s = Tensor.from_numpy(np.array(2.5, np.float32))
    assert s.shape == () and s.numel() == 1 and s.numpy() == 2.5
    assert s.view(1).numpy().tolist() == [2.5]


@pytest.mark.parametrize("shape, exc, message", [
    ((2, -1), ValueError, "negative dimension"),
    ((2.0, 3), TypeError, "non-integer dimension 2.0"),
    ("ab", TypeError, "non-integer dimension 'a'"),
    (None, TypeError, "must be an int or a sequence of ints"),
])
def test_bad_shapes(shape, exc, message):
    with pytest.raises(exc, match=message):
        Tensor.empty(shape)


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match="unknown data type 'f33'"):
        Tensor.empty((2,), "f33")
    with pytest.raises(ValueError, match="INVALID"):
        Tensor.empty((2,), DataType.INVALID)
    with pytest.raises(ValueError, match="device cpu:1 does not exist; cpu has 1 device"):
        Tensor.empty((2,), device="cpu:1")
    with pytest.raises(ValueError, match="unknown device type 'gpu'"):
        Tensor.empty((2,), device="gpu")


# ---- host transfer ----------------------------------------------------------------------
def test_load_raw_bytes():
    host = np.arange(6, dtype=np.float16).reshape(2, 3)
    t = Tensor.empty((2, 3), "f16").load(host.tobytes())
    np.testing.assert_array_equal(t.numpy(), host)
    with pytest.raises(ValueError, match="buffer has 10 bytes, tensor \\(2, 3\\) F16 needs 12"):
        t.load(bytes(10))


def test_load_array_of_wrong_shape():
    with pytest.raises(ValueError, match="array shape \\(3, 2\\) does not match tensor shape \\(2, 3\\)"):
        Tensor.empty((2, 3)).load(np.zeros((3, 2)))


def test_load_into_a_view_writes_through():
    t, host = arange((4, 5))
    t.slice(1, 1, 3).load(np.full((4, 2), -1.0))
    host[:, 1:3] = -1
    np.testing.assert_array_equal(t.numpy(), host)


def test_numpy_returns_an_independent_c_contiguous_copy():
    t, host = arange((3, 4))
    p = t.permute(1, 0)
    out = p.numpy()
    assert out.flags.c_contiguous
    out[:] = 0
    np.testing.assert_array_equal(t.numpy(), host)


def test_to_same_device_is_identity():
    t, _ = arange((2,))
    assert t.to("cpu") is t and t.to("cpu:0") is t


# ---- views ------------------------------------------------------------------------------
def test_permute_matches_numpy_transpose():
    t, host = arange((2, 3, 4))
    for dims in itertools.permutations(range(3)):
        p = t.permute(*dims)
        ref = host.transpose(dims)
        assert p.shape == ref.shape and shares_storage(p, t)
        assert p.is_contiguous() == ref.flags.c_contiguous
        np.testing.assert_array_equal(p.numpy(), ref)
    np.testing.assert_array_equal(t.permute([-1, 0, 1]).numpy(), host.transpose(2, 0, 1))


@pytest.mark.parametrize("dims, message", [
    ((0, 1), "not a permutation"), ((0, 1, 1), "not a permutation"), ((0, 1, 5), "out of range"),
    ((0, 1, 1.0), "must be ints"),
])
def test_bad_permutations(dims, message):
    t, _ = arange((2, 3, 4))
    with pytest.raises((ValueError, TypeError), match=message):
        t.permute(*dims)


def test_slice_matches_numpy():
    t, host = arange((4, 5, 6))
    for dim in range(3):
        for start, end in [(0, 1), (1, 3), (2, host.shape[dim]), (1, 1)]:
            s = t.slice(dim, start, end)
            index = [slice(None)] * 3
            index[dim] = slice(start, end)
            ref = host[tuple(index)]
            assert s.shape == ref.shape and shares_storage(s, t)
            np.testing.assert_array_equal(s.numpy(), ref)
    np.testing.assert_array_equal(t.slice(-1, 2, 4).numpy(), host[..., 2:4])
    np.testing.assert_array_equal(t.slice(0, 1, 3).slice(2, 1, 4).numpy(), host[1:3, :, 1:4])


@pytest.mark.parametrize("args, exc, message", [
    ((3, 0, 1), ValueError, "dim 3 is out of range for 3 dimensions"),
    ((0, 2, 1), ValueError, "\\[2, 1\\) is not within dimension 0 of size 4"),
    ((1, 0, 6), ValueError, "not within dimension 1 of size 5"),
    ((0, -1, 2), ValueError, "not within"),
    ((0, 0.5, 2), TypeError, "start must be an int"),
])
def test_bad_slices(args, exc, message):
    t, _ = arange((4, 5, 6))
    with pytest.raises(exc, match=message):
        t.slice(*args)


def test_views_share_storage_and_writes_show_through():
    t, host = arange((4, 6))
    v = t.view(2, 2, 6)
    p = t.permute(1, 0)
    s = t.slice(1, 2, 4)
    v.host_array()[1, 0, 0] = -7.0  # element (2, 0)
    s.host_array()[0, 0] = -9.0  # element (0, 2)
    host[2, 0], host[0, 2] = -7.0, -9.0
    for view, ref in [(t, host), (v, host.reshape(2, 2, 6)), (p, host.T), (s, host[:, 2:4])]:
        assert shares_storage(view, t)
        np.testing.assert_array_equal(view.numpy(), ref)


def _numpy_view(a: np.ndarray, shape) -> np.ndarray | None:
    """NumPy's reshape without a copy, or None when it needs one."""
    try:
        return np.reshape(a, shape, copy=False)
    except ValueError:
        return None


def _strided_cases():
    """(name, tensor, numpy array) pairs with varied layouts over the same data."""
    t, host = arange((4, 6, 5))
    yield "contiguous", t, host
    yield "sliced dim0", t.slice(0, 1, 3), host[1:3]
    yield "sliced dim1", t.slice(1, 2, 5), host[:, 2:5]
    yield "sliced last", t.slice(2, 0, 4), host[:, :, 0:4]
    yield "permuted", t.permute(2, 0, 1), host.transpose(2, 0, 1)
    yield "permuted inner", t.permute(0, 2, 1), host.transpose(0, 2, 1)
    yield "sliced permuted", t.slice(1, 0, 4).permute(1, 0, 2), host[:, 0:4].transpose(1, 0, 2)
    u, uh = arange((1, 6, 1, 4))
    yield "unit dims", u, uh
    yield "unit dims permuted", u.permute(2, 1, 0, 3), uh.transpose(2, 1, 0, 3)


def _candidate_shapes(n: int):
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    shapes = {(n,), (1, n), (n, 1)}
    for a in divisors:
        shapes.add((a, n // a))
        for b in divisors:
            if (n // a) % b == 0:
                shapes.add((a, b, n // a // b))
                shapes.add((a, 1, b, n // a // b))
    return sorted(shapes)


@pytest.mark.parametrize("case", list(_strided_cases()), ids=lambda c: c[0])
def test_view_agrees_with_numpy_on_every_reshape(case):
    _, t, host = case
    checked = raised = 0
    for shape in _candidate_shapes(host.size):
        ref = _numpy_view(host, shape)
        if ref is None:
            with pytest.raises(ValueError, match="without a copy; call .contiguous\\(\\) first"):
                t.view(shape)
            raised += 1
        else:
            v = t.view(*shape)
            assert v.shape == ref.shape and shares_storage(v, t)
            np.testing.assert_array_equal(v.numpy(), ref, err_msg=f"view {shape}")
            checked += 1
    assert checked > 0


def test_view_of_a_permuted_tensor_must_raise():
    t, _ = arange((2, 3, 4))
    with pytest.raises(ValueError, match="cannot be viewed as \\(24,\\) without a copy"):
        t.permute(2, 0, 1).view(24)


def test_view_splits_a_dim_of_a_sliced_tensor():
    t, host = arange((6, 8))
    s = t.slice(1, 2, 6)  # (6, 4), rows not adjacent
    v = s.view(3, 2, 2, 2)
    np.testing.assert_array_equal(v.numpy(), host[:, 2:6].reshape(3, 2, 2, 2))
    with pytest.raises(ValueError, match="without a copy"):
        s.view(24)  # merging rows that are not adjacent needs a copy


def test_view_infers_one_dimension():
    t, host = arange((4, 6))
    np.testing.assert_array_equal(t.view(-1, 3).numpy(), host.reshape(-1, 3))
    np.testing.assert_array_equal(t.view((2, -1)).numpy(), host.reshape(2, -1))


@pytest.mark.parametrize("shape, message", [
    ((5, 5), "does not hold the 24 elements"), ((-1, -1), "only one dimension may be -1"),
    ((-1, 5), "cannot infer -1"), ((2.0, 12), "non-integer dimension"), ((-2, -12), "does not hold"),
])
def test_bad_views(shape, message):
    t, _ = arange((4, 6))
    with pytest.raises((ValueError, TypeError), match=message):
        t.view(*shape)


def test_contiguous_and_clone():
    t, host = arange((3, 4))
    assert t.contiguous() is t
    p = t.permute(1, 0)
    c = p.contiguous()
    assert c.is_contiguous() and not shares_storage(c, t)
    np.testing.assert_array_equal(c.numpy(), host.T)
    k = t.clone()
    k.host_array()[0, 0] = 99
    assert t.numpy()[0, 0] == 0


def test_copy_between_layouts():
    t, host = arange((3, 4))
    dst = Tensor.zeros((4, 3))
    dst.copy_(t.permute(1, 0))
    np.testing.assert_array_equal(dst.numpy(), host.T)
    dst.permute(1, 0).copy_(t)  # into a strided destination
    np.testing.assert_array_equal(dst.numpy(), host.T)
    with pytest.raises(ValueError, match="does not match"):
        dst.copy_(t)


def test_overlapping_copy_within_one_storage():
    t, host = arange((8,))
    t.slice(0, 1, 8).copy_(t.slice(0, 0, 7))
    expected = host.copy()
    expected[1:] = host[:7]
    np.testing.assert_array_equal(t.numpy(), expected)


def test_storage_returns_to_the_allocator_with_its_last_view():
    allocator = get_runtime("cpu").allocator
    before = allocator.stats().allocated
    t = Tensor.empty((1000,))
    v = t.slice(0, 10, 20).view(2, 5)
    arr = v.host_array()
    del t, v
    assert allocator.stats().allocated > before  # the NumPy view still holds the storage
    del arr
    assert allocator.stats().allocated == before



# ---- frozen (read-only) tensors ------------------------------------------------------------
def test_frozen_tensor_refuses_every_write():
    t, host = arange((3, 4))
    view = t.slice(1, 1, 3)  # made before freezing: shares the storage, so it is frozen too
    assert t.freeze() is t and t.frozen and view.frozen
    with pytest.raises(FrozenTensorError, match=r"op add: cannot write into a frozen \(read-only\) tensor \(3, 4\) F32"):
        llaisys.ops.add(t, t, t)
    with pytest.raises(FrozenTensorError, match="copy_: cannot write into a frozen"):
        view.copy_(Tensor.zeros((3, 2)))
    with pytest.raises(FrozenTensorError, match="load: cannot write into a frozen"):
        t.load(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="read-only"):
        t.host_array()[0, 0] = 7.0  # NumPy's own error: the host view is read-only
    np.testing.assert_array_equal(t.numpy(), host)  # nothing changed
    assert issubclass(FrozenTensorError, ValueError)


def test_frozen_tensor_reads_and_copies_normally():
    t, host = arange((3, 4))
    t.freeze()
    out = llaisys.ops.functional.add(t, t)  # a frozen input is fine
    np.testing.assert_array_equal(out.numpy(), host * 2)
    copy = t.clone()
    assert not copy.frozen and copy.storage is not t.storage
    copy.load(np.zeros((3, 4), np.float32))  # the copy is writable
    np.testing.assert_array_equal(t.permute(1, 0).contiguous().numpy(), host.T)


def test_host_view_is_a_frozen_tensor_over_bytes_it_does_not_copy():
    raw = np.frombuffer(np.arange(8, dtype=np.float32).tobytes(), np.uint8)  # read-only, like a file map
    t = Tensor.host_view(raw, (2, 4), DataType.F32)
    assert t.frozen and np.shares_memory(t.host_array(), raw) and not t.host_array().flags.writeable
    np.testing.assert_array_equal(t.numpy(), np.arange(8, dtype=np.float32).reshape(2, 4))
    with pytest.raises(FrozenTensorError, match="load: cannot write into a frozen"):
        t.load(np.zeros((2, 4), np.float32))
    np.testing.assert_array_equal(llaisys.ops.functional.add(t, t).numpy(), 2 * t.numpy())
    with pytest.raises(ValueError, match="32 bytes do not hold a F32 tensor"):
        Tensor.host_view(raw, (3, 4), DataType.F32)
    q = Tensor.host_view(np.zeros(40, np.uint8), (2, 32), DataType.Q4_1)  # two blocks of 20 bytes
    assert q.raw_shape == (2, 20) and q.frozen


def _resident_bytes() -> int:
    """This process's resident set, from the kernel's own count (/proc/self/statm, in pages)."""
    import mmap

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_dropping_file_pages_frees_memory_and_keeps_the_bytes(tmp_path):
    import mmap

    data = np.random.default_rng(0).integers(0, 256, 64 << 20, np.uint8)  # 64 MiB
    path = tmp_path / "weights.bin"
    data.tofile(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, np.uint8)
    t = Tensor.host_view(view[100:], (view.size - 100,), DataType.U8)
    assert int(t.host_array().sum(dtype=np.int64)) == int(data[100:].sum(dtype=np.int64))  # every page touched
    before = _resident_bytes()
    assert t.storage.drop_file_pages(0, t.storage.nbytes)
    assert before - _resident_bytes() > 60 << 20  # the kernel took the pages back
    np.testing.assert_array_equal(t.host_array(), data[100:])  # read from the file again
    anonymous = Tensor.from_numpy(data[:1 << 20])
    assert not anonymous.storage.drop_file_pages(0, 1 << 20)  # never memory that is not a file map
    np.testing.assert_array_equal(anonymous.numpy(), data[:1 << 20])


def test_only_frozen_storage_keeps_a_host_copy():
    t, _ = arange((4,))
    with pytest.raises(ValueError, match="not frozen"):
        t.storage.host_copy()
    t.freeze()
    assert t.storage.host_copy() is t.storage  # CPU memory is host memory already

def test_repr_and_debug_print(capsys):
    t = Tensor.from_numpy(np.array([[1.5, 2.0], [3.0, 4.0]], np.float32))
    r = repr(t.permute(1, 0))
    assert "shape=(2, 2)" in r and "dtype=F32" in r and "device=cpu:0" in r and "strides=(1, 2)" in r
    t.debug()
    printed = capsys.readouterr().out
    assert "1.5" in printed and "4." in printed and "F32" in printed
