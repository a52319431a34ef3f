"""The rules of CUDA's device model, enforced on every aten op (forward, backward, optimizer).

See :mod:`lptrain.testing.virtual_cuda`: no op mixes device and host tensors (a 0-dim host
tensor may be an input), no in-place op writes device results into a host tensor, a random
op on device tensors draws from a device generator; outputs of ops on device tensors are
device tensors; host syncs (``item``, device-to-host copies, data-dependent output sizes) are
counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import scaled_grouped_mm as _grouped
from . import scaled_mm as _scaled
from .labels import DEVICE, LABEL, TO_HOST, aten, is_device, label, label_all

if TYPE_CHECKING:
    from .device import VirtualCuda

# ---- ops ------------------------------------------------------------------------------------

# Ops that move data between host and device on purpose (checked by their own rules).
TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
              aten._copy_from_and_resize.default}


def _mm_out_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """CUDA's 16-bit GEMM with a wider output: exact products, fp32 accumulation."""
    return torch.mm(a.to(out_dtype), b.to(out_dtype))


# Ops CUDA has and the CPU does not (or has with other rules), run here the way the device
# computes them: mm with a wider output; torch's scaled GEMMs with CUDA's kernel, layout and
# scale checks (scaled_mm.py).
CUDA_ONLY: dict[Any, Any] = {aten.mm.dtype: _mm_out_dtype} if "dtype" in aten.mm.overloads() else {}
CUDA_ONLY[aten._scaled_mm.default] = _scaled.scaled_mm_v1
if hasattr(aten, "_scaled_mm_v2"):
    CUDA_ONLY[aten._scaled_mm_v2.default] = _scaled.scaled_mm_v2
if hasattr(aten, "_scaled_grouped_mm_v2"):
    CUDA_ONLY[aten._scaled_grouped_mm_v2.default] = _grouped.scaled_grouped_mm_v2

# Ops whose output size depends on device values: CUDA must sync to allocate the output.
SYNC_OPS = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.is_nonzero.default, aten.equal.default, aten._local_scalar_dense.default,
}
SYNC_NAMES = {aten._local_scalar_dense.default: "item", aten.is_nonzero.default: "bool"}
# CUDA's "CPU scalar" exception does not hold inside tensor-list arguments (cat, stack,
# foreach): every tensor of a list must be on the device.


# Ops whose outputs always share their input's storage (unlike ``reshape``, ``contiguous`` or
# ``to``, whose schemas say "alias" but which may copy): their outputs need no label.
ALWAYS_VIEWS = frozenset({
    "alias", "as_strided", "detach", "diagonal", "expand", "narrow", "permute", "select",
    "slice", "split", "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unfold",
    "unsqueeze", "view", "_reshape_alias",
})


class _Op:
    """What the rules need to know of an aten op, read from its schema once (not per call):
    which arguments it writes, whether it takes a generator, whether it is a transfer or a
    sync, what computes it on the device, and whether it is a pure view (every output an
    alias of an input, nothing written: its outputs share a labelled input's storage)."""

    __slots__ = ("call", "device_impl", "func", "pure_view", "sync", "takes_generator", "transfer", "written")

    def __init__(self, func: Any) -> None:
        self.func = func  # (keeps the op, and so its id, alive)
        schema = func._schema
        self.written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write)
        self.takes_generator = any(a.name == "generator" for a in schema.arguments)
        self.transfer = func in TRANSFERS
        self.sync = SYNC_NAMES.get(func, func.overloadpacket.__name__) if func in SYNC_OPS else None
        # (the op's C++ callable: its Python ``__call__`` only forwards to it)
        self.call = getattr(func, "_op", func)
        self.device_impl = CUDA_ONLY.get(func) or self.call
        self.pure_view = (func.overloadpacket.__name__ in ALWAYS_VIEWS and not self.written
                          and bool(schema.returns)
                          and all(r.alias_info is not None for r in schema.returns))


# by ``id(op)``: an OpOverload's ``__hash__`` is a Python method, too slow for every op
_OPS: dict[int, _Op] = {}


def _op(func: Any) -> _Op:
    op = _OPS[id(func)] = _Op(func)
    return op


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for i, name in (_OPS.get(id(func)) or _op(func)).written:
        v = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _tensor_args(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(top-level tensors, tensors inside list arguments)."""
    top, listed = [], []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            top.append(v)
        elif isinstance(v, (list, tuple)):
            listed.extend(x for x in v if isinstance(x, torch.Tensor))
    return top, listed


_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_tf_modes = torch._C._len_torch_function_stack
_pop_tf_mode = torch._C._pop_torch_function_stack
_push_tf_mode = torch._C._push_on_torch_function_stack
try:  # what ``torch._disable_dynamo(recursive=True)`` does around a mode's dispatch, unwrapped
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # pragma: no cover - torch without dynamo: torch's own wrapper (below)
    _set_eval_frame = None


def _where(tensors: list[torch.Tensor]) -> tuple[int, int, bool]:
    """(device tensors, host tensors, whether all are dense) among ``tensors``; meta tensors
    are neither device nor host."""
    n_dev = n_host = 0
    dense = True
    for t in tensors:
        tp = type(t)
        if tp is _Tensor or tp is _Parameter:
            if getattr(t.untyped_storage(), LABEL, None) is not None:
                n_dev += 1
            elif not t.is_meta:
                n_host += 1
        else:
            dense = False
            if t.is_meta:
                continue
            if is_device(t):
                n_dev += 1
            else:
                n_host += 1
    return n_dev, n_host, dense


class DispatchRules(TorchDispatchMode):
    def __init__(self, device: VirtualCuda) -> None:
        super().__init__()
        self.vd = device

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in ``torch._disable_dynamo`` (a Python
        # wrapper costing as much as the rules themselves); this one turns dynamo's frame
        # evaluation off around its body itself, the same effect
        return _set_eval_frame is None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        prior = _set_eval_frame(None) if _set_eval_frame is not None else None
        try:
            # In a backward pass the placement mode is on (``VirtualCuda.mode_active``) while
            # autograd runs its nodes' ops: the rules' own tensor queries and the op itself
            # run without it (and any other torch-function mode), as in the forward pass,
            # where each mode is off by the time an op reaches the dispatcher.
            if _tf_modes():
                modes = [_pop_tf_mode() for _ in range(_tf_modes())]
                try:
                    return self._dispatch(func, args, kwargs or {})
                finally:
                    for m in reversed(modes):
                        _push_tf_mode(m)
            return self._dispatch(func, args, kwargs or {})
        finally:
            if _set_eval_frame is not None:
                _set_eval_frame(prior)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        op = _OPS.get(id(func)) or _op(func)
        if op.transfer:
            return self._transfer(func, args, kwargs)
        tensors = []
        for v in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(v, torch.Tensor):
                tensors.append(v)
            elif isinstance(v, (list, tuple)):
                tensors.extend(x for x in v if isinstance(x, torch.Tensor))
        n_dev, n_host, dense = _where(tensors)
        vd = self.vd
        if not n_dev:
            out = op.call(*args, **kwargs)
            if not tensors and vd.ambient() == DEVICE:  # a factory inside a call on the device
                label_all(out, vd.stats)
            return out
        if n_host:  # the placement rules can only fire with a host tensor among device ones
            top, listed = _tensor_args(args, kwargs)
            self._check(func, top, listed, args, kwargs)
        elif op.takes_generator:  # (the generator rule alone)
            self._check_generator(func, args, kwargs)
        if op.sync is not None:
            vd.stats.sync(op.sync)
        if op.takes_generator and kwargs.get("generator") is None:
            kwargs["generator"] = vd.generator  # CUDA's default generator
        out = op.device_impl(*args, **kwargs)
        if op.pure_view and dense and not n_host:  # a view shares a labelled storage
            return out
        if type(out) is _Tensor:
            label(out, vd.stats)
        else:
            label_all(out, vd.stats)
        return out

    def _check(self, func: Any, top: list, listed: list, args: tuple, kwargs: dict) -> None:
        written = {id(t) for t in _written(func, args, kwargs)}
        for t in top:
            if is_device(t) or t.device.type == "meta":
                continue
            if id(t) in written:
                self.vd.violation("an in-place op writes device results into a host tensor", func, args)
            if t.dim() > 0:
                self.vd.violation("an op mixes device and host tensors", func, args)
        for t in listed:
            if not is_device(t) and t.device.type != "meta":
                self.vd.violation("an op mixes device and host tensors (tensor list)", func, args)
        self._check_generator(func, args, kwargs)

    def _check_generator(self, func: Any, args: tuple, kwargs: dict) -> None:
        gen = kwargs.get("generator")  # (None first: torch.Generator's isinstance is a Python hook)
        if gen is not None and isinstance(gen, torch.Generator) and not is_device(gen):
            self.vd.violation("a random op on device tensors draws from a host generator", func, args)

    def _transfer(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is aten._to_copy.default:
            src = args[0]
            out = func(*args, **kwargs)
            if is_device(src):
                if self.vd.ambient() == TO_HOST:
                    if not kwargs.get("non_blocking", False):
                        self.vd.stats.sync("device-to-host copy")
                else:  # autograd's and composites' dtype casts keep their placement
                    label(out, self.vd.stats)
            return out
        dst, src = args[0], args[1]
        if is_device(src) and not is_device(dst) and not dst.is_meta:
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            if not non_blocking:
                self.vd.stats.sync("device-to-host copy")
        return func(*args, **kwargs)

