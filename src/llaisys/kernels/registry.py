"""The kernel registry: kernels keyed by (op name, backend, layout, dtype, weight dtype).

``register_kernel`` is the Python analogue of ``PD_REGISTER_PLUGIN_KERNEL``. A kernel has the
uniform signature ``kernel(outputs, inputs, attrs)``: tuples of Tensors (outputs first, as
the ops API orders them) and a dict of scalar attributes. Kernels trust their arguments; the
public ops check them.

``dtype`` is the type of the op's activations (its output). ``weight dtype`` is that of its
weight input for the ops that take one in another type (linear, embedding: a block-quantized
weight, or an F16/BF16 weight with F32 activations); it equals ``dtype`` otherwise, and a
kernel registered without ``weight_dtypes`` (every plugin kernel) serves only that case.

Dispatch refuses frozen outputs (FrozenTensorError), then looks up (name, device type,
layout, dtype, weight dtype), then the same key with ``Layout.ANY``. On a device with no such kernel the CPU
kernel runs on host copies (inputs copied to the host, outputs copied back), logged once per
op; a frozen input (a weight) is copied once and its host copy kept with its storage, so each
call copies activations only. Set ``LLAISYS_KERNEL_FALLBACK=0`` to make the fallback an error.
With no kernel anywhere the error lists what is registered for the op.
"""
from __future__ import annotations

import enum
import functools
import importlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..runtime.device import DeviceType
from ..runtime.dtypes import DataType
from ..runtime.errors import KernelNotFoundError
from ..tensor.tensor import set_device_copy

if TYPE_CHECKING:
    from ..tensor import Tensor

log = logging.getLogger(__name__)

Kernel = Callable[[tuple, tuple, dict], None]


class Layout(enum.IntEnum):
    """Memory layout a kernel accepts; values follow the plugin ABI's ``C_DataLayout``."""

    ANY = 0  # ALL_LAYOUT: any strided tensor
    NHWC = 1
    NCHW = 2
    NCDHW = 3
    NDHWC = 4
    STRIDED = 5


KernelKey = tuple  # (name, backend name, Layout, DataType, weight DataType)

_lock = threading.Lock()
_kernels: dict[KernelKey, Kernel] = {}
# Kernels of built-in device types other than the CPU, imported when a tensor of that type
# first reaches the registry (a machine that never names the device never imports them).
_BUILTIN_KERNELS = {"nvidia": "llaisys.kernels.nvidia"}
_builtin_loaded: set[str] = set()
_fallback_logged: set[tuple[str, str]] = set()


def _backend_name(backend: "str | DeviceType") -> str:
    return backend.name if isinstance(backend, DeviceType) else str(backend).lower()


def register_kernel(
    name: str,
    backend: "str | DeviceType",
    layout: Layout = Layout.ANY,
    dtypes: Iterable[DataType] = (),
    kernel: Kernel | None = None,
    replace: bool = False,
    weight_dtypes: Iterable[DataType] | None = None,
):
    """Register ``kernel`` for op ``name`` on ``backend`` for each of ``dtypes`` (the
    activations' type) with each of ``weight_dtypes`` (the weight's; None: the same type).

    Usable as a decorator when ``kernel`` is omitted. Registering a key twice raises
    ValueError unless ``replace`` is true.
    """
    dtypes = tuple(DataType(d) for d in dtypes)
    if not dtypes:
        raise ValueError(f"register_kernel({name!r}): give at least one dtype")
    weights = None if weight_dtypes is None else tuple(DataType(d) for d in weight_dtypes)
    pairs = [(dt, dt) for dt in dtypes] if weights is None else [(dt, wt) for dt in dtypes for wt in weights]
    backend_name = _backend_name(backend)

    def add(fn: Kernel) -> Kernel:
        with _lock:
            for dt, wt in pairs:
                key = (name, backend_name, Layout(layout), dt, wt)
                if key in _kernels and not replace:
                    raise ValueError(f"kernel {_fmt(key)} is already registered")
                _kernels[key] = fn
        return fn

    return add(kernel) if kernel is not None else add


def unregister_kernels(backend: "str | DeviceType", ops: Iterable[str] | None = None) -> int:
    """Drop the kernels of ``backend``: every one (``ops`` None), or only those of the op
    names in ``ops``; returns how many were dropped."""
    backend_name = _backend_name(backend)
    names = None if ops is None else (frozenset((ops,)) if isinstance(ops, str) else frozenset(ops))
    with _lock:
        keys = [k for k in _kernels if k[1] == backend_name and (names is None or k[0] in names)]
        for k in keys:
            del _kernels[k]
    return len(keys)


def registered_kernels(name: str | None = None) -> list[KernelKey]:
    """The registered keys, optionally only those of op ``name``."""
    with _lock:
        keys = [k for k in _kernels if name is None or k[0] == name]
    return sorted(keys, key=lambda k: (k[0], k[1], int(k[2]), int(k[3]), int(k[4])))


def find_kernel(name: str, backend: str, dtype: DataType, layout: Layout = Layout.ANY,
                weight_dtype: DataType | None = None) -> Kernel | None:
    """The kernel for the key (``weight_dtype`` None: ``dtype``), trying ``Layout.ANY`` after
    ``layout``; None when absent."""
    wt = dtype if weight_dtype is None else weight_dtype
    fn = _kernels.get((name, backend, layout, dtype, wt))
    if fn is None and _load_builtin(backend):
        fn = _kernels.get((name, backend, layout, dtype, wt))
    if fn is None and layout is not Layout.ANY:
        fn = _kernels.get((name, backend, Layout.ANY, dtype, wt))
    return fn


def fallback_enabled() -> bool:
    """Whether ops missing on a device may run on the CPU (``LLAISYS_KERNEL_FALLBACK``)."""
    return os.environ.get("LLAISYS_KERNEL_FALLBACK", "1").lower() not in ("0", "false", "no", "off")


def dispatch(name: str, dtype: DataType, outputs: Sequence["Tensor"], inputs: Sequence["Tensor | None"],
             attrs: dict[str, Any], weight_dtype: DataType | None = None) -> None:
    """Run op ``name`` on the device of ``outputs[0]``, for activations of ``dtype`` and a
    weight of ``weight_dtype`` (None: ``dtype``). Raises FrozenTensorError when an output is
    frozen, KernelNotFoundError when no kernel (nor the CPU fallback) serves it."""
    fn = resolve(name, dtype, outputs, weight_dtype)
    fn(outputs, inputs, attrs)


def resolve(name: str, dtype: DataType, outputs: Sequence["Tensor"], weight_dtype: DataType | None = None) -> Kernel:
    """The callable ``dispatch`` would run for these outputs: the device's kernel, or the CPU
    kernel wrapped in host copies. It keeps serving calls with outputs on the same device
    (a recorded ``ops.Plan`` replays it). Raises as ``dispatch`` does."""
    for out in outputs:
        if out.storage.frozen:
            out.check_writable(f"op {name}")
    device = outputs[0].device
    wt = dtype if weight_dtype is None else weight_dtype
    key = (name, device.type.name, Layout.ANY, dtype, wt)
    fn = _kernels.get(key)
    if fn is None and _load_builtin(device.type.name):
        fn = _kernels.get(key)
    if fn is not None:
        return fn
    if not device.is_cpu:
        cpu_fn = _kernels.get((name, "cpu", Layout.ANY, dtype, wt))
        if cpu_fn is not None and fallback_enabled():
            return functools.partial(_run_on_host, cpu_fn, name, device)
        if cpu_fn is not None:
            raise KernelNotFoundError(
                f"no kernel {_fmt(key)} and CPU fallback is "
                f"off (LLAISYS_KERNEL_FALLBACK=0); registered for {name!r}: {_listing(name)}"
            )
    raise KernelNotFoundError(f"no kernel {_fmt(key)}; registered for {name!r}: {_listing(name)}")


def _load_builtin(backend: str) -> bool:
    """Import the built-in kernels of device type ``backend`` the first time; True if done now."""
    module = _BUILTIN_KERNELS.get(backend)
    if module is None or backend in _builtin_loaded:
        return False
    _builtin_loaded.add(backend)
    try:
        importlib.import_module(module)
    except BaseException:
        _builtin_loaded.discard(backend)
        raise
    return True


def _run_on_host(fn: Kernel, name: str, device, outputs, inputs, attrs) -> None:
    key = (name, device.type.name)
    if key not in _fallback_logged:
        _fallback_logged.add(key)
        log.info("op %s has no kernel on %s; running it on the CPU with copies", name, device.type.name)
    # Raw byte spans rather than t.to("cpu"): a strided view would need the device's own
    # rearrange kernel, which may be missing too and would come back here. A frozen input's
    # span is its storage's host copy, made on first use: weights cross to the host once.
    host_in = tuple(None if t is None else t.host_span() for t in inputs)
    # An op writes every element of its outputs, so a dense output needs no copy in; a strided
    # one does, since the bytes between its elements go back as they were.
    host_out = tuple(t.host_span(copy=not t.is_contiguous()) for t in outputs)
    fn(host_out, host_in, attrs)
    for dev_t, host_t in zip(outputs, host_out):
        dev_t.store_host_span(host_t)


def _fmt(key: KernelKey) -> str:
    name, backend, layout, dtype, weight = key
    mixed = "" if weight == dtype else f", weight {DataType(weight).name}"
    return f"({name}, {backend}, {Layout(layout).name}, {DataType(dtype).name}{mixed})"


def _listing(name: str) -> str:
    keys = registered_kernels(name)
    return ", ".join(_fmt(k) for k in keys) if keys else "nothing"


set_device_copy(lambda dst, src: dispatch("rearrange", dst.dtype, (dst,), (src,), {}))  # Tensor.copy_ on a device
