"""The kernel bridge: C kernels a plugin registers through ``kernel_ext.h`` become entries of
llaisys's kernel registry.

``collect_kernels`` calls the plugin's ``InitPluginKernels`` with a registrar and gathers
what it registers (nothing enters the registry yet, so a failure leaves nothing behind);
``install_kernels`` then registers a Python wrapper per (op, dtype). The wrapper turns the
op's Tensors into ``LlaisysTensorDesc`` (data pointer, C_DataType, shape, strides in
elements) and calls the C function synchronously (stream NULL).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..kernels.registry import Layout, register_kernel, unregister_kernels
from ..runtime.dtypes import DataType
from ..backends.plugin import abi
from ..backends.plugin.errors import PluginError

if TYPE_CHECKING:
    from ..tensor import Tensor
    from ..backends.plugin.backend import PluginBackend

log = logging.getLogger(__name__)

KNOWN_OPS = ("add", "argmax", "embedding", "linear", "rearrange", "rms_norm", "rope", "self_attention", "swiglu")

# C_DataLayout -> registry Layout; ANY (= ALL_LAYOUT) and STRIDED both take any strided tensor.
_LAYOUTS = {0: Layout.ANY, 1: Layout.NHWC, 2: Layout.NCHW, 3: Layout.NCDHW, 4: Layout.NDHWC, 5: Layout.ANY}  # same values; STRIDED registers as ANY


@dataclass(frozen=True)
class PluginKernel:
    """One C kernel a plugin registered: ``fn`` is its address."""

    op: str
    layout: Layout
    dtype: DataType
    fn: int


def collect_kernels(lib: ctypes.CDLL, backend: "PluginBackend") -> list[PluginKernel]:
    """Call the plugin's ``InitPluginKernels`` (if it exports one) and return what it registered.

    Raises PluginError when it fails, or registers for another backend, a bad layout or type,
    a NULL function or the same key twice.
    """
    try:
        entry = abi.InitPluginKernelsFn(("InitPluginKernels", lib))
    except AttributeError:
        return []
    name = backend.device_type.name
    found: list[PluginKernel] = []
    problems: list[str] = []

    def on_register(context: Any, op_name: bytes | None, backend_name: bytes | None, layout: int, dtype: int,
                    fn: int | None) -> int:
        try:
            op = (op_name or b"").decode()
            owner = (backend_name or b"").decode()
            if not op:
                raise ValueError("an empty op name")
            if owner.lower() != name:
                raise ValueError(f"kernel {op!r} for backend {owner!r}, but this plugin's device type is {name!r}")
            if layout not in _LAYOUTS:
                raise ValueError(f"kernel {op!r} with unknown C_DataLayout {layout}")
            if not fn:
                raise ValueError(f"kernel {op!r} with a NULL function")
            dtypes = abi.from_c_dtype(dtype)
            for dt in dtypes:
                key = PluginKernel(op, _LAYOUTS[layout], dt, fn)
                if any((k.op, k.layout, k.dtype) == (op, key.layout, dt) for k in found):
                    raise ValueError(f"kernel {op!r} for {abi.c_dtype_name(dtype)} registered twice")
            if op not in KNOWN_OPS:
                log.info("plugin %s registers kernel %r, which no llaisys op uses", backend.library, op)
            found.extend(PluginKernel(op, _LAYOUTS[layout], dt, fn) for dt in dtypes)
            return abi.C_SUCCESS
        except Exception as exc:  # an exception must not cross back into C
            problems.append(str(exc))
            return abi.C_ERROR

    callback = abi.RegisterKernelFn(on_register)
    registrar = abi.LlaisysKernelRegistrar(ctypes.sizeof(abi.LlaisysKernelRegistrar), abi.KERNEL_ABI_VERSION,
                                           None, callback)
    status = entry(ctypes.byref(registrar))
    if status != abi.C_SUCCESS or problems:
        why = "; ".join(problems) or "no reason given"
        raise PluginError(f"plugin {backend.library}: InitPluginKernels returned {abi.status_name(status)} ({why})")
    return found


def install_kernels(kernels: Sequence[PluginKernel], backend: "PluginBackend") -> None:
    """Register a wrapper for each kernel under the plugin's device type."""
    try:
        for k in kernels:
            register_kernel(k.op, backend.device_type, k.layout, (k.dtype,), _wrap(k, backend))
    except BaseException:
        unregister_kernels(backend.device_type)
        raise


def _wrap(kernel: PluginKernel, backend: "PluginBackend") -> Callable[[tuple, tuple, dict], None]:
    cfn = abi.LlaisysKernelFn(kernel.fn)
    api = f"kernel {kernel.op}"

    def run(outputs: Sequence["Tensor"], inputs: Sequence["Tensor | None"], attrs: dict[str, Any]) -> None:
        outs, out_descs = _desc_array(outputs)
        ins, in_descs = _desc_array(inputs)  # the descriptors stay alive until the call returns
        index = outputs[0].device.index
        attr_arr = _attrs(tuple(attrs.items())) if attrs else None
        status = cfn(backend.device_handle(index), None, outs, len(outputs), ins, len(inputs), attr_arr, len(attrs))
        backend.check_status(api, status, index)

    run.__name__ = f"{backend.device_type.name}_{kernel.op}"
    run.__doc__ = f"{kernel.op} ({kernel.dtype.name}) by the C kernel of plugin {backend.library}"
    return run


_DESC_SIZE = ctypes.sizeof(abi.LlaisysTensorDesc)


@functools.lru_cache(maxsize=4096)
def _dims(values: tuple[int, ...]) -> ctypes.Array:
    """A C int64 array of ``values``, shared by every call with the same shape or strides
    (kernels receive them as const)."""
    return (ctypes.c_int64 * max(len(values), 1))(*values)


@functools.lru_cache(maxsize=256)
def _attrs(items: tuple[tuple[str, float], ...]) -> ctypes.Array:
    """A C LlaisysKernelAttr array of ``items`` (ops repeat the same eps, theta and scale)."""
    return (abi.LlaisysKernelAttr * len(items))(*(abi.LlaisysKernelAttr(k.encode(), float(v)) for k, v in items))


def _desc_array(tensors: Sequence["Tensor | None"]) -> tuple[ctypes.Array, ctypes.Array]:
    """(array of descriptor addresses, the descriptors): one LlaisysTensorDesc per tensor,
    a NULL address for an absent one."""
    n = max(len(tensors), 1)
    descs = (abi.LlaisysTensorDesc * n)()
    ptrs = (ctypes.c_void_p * n)()
    base = ctypes.addressof(descs)
    for i, t in enumerate(tensors):
        if t is not None:
            descs[i] = abi.LlaisysTensorDesc(t.data_ptr, abi.to_c_dtype(t.dtype), len(t.shape), _dims(t.shape),
                                             _dims(t.strides))
            ptrs[i] = base + i * _DESC_SIZE
    return ptrs, descs
