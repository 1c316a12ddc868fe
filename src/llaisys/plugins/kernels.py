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
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..kernels.registry import Layout, register_kernel, unregister_kernels
from ..runtime.dtypes import DataType
from . import abi
from .errors import PluginError

if TYPE_CHECKING:
    from ..tensor import Tensor
    from .backend import PluginBackend

log = logging.getLogger(__name__)

KNOWN_OPS = ("add", "argmax", "embedding", "linear", "rearrange", "rms_norm", "rope", "self_attention", "swiglu")

# C_DataLayout -> registry Layout; ANY (= ALL_LAYOUT) and STRIDED both take any strided tensor.
_LAYOUTS = {0: Layout.ANY, 1: Layout.NHWC, 2: Layout.NCHW, 3: Layout.NCDHW, 4: Layout.NDHWC, 5: Layout.ANY}


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
        keep: list[Any] = []  # the descriptors and their arrays live until the call returns
        outs = _desc_array(outputs, keep)
        ins = _desc_array(inputs, keep)
        attr_arr = (abi.LlaisysKernelAttr * max(len(attrs), 1))(
            *(abi.LlaisysKernelAttr(k.encode(), float(v)) for k, v in attrs.items()))
        index = outputs[0].device.index
        status = cfn(backend.device_handle(index), None, outs, len(outputs), ins, len(inputs), attr_arr, len(attrs))
        backend.check_status(api, status, index)

    run.__name__ = f"{backend.device_type.name}_{kernel.op}"
    run.__doc__ = f"{kernel.op} ({kernel.dtype.name}) by the C kernel of plugin {backend.library}"
    return run


def _desc_array(tensors: Sequence["Tensor | None"], keep: list[Any]) -> Any:
    arr = (ctypes.POINTER(abi.LlaisysTensorDesc) * max(len(tensors), 1))()
    for i, t in enumerate(tensors):
        if t is None:
            continue
        shape = (ctypes.c_int64 * max(t.ndim, 1))(*t.shape)
        strides = (ctypes.c_int64 * max(t.ndim, 1))(*t.strides)
        desc = abi.LlaisysTensorDesc(t.data_ptr, abi.to_c_dtype(t.dtype), t.ndim, shape, strides)
        keep.extend((shape, strides, desc))
        arr[i] = ctypes.pointer(desc)
    return arr
