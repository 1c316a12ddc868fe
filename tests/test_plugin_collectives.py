"""The reference plugin's collectives between processes (plugins/custom_cpu/ccl.c over POSIX
shared memory): through the C table in groups of 2 and 3 spawned processes, with a dead
peer, and through XcclCommunicator under mpiexec. References are NumPy, in float64 for the
floating types; every rank must hold bitwise the same result."""
from __future__ import annotations

import ctypes
import glob
import json
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import llaisys
from llaisys import DataType, Tensor
from llaisys.backends.plugin import abi
from llaisys.parallel import CommError, SingleProcess
from llaisys.parallel.launch import find_mpiexec
from llaisys.parallel.xccl import XcclCommunicator
from llaisys.plugins import PluginError, load_plugin
from llaisys.plugins.build import build_plugin, build_reference_plugin

DEV = "custom_cpu:0"
SUM, AVG, MAX, MIN, PRODUCT = range(5)
STEP_F32 = (1 << 20) // 4  # float32 elements of one staging area in ccl.c (CC_CCL_CHUNK)
GROUP_TIMEOUT = 60  # seconds a group of processes may take before the test fails
NUMPY_TYPES = {"FLOAT16": np.float16, "BFLOAT16": ml_dtypes.bfloat16, "FLOAT32": np.float32,
               "FLOAT64": np.float64, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32, "INT64": np.int64}
TOLERANCE = {"FLOAT16": (1e-3, 1e-3), "BFLOAT16": (1e-2, 8e-3), "FLOAT32": (1e-6, 1e-6), "FLOAT64": (1e-12, 1e-12)}

# (name, collective, C data type, count, reduce op, root): the cases one group runs.
CASES = [
    ("all_reduce f32 over 4 steps", "all_reduce", "FLOAT32", 3 * STEP_F32 + 1234, SUM, None),
    ("all_reduce f32 in place", "all_reduce_inplace", "FLOAT32", 1001, SUM, None),
    ("all_reduce f32 avg", "all_reduce", "FLOAT32", 999, AVG, None),
    ("all_reduce f32 max", "all_reduce", "FLOAT32", 999, MAX, None),
    ("all_reduce f32 min", "all_reduce", "FLOAT32", 999, MIN, None),
    ("all_reduce f32 product", "all_reduce", "FLOAT32", 999, PRODUCT, None),
    ("all_reduce f64", "all_reduce", "FLOAT64", 777, SUM, None),
    ("all_reduce f16", "all_reduce", "FLOAT16", 5000, SUM, None),
    ("all_reduce bf16", "all_reduce", "BFLOAT16", 5000, SUM, None),
    ("all_reduce i64", "all_reduce", "INT64", 1000, SUM, None),
    ("all_reduce i32 max", "all_reduce", "INT32", 1000, MAX, None),
    ("all_reduce i8 wraps", "all_reduce", "INT8", 1000, SUM, None),
    ("all_reduce u8 min", "all_reduce", "UINT8", 1000, MIN, None),
    ("broadcast from 1", "broadcast", "FLOAT64", 2 * (STEP_F32 // 2) + 5, None, 1),
    ("all_gather i32", "all_gather", "INT32", STEP_F32 + 77, None, None),
    ("reduce to the last rank", "reduce", "FLOAT32", 2000, SUM, -1),
    ("reduce_scatter f32", "reduce_scatter", "FLOAT32", 150_001, SUM, None),
]


def inputs(name: str, dtype: str, count: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s send buffer of case ``name`` (reduce_scatter sends nranks blocks: the
    caller asks for them by count)."""
    rng = np.random.default_rng([sum(map(ord, name)), rank])
    if dtype == "INT64":
        return rng.integers(-(1 << 60), 1 << 60, count, dtype=np.int64)  # past double's 53 bits
    if dtype in ("INT8", "UINT8", "INT32"):
        info = np.iinfo(NUMPY_TYPES[dtype])
        return rng.integers(info.min, info.max, count, endpoint=True, dtype=NUMPY_TYPES[dtype])
    scale = 1.0 if "product" in name else 10.0
    return (rng.standard_normal(count) * scale).astype(NUMPY_TYPES[dtype])


# ---- what each spawned rank runs --------------------------------------------------------------
def _join(table, uid: bytes, nranks: int, rank: int) -> ctypes.c_void_p:
    buf = ctypes.create_string_buffer(uid, len(uid))
    root = abi.C_CCLRootId(len(uid), ctypes.cast(buf, ctypes.c_void_p))
    comm = ctypes.c_void_p()
    status = table.xccl_comm_init_rank(nranks, ctypes.byref(root), rank, ctypes.byref(comm))
    if status != abi.C_SUCCESS:
        raise RuntimeError(f"rank {rank}: xccl_comm_init_rank returned {abi.status_name(status)}")
    return comm


def _run_case(table, comm, stream, nranks: int, rank: int, case: tuple) -> np.ndarray:
    name, kind, dtype, count, op, root = case
    c_type = abi.C_DATA_TYPES.index(dtype)
    send = Tensor.from_numpy(inputs(name, dtype, count * (nranks if kind == "reduce_scatter" else 1), rank), DEV)
    out_count = {"all_gather": nranks * count}.get(kind, count)
    recv = send if kind in ("all_reduce_inplace", "broadcast") else Tensor.zeros((out_count,), send.dtype, DEV)
    root = nranks - 1 if root == -1 else root
    if kind.startswith("all_reduce"):
        status = table.xccl_all_reduce(send.data_ptr, recv.data_ptr, count, c_type, op, comm, stream)
    elif kind == "broadcast":
        status = table.xccl_broadcast(send.data_ptr, count, c_type, root, comm, stream)
    elif kind == "all_gather":
        status = table.xccl_all_gather(send.data_ptr, recv.data_ptr, count, c_type, comm, stream)
    elif kind == "reduce":
        status = table.xccl_reduce(send.data_ptr, recv.data_ptr, count, c_type, op, root, comm, stream)
    else:
        status = table.xccl_reduce_scatter(send.data_ptr, recv.data_ptr, count, c_type, op, comm, stream)
    if status != abi.C_SUCCESS:
        raise RuntimeError(f"rank {rank}: {name} returned {abi.status_name(status)}")
    return recv.numpy()


def _rank_main(results, plugin_path: str, uid: bytes, nranks: int, rank: int, job: str, env: dict) -> None:
    """One rank of a spawned group: join, run ``job``, put (rank, result or error) on ``results``."""
    os.environ.update(env)
    try:
        backend = load_plugin(plugin_path).backend
        table = backend.table
        comm = _join(table, uid, nranks, rank)
        stream = backend.create_stream(0)
        if job == "cases":
            out = {case[0]: _run_case(table, comm, stream, nranks, rank, case) for case in CASES}
        elif rank == nranks - 1:  # job "die": the last rank leaves without a word
            os._exit(0)
        else:
            x = Tensor.from_numpy(np.ones(1000, np.float32), DEV)
            start = time.monotonic()
            first = table.xccl_all_reduce(x.data_ptr, x.data_ptr, 1000, abi.C_DATA_TYPES.index("FLOAT32"), SUM, comm,
                                          stream)
            elapsed = time.monotonic() - start
            again = table.xccl_all_reduce(x.data_ptr, x.data_ptr, 1000, abi.C_DATA_TYPES.index("FLOAT32"), SUM, comm,
                                          stream)
            out = {"status": first, "seconds": elapsed, "again": again}
        backend.destroy_stream(0, stream)
        table.xccl_destroy_comm(comm)
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def run_group(plugin_path: str, uid: bytes, nranks: int, job: str, reporting: int, env: dict | None = None) -> dict:
    """Start ``nranks`` spawned processes running ``job`` and gather the reports of ``reporting``
    of them; a rank's error fails the test."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    env = {"LLAISYS_CCL_TIMEOUT": "30", **(env or {})}
    procs = [ctx.Process(target=_rank_main, args=(results, plugin_path, uid, nranks, r, job, env), daemon=True)
             for r in range(nranks)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + GROUP_TIMEOUT
    try:
        while len(got) < reporting:
            try:
                rank, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{nranks} ranks running {job!r}: only ranks {sorted(got)} reported in {GROUP_TIMEOUT} s")
            if isinstance(value, str):
                pytest.fail(f"rank {rank} of {nranks} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got


def leftover_segments() -> list[str]:
    """Shared-memory segments named by ids this process made."""
    return glob.glob(f"/dev/shm/llcc-{os.getpid()}-*")


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plugin():
    return load_plugin(build_reference_plugin())


def new_id(plugin) -> bytes:
    size = ctypes.c_size_t()
    assert plugin.backend.table.xccl_get_unique_id_size(ctypes.byref(size)) == abi.C_SUCCESS
    buf = ctypes.create_string_buffer(size.value)
    root = abi.C_CCLRootId(size.value, ctypes.cast(buf, ctypes.c_void_p))
    assert plugin.backend.table.xccl_get_unique_id(ctypes.byref(root)) == abi.C_SUCCESS
    return buf.raw


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def group(request, plugin):
    nranks = request.param
    results = run_group(plugin.path, new_id(plugin), nranks, "cases", nranks)
    assert not leftover_segments()
    return nranks, results


# ---- the C table between processes ----------------------------------------------------------
def reference(case: tuple, nranks: int, rank: int) -> np.ndarray | None:
    """What rank ``rank`` must hold after ``case`` (None: its receive buffer stays zero)."""
    name, kind, dtype, count, op, root = case
    if kind == "broadcast":
        return inputs(name, dtype, count, root)
    if kind == "all_gather":
        return np.concatenate([inputs(name, dtype, count, r) for r in range(nranks)])
    if kind == "reduce" and rank != nranks - 1:
        return None
    n = count * (nranks if kind == "reduce_scatter" else 1)
    stack = np.stack([inputs(name, dtype, n, r) for r in range(nranks)])  # (nranks, n)
    if kind == "reduce_scatter":
        stack = stack[:, rank * count:(rank + 1) * count]
    if dtype in TOLERANCE:
        stack = stack.astype(np.float64)
        reducer = {SUM: np.sum, AVG: np.mean, MAX: np.max, MIN: np.min, PRODUCT: np.prod}[op]
        return reducer(stack, axis=0)
    if op == SUM:
        return np.sum(stack, axis=0, dtype=stack.dtype)  # wraps like the plugin
    return {MAX: np.max, MIN: np.min}[op](stack, axis=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_collective_matches_numpy(group, case):
    nranks, results = group
    name, kind, dtype, count, op, root = case
    for rank in range(nranks):
        got, want = results[rank][name], reference(case, nranks, rank)
        if want is None:
            assert not got.any(), f"rank {rank} is no root, yet its receive buffer was written"
        elif dtype in TOLERANCE and op not in (MAX, MIN):
            atol, rtol = TOLERANCE[dtype]
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol, err_msg=f"rank {rank}")
        else:
            np.testing.assert_array_equal(got.astype(want.dtype), want, err_msg=f"rank {rank}")
    if kind in ("all_reduce", "all_reduce_inplace", "broadcast", "all_gather"):
        for rank in range(1, nranks):  # the fixed order of the sum gives every rank the same bits
            assert results[rank][name].tobytes() == results[0][name].tobytes()


@pytest.mark.timeout(120)
def test_dead_peer_fails_the_others_fast(plugin, capfd):
    # The timeout is far above the bound asserted: the peers' deaths must be noticed first.
    results = run_group(plugin.path, new_id(plugin), 3, "die", reporting=2, env={"LLAISYS_CCL_TIMEOUT": "20"})
    for rank, report in results.items():
        assert report["status"] == abi.C_FAILED, f"rank {rank}"
        assert report["seconds"] < 5, f"rank {rank} took {report['seconds']:.1f} s to notice"
        assert report["again"] == abi.C_FAILED  # the communicator stays failed
    assert not leftover_segments()
    assert "rank 2 (pid" in capfd.readouterr().err


# ---- joining, in one process ------------------------------------------------------------------
def _init(plugin, uid: bytes, nranks: int, rank: int, out: dict | None = None) -> int:
    buf = ctypes.create_string_buffer(uid, len(uid))
    root = abi.C_CCLRootId(len(uid), ctypes.cast(buf, ctypes.c_void_p))
    comm = ctypes.c_void_p()
    start = time.monotonic()
    status = plugin.backend.table.xccl_comm_init_rank(nranks, ctypes.byref(root), rank, ctypes.byref(comm))
    if status == abi.C_SUCCESS:
        plugin.backend.table.xccl_destroy_comm(comm)
    if out is not None:
        out.update(status=status, seconds=time.monotonic() - start)
    return status


def test_init_refuses_bad_arguments(plugin):
    uid = new_id(plugin)
    assert uid.startswith(b"/llcc-") and len(uid) == 32 and uid != new_id(plugin)
    assert _init(plugin, uid, 0, 0) == abi.C_ERROR
    assert _init(plugin, uid, 2, 2) == abi.C_ERROR
    assert _init(plugin, bytes(32), 2, 0) == abi.C_ERROR  # no id made by xccl_get_unique_id
    assert not leftover_segments()


def _with_first_rank(plugin, uid: bytes, nranks: int, second) -> dict:
    """Rank 0 of ``nranks`` joins on a thread; once its segment exists ``second()`` runs.
    Returns rank 0's status and the seconds its join took."""
    first: dict = {}
    thread = threading.Thread(target=_init, args=(plugin, uid, nranks, 0, first))
    thread.start()
    try:
        path = "/dev/shm/" + uid.rstrip(b"\0").decode()[1:]
        deadline = time.monotonic() + 5
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        second()
    finally:
        thread.join(30)
    return first


def test_init_refuses_another_group_size(plugin, monkeypatch):
    monkeypatch.setenv("LLAISYS_CCL_TIMEOUT", "0.5")
    uid = new_id(plugin)
    first = _with_first_rank(plugin, uid, 2, lambda: assert_status(_init(plugin, uid, 3, 1), abi.C_ERROR))
    assert first["status"] == abi.C_FAILED and first["seconds"] < 5  # timed out alone
    assert not leftover_segments()


def test_init_refuses_a_rank_taken_twice(plugin, monkeypatch):
    monkeypatch.setenv("LLAISYS_CCL_TIMEOUT", "20")
    uid = new_id(plugin)
    first = _with_first_rank(plugin, uid, 2, lambda: assert_status(_init(plugin, uid, 2, 0), abi.C_ERROR))
    assert first["status"] == abi.C_FAILED and first["seconds"] < 5  # failed with the group, not timed out
    assert not leftover_segments()


def assert_status(status: int, want: int) -> None:
    assert status == want, f"{abi.status_name(status)}, expected {abi.status_name(want)}"


# ---- XcclCommunicator -----------------------------------------------------------------------
def test_communicator_of_one_rank(plugin):
    comm = XcclCommunicator(DEV, SingleProcess())
    try:
        x = Tensor.from_numpy(np.arange(6, dtype=np.float32), DEV)
        comm.all_reduce(x)
        np.testing.assert_array_equal(x.numpy(), np.arange(6))
        out = Tensor.zeros((1, 6), DataType.F32, DEV)
        comm.all_gather(out, x)
        np.testing.assert_array_equal(out.numpy(), np.arange(6).reshape(1, 6))
        comm.broadcast(x, root=0)
        comm.barrier()
        assert comm.broadcast_object({"a": 1}) == {"a": 1}
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_reduce(Tensor.from_numpy(np.zeros((3, 2), np.float32), DEV).permute(1, 0))
        with pytest.raises(ValueError, match="on cpu:0; this communicator works on custom_cpu:0"):
            comm.all_reduce(Tensor.from_numpy(np.zeros(3, np.float32)))
        with pytest.raises(ValueError, match="root 1"):
            comm.broadcast(x, root=1)
    finally:
        comm.close()
        comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.all_reduce(x)


def test_communicator_needs_a_plugin_with_collectives(plugin, tmp_path):
    with pytest.raises(ValueError, match="needs a plugin device; cpu:0"):
        XcclCommunicator("cpu", SingleProcess())
    source = Path(__file__).parent / "plugins" / "variants.c"
    lib = build_plugin(source, tmp_path / "libno_ccl.so", ['DEVICE_TYPE="no_ccl_dev"'])
    load_plugin(lib)
    try:
        with pytest.raises(PluginError, match="need xccl_get_unique_id_size, .*xccl_broadcast, which the plugin"):
            XcclCommunicator("no_ccl_dev:0", SingleProcess())
    finally:
        llaisys.plugins.unload_plugin("no_ccl_dev")


MPI_SCRIPT = """
import json, sys
import numpy as np
from llaisys import DataType, Tensor
from llaisys.parallel.mpi import MPICommunicator
from llaisys.parallel.xccl import XcclCommunicator
from llaisys.plugins import load_plugin

load_plugin(sys.argv[1])
dev = "custom_cpu:0"
comm = XcclCommunicator(dev, MPICommunicator())
r, n = comm.rank, comm.size
x = Tensor.from_numpy(np.random.default_rng(r).standard_normal(300_000).astype(np.float32), dev)
comm.all_reduce(x)
gathered = Tensor.zeros((n, 3), DataType.I64, dev)
comm.all_gather(gathered, Tensor.from_numpy(np.array([r, 10 * r, -r], np.int64), dev))
b = Tensor.from_numpy(np.full(5, float(r), np.float64), dev)
comm.broadcast(b, root=n - 1)
obj = comm.broadcast_object({"step": 7, "from": r} if r == 0 else None)
comm.barrier()
comm.close()
comm.close()
np.save(f"{sys.argv[2]}/all_reduce{r}.npy", x.numpy())
with open(f"{sys.argv[2]}/rank{r}.json", "w") as f:
    json.dump({"rank": r, "size": n, "all_gather": gathered.numpy().tolist(), "broadcast": b.numpy().tolist(),
               "object": obj}, f)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nranks", [2, 3])
def test_communicator_under_mpiexec(plugin, tmp_path, nranks):
    pytest.importorskip("mpi4py")
    try:
        mpiexec = find_mpiexec()  # beside this interpreter (a venv's bin/) first, then PATH
    except FileNotFoundError:
        pytest.skip("no MPI launcher (the test extra installs MPICH's mpiexec)")
    script = tmp_path / "ranks.py"
    script.write_text(MPI_SCRIPT)
    src = str(Path(llaisys.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
           "LLAISYS_CCL_TIMEOUT": "30"}
    before = set(glob.glob("/dev/shm/llcc-*"))
    proc = subprocess.run([mpiexec, "-n", str(nranks), sys.executable, str(script), plugin.path, str(tmp_path)],
                          capture_output=True, text=True, timeout=GROUP_TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = sum(np.random.default_rng(r).standard_normal(300_000).astype(np.float32).astype(np.float64)
               for r in range(nranks))
    sums = [np.load(tmp_path / f"all_reduce{r}.npy") for r in range(nranks)]
    for r in range(nranks):
        np.testing.assert_allclose(sums[r], want, rtol=1e-6, atol=1e-6)
        assert sums[r].tobytes() == sums[0].tobytes()
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert (report["rank"], report["size"]) == (r, nranks)
        assert report["all_gather"] == [[q, 10 * q, -q] for q in range(nranks)]
        assert report["broadcast"] == [float(nranks - 1)] * 5
        assert report["object"] == {"step": 7, "from": 0}
    assert set(glob.glob("/dev/shm/llcc-*")) <= before, "a shared-memory segment was left behind"
