"""Python-level placement: ``cuda`` requests mapped onto the CPU, ``.device`` reported.

A :class:`~torch.overrides.TorchFunctionMode` sees every Python-level torch call: a
``device="cuda"`` argument becomes the CPU and labels the outputs device memory; ``.to``,
``.cuda()``, ``.cpu()`` move by copying; ``.device`` / ``.is_cuda`` of device tensors read
``cuda:0``; and each call tells the dispatch rules where the tensors that its decomposition
creates belong (autograd and composite ops create them with the real, CPU device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from .labels import (
    CPU,
    CUDA,
    DEVICE,
    HOST,
    TO_HOST,
    any_device,
    is_cuda_device,
    is_device,
    label,
    label_all,
)

if TYPE_CHECKING:
    from .device import VirtualCuda


_FACTORY_DEVICE_KW = "device"


def _to_args(t: torch.Tensor, args: tuple, kwargs: dict) -> tuple[Any, Any, bool, bool]:
    """(device, dtype, non_blocking, copy) of a ``Tensor.to`` call."""
    copy = bool(kwargs.get("copy", False))
    device, dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args, **{k: v for k, v in kwargs.items() if k != "copy"})
    if args and isinstance(args[0], torch.Tensor):
        device = CUDA if is_device(args[0]) else args[0].device
    return device, dtype, non_blocking, copy



class Placement(TorchFunctionMode):
    """Maps ``cuda`` placements of Python-level calls onto the CPU (see the module doc) and
    tells the dispatch rules where the ops a call decomposes into belong: tensors that
    composite ops and autograd create from an input's options (``device=cpu``, as every
    tensor is really on the CPU) belong where the call's tensors are."""

    def __init__(self, device: VirtualCuda) -> None:
        super().__init__()
        self.vd = device
        self._local = device._ambient  # (its ``stack``: see VirtualCuda.ambient_stack)
        # func -> how this mode answers it: a handler of ``device.special``, _GETTER (a
        # property read other than those: it places nothing) or _PLACE (a call that may
        # create tensors); decided at its first call, one dict lookup afterwards
        self._kinds: dict[Any, Any] = {}

    def _kind(self, func: Any) -> Any:
        kind = self.vd.special.get(func)
        if kind is None:
            kind = _GETTER if getattr(func, "__name__", "") == "__get__" else _PLACE
        if len(self._kinds) < _MAX_KINDS:  # (bounded, should a caller pass fresh closures)
            self._kinds[func] = kind
        return kind

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        try:
            kind = self._kinds[func]
        except KeyError:
            kind = self._kind(func)
        if kind is _GETTER:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind is not _PLACE:
            return kind(func, args, dict(kwargs) if kwargs else {})
        kwargs = kwargs or {}
        dev = kwargs.get(_FACTORY_DEVICE_KW)
        try:
            stack = self._local.stack
        except AttributeError:  # this thread's first call
            stack = self.vd.ambient_stack()
        if dev is not None:
            if is_cuda_device(dev):
                kwargs = {**kwargs, _FACTORY_DEVICE_KW: CPU}
                stack.append(DEVICE)
                try:
                    out = func(*args, **kwargs)
                finally:
                    stack.pop()
                return label_all(out, self.vd.stats)
            stack.append(HOST)
        else:
            stack.append(DEVICE if any_device(args, kwargs) else HOST)
        try:
            return func(*args, **kwargs)
        finally:
            stack.pop()


_GETTER, _PLACE = object(), object()
_MAX_KINDS = 1 << 14


class PlacementHandlers:
    """The Python-level torch functions the placement mode answers itself (a mixin of
    :class:`~.device.VirtualCuda`)."""

    stats: Any

    def python_handlers(self) -> dict[Any, Callable[[Any, tuple, dict], Any]]:
        st = self.stats
        T = torch.Tensor

        def device_get(func: Any, args: tuple, kwargs: dict) -> Any:
            return CUDA if is_device(args[0]) else func(*args, **kwargs)

        def is_cuda_get(func: Any, args: tuple, kwargs: dict) -> Any:
            return True if is_device(args[0]) else func(*args, **kwargs)

        def is_cpu_get(func: Any, args: tuple, kwargs: dict) -> Any:
            return False if is_device(args[0]) else func(*args, **kwargs)

        def get_device(func: Any, args: tuple, kwargs: dict) -> Any:
            return 0 if is_device(args[0]) else func(*args, **kwargs)

        def to(func: Any, args: tuple, kwargs: dict) -> Any:
            t = args[0]
            device, dtype, non_blocking, copy = _to_args(t, args[1:], kwargs)
            if device is None:
                return func(*args, **kwargs)
            want_device = is_cuda_device(device)
            fwd: dict[str, Any] = {"dtype": dtype, "non_blocking": non_blocking}
            if want_device == is_device(t) and not copy and (dtype is None or dtype == t.dtype):
                return t
            if device is not None and getattr(device, "type", str(device)) == "meta":
                return func(*args, **kwargs)
            with self.placed(DEVICE if want_device else TO_HOST):
                out = t.to(device=CPU, copy=True, **{k: v for k, v in fwd.items() if v is not None})
            if want_device:
                if is_device(t):
                    return out  # device -> device (dtype change or copy): labelled by dispatch
                return label(out, st)
            return out  # a device-to-host copy: counted by the dispatch rules

        def cuda(func: Any, args: tuple, kwargs: dict) -> Any:
            t = args[0]
            if is_device(t):
                return t
            with self.placed(DEVICE):
                return label(t.to(device=CPU, copy=True), st)

        def cpu(func: Any, args: tuple, kwargs: dict) -> Any:
            t = args[0]
            if not is_device(t):
                return func(*args, **kwargs)
            with self.placed(TO_HOST):
                return t.to(device=CPU, copy=True)  # counted by the dispatch rules

        def scalar(kind: str) -> Callable[[Any, tuple, dict], Any]:
            def read(func: Any, args: tuple, kwargs: dict) -> Any:
                if is_device(args[0]):
                    st.sync(kind)
                    with self.checks_paused():
                        return func(*args, **kwargs)
                return func(*args, **kwargs)

            return read

        def autograd(fn: Callable[..., Any], tensor_method: bool) -> Callable[[Any, tuple, dict], Any]:
            """Backward passes run user code (hooks, custom backwards): run them with the
            placement mode active (a handler otherwise runs its function with it popped)."""

            def run(func: Any, args: tuple, kwargs: dict) -> Any:
                if tensor_method:  # Tensor.backward(self, gradient, retain_graph, create_graph, inputs)
                    names = ("gradient", "retain_graph", "create_graph", "inputs")
                    kw = dict(zip(names, args[1:], strict=False))
                    kw.update(kwargs)
                    grads = kw.pop("gradient", None)
                    call_args: tuple = (args[0],)
                    kwargs = {"grad_tensors": grads, **kw}
                else:
                    call_args = args
                with self.placed(DEVICE if any_device(args, kwargs) else HOST), self.mode_active():
                    return fn(*call_args, **kwargs)

            return run

        def numpy(func: Any, args: tuple, kwargs: dict) -> Any:
            if is_device(args[0]):
                self.violation("a device tensor converted to numpy (call .cpu() first)", func, args)
            return func(*args, **kwargs)

        out: dict[Any, Callable[[Any, tuple, dict], Any]] = {
            T.device.__get__: device_get,
            T.is_cuda.__get__: is_cuda_get,
            T.is_cpu.__get__: is_cpu_get,
            T.get_device: get_device,
            T.to: to,
            T.cuda: cuda,
            T.cpu: cpu,
            T.tolist: scalar("tolist"),
            T.numpy: numpy,
            T.backward: autograd(torch.autograd.backward, tensor_method=True),
            torch.autograd.backward: autograd(torch.autograd.backward, tensor_method=False),
            torch.autograd.grad: autograd(torch.autograd.grad, tensor_method=False),
        }
        # item/float/int/bool reach aten._local_scalar_dense (counted in dispatch)
        return out

