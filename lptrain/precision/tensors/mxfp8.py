"""MXFP8 (TE ``MXFP8Tensor``), numerics.md 2.4: FP8 elements with one E8M0 scale per 32.

Rowwise: 1x32 blocks along the last dim. Columnwise: 32x1 blocks along dim 0, computed
independently from the high-precision input and NOT transposed (same [M, K] layout), so the
two orientations generally differ. Per block: code = RCEIL(fp32(amax * fl32(1/max))) (P4),
q = satfinite_rne(x * 2^(127-code)) (P5 ``exp2f_rcp``). Dequant multiplies by 2^(code-127).
Optional 2D mode (weights only, off by default): one code per 32x32 tile used for both
orientations, so both data buffers are identical. Scales are compact uint8 codes: rowwise
[M, K/32], columnwise [M/32, K] (2D: the tile code repeated into both shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from .. import scaling as _scaling
from ..formats import FP8Format, cast_to_fp8, fp8_to_float
from ..scratch import Workspace, host_shortcuts
from ._chunks import map_row_chunks
from .base import BlockCut, FP8QuantizedTensor, FP8Quantizer, Orientation, Role, rows_of
from .scaled_operand import MX_1X32, ScaledOperand, as_dtype

MX_BLOCK = 32


class MXFP8Tensor(FP8QuantizedTensor):
    """Fields: ``rowwise_data`` [M, K] u8, ``rowwise_scale_inv`` [M, K/32] u8 (E8M0),
    ``columnwise_data`` [M, K] u8, ``columnwise_scale_inv`` [M/32, K] u8 (E8M0).

    Staged as bf16: the parameter needs both orientations, each quantized from the
    high-precision value with its own block structure, so a byte shard of a flat buffer is not
    enough to rebuild it; the all-gather moves bf16 and each rank requantizes.
    """

    ROWWISE_FIELDS = ("rowwise_data", "rowwise_scale_inv")
    COLUMNWISE_FIELDS = ("columnwise_data", "columnwise_scale_inv")
    STAGING_DTYPE = torch.bfloat16

    def _dequantize_2d(self, orientation: Orientation) -> torch.Tensor:
        data, codes = self._buffers(orientation)
        m, k = data.shape
        # the scales shaped for broadcasting once; a chunk slices them only when it is not
        # the whole tensor (every view is a dispatcher call, which a small operand feels)
        if orientation == "rowwise":
            srow = _scaling.e8m0_to_dequant_scale(codes).view(m, k // MX_BLOCK, 1)

            def rows(o: torch.Tensor, r0: int, r1: int) -> None:
                s = srow if r1 - r0 == m else srow[r0:r1]
                o.view(r1 - r0, k // MX_BLOCK, MX_BLOCK).mul_(s)

            return fp8_to_float(data, self.fp8_format, rows)
        scol = _scaling.e8m0_to_dequant_scale(codes).view(m // MX_BLOCK, 1, k)

        def cols(o: torch.Tensor, r0: int, r1: int) -> None:
            s = scol if r1 - r0 == m else scol[r0 // MX_BLOCK : r1 // MX_BLOCK]
            o.view((r1 - r0) // MX_BLOCK, MX_BLOCK, k).mul_(s)

        return fp8_to_float(data, self.fp8_format, cols, MX_BLOCK)


    def gemm_operand(self, orientation: Orientation) -> ScaledOperand:
        """BlockWise1x32 with E8M0 codes. Row-wise: ``[M, K]`` as stored. Column-wise: the
        32x1 copy is stored untransposed (as TE keeps it for Blackwell, whose GEMMs take every
        layout), so the ``[K, M]`` operand is its transposed view (M-major) with the codes'
        transpose ``[K, M/32]``."""
        data, codes = self._buffers(orientation)
        if orientation == "columnwise":
            data, codes = data.t(), codes.t()
        e8m0 = getattr(torch, "float8_e8m0fnu", None)
        return ScaledOperand(data.view(self.fp8_format.torch_dtype), MX_1X32, as_dtype(codes, e8m0))

    def stat_layout(self, orientation: Orientation) -> tuple[BlockCut, torch.Tensor, bool]:
        """1x32 blocks along K (row-wise) or 32x1 along M (column-wise, same [M, K] layout),
        each scaled by 2^(code - 127)."""
        scales = _scaling.e8m0_to_dequant_scale(self._buffers(orientation)[1])
        if orientation == "rowwise":
            return (lambda t: t.reshape(-1, MX_BLOCK)), scales, False

        def cols(t: torch.Tensor) -> torch.Tensor:
            m, k = t.shape
            return t.view(m // MX_BLOCK, MX_BLOCK, k).transpose(1, 2).reshape(-1, MX_BLOCK)

        return cols, scales, False


class MXFP8Quantizer(FP8Quantizer):
    """MXFP8 quantizer (E4M3 or E5M2 elements, E8M0 RCEIL block scales)."""

    tensor_cls = MXFP8Tensor

    def __init__(
        self,
        role: Role,
        rowwise: bool = True,
        columnwise: bool = True,
        *,
        fp8_format: FP8Format,
        use_2d: bool = False,
    ) -> None:
        super().__init__(role, rowwise, columnwise, fp8_format=fp8_format)
        self.use_2d = use_2d

    def check_shape(self, shape: Sequence[int]) -> None:
        super().check_shape(shape)
        k, m = shape[-1], rows_of(shape)
        if k % MX_BLOCK or m % MX_BLOCK:
            raise ValueError(
                f"MXFP8 needs M and K divisible by 32 (TE is_quantizable), got M={m}, K={k}"
            )

    def _blocks(self, xv: torch.Tensor, dim: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, fp8 bytes) for ``xv`` with blocks reduced over ``dim`` (kept for broadcast)."""
        codes, mult = _scaling.mxfp8_block_scales(_scaling.block_amax(xv, dim), self.fp8_format.max)
        dims = (dim,) if isinstance(dim, int) else dim
        for d in sorted(dims):
            mult = mult.unsqueeze(d)
        return codes, cast_to_fp8(xv * mult, self.fp8_format, inplace=True)

    def _quantize_fields(self, x2d: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        xf = x2d.float()
        k = xf.shape[1]
        out: dict[str, Optional[torch.Tensor]] = dict.fromkeys(MXFP8Tensor._field_names())
        if self.use_2d:

            def tiles(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                xv = c.view(c.shape[0] // MX_BLOCK, MX_BLOCK, k // MX_BLOCK, MX_BLOCK)
                codes, q = self._blocks(xv, (1, 3))  # codes [rows/32, K/32]
                return codes, q.view(c.shape[0], k)

            codes, q = map_row_chunks(tiles, xf, MX_BLOCK)
            if self.rowwise:
                out["rowwise_data"] = q
                out["rowwise_scale_inv"] = codes.repeat_interleave(MX_BLOCK, 0)
            if self.columnwise:
                out["columnwise_data"] = q.clone() if self.rowwise else q
                out["columnwise_scale_inv"] = codes.repeat_interleave(MX_BLOCK, 1)
            return out
        if self.rowwise and self.columnwise and host_shortcuts(xf):
            return self._quantize_both(xf, out)
        if self.rowwise:

            def rows(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                codes, q = self._blocks(c.view(c.shape[0], k // MX_BLOCK, MX_BLOCK), 2)
                return codes, q.view(c.shape[0], k)

            out["rowwise_scale_inv"], out["rowwise_data"] = map_row_chunks(rows, xf)
        if self.columnwise:

            def cols(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                codes, q = self._blocks(c.view(c.shape[0] // MX_BLOCK, MX_BLOCK, k), 1)
                return codes, q.view(c.shape[0], k)

            out["columnwise_scale_inv"], out["columnwise_data"] = map_row_chunks(
                cols, xf, MX_BLOCK
            )
        return out

    def _quantize_both(
        self, xf: torch.Tensor, out: dict[str, Optional[torch.Tensor]]
    ) -> dict[str, Optional[torch.Tensor]]:
        """Both orientations from one |x| pass: the rowwise (1x32) and columnwise (32x1) block
        amaxes are reduced from the same bit patterns, a NaN is looked for once (any NaN is
        in some rowwise block), and the codes and multipliers of both grids come from one
        scale computation. Same values as quantizing each orientation on its own: the block
        math is elementwise per block, only the number of passes and ops changes (on a small
        model the ~30 per-orientation ops of scale set-up cost more than the block math)."""
        k = xf.shape[1]
        fmax = self.fp8_format.max
        ws = Workspace.shared(xf.device)

        def both(c: torch.Tensor) -> tuple[torch.Tensor, ...]:
            r = c.shape[0]
            rv = c.view(r, k // MX_BLOCK, MX_BLOCK)
            cv = c.view(r // MX_BLOCK, MX_BLOCK, k)
            a = _scaling.abs_bits(c, ws)
            ra = a.view(r, k // MX_BLOCK, MX_BLOCK).amax(2)
            if _scaling.has_nan_bits(ra):  # rare: the NaN-ignoring reductions, per grid
                ra, ca = _scaling.block_amax(rv, 2).view(torch.int32), _scaling.block_amax(cv, 1).view(torch.int32)
            else:
                ca = a.view(r // MX_BLOCK, MX_BLOCK, k).amax(1)
            n = ra.numel()
            codes, mult = _scaling.mxfp8_block_scales_i32(
                torch.cat((ra.view(-1), ca.view(-1))).view(torch.float32), fmax)
            qr = cast_to_fp8(rv * mult[:n].view(r, k // MX_BLOCK, 1), self.fp8_format, inplace=True)
            qc = cast_to_fp8(cv * mult[n:].view(r // MX_BLOCK, 1, k), self.fp8_format, inplace=True)
            return (codes[:n].view(r, k // MX_BLOCK).to(torch.uint8), qr.view(r, k),
                    codes[n:].view(r // MX_BLOCK, k).to(torch.uint8), qc.view(r, k))

        (out["rowwise_scale_inv"], out["rowwise_data"], out["columnwise_scale_inv"],
         out["columnwise_data"]) = map_row_chunks(both, xf, MX_BLOCK)
        return out

    def __repr__(self) -> str:
        return (
            f"MXFP8Quantizer(role={self.role!r}, {self.fp8_format.name}, 2d={self.use_2d}, "
            f"rowwise={self.rowwise}, columnwise={self.columnwise})"
        )
