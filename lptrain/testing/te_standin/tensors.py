"""Stand-in Transformer Engine quantized tensors and quantizers, on lptrain's emulated ones.

Each class has TE's name, module path and the attributes lptrain may touch (read from TE's
sources, 2.2 to 2.20.dev): ``Float8Tensor`` (``_data``, ``_transpose``, ``_scale_inv``,
``_transpose_invalid``), ``MXFP8Tensor`` / ``Float8BlockwiseQTensor`` / ``NVFP4Tensor``
(``_rowwise_data``, ``_columnwise_data``, ``_rowwise_scale_inv``, ``_columnwise_scale_inv``,
NVFP4's ``_amax_rowwise`` / ``_amax_columnwise``, blockwise's ``_is_2D_scaled``) and
``GroupedTensor`` (``rowwise_data``, ``scale_inv``, ..., ``quantized_tensors``). The bytes
live in an lptrain emulated tensor (``_emu``): TE's attribute *is* that tensor's buffer, so
replacing ``_data`` (``replace_raw_data``) re-points the bytes the GEMMs read, as in TE.

TE's documented behaviours that lptrain depends on are reproduced, not idealised:

* a wrapper subclass: ``data_ptr()`` is 0, the bytes are in the attributes above;
* ``param.data = tensor`` requantizes into *new* storage (TE's ``_set_data``), unless
  ``tensor`` is the same class (then its storage is adopted);
* ``reshape`` / ``view`` changing the inner dimension: ``MXFP8Tensor`` raises (``view``
  warns and returns a dequantized tensor), ``Float8BlockwiseQTensor`` raises up to 2.13
  (warns from 2.14); ``GroupedTensor`` refuses every shape op, ``select`` (``w[i]``) included;
* ``copy_`` into a quantized tensor quantizes in place (``quantize_``); any other op runs on
  the dequantized value (TE: "cast to the nominal dtype");
* ``get_high_precision_init_val()`` / ``clear_high_precision_init_val()`` are bound on
  parameters made under ``quantized_model_init(preserve_high_precision_init_val=True)``
  (a CPU copy, as TE keeps).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import torch

aten = torch.ops.aten
_SHAPE_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.select.int,
    aten.slice.Tensor, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.split.Tensor, aten.chunk.default,
    aten.unbind.int, aten.expand.default, aten.narrow.default, aten.flatten.using_ints,
}


class Quantizer:
    """TE's ``Quantizer`` base: ``quantize``, ``update_quantized``, usage flags, ``copy``.

    The lptrain emulated quantizer doing the math is kept under a private name: the stand-in's
    public surface is a subset of TE's at every release (``tests/data/te_api.json``)."""

    _tensor_cls: ClassVar[type[QuantizedTensor]]

    def __init__(self, emu: Any) -> None:
        self._emu_quantizer = emu
        self.rowwise_usage = emu.rowwise
        self.columnwise_usage = emu.columnwise
        self.internal = False

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise
        self._emu_quantizer = self._emu_quantizer.with_usage(self.rowwise_usage, self.columnwise_usage)

    def _copy(self) -> Quantizer:
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        return out

    def quantize(self, tensor: torch.Tensor) -> QuantizedTensor:
        return self._tensor_cls(self._emu_quantizer.quantize(tensor.detach()), self)

    def __call__(self, tensor: torch.Tensor) -> QuantizedTensor:
        return self.quantize(tensor)

    def update_quantized(self, src: torch.Tensor, dst: QuantizedTensor,
                         *, noop_flag: Optional[torch.Tensor] = None) -> QuantizedTensor:
        dst.quantize_(src)
        return dst


class Float8Quantizer(Quantizer):
    """Delayed scaling (the scale comes from the recipe's amax history)."""

    copy = Quantizer._copy


class Float8CurrentScalingQuantizer(Quantizer):
    """Per-tensor current scaling."""

    copy = Quantizer._copy

    @property
    def force_pow_2_scales(self) -> bool:
        return bool(self._emu_quantizer.power_2_scale)

    @property
    def amax_epsilon(self) -> float:
        return float(self._emu_quantizer.amax_epsilon)


class MXFP8Quantizer(Quantizer):
    copy = Quantizer._copy


class Float8BlockQuantizer(Quantizer):
    copy = Quantizer._copy


class NVFP4Quantizer(Quantizer):
    copy = Quantizer._copy

    @property
    def stochastic_rounding(self) -> bool:
        return bool(self._emu_quantizer.stochastic_rounding)

    @stochastic_rounding.setter
    def stochastic_rounding(self, enabled: bool) -> None:
        """TE's attribute: a copy set to False rounds to nearest and draws no bits."""
        if bool(enabled) != self.stochastic_rounding:
            self._emu_quantizer = copy.copy(self._emu_quantizer)
            self._emu_quantizer.stochastic_rounding = bool(enabled)


def _field(name: str, emu_name: str) -> property:
    def get(self: QuantizedTensor) -> Optional[torch.Tensor]:
        return self._emu._fields.get(emu_name)

    def put(self: QuantizedTensor, value: Optional[torch.Tensor]) -> None:
        self._emu._fields[emu_name] = value

    return property(get, put, doc=f"TE's ``{name}``: lptrain field ``{emu_name}``")


class QuantizedTensor(torch.Tensor):
    """TE's ``QuantizedTensor`` (see the module doc)."""

    _emu: Any
    _quantizer: Quantizer

    @staticmethod
    def __new__(cls, emu: Any, quantizer: Quantizer, requires_grad: bool = False) -> QuantizedTensor:
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(emu.shape), dtype=emu.dtype, device=emu.device, requires_grad=requires_grad
        )
        self._emu = emu
        self._quantizer = quantizer
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---- TE's API -----------------------------------------------------------------------------

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self._emu.dequantize().to(dtype or self.dtype)

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None) -> QuantizedTensor:
        """Quantize ``tensor`` into these buffers, in place (same storage)."""
        src = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
        self._emu.requantize_from(src.detach().reshape(self.shape))
        return self

    def _get_quantizer(self) -> Quantizer:
        return self._quantizer

    def _like(self, emu: Any) -> QuantizedTensor:
        out = type(self)(emu, self._quantizer)
        return out

    # ``param.data = x``: TE requantizes into new storage unless ``x`` is the same class.
    def _get_data(self) -> QuantizedTensor:
        return self._like(_shallow(self._emu))

    def _set_data(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, type(self)):
            self._emu = tensor._emu
            self._quantizer = tensor._quantizer._copy()
            return
        self._emu = self._quantizer.quantize(tensor.detach().to(self.device))._emu

    data = property(_get_data, _set_data)  # type: ignore[assignment]

    # ---- torch integration --------------------------------------------------------------------

    @classmethod
    def _refuse(cls, func: Any, args: tuple) -> None:
        """Shape ops this class refuses (none by default)."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._like(_shallow(args[0]._emu))
        if func is aten.clone.default:
            return args[0]._like(_deep(args[0]._emu))
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, QuantizedTensor):
                dst.quantize_(src)
            else:
                dst.copy_(src.dequantize() if isinstance(src, QuantizedTensor) else src)
            return dst
        if func in _SHAPE_OPS:
            cls._refuse(func, args)
        plain: dict[int, torch.Tensor] = {}

        def unwrap(t: Any) -> Any:
            if isinstance(t, QuantizedTensor):
                return plain.setdefault(id(t), t.dequantize())
            if isinstance(t, (list, tuple)):
                return type(t)(unwrap(x) for x in t)
            return t

        out = func(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
        for i, a in enumerate(func._schema.arguments):
            info = a.alias_info
            if info is not None and info.is_write and i < len(args) and isinstance(args[i], QuantizedTensor):
                args[i].quantize_(plain[id(args[i])])
                if out is plain[id(args[i])]:
                    out = args[i]
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, stand-in)"


def _shallow(emu: Any) -> Any:
    """Another handle on the same bytes (an unquantized grouped weight holds a plain tensor)."""
    return emu._shallow_copy() if hasattr(emu, "_shallow_copy") else emu.detach()


def _deep(emu: Any) -> Any:
    return emu._deep_copy() if hasattr(emu, "_deep_copy") else emu.clone()


def _inner_dim_changes(tensor: torch.Tensor, shape: Sequence[Any]) -> tuple[list[int], bool]:
    dims = list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)) else list(shape)
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = tensor.numel() // max(known, 1)
    return dims, not dims or dims[-1] != tensor.shape[-1]


def _update_usage(self: QuantizedTensor, rowwise_usage: Optional[bool] = None,
                  columnwise_usage: Optional[bool] = None) -> None:
    """TE's ``update_usage`` (on the storage classes, not on ``QuantizedTensor``)."""
    row = self._emu.has_orientation("rowwise") if rowwise_usage is None else rowwise_usage
    col = self._emu.has_orientation("columnwise") if columnwise_usage is None else columnwise_usage
    self._emu.update_usage(rowwise=row, columnwise=col)


class Float8Tensor(QuantizedTensor):
    """TE's per-tensor FP8 tensor (delayed and current scaling)."""

    update_usage = _update_usage

    _data = _field("_data", "rowwise_data")
    _transpose = _field("_transpose", "columnwise_data")
    _scale_inv = _field("_scale_inv", "scale_inv")
    _transpose_invalid = False

    @property
    def _fp8_dtype(self) -> Any:
        return self._emu.fp8_format

    def _reset_caches(self) -> None:
        """TE: drop the transpose; it is rebuilt when needed (``_create_transpose``)."""
        self._transpose_invalid = True

    def _create_transpose(self) -> None:
        self._emu.rebuild_columnwise()
        self._transpose_invalid = False

    def reshape(self, *shape: Any) -> torch.Tensor:  # type: ignore[override]
        dims, _ = _inner_dim_changes(self, shape)
        return self.dequantize().reshape(dims)  # TE returns an FP8 view; the values agree

    def view(self, *shape: Any) -> torch.Tensor:  # type: ignore[override]
        return self.reshape(*shape)


class _BlockScaled(QuantizedTensor):
    """The storage attributes TE's block-scaled classes share (MXFP8, blockwise, NVFP4)."""

    _rowwise_data = _field("_rowwise_data", "rowwise_data")
    _columnwise_data = _field("_columnwise_data", "columnwise_data")
    _rowwise_scale_inv = _field("_rowwise_scale_inv", "rowwise_scale_inv")
    _columnwise_scale_inv = _field("_columnwise_scale_inv", "columnwise_scale_inv")
    update_usage = _update_usage

    @property
    def _fp8_dtype(self) -> Any:
        """TE's element dtype of the FP8 families (MXFP8, blockwise): lptrain's format."""
        return getattr(self._emu, "fp8_format", None)


class MXFP8Tensor(_BlockScaled):
    """TE's MXFP8 tensor: 1x32 E8M0 block scales per orientation."""

    _with_gemm_swizzled_scales = False

    def reshape(self, *shape: Any) -> torch.Tensor:  # type: ignore[override]
        dims, inner = _inner_dim_changes(self, shape)
        if inner:
            raise RuntimeError(
                "MXFP8Tensor does not support reshaping inner dimension "
                f"(attempted to reshape dims={tuple(self.shape)} to {tuple(dims)})"
            )
        return self.dequantize().reshape(dims)

    def view(self, *shape: Any) -> torch.Tensor:  # type: ignore[override]
        dims, inner = _inner_dim_changes(self, shape)
        if inner:
            warnings.warn("MXFP8Tensor does not support reshaping inner dimension. "
                          f"(attempted to reshape dims={tuple(self.shape)} to {tuple(dims)})",
                          stacklevel=2)
        return self.dequantize().view(dims)


class Float8BlockwiseQTensor(_BlockScaled):
    """TE's 128x128 (weights) / 1x128 blockwise FP8 tensor."""

    _refuses_inner_reshape: ClassVar[bool] = True  # TE <= 2.13; 2.14+ warns (set per version)

    @property
    def _is_2D_scaled(self) -> bool:
        return bool(self._emu.is_2d)

    def _create_columnwise(self) -> None:
        self._emu.update_usage(rowwise=True, columnwise=True)

    def reshape(self, *shape: Any) -> torch.Tensor:  # type: ignore[override]
        dims, inner = _inner_dim_changes(self, shape)
        changed = inner or (len(dims) < 2 or dims[-2] != self.shape[-2])
        if changed and self._refuses_inner_reshape:
            raise RuntimeError(
                "Float8BlockwiseQTensor does not support reshaping inner dimensions "
                f"(attempted to reshape dims={tuple(self.shape)} to {tuple(dims)})"
            )
        if changed:
            warnings.warn("Float8BlockwiseQTensor does not support reshaping inner dimension",
                          stacklevel=2)
        return self.dequantize().reshape(dims)

    def view(self, *shape: Any) -> torch.Tensor:  # type: ignore[override]
        return self.reshape(*shape)


class NVFP4Tensor(_BlockScaled):
    """TE's NVFP4 tensor: packed E2M1, E4M3 per-16 scales, fp32 per-tensor amax."""

    _amax_rowwise = _field("_amax_rowwise", "amax_rowwise")
    _amax_columnwise = _field("_amax_columnwise", "amax_columnwise")


def tensor_flatten(self: torch.Tensor) -> tuple[list[str], dict[str, Any]]:
    """``__tensor_flatten__`` (TE 2.19+): quantized tensors become *traceable* wrapper
    subclasses, which ``nn.Module._apply`` (``.to()``, ``.cuda()``, ...) swaps for a fresh
    ``Parameter`` with ``torch.utils.swap_tensors`` -- so the parameter's ``__dict__``
    (``_high_precision_init_val`` and the bound get/clear methods with it) is lost."""
    return [], {"emu": self._emu, "quantizer": getattr(self, "_quantizer", None)}


def tensor_unflatten(cls: type, inner: dict[str, Any], ctx: dict[str, Any], size: Any, stride: Any) -> Any:
    return cls(ctx["emu"], ctx["quantizer"])


def set_traceable(enabled: bool) -> None:
    """Give the stand-in tensor classes TE 2.19's ``__tensor_flatten__`` (or take it away)."""
    for cls in (QuantizedTensor, GroupedTensor):
        if enabled:
            cls.__tensor_flatten__ = tensor_flatten  # type: ignore[attr-defined]
            cls.__tensor_unflatten__ = classmethod(tensor_unflatten)  # type: ignore[attr-defined]
        else:
            for name in ("__tensor_flatten__", "__tensor_unflatten__"):
                if name in vars(cls):
                    delattr(cls, name)


def member_cls(emu: Any) -> type[QuantizedTensor]:
    """The stand-in class for an lptrain emulated tensor's family."""
    from lptrain.precision import tensors as T

    for family, cls in ((T.GroupedQuantizedTensor, GroupedTensor), (T.Float8Tensor, Float8Tensor),
                        (T.MXFP8Tensor, MXFP8Tensor), (T.BlockwiseFP8Tensor, Float8BlockwiseQTensor),
                        (T.NVFP4Tensor, NVFP4Tensor)):
        if isinstance(emu, family):
            return cls
    raise TypeError(f"no stand-in TE tensor for {type(emu).__name__}")


def quantizer_for(emu_quantizer: Any) -> Quantizer:
    """The stand-in TE quantizer class for an lptrain emulated quantizer."""
    from lptrain.precision import tensors as T

    if isinstance(emu_quantizer, T.Float8Quantizer):
        cls: type[Quantizer] = Float8Quantizer if emu_quantizer.state is not None else Float8CurrentScalingQuantizer
    elif isinstance(emu_quantizer, T.MXFP8Quantizer):
        cls = MXFP8Quantizer
    elif isinstance(emu_quantizer, T.BlockwiseQuantizer):
        cls = Float8BlockQuantizer
    elif isinstance(emu_quantizer, T.NVFP4Quantizer):
        cls = NVFP4Quantizer
    else:
        raise TypeError(f"no stand-in TE quantizer for {type(emu_quantizer).__name__}")
    q = cls(emu_quantizer)
    return q


def wrap(emu: Any, quantizer: Quantizer) -> QuantizedTensor:
    return member_cls(emu)(emu, quantizer)


Float8Quantizer._tensor_cls = Float8Tensor
Float8CurrentScalingQuantizer._tensor_cls = Float8Tensor
MXFP8Quantizer._tensor_cls = MXFP8Tensor
Float8BlockQuantizer._tensor_cls = Float8BlockwiseQTensor
NVFP4Quantizer._tensor_cls = NVFP4Tensor


# The grouped tensor lives in its own module (it is not a QuantizedTensor); re-exported here,
# where the rest of the stand-in looks tensor classes up.
from .grouped_tensor import GroupedTensor  # noqa: E402
