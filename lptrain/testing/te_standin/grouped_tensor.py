"""Stand-in ``transformer_engine.pytorch.tensor.grouped_tensor.GroupedTensor`` (TE 2.14+)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .tensors import _SHAPE_OPS, Quantizer, aten, member_cls


class GroupedTensor(torch.Tensor):
    """TE's ``GroupedTensor`` (``GroupedTensorStorage`` + ``torch.Tensor``, 2.14+): the members'
    bytes in one flat storage per field; ``quantized_tensors`` (a list made once) are per-member
    tensors viewing it, created with ``requires_grad=False``. Not a ``QuantizedTensor``: no
    ``quantize_``, no ``dequantize`` of its own (``torch.Tensor.dequantize`` runs through the
    dispatch on the stacked dequantized members and returns fp32); writes go through the
    storage's ``quantize(list_of_tensors)`` (the quantizer's ``update_quantized`` per member).
    Shape ops are refused except ``view(-1)`` (the flat row-wise bytes). ``_emu`` is an lptrain
    ``GroupedQuantizedTensor``, or a plain ``[N, out, in]`` tensor when unquantized."""

    _emu: Any
    quantizer: Optional[Quantizer]
    quantized_tensors: list[torch.Tensor]

    @staticmethod
    def __new__(cls, emu: Any, quantizer: Optional[Quantizer], requires_grad: bool = False,
                members: Optional[list[torch.Tensor]] = None) -> GroupedTensor:
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(emu.shape), dtype=emu.dtype, device=emu.device, requires_grad=requires_grad)
        self._emu = emu
        self.quantizer = quantizer
        self.num_tensors = int(emu.shape[0])
        self.quantized_tensors = members if members is not None else self.split_into_quantized_tensors()
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def split_into_quantized_tensors(self) -> list[torch.Tensor]:
        """Per-member tensors viewing this storage (no copy), ``requires_grad=False``."""
        emu = self._emu
        if not hasattr(emu, "members"):
            return list(emu.detach().unbind(0))
        return [member_cls(m)(m, self.quantizer) for m in emu.members()]

    def quantize(self, tensors: Sequence[torch.Tensor],
                 noop_flag: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Quantize ``tensors`` (one per member) into this storage, in place."""
        members = self.split_into_quantized_tensors()
        for src, dst in zip(tensors, members, strict=True):
            if self.quantizer is None:
                dst.copy_(src)
            else:
                self.quantizer.update_quantized(src, dst, noop_flag=noop_flag)
        return members

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def _flat(self, *names: str) -> Optional[torch.Tensor]:
        fields = getattr(self._emu, "_fields", None)
        if fields is None:  # unquantized: the stacked values are the row-wise data
            return self._emu if names[0] == "rowwise_data" else None
        return next((fields[n] for n in names if fields.get(n) is not None), None)

    rowwise_data = property(lambda self: self._flat("rowwise_data"))
    columnwise_data = property(lambda self: self._flat("columnwise_data"))
    scale_inv = property(lambda self: self._flat("rowwise_scale_inv", "scale_inv"))
    columnwise_scale_inv = property(lambda self: self._flat("columnwise_scale_inv"))
    amax = property(lambda self: self._flat("amax_rowwise"))
    columnwise_amax = property(lambda self: self._flat("amax_columnwise"))

    def _stacked(self) -> torch.Tensor:
        emu = self._emu
        return emu.dequantize() if hasattr(emu, "_fields") else emu

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            src = args[0]
            return GroupedTensor(src._emu, src.quantizer, members=src.quantized_tensors)
        if func in (aten.view.default, aten._unsafe_view.default):
            src, shape = args[0], tuple(args[1])
            if shape in ((-1,), (src.numel(),)) and src.rowwise_data is not None:
                return src.rowwise_data.view(-1)
            raise RuntimeError(f"{cls.__name__} only supports view(-1) for distributed optimizer flattening")
        if func in _SHAPE_OPS:
            raise RuntimeError(f"{cls.__name__} forbids shape-manipulation op: {func} ")

        def unwrap(t: Any) -> Any:
            if isinstance(t, GroupedTensor):
                return t._stacked()
            if isinstance(t, (list, tuple)):
                return type(t)(unwrap(x) for x in t)
            return t

        new_args = [unwrap(a) for a in args]
        out = func(*new_args, **{k: unwrap(v) for k, v in kwargs.items()})
        if func._schema.is_mutable:
            for a, na, info in zip(args, new_args, func._schema.arguments, strict=False):
                if isinstance(a, GroupedTensor) and info.alias_info is not None and info.alias_info.is_write:
                    a.quantize(list(na.unbind(0)))
            return None
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"GroupedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, stand-in)"
