"""Blockwise FP8 (TE ``Float8BlockwiseQTensor``, DeepSeek-V3 style), numerics.md 2.3.

1D (inputs, grads): one fp32 scale per 1x128 block along the last dim. The columnwise copy
uses 1x128 blocks along dim 0, is quantized separately from the high-precision input and is
stored transposed [K, M] (GEMM_READY): it generally differs from the rowwise bytes.
2D (weights): one scale per 128x128 tile; columnwise = exact transpose of data and scales.
Edge blocks count out-of-range elements as 0 for the amax. Scales follow P3 with
``value_for_inf`` = the input dtype's max; pow2 is on by default. Scales are kept compact:
rowwise 1D [M, ceil(K/128)], columnwise 1D [K, ceil(M/128)], 2D [ceil(M/128), ceil(K/128)].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import scaling as _scaling
from ..formats import FP8Format, cast_to_fp8, fp8_to_float
from ._chunks import map_row_chunks
from .base import BlockCut, FP8QuantizedTensor, FP8Quantizer, Orientation, Role
from .scaled_operand import BLOCK_1X128, BLOCK_128X128, ScaledOperand

BLOCK = 128


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor up to [rows, cols] (no copy when already that size)."""
    pr, pc = rows - x.shape[0], cols - x.shape[1]
    return x if pr == 0 and pc == 0 else F.pad(x, (0, pc, 0, pr))


def _expand_scale(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    """Broadcast a compact block-scale grid back to [rows, cols] (for dequantization)."""
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


class BlockwiseFP8Tensor(FP8QuantizedTensor):
    """Fields: ``rowwise_data`` [M, K] u8, ``rowwise_scale_inv`` fp32, ``columnwise_data``
    [K, M] u8, ``columnwise_scale_inv`` fp32 (compact layouts in the module doc).

    Staged as uint8: data bytes are row-local and the fp32 scales are plain arrays, so the raw
    bytes can be placed in a flat buffer and all-gathered (the 2D columnwise copy is rebuilt
    by transposing afterwards, as TE's ``_create_columnwise``).
    """

    ROWWISE_FIELDS = ("rowwise_data", "rowwise_scale_inv")
    COLUMNWISE_FIELDS = ("columnwise_data", "columnwise_scale_inv")
    STAGING_DTYPE = torch.uint8

    @property
    def is_2d(self) -> bool:
        return self._quantizer.block_dim == 2  # type: ignore[attr-defined]

    def _derive_orientation(self, orientation: Orientation) -> dict[str, torch.Tensor]:
        if not self.is_2d:
            return super()._derive_orientation(orientation)
        data, sinv = self._buffers("columnwise" if orientation == "rowwise" else "rowwise")
        return {
            f"{orientation}_data": data.t().contiguous(),
            f"{orientation}_scale_inv": sinv.t().contiguous(),
        }

    @property
    def shard_quantizable(self) -> bool:
        """128x128 tiles only: their scales depend on tile amaxes alone and the column-wise
        copy is a transpose. 1x128 column-wise blocks are quantized separately (bf16 gather)."""
        return self.is_2d and self._fields["rowwise_data"] is not None

    def _tile_rows(self, lo: int, hi: int) -> tuple[int, int]:
        """Rows ``[r0, r1)`` (multiples of 128) covering flat elements ``[lo, hi)``."""
        k = self.shape[-1]
        return lo // k // BLOCK * BLOCK, min(_ceil_div(_ceil_div(hi, k), BLOCK) * BLOCK, _ceil_div(self._rows(), BLOCK) * BLOCK)

    def _rows(self) -> int:
        return self.numel() // self.shape[-1]

    def _piece_grid(self, x: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        """``x`` placed in a zero [r1-r0, K_padded] fp32 grid of whole tiles; returns (grid, r0)."""
        k = self.shape[-1]
        r0, r1 = self._tile_rows(lo, hi)
        grid = torch.zeros((r1 - r0) * _ceil_div(k, BLOCK) * BLOCK, dtype=torch.float32, device=x.device)
        kp = _ceil_div(k, BLOCK) * BLOCK
        view = grid.view(r1 - r0, kp)[:, :k]
        flat_start = lo - r0 * k
        if kp == k:
            grid[flat_start : flat_start + (hi - lo)] = x.float()
        else:
            tmp = torch.zeros((r1 - r0) * k, dtype=torch.float32, device=x.device)
            tmp[flat_start : flat_start + (hi - lo)] = x.float()
            view.copy_(tmp.view(r1 - r0, k))
        return grid.view(r1 - r0, kp), r0

    def shard_amax(self, x: Optional[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        nm, nk = _ceil_div(self._rows(), BLOCK), _ceil_div(self.shape[-1], BLOCK)
        out = torch.zeros(nm, nk, dtype=torch.float32, device=self.device)
        if x is None or x.numel() == 0:
            return out
        grid, r0 = self._piece_grid(x, lo, hi)
        tiles = grid.view(grid.shape[0] // BLOCK, BLOCK, nk, BLOCK)
        out[r0 // BLOCK : r0 // BLOCK + tiles.shape[0]] = _scaling.block_amax(tiles, (1, 3))
        return out

    def shard_quantize(self, x: Optional[torch.Tensor], lo: int, hi: int, amax: torch.Tensor) -> Optional[torch.Tensor]:
        q: BlockwiseQuantizer = self._quantizer  # type: ignore[assignment]
        s = q._scale(amax, float(torch.finfo(self.dtype).max))  # value_for_inf: input dtype max
        sinv = torch.reciprocal(s)
        self._fields["rowwise_scale_inv"].copy_(sinv)  # type: ignore[union-attr]
        if self._fields["columnwise_scale_inv"] is not None:
            self._fields["columnwise_scale_inv"].copy_(sinv.t())  # type: ignore[union-attr]
        if x is None:
            return None
        k = self.shape[-1]
        grid, r0 = self._piece_grid(x, lo, hi)
        nk = grid.shape[1] // BLOCK
        tiles = grid.view(grid.shape[0] // BLOCK, BLOCK, nk, BLOCK)
        st = s[r0 // BLOCK : r0 // BLOCK + tiles.shape[0]]
        qb = cast_to_fp8(tiles * st[:, None, :, None], self.fp8_format, inplace=True)
        rows = qb.view(grid.shape[0], nk * BLOCK)[:, :k].reshape(-1)
        start = lo - r0 * k
        return rows[start : start + (hi - lo)]

    def gemm_operand(self, orientation: Orientation) -> ScaledOperand:
        """1x128 blocks (inputs, grads): both orientations are stored GEMM-ready, K-major with
        their scales per row ([K, M] column-wise, blocks along the tokens). 128x128 tiles
        (weights): either orientation, or the transposed view of the kept one."""
        dtype = self.fp8_format.torch_dtype
        if self.has_orientation(orientation) or not self.is_2d:
            data, sinv = self._buffers(orientation)
            return ScaledOperand(data.view(dtype), BLOCK_128X128 if self.is_2d else BLOCK_1X128, sinv)
        data, sinv = self._buffers("columnwise" if orientation == "rowwise" else "rowwise")
        return ScaledOperand(data.t().view(dtype), BLOCK_128X128, sinv.t())

    def stat_layout(self, orientation: Orientation) -> tuple[BlockCut, torch.Tensor, bool]:
        """128x128 tiles (2D, either orientation: transposes of each other), or 1x128 blocks
        along K (row-wise) / along M (column-wise); edge blocks zero-padded."""
        sinv = self._buffers(orientation)[1]
        if self.is_2d:

            def tiles(t: torch.Tensor) -> torch.Tensor:
                nm, nk = _ceil_div(t.shape[0], BLOCK), _ceil_div(t.shape[1], BLOCK)
                p = _pad_to(t, nm * BLOCK, nk * BLOCK).view(nm, BLOCK, nk, BLOCK)
                return p.permute(0, 2, 1, 3).reshape(-1, BLOCK * BLOCK)

            return tiles, sinv if orientation == "rowwise" else sinv.t(), False
        if orientation == "rowwise":
            return (lambda t: _pad_to(t, t.shape[0], _ceil_div(t.shape[1], BLOCK) * BLOCK)
                    .reshape(-1, BLOCK)), sinv, False
        return (lambda t: _pad_to(t.t(), t.shape[1], _ceil_div(t.shape[0], BLOCK) * BLOCK)
                .reshape(-1, BLOCK)), sinv, False

    def _dequantize_2d(self, orientation: Orientation) -> torch.Tensor:
        data, sinv = self._buffers(orientation)
        r, c = data.shape
        fmt = self.fp8_format
        if self.is_2d and r % BLOCK == 0 and c % BLOCK == 0:

            def tiles(o: torch.Tensor, r0: int, r1: int) -> None:
                o.view((r1 - r0) // BLOCK, BLOCK, c // BLOCK, BLOCK).mul_(
                    sinv[r0 // BLOCK : r1 // BLOCK, None, :, None]
                )

            vals = fp8_to_float(data, fmt, tiles, BLOCK)
        elif not self.is_2d and c % BLOCK == 0:

            def rows(o: torch.Tensor, r0: int, r1: int) -> None:
                o.view(r1 - r0, c // BLOCK, BLOCK).mul_(sinv[r0:r1, :, None])

            vals = fp8_to_float(data, fmt, rows)
        else:  # edge blocks: broadcast the compact grid (rare shapes)
            br = BLOCK if self.is_2d else 1
            vals = fp8_to_float(data, fmt).mul_(_expand_scale(sinv, r, c, br, BLOCK))
        return vals if orientation == "rowwise" else vals.t()


class BlockwiseQuantizer(FP8Quantizer):
    """Blockwise FP8 quantizer; ``block_dim`` 1 (1x128) or 2 (128x128)."""

    tensor_cls = BlockwiseFP8Tensor

    def __init__(
        self,
        role: Role,
        rowwise: bool = True,
        columnwise: bool = True,
        *,
        fp8_format: FP8Format,
        block_dim: int,
        power_2_scale: bool = True,
        amax_epsilon: float = 0.0,
    ) -> None:
        super().__init__(role, rowwise, columnwise, fp8_format=fp8_format)
        if block_dim not in (1, 2):
            raise ValueError(f"block_dim must be 1 or 2, got {block_dim}")
        self.block_dim = block_dim
        self.power_2_scale = power_2_scale
        self.amax_epsilon = amax_epsilon

    def _scale(self, block_amax: torch.Tensor, value_for_inf: float) -> torch.Tensor:
        return _scaling.compute_scale_from_amax(
            block_amax, self.fp8_format.max, self.power_2_scale, self.amax_epsilon, value_for_inf
        )

    def _rowwise_1d(self, xf: torch.Tensor, vfi: float) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = xf.shape
        nb = _ceil_div(k, BLOCK)
        xp = _pad_to(xf, m, nb * BLOCK)

        def chunk(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            xv = c.view(c.shape[0], nb, BLOCK)
            s = self._scale(_scaling.block_amax(xv, -1), vfi)
            q = cast_to_fp8(xv * s[:, :, None], self.fp8_format, inplace=True)
            return q.view(c.shape[0], nb * BLOCK)[:, :k], torch.reciprocal(s)

        q, sinv = map_row_chunks(chunk, xp)
        return q.contiguous(), sinv

    def _columnwise_1d(self, xf: torch.Tensor, vfi: float) -> tuple[torch.Tensor, torch.Tensor]:
        # 1x128 blocks along dim 0, computed in place on [M, K] (elementwise ops, so identical
        # to quantizing x^T) and the bytes transposed at the end: cheaper than an fp32 transpose.
        m, k = xf.shape
        nb = _ceil_div(m, BLOCK)

        def chunk(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            xv = c.view(c.shape[0] // BLOCK, BLOCK, k)
            s = self._scale(_scaling.block_amax(xv, 1), vfi)  # [blocks, K]
            q = cast_to_fp8(xv * s[:, None, :], self.fp8_format, inplace=True)
            return q.view(c.shape[0], k), torch.reciprocal(s)

        q, sinv = map_row_chunks(chunk, _pad_to(xf, nb * BLOCK, k), BLOCK)
        return q[:m].t().contiguous(), sinv.t().contiguous()

    def _quantize_2d(self, xf: torch.Tensor, vfi: float) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = xf.shape
        nm, nk = _ceil_div(m, BLOCK), _ceil_div(k, BLOCK)

        def chunk(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            xv = c.view(c.shape[0] // BLOCK, BLOCK, nk, BLOCK)
            s = self._scale(_scaling.block_amax(xv, (1, 3)), vfi)  # [tiles, nk]
            q = cast_to_fp8(xv * s[:, None, :, None], self.fp8_format, inplace=True)
            return q.view(c.shape[0], nk * BLOCK), torch.reciprocal(s)

        q, sinv = map_row_chunks(chunk, _pad_to(xf, nm * BLOCK, nk * BLOCK), BLOCK)
        return q[:m, :k].contiguous(), sinv

    def _quantize_fields(self, x2d: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        vfi = float(torch.finfo(x2d.dtype).max)  # value_for_inf = input dtype max (P3)
        xf = x2d.float()
        out: dict[str, Optional[torch.Tensor]] = dict.fromkeys(
            BlockwiseFP8Tensor._field_names()
        )
        if self.block_dim == 2:
            q, sinv = self._quantize_2d(xf, vfi)
            if self.rowwise:
                out["rowwise_data"], out["rowwise_scale_inv"] = q, sinv
            if self.columnwise:
                out["columnwise_data"] = q.t().contiguous()
                out["columnwise_scale_inv"] = sinv.t().contiguous()
            return out
        if self.rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = self._rowwise_1d(xf, vfi)
        if self.columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = self._columnwise_1d(xf, vfi)
        return out

    def __repr__(self) -> str:
        return (
            f"BlockwiseQuantizer(role={self.role!r}, {self.fp8_format.name}, "
            f"{'1x128' if self.block_dim == 1 else '128x128'}, pow2={self.power_2_scale}, "
            f"eps={self.amax_epsilon}, rowwise={self.rowwise}, columnwise={self.columnwise})"
        )
