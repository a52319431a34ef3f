"""Per-tensor FP8 (TE ``Float8Tensor``): delayed scaling and current (tensorwise) scaling.

One fp32 scale per tensor. The columnwise copy is the exact byte transpose of the rowwise data
with the same ``scale_inv`` (what TE builds as ``_transpose`` on GPUs without non-TN FP8 GEMMs),
so the two orientations always dequantize to the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import scaling as _scaling
from ..byte_transpose import transposed_bytes
from ..formats import FLT_MAX, FP8Format, cast_to_fp8, fp8_to_float
from ._chunks import map_row_chunks
from .base import BlockCut, FP8QuantizedTensor, FP8Quantizer, Orientation, Role
from .scaled_operand import TENSORWISE, ScaledOperand

if TYPE_CHECKING:
    from ..recipes import DelayedScalingState


class Float8Tensor(FP8QuantizedTensor):
    """Fields: ``rowwise_data`` [M, K] u8, ``scale_inv`` (1,) fp32, ``columnwise_data`` [K, M] u8.

    Staged as uint8: the bytes are elementwise with one shared scale, so any contiguous byte
    range of a flat buffer is a valid shard and an all-gather reassembles the tensor exactly.
    """

    ROWWISE_FIELDS = ("rowwise_data",)
    SHARED_FIELDS = ("scale_inv",)
    COLUMNWISE_FIELDS = ("columnwise_data",)
    STAGING_DTYPE = torch.uint8

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._fields["scale_inv"]  # type: ignore[return-value]

    def _derive_orientation(self, orientation: Orientation) -> dict[str, torch.Tensor]:
        src = self._fields["columnwise_data" if orientation == "rowwise" else "rowwise_data"]
        assert src is not None
        return {f"{orientation}_data": transposed_bytes(src)}

    @property
    def shard_quantizable(self) -> bool:
        """Current scaling only: a delayed-scaling weight's scale comes from its amax history,
        which a byte-sharded quantization would have to replay; those gather bf16."""
        return self._quantizer.state is None and self._fields["rowwise_data"] is not None  # type: ignore[attr-defined]

    def shard_amax(self, x: Optional[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        if x is None or x.numel() == 0:
            return torch.zeros(1, dtype=torch.float32, device=self.device)
        return _scaling.amax(x.float()).reshape(1)

    def shard_quantize(self, x: Optional[torch.Tensor], lo: int, hi: int, amax: torch.Tensor) -> Optional[torch.Tensor]:
        q: Float8Quantizer = self._quantizer  # type: ignore[assignment]
        s = _scaling.compute_scale_from_amax(
            amax.reshape(1), q.fp8_format.max, q.power_2_scale, q.amax_epsilon, FLT_MAX
        )
        self.scale_inv.copy_(torch.reciprocal(s))
        if x is None:
            return None
        return cast_to_fp8(x.float() * s, q.fp8_format, inplace=True)

    def gemm_operand(self, orientation: Orientation) -> ScaledOperand:
        """TensorWise: the bytes of ``orientation`` (K-major: the columnwise copy is the byte
        transpose) or, when only the other one is kept, its transposed view; ``scale_inv``."""
        other = "columnwise" if orientation == "rowwise" else "rowwise"
        own = self._fields[f"{orientation}_data"]
        data = own if own is not None else self._fields[f"{other}_data"].t()  # type: ignore[union-attr]
        return ScaledOperand(data.view(self.fp8_format.torch_dtype), TENSORWISE, self.scale_inv)

    def stat_layout(self, orientation: Orientation) -> tuple[BlockCut, torch.Tensor, bool]:
        """One block: the whole tensor, scaled by ``scale_inv``."""
        return (lambda t: t.reshape(1, -1)), self.scale_inv, True

    def _dequantize_2d(self, orientation: Orientation) -> torch.Tensor:
        data = self._fields[f"{orientation}_data"]
        assert data is not None
        vals = fp8_to_float(data, self.fp8_format, scale=self.scale_inv)
        return vals if orientation == "rowwise" else vals.t()


class Float8Quantizer(FP8Quantizer):
    """Per-tensor FP8 quantizer.

    Current scaling (``state is None``): s = compute_scale_from_amax(amax(x)) (P3), optionally
    after MAX-reducing amax with ``amax_reduction``. Delayed scaling: s = ``state.scale`` (the
    scale computed at the end of the previous step) and max|x| is recorded into
    ``state.amax_history[0]``. Data = satfinite_rne(fp32(x * s)), scale_inv = fp32(1 / s).
    """

    tensor_cls = Float8Tensor

    def __init__(
        self,
        role: Role,
        rowwise: bool = True,
        columnwise: bool = True,
        *,
        fp8_format: FP8Format,
        power_2_scale: bool = False,
        amax_epsilon: float = 0.0,
        amax_reduction: Optional[Any] = None,
        state: Optional[DelayedScalingState] = None,
    ) -> None:
        super().__init__(role, rowwise, columnwise, fp8_format=fp8_format)
        self.power_2_scale = power_2_scale
        self.amax_epsilon = amax_epsilon
        self.amax_reduction = amax_reduction
        self.state = state
        if state is not None and state.fp8_format != fp8_format:
            raise ValueError(f"state format {state.fp8_format} != quantizer format {fp8_format}")

    def current_scale(self, x2d: torch.Tensor) -> torch.Tensor:
        """The (1,) fp32 scale used for ``x2d`` (records the amax for delayed scaling)."""
        a = _scaling.amax(x2d).reshape(1)
        if self.state is not None:
            self.state.record_amax(a)
            return self.state.scale.clone()
        a = _scaling.maybe_reduce_amax(a, self.amax_reduction)
        return _scaling.compute_scale_from_amax(
            a, self.fp8_format.max, self.power_2_scale, self.amax_epsilon, FLT_MAX
        )

    def _quantize_fields(self, x2d: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        xf = x2d.float()
        s = self.current_scale(xf)
        (q,) = map_row_chunks(lambda c: (cast_to_fp8(c * s, self.fp8_format, inplace=True),), xf)
        return {
            "rowwise_data": q if self.rowwise else None,
            "scale_inv": torch.reciprocal(s),
            "columnwise_data": transposed_bytes(q) if self.columnwise else None,
        }

    def __repr__(self) -> str:
        kind = "delayed" if self.state is not None else "current"
        return (
            f"Float8Quantizer({kind}, role={self.role!r}, {self.fp8_format.name}, "
            f"rowwise={self.rowwise}, columnwise={self.columnwise})"
        )
