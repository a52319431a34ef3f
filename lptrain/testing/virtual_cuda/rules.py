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
from .labels import DEVICE, TO_HOST, aten, is_device, label, label_all

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


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
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


class DispatchRules(TorchDispatchMode):
    def __init__(self, device: VirtualCuda) -> None:
        super().__init__()
        self.vd = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        top, listed = _tensor_args(args, kwargs)
        tensors = [t for t in (*top, *listed) if t.device.type != "meta"]
        on_device = [t for t in tensors if is_device(t)]
        if func in TRANSFERS:
            return self._transfer(func, args, kwargs, on_device)
        if on_device:
            self._check(func, top, listed, on_device, args, kwargs)
            if func in SYNC_OPS:
                self.vd.stats.sync(SYNC_NAMES.get(func, func.overloadpacket.__name__))
            if kwargs.get("generator", 0) is None or (
                "generator" not in kwargs and any(a.name == "generator" for a in func._schema.arguments)
            ):
                kwargs["generator"] = self.vd.generator  # CUDA's default generator
        out = CUDA_ONLY.get(func, func)(*args, **kwargs) if on_device else func(*args, **kwargs)
        if on_device or (not top and not listed and self.vd.ambient() == DEVICE):
            label_all(out, self.vd.stats)
        return out

    def _check(self, func: Any, top: list, listed: list, on_device: list, args: tuple, kwargs: dict) -> None:
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
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and not is_device(gen):
            self.vd.violation("a random op on device tensors draws from a host generator", func, args)

    def _transfer(self, func: Any, args: tuple, kwargs: dict, on_device: list) -> Any:
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

