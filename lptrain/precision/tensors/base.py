"""The format-agnostic quantized-tensor interface: ``QuantizedTensor`` and ``Quantizer``.

Buffer, optimizer and checkpoint code only ever talk to this interface; every format answers
the questions (raw buffers, bytes per orientation, staging dtype, requantize, dequantize) itself.

``QuantizedTensor`` is a ``torch.Tensor`` wrapper subclass (the pattern TE and torchao use): its
``shape``/``dtype`` are the logical ones, so it can be the data of an ``nn.Parameter`` and modules
see an ordinary weight. Its bytes live in a dict of plain tensors (``_fields``). Any aten op
that is not handled explicitly runs on the dequantized value, so a quantized parameter behaves
like its high-precision value everywhere it is not consumed by a quantized GEMM.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional

import torch
from torch.utils._pytree import tree_map

from ..formats import FP8Format, rounding_limit

if TYPE_CHECKING:
    from .grouped import GroupedQuantizedTensor
    from .scaled_operand import ScaledOperand

Role = Literal["input", "weight", "grad"]
Orientation = Literal["rowwise", "columnwise"]
ROLES: tuple[str, ...] = ("input", "weight", "grad")
_ORIENTATIONS = ("rowwise", "columnwise")

aten = torch.ops.aten
BlockCut = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StatBlocks:
    """An operand cut into its scaling blocks, for the quantization statistics: ``values``
    (the high-precision input, or None) and ``dequantized`` ``[B, E]``, ``scales`` ``[B]``
    (each block's dequantization scale), the format's clamp limit (a value beyond
    ``clamp_limit * scale`` was clamped), and whether the format has one scale per tensor."""

    values: Optional[torch.Tensor]
    dequantized: torch.Tensor
    scales: torch.Tensor
    clamp_limit: float
    per_tensor: bool


def _check_orientation(orientation: str) -> None:
    if orientation not in _ORIENTATIONS:
        raise ValueError(f"orientation must be 'rowwise' or 'columnwise', got {orientation!r}")


def rows_of(shape: Sequence[int]) -> int:
    """M = prod(leading dims) of a logical shape (the row count of its 2-D view)."""
    return math.prod(shape[:-1])


def flatten_2d(x: torch.Tensor) -> torch.Tensor:
    """[*, K] -> [M, K] with M = prod(leading dims); a 1-D tensor is one row."""
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-d tensor")
    return x.reshape(-1, x.shape[-1])


class Quantizer(ABC):
    """Turns high-precision tensors of one role into one quantized-tensor family.

    Subclasses implement ``_quantize_fields`` (the vectorised math, returning the raw buffers)
    and ``check_shape``; everything else (wrapping, in-place requantize, grouping) is shared.
    """

    tensor_cls: ClassVar[type[QuantizedTensor]]

    def __init__(self, role: Role, rowwise: bool = True, columnwise: bool = True) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not (rowwise or columnwise):
            raise ValueError("a quantizer needs rowwise and/or columnwise usage")
        self.role: Role = role
        self.rowwise = rowwise
        self.columnwise = columnwise

    @abstractmethod
    def _quantize_fields(self, x2d: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        """Quantize ``x2d`` ([M, K], input dtype) into this family's buffers."""

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raise ``ValueError`` if a tensor of ``shape`` cannot be quantized (default: any)."""
        if len(shape) == 0:
            raise ValueError("cannot quantize a 0-d tensor")

    def quantize(
        self, x: torch.Tensor, *, preserve_high_precision_init_val: bool = False
    ) -> QuantizedTensor:
        x = x.detach()
        if isinstance(x, QuantizedTensor):
            x = x.dequantize().to(x.dtype)
        self.check_shape(x.shape)
        fields = self._quantize_fields(flatten_2d(x))
        qt = self.tensor_cls(x.shape, x.dtype, quantizer=self, fields=fields, device=x.device)
        if preserve_high_precision_init_val:
            qt._hp_init = x.to("cpu", copy=True)
        return qt

    def requantize_into(self, x: torch.Tensor, dst: QuantizedTensor) -> None:
        """Quantize ``x`` and write the bytes and scales into ``dst``'s existing buffers."""
        x = x.detach()
        if isinstance(x, QuantizedTensor):
            x = x.dequantize()
        if tuple(x.shape) != tuple(dst.shape):
            raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(dst.shape)}")
        x = x.to(dst.dtype)  # like TE: master -> model dtype -> quantize
        self.check_shape(x.shape)
        dst._assign_fields(self._quantize_fields(flatten_2d(x)))

    def with_usage(self, rowwise: bool, columnwise: bool) -> Quantizer:
        """A shallow copy with other usage flags (shares state/generator objects)."""
        q = copy.copy(self)
        if not (rowwise or columnwise):
            raise ValueError("a quantizer needs rowwise and/or columnwise usage")
        q.rowwise, q.columnwise = rowwise, columnwise
        return q

    def quantize_grouped(
        self,
        xs: Sequence[torch.Tensor] | torch.Tensor,
        *,
        preserve_high_precision_init_val: bool = False,
    ) -> GroupedQuantizedTensor:
        """Quantize N same-shape members (e.g. MoE experts) into one grouped tensor."""
        from .grouped import GroupedQuantizedTensor

        keep = preserve_high_precision_init_val
        return GroupedQuantizedTensor.from_members(
            [self.quantize(x, preserve_high_precision_init_val=keep) for x in xs]
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(role={self.role!r}, rowwise={self.rowwise}, "
            f"columnwise={self.columnwise})"
        )


class QuantizedTensor(torch.Tensor):
    """A quantized tensor with a logical shape and dtype (the high-precision ones).

    Families declare their buffer names in ``ROWWISE_FIELDS``/``COLUMNWISE_FIELDS``/
    ``SHARED_FIELDS`` and implement ``_dequantize_2d``. Buffers absent for an unused orientation
    are ``None``.
    """

    ROWWISE_FIELDS: ClassVar[tuple[str, ...]] = ()
    COLUMNWISE_FIELDS: ClassVar[tuple[str, ...]] = ()
    SHARED_FIELDS: ClassVar[tuple[str, ...]] = ()
    STAGING_DTYPE: ClassVar[torch.dtype] = torch.bfloat16

    _quantizer: Quantizer
    _fields: dict[str, Optional[torch.Tensor]]
    _hp_init: Optional[torch.Tensor]

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        quantizer: Quantizer,
        fields: dict[str, Optional[torch.Tensor]],
        device: Optional[torch.device] = None,
        requires_grad: bool = False,
    ) -> QuantizedTensor:
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )
        self._quantizer = quantizer
        self._fields = {k: fields.get(k) for k in cls._field_names()}
        self._hp_init = None
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---- interface --------------------------------------------------------------------------

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return cls.ROWWISE_FIELDS + cls.SHARED_FIELDS + cls.COLUMNWISE_FIELDS

    @property
    def quantizer(self) -> Quantizer:
        return self._quantizer

    orig_dtype = property(lambda self: self.dtype, doc="The logical dtype (TE's name for it).")

    @property
    def staging_dtype(self) -> torch.dtype:
        """Dtype used to stage this tensor for a parameter all-gather (see the family doc)."""
        return self.STAGING_DTYPE

    def has_orientation(self, orientation: str) -> bool:
        _check_orientation(orientation)
        names = self.ROWWISE_FIELDS if orientation == "rowwise" else self.COLUMNWISE_FIELDS
        return all(self._fields[k] is not None for k in names)

    def _buffers(self, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(``{orientation}_data``, ``{orientation}_scale_inv``) of a present orientation
        (the block-scaled families' shared layout)."""
        data = self._fields[f"{orientation}_data"]
        scale = self._fields[f"{orientation}_scale_inv"]
        assert data is not None and scale is not None, f"{orientation} buffers absent"
        return data, scale

    def _dequantize_2d(self, orientation: Orientation) -> torch.Tensor:
        raise NotImplementedError  # per family: fp32 [M, K] values of a present orientation

    def dequantize(self, orientation: str = "rowwise") -> torch.Tensor:
        """fp32 values with the logical shape; uses the other orientation if this one is absent."""
        _check_orientation(orientation)
        if not self.has_orientation(orientation):
            orientation = "columnwise" if orientation == "rowwise" else "rowwise"
        if math.prod(self.shape) == 0:  # e.g. an MoE expert that received no tokens
            return torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        return self._dequantize_2d(orientation).reshape(self.shape)  # type: ignore[arg-type]

    def gemm_operand(self, orientation: Orientation) -> ScaledOperand:
        """An operand of torch's scaled GEMM as stored, per family (scaled_operand.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no scaled-GEMM layout")

    def _derive_orientation(self, orientation: Orientation) -> dict[str, torch.Tensor]:
        """Buffers of an absent ``orientation`` rebuilt from the present one, where the format
        makes them exact transposes/copies; families that quantize orientations separately
        cannot (default: raise)."""
        raise ValueError(
            f"{type(self).__name__} cannot rebuild its {orientation} buffers from the other "
            "orientation (they are quantized separately); requantize from high precision"
        )

    def update_usage(self, *, rowwise: bool, columnwise: bool) -> None:
        """Keep only the buffers of the requested orientations, in place (TE ``update_usage``).

        Dropping frees memory (e.g. saved-for-backward operands that only need columnwise).
        Enabling an absent orientation works only where it is derivable (per-tensor and 2D
        block formats: exact transposes); otherwise ``ValueError``. The quantizer's usage flags
        follow, so later ``requantize_from`` writes exactly the kept buffers.
        """
        if not (rowwise or columnwise):
            raise ValueError("update_usage needs rowwise and/or columnwise")
        want = {"rowwise": rowwise, "columnwise": columnwise}
        for o, keep in want.items():
            if keep and not self.has_orientation(o):
                self._fields.update(self._derive_orientation(o))  # type: ignore[arg-type]
        for o, keep in want.items():
            if not keep:
                for k in self.ROWWISE_FIELDS if o == "rowwise" else self.COLUMNWISE_FIELDS:
                    self._fields[k] = None
        self._quantizer = self._quantizer.with_usage(rowwise, columnwise)

    def requantize_from(self, src: torch.Tensor) -> None:
        """Requantize ``src`` (cast to the logical dtype first) into these buffers, in place."""
        self._quantizer.requantize_into(src, self)

    def storage_views(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._fields.items() if v is not None}

    def nbytes(self, orientation: Optional[str] = None) -> int:  # type: ignore[override]
        """Bytes held: all buffers, or one orientation's data + scales (+ shared scale/amax)."""
        if orientation is None:
            names = self._field_names()
        else:
            _check_orientation(orientation)
            own = self.ROWWISE_FIELDS if orientation == "rowwise" else self.COLUMNWISE_FIELDS
            names = own + self.SHARED_FIELDS
        return sum(
            t.numel() * t.element_size() for k in names if (t := self._fields.get(k)) is not None
        )

    # ---- quantization statistics (lptrain.precision.operand_stats) ---------------------------

    def stat_layout(self, orientation: Orientation) -> tuple[BlockCut, torch.Tensor, bool]:
        """How ``orientation`` is scaled: ``(cut, scales, per_tensor)``. ``cut`` turns a
        logical ``[M, K]`` fp32 tensor into that orientation's scaling blocks ``[B, E]``
        (edge blocks zero-padded), ``scales`` are the B fp32 dequantization scales in the same
        order (per family; the scale of an E8M0/E4M3 code, or ``scale_inv``)."""
        raise NotImplementedError(f"{type(self).__name__} has no statistics layout")

    @property
    def clamp_limit(self) -> float:
        """The smallest scaled magnitude the element format cannot round to its largest code
        (:func:`~lptrain.precision.formats.rounding_limit`: E4M3 464, E5M2 61440, E2M1 7)."""
        raise NotImplementedError

    def stat_blocks(self, x: Optional[torch.Tensor],
                    rowwise: Optional[torch.Tensor] = None) -> StatBlocks:
        """``x`` (the high-precision tensor this was quantized from; None when there is none,
        e.g. a quantized primary weight) and these dequantized values, cut into the scaling
        blocks of the orientation the forward GEMM or dgrad reads (row-wise; column-wise when
        only that one is kept). ``rowwise``: the row-wise dequantized values, when the caller
        already has them (the GEMM's operand: not dequantized twice)."""
        o: Orientation = "rowwise" if self.has_orientation("rowwise") else "columnwise"
        cut, scales, per_tensor = self.stat_layout(o)
        k = self.shape[-1]
        deq = (rowwise if rowwise is not None and o == "rowwise" else self.dequantize(o)).reshape(-1, k)
        ref = cut(x.detach().float().reshape(-1, k)) if x is not None else None
        return StatBlocks(ref, cut(deq), scales.float().reshape(-1), self.clamp_limit, per_tensor)

    # ---- sharded primary weights (ZeRO-3): the data bytes exist only around their uses -----

    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("rowwise_data", "columnwise_data")

    def release_data(self) -> None:
        """Free the storage of the data buffers (resized to 0; scales, amaxes and the
        tensor objects stay, so views saved for backward become valid again after
        :meth:`restore_data`). Contents are undefined until refilled."""
        sizes = getattr(self, "_released_bytes", None) or {}
        for k in self.DATA_FIELDS:
            t = self._fields.get(k)
            if t is not None and t.untyped_storage().nbytes():
                sizes[k] = t.untyped_storage().nbytes()
                t.untyped_storage().resize_(0)
        self._released_bytes = sizes

    def restore_data(self) -> None:
        """Give released data buffers their storage back (contents to be refilled: a gather
        into an aliased buffer, then ``rebuild_columnwise``, or ``requantize_from``)."""
        for k, n in (getattr(self, "_released_bytes", None) or {}).items():
            t = self._fields.get(k)
            if t is not None and t.untyped_storage().nbytes() != n:
                t.untyped_storage().resize_(n)
        self._released_bytes = {}

    def high_precision_init_value(self) -> Optional[torch.Tensor]:
        return self._hp_init

    def clear_high_precision_init_value(self) -> None:
        self._hp_init = None

    # ---- byte-level param gather (sharded primary weights) -----------------------------------
    #
    # A family whose row-wise bytes can be cut into arbitrary element ranges of a flat buffer
    # (one shared scale, or scales that depend only on block amaxes) is ``shard_quantizable``:
    # each rank quantizes only its shard of the fp32 master straight into its byte range of
    # the param buffer, with the amax (per tensor or per block) MAX-reduced over the group
    # first, so every rank derives the same scales; the all-gather then moves 1 byte per
    # element and the column-wise copy is rebuilt locally. Other families gather their
    # high-precision value and requantize.

    @property
    def shard_quantizable(self) -> bool:
        return False

    def shard_amax(self, x: Optional[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Partial amax (per tensor or per block) of the flat elements ``[lo, hi)`` with
        values ``x`` (None: no local elements), to be MAX-reduced over the group."""
        raise NotImplementedError(f"{type(self).__name__} is not shard-quantizable")

    def shard_quantize(self, x: Optional[torch.Tensor], lo: int, hi: int, amax: torch.Tensor) -> Optional[torch.Tensor]:
        """Set the scales from the reduced ``amax`` (identical on every rank) and return the
        row-wise bytes of elements ``[lo, hi)`` (None when ``x`` is None)."""
        raise NotImplementedError(f"{type(self).__name__} is not shard-quantizable")

    def alias_rowwise_data(self, view: torch.Tensor) -> None:
        """Make the row-wise bytes a view of ``view`` (a uint8 buffer slice), keeping values."""
        data = self._fields["rowwise_data"]
        assert data is not None
        view.copy_(data.reshape(-1))
        self._fields["rowwise_data"] = view.view(data.shape)

    def rebuild_columnwise(self) -> None:
        """After a byte-level gather: rebuild the column-wise buffers from the row-wise ones."""
        cols = [k for k in self.COLUMNWISE_FIELDS if self._fields[k] is not None]
        if not cols:
            return
        derived = self._derive_orientation("columnwise")
        for k in cols:
            dst, src = self._fields[k], derived.get(k)
            if src is None or dst is None:
                continue
            if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
                if src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride():
                    continue  # already the same view (e.g. a one-row scale grid)
                src = src.clone()
            dst.copy_(src.reshape(dst.shape))

    # ---- buffer plumbing ----------------------------------------------------------------------

    def _assign_fields(self, new: dict[str, Optional[torch.Tensor]]) -> None:
        for k, dst in self._fields.items():
            src = new.get(k)
            if (dst is None) != (src is None):
                raise ValueError(f"buffer {k!r} presence differs between quantizations")
            if dst is not None and src is not None:
                dst.copy_(src.reshape(dst.shape))

    def _rewrap(self, fields: dict[str, Optional[torch.Tensor]]) -> QuantizedTensor:
        out = type(self)(
            self.shape, self.dtype, quantizer=self._quantizer, fields=fields, device=self.device
        )
        out._hp_init = self._hp_init
        return out

    def _shallow_copy(self) -> QuantizedTensor:
        return self._rewrap(dict(self._fields))

    def _deep_copy(self) -> QuantizedTensor:
        return self._rewrap({k: None if v is None else v.clone() for k, v in self._fields.items()})

    def _same_layout(self, other: torch.Tensor) -> bool:
        if type(other) is not type(self) or tuple(other.shape) != tuple(self.shape):
            return False
        mine, theirs = self._fields, other._fields  # type: ignore[attr-defined]
        return all(
            (mine[k] is None) == (theirs[k] is None)
            and (mine[k] is None or mine[k].shape == theirs[k].shape)  # type: ignore[union-attr]
            for k in mine
        )

    def _copy_from(self, src: torch.Tensor) -> None:
        if self._same_layout(src):
            self._assign_fields(src._fields)  # type: ignore[attr-defined]
        else:
            self.requantize_from(src)

    def _plain(self) -> torch.Tensor:
        return self.dequantize().to(self.dtype)

    # ---- torch integration ----------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._shallow_copy()
        if func is aten.clone.default:
            return args[0]._deep_copy()
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, QuantizedTensor):
                dst._copy_from(src)
            else:
                dst.copy_(src._plain())
            return dst
        # Generic fallback: run on dequantized values; in-place writes to a QuantizedTensor
        # are requantized into its buffers.
        plain = {}

        def unwrap(t: Any) -> Any:
            if isinstance(t, QuantizedTensor):
                if id(t) not in plain:
                    plain[id(t)] = t._plain()
                return plain[id(t)]
            return t

        uargs = tree_map(unwrap, args)
        ukwargs = tree_map(unwrap, kwargs)
        out = func(*uargs, **ukwargs)
        schema_args = func._schema.arguments
        for i, a in enumerate(args):
            info = schema_args[i].alias_info if i < len(schema_args) else None
            if info is not None and info.is_write and isinstance(a, QuantizedTensor):
                a.requantize_from(uargs[i])
                if out is uargs[i]:
                    out = a
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        present = [o for o in _ORIENTATIONS if self.has_orientation(o)]
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"quantizer={self._quantizer!r}, orientations={present})"
        )


class FP8QuantizedTensor(QuantizedTensor):
    """Families whose element bytes are FP8 (per-tensor, blockwise, MXFP8): the element
    format is the quantizer's."""

    @property
    def fp8_format(self) -> FP8Format:
        return self._quantizer.fp8_format  # type: ignore[attr-defined]

    @property
    def clamp_limit(self) -> float:
        fmt = self.fp8_format
        return rounding_limit(fmt.max, float(torch.finfo(fmt.torch_dtype).eps))


class FP8Quantizer(Quantizer):
    """Quantizers producing FP8 element bytes: they all carry the element ``fp8_format``."""

    def __init__(
        self, role: Role, rowwise: bool = True, columnwise: bool = True, *, fp8_format: FP8Format
    ) -> None:
        super().__init__(role, rowwise, columnwise)
        self.fp8_format = fp8_format
