"""The kernel bridge: C kernels a plugin registers through ``kernel_ext.h`` become entries of
llaisys's kernel registry.

``collect_kernels`` calls the plugin's ``InitPluginKernels`` with a registrar and gathers
what it registers (nothing enters the registry yet, so a failure leaves nothing behind);
``install_kernels`` then registers a Python wrapper per (op, dtype). The wrapper turns the
op's Tensors into ``LlaisysTensorDesc`` (data pointer, C_DataType, shape, strides in
elements) and calls the C function synchronously (stream NULL).

Every kernel has the one C signature of ``kernel_ext.h``, so a call recorded in an
``ops.Plan`` is also offered as a native call (``native_call``): its descriptors, attributes
and device handle are built once, and the plan runs it from C inside a stretch with the
calls around it (``csrc/ops/plugin_calls.c``); a rebind rewrites the descriptors in place.

``KNOWN_OPS`` are the ops a plugin kernel can serve: the nine of every model and the paged
KV-cache ops (``kv_cache_write``, ``paged_attention``, ``paged_attention_window``), with which
a plugin device runs single sequences and the serving engine through paged passes, and their
8-bit forms (``kv_cache_write_q8``: outputs k_cache, v_cache I8 and k_scale, v_scale F32;
``paged_attention_q8``, ``paged_attention_q8_window``: the scales the last two inputs), with
which the engine runs ``kv_cache_dtype="int8"`` there.

Layouts: the runtime asks only for ``ANY`` (the ops take strided tensors of any layout), so
a kernel registered under ``ANY`` or ``STRIDED`` serves every call, and one registered under
NHWC, NCHW, NCDHW or NDHWC would never run: it is refused at registration, naming it.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .. import _native
from .._native import structs
from ..kernels.registry import Layout, register_kernel, unregister_kernels
from ..runtime.dtypes import DataType
from ..backends.plugin import abi
from ..backends.plugin.errors import PluginError

if TYPE_CHECKING:
    from ..tensor import Tensor
    from ..backends.plugin.backend import PluginBackend

log = logging.getLogger(__name__)

# The ops a plugin kernel may serve (a kernel for another name is registered, and logged).
KNOWN_OPS = ("add", "argmax", "embedding", "linear", "rearrange", "rms_norm", "rope", "self_attention", "swiglu",
             "kv_cache_write", "paged_attention", "paged_attention_window",
             "kv_cache_write_q8", "paged_attention_q8", "paged_attention_q8_window")

# C_DataLayout -> registry Layout; ANY (= ALL_LAYOUT) and STRIDED both take any strided tensor.
# The layouts of images (NHWC ...) are refused: dispatch never asks for them.
_LAYOUTS = {0: Layout.ANY, 5: Layout.ANY}  # STRIDED registers as ANY
_UNUSED_LAYOUTS = {1: "NHWC", 2: "NCHW", 3: "NCDHW", 4: "NDHWC"}


@dataclass(frozen=True)
class PluginKernel:
    """One C kernel a plugin registered: ``fn`` is its address."""

    op: str
    layout: Layout
    dtype: DataType
    fn: int


def collect_kernels(lib: _native.Library, backend: "PluginBackend") -> list[PluginKernel]:
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
            if layout in _UNUSED_LAYOUTS:
                raise ValueError(f"kernel {op!r} ({abi.c_dtype_name(dtype)}) registered under layout "
                                 f"{_UNUSED_LAYOUTS[layout]}, which llaisys never asks for, so it would never "
                                 "run: register it under ALL_LAYOUT (any strided tensor)")
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
    run.native_call = functools.partial(_native_call, kernel, backend)  # type: ignore[attr-defined]
    return run


@dataclass(slots=True)
class _Described:
    """One tensor's descriptor in a ``_Descs``, with the shape and stride arrays it points at."""

    desc: abi.LlaisysTensorDesc  # a view of the descriptor array's element
    shape: ctypes.Array
    strides: ctypes.Array
    dtype: DataType
    rank: int


class _Descs:
    """Descriptors of a fixed list of tensors (None: a NULL entry) that own their shape and
    stride arrays, so a rebind can rewrite them in place."""

    __slots__ = ("descs", "ptrs", "entries", "tensors", "given")

    def __init__(self, tensors: Sequence["Tensor | None"]):
        n = max(len(tensors), 1)
        self.descs = (abi.LlaisysTensorDesc * n)()
        self.ptrs = (ctypes.c_void_p * n)()
        self.entries: list[_Described | None] = []  # per tensor; None for a NULL entry
        self.tensors = list(tensors)  # the tensors described now
        self.given = self._frozen(tensors)  # the tuple they came as (a rebind often passes it again)
        base = ctypes.addressof(self.descs)
        for i, t in enumerate(tensors):
            if t is None:
                self.entries.append(None)
                continue
            rank = len(t.shape)
            dims = ctypes.c_int64 * max(rank, 1)
            shape, strides = dims(*t.shape), dims(*t.strides)
            desc = self.descs[i]  # a view of the array's element
            desc.data, desc.dtype, desc.ndim, desc.shape, desc.strides = (
                t.data_ptr, abi.to_c_dtype(t.dtype), rank, shape, strides)
            self.ptrs[i] = base + i * _DESC_SIZE
            self.entries.append(_Described(desc, shape, strides, t.dtype, rank))

    def follow(self, tensors: Sequence["Tensor | None"]) -> bool:
        """Point the descriptors at ``tensors`` (same dtypes and ranks); False when they differ
        (then nothing is changed)."""
        if tensors is self.given:
            return True  # the same tuple again: the other side of the call was rebound
        olds, entries = self.tensors, self.entries
        if len(tensors) != len(olds):
            return False
        moved = []  # a decoding step moves one or two tensors of a call
        for i, t in enumerate(tensors):
            if t is olds[i]:
                continue
            entry = entries[i]
            if t is None or entry is None or t.dtype != entry.dtype or len(t.shape) != entry.rank:
                return False
            moved.append(i)
        for i in moved:
            t, old = tensors[i], olds[i]
            entry = entries[i]
            if t.shape != old.shape:
                entry.shape[:len(t.shape)] = t.shape
            if t.strides != old.strides:
                entry.strides[:len(t.strides)] = t.strides
            entry.desc.data = t.storage.ptr + t.offset  # t.data_ptr
            olds[i] = t
        self.given = self._frozen(tensors)
        return True

    def fields(self, i: int) -> "tuple[int, int] | None":
        """The addresses of tensor ``i``'s data pointer and first dimension (None for a NULL
        entry or past the end), for writing them from C. A tensor moved that way is no longer
        the one ``tensors`` names: the caller keeps track of what the descriptor holds."""
        if not 0 <= i < len(self.entries) or self.entries[i] is None:
            return None
        return ctypes.addressof(self.descs) + i * _DESC_SIZE + _DATA_OFFSET, ctypes.addressof(self.entries[i].shape)

    @staticmethod
    def _frozen(tensors: Sequence["Tensor | None"]) -> "tuple | None":
        return tensors if isinstance(tensors, tuple) else None  # a list could change behind our back


def _native_call(kernel: PluginKernel, backend: "PluginBackend", outputs: Sequence["Tensor"],
                 inputs: Sequence["Tensor | None"], attrs: dict[str, Any]) -> Any:
    """The recorded call of plugin kernel ``kernel`` as a native call (see
    ``kernels.cpu.native_calls``): its descriptors, attributes and device handle built now,
    rewritten in place by a rebind. None without the native ops library."""
    from ..kernels.cpu import native_calls

    lib = native_ops_library()
    if lib is None:
        return None
    index = outputs[0].device.index
    device = backend.device_handle(index)
    outs, ins = _Descs(outputs), _Descs(inputs)
    attr_arr = _attrs(tuple(attrs.items())) if attrs else None
    block = structs.PluginKernelCall(kernel.fn, ctypes.addressof(device.contents), ctypes.addressof(outs.ptrs),
                                     len(outputs), ctypes.addressof(ins.ptrs), len(inputs),
                                     None if attr_arr is None else ctypes.addressof(attr_arr), len(attrs))
    api = f"kernel {kernel.op}"

    def fail(status: int) -> None:  # C_WARNING is logged once and the stretch goes on
        backend.check_status(api, status, index)

    def rebind(outputs2: tuple, inputs2: tuple) -> bool:
        return outs.follow(outputs2) and ins.follow(inputs2)  # each checks its length

    def fields(side: str, i: int) -> "tuple[int, int] | None":
        return (outs if side == "outputs" else ins).fields(i)

    fn = native_calls.address(lib, "llaisys_ops_plugin_kernel_call")
    return native_calls.NativeCall(f"{api} of {backend.device_type.name}", fn, block,
                                   keep=(outs, ins, attr_arr, device), rebind=rebind, fail=fail,
                                   fields=fields)


def native_ops_library() -> "_native.Library | None":
    """The native ops library (``csrc/ops``), which runs recorded plugin calls; None when it
    is not built (plans then call plugin kernels from Python)."""
    lib = _native.load("ops")
    return lib if lib is not None and hasattr(lib, "llaisys_ops_plugin_kernel_call") else None


_DESC_SIZE = ctypes.sizeof(abi.LlaisysTensorDesc)
_DATA_OFFSET = abi.LlaisysTensorDesc.data.offset


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
