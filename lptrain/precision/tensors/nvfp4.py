"""NVFP4 (TE ``NVFP4Tensor``), numerics.md 2.5: E2M1 elements, E4M3 scale per 16, fp32 amax.

Two-level scaling: a per-tensor S_enc = 2688 / amax and per-block E4M3 decode scales
sdec_b = e4m3(vmax * S_enc / 6); elements are e2m1(x * enc_b) with enc_b = 1/(sdec_b * S_dec).
Rowwise blocks are 1x16 along K; the columnwise copy is quantized from x^T ([K, M], blocks of
16 tokens), optionally after the random Hadamard transform (inputs and grads; rounded to bf16),
with its own amax, and stored transposed [K, M/2]. Weights use 16x16 tiles (one scale per
tile, repeated over its 16 rows) and then the columnwise copy is the exact transpose.
Gradients use stochastic rounding from a seeded ``torch.Generator``. TE stores amax, not
S_enc; so do we. Packing: two codes per byte, element 2i in the low nibble.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from .. import scaling as _scaling
from ..formats import (
    E2M1_GRID,
    Workspace,
    draw_rbits,
    e2m1_codes_i32,
    pack_fp4_i32,
    pack_fp4_rows,
    sr_e2m1_codes_i32,
)
from ..rht import apply_rht, rotate_token_groups
from ._chunks import map_row_chunks
from .base import Orientation, QuantizedTensor, Quantizer, Role, rows_of

NV_BLOCK = 16

# byte -> (low value, high value) as one int64 (two fp32, low nibble's value first): one
# 1-D gather per byte decodes both packed codes.
_GRID = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32)
_BYTE_LUT = torch.stack((_GRID.repeat(16), _GRID.repeat_interleave(16)), dim=1).view(torch.int64).view(-1)
_CHUNK_BYTES = 1 << 18  # packed bytes per pass (~2 MiB of fp32 output, cached for the scaling)


def unpack_fp4_values(
    packed: torch.Tensor, block_scale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[R, C/2] packed bytes -> [R, C] fp32 E2M1 values, times ``block_scale`` [R, C/16] if given.

    Row chunks: the int32 index temporary stays small and each chunk is scaled while cached.
    """
    r, half = packed.shape
    lut = _BYTE_LUT.to(packed.device)
    out = torch.empty(r, half * 2, dtype=torch.float32, device=packed.device)
    words = out.view(torch.int64)  # [R, C/2]: one (low, high) value pair per byte

    step = max(1, _CHUNK_BYTES // max(half, 1))
    for r0 in range(0, r, step):
        r1 = min(r, r0 + step)
        idx = packed[r0:r1].reshape(-1).to(torch.int32)
        torch.index_select(lut, 0, idx, out=words[r0:r1].view(-1))
        if block_scale is not None:
            out[r0:r1].view(r1 - r0, -1, NV_BLOCK).mul_(block_scale[r0:r1, :, None])
    return out


class NVFP4Tensor(QuantizedTensor):
    """Fields: ``rowwise_data`` [M, K/2] u8, ``rowwise_scale_inv`` [M, K/16] u8 (E4M3 bits),
    ``amax_rowwise`` (1,) fp32; ``columnwise_data`` [K, M/2], ``columnwise_scale_inv``
    [K, M/16], ``amax_columnwise`` (1,).

    Staged as bf16: packed nibbles with per-16 block scales, a per-orientation global amax and
    a separately quantized (rotated) columnwise copy cannot be cut into byte shards of a flat
    buffer; the all-gather moves bf16 and each rank requantizes.
    """

    ROWWISE_FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax_rowwise")
    COLUMNWISE_FIELDS = ("columnwise_data", "columnwise_scale_inv", "amax_columnwise")
    STAGING_DTYPE = torch.bfloat16

    @property
    def with_rht(self) -> bool:
        return self._quantizer.with_rht  # type: ignore[attr-defined]

    def _values(self, orientation: Orientation) -> torch.Tensor:
        """fp32 dequantized values in the stored layout ([M, K] rowwise, [K, M] columnwise)."""
        data, sbytes = self._buffers(orientation)
        gamax = self._fields[f"amax_{orientation}"]
        assert gamax is not None
        return unpack_fp4_values(data, _scaling.nvfp4_dequant_block_scale(sbytes, gamax))

    def columnwise_rht_operand(self) -> torch.Tensor:
        """The columnwise [K, M] fp32 GEMM operand as stored (rotated when RHT is on)."""
        return self._values("columnwise")

    def _dequantize_2d(self, orientation: Orientation) -> torch.Tensor:
        vals = self._values(orientation)
        if orientation == "rowwise":
            return vals
        if self.with_rht:  # undo the rotation so values compare with the logical tensor
            vals = apply_rht(vals, inverse=True, round_to_bf16=False)
        return vals.t()


class NVFP4Quantizer(Quantizer):
    """NVFP4 quantizer; ``with_rht`` applies to the columnwise copy only, ``use_2d`` = 16x16
    tiles (weights), ``stochastic_rounding`` draws 8 bits per element from ``generator``."""

    tensor_cls = NVFP4Tensor

    def __init__(
        self,
        role: Role,
        rowwise: bool = True,
        columnwise: bool = True,
        *,
        with_rht: bool = False,
        stochastic_rounding: bool = False,
        use_2d: bool = False,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__(role, rowwise, columnwise)
        if use_2d and with_rht:
            raise ValueError("NVFP4 2D (weight) quantization is not combined with RHT")
        self.with_rht = with_rht
        self.stochastic_rounding = stochastic_rounding
        self.use_2d = use_2d
        if stochastic_rounding and generator is None:
            generator = torch.Generator().manual_seed(0)
        self.generator = generator

    def check_shape(self, shape: Sequence[int]) -> None:
        super().check_shape(shape)
        k, m = shape[-1], rows_of(shape)
        if k % NV_BLOCK:
            raise ValueError(f"NVFP4 needs K divisible by 16, got K={k}")
        if (self.columnwise or self.use_2d) and m % NV_BLOCK:
            raise ValueError(f"NVFP4 columnwise/2D needs M divisible by 16, got M={m}")

    def _codes(self, x: torch.Tensor, enc: torch.Tensor, ws: Workspace) -> torch.Tensor:
        """int32 E2M1 codes of fp32(x * enc) (RNE, or SR with fresh bits), in ``ws``."""
        y = torch.mul(x, enc, out=ws.get("y", x.shape, torch.float32))
        if self.stochastic_rounding:
            return sr_e2m1_codes_i32(y, draw_rbits(y.numel(), self.generator, y.device), ws)
        return e2m1_codes_i32(y, ws)

    def _quantize_blocks(
        self, xf: torch.Tensor, gamax: torch.Tensor, dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed bytes, scale bytes) with 16-element blocks along ``dim`` of ``xf`` [M, K].

        dim=1: rowwise 1x16 blocks; bytes [M, K/2] packed along K, scales [M, K/16].
        dim=0: blocks of 16 rows computed in place on [M, K] (elementwise math, so identical
        to quantizing x^T) with scales [M/16, K]; the bytes pair rows 2i, 2i+1 ([M/2, K]), so
        their transpose is the [K, M/2] packing of x^T.
        """
        k = xf.shape[1]
        scaler = _scaling.NVFP4BlockScaler(_scaling.nvfp4_global_encode_scale(gamax))
        ws = Workspace(xf.device)

        def rows(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            xv = c.view(c.shape[0], k // NV_BLOCK, NV_BLOCK)
            sbytes, enc = scaler(_scaling.block_amax(xv, 2, ws))
            return pack_fp4_i32(self._codes(xv, enc[:, :, None], ws).view(c.shape[0], k)), sbytes

        def cols(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            xv = c.view(c.shape[0] // NV_BLOCK, NV_BLOCK, k)
            sbytes, enc = scaler(_scaling.block_amax(xv, 1, ws))
            return pack_fp4_rows(self._codes(xv, enc[:, None, :], ws).view(c.shape[0], k)), sbytes

        if dim == 1:
            return map_row_chunks(rows, xf)  # type: ignore[return-value]
        return map_row_chunks(cols, xf, NV_BLOCK)  # type: ignore[return-value]

    def _quantize_fields(self, x2d: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        xf = x2d.float()
        k = xf.shape[1]
        out: dict[str, Optional[torch.Tensor]] = dict.fromkeys(NVFP4Tensor._field_names())
        gamax = _scaling.amax(xf).reshape(1)
        if self.use_2d:
            scaler = _scaling.NVFP4BlockScaler(_scaling.nvfp4_global_encode_scale(gamax))
            ws = Workspace(xf.device)

            def tiles(c: torch.Tensor) -> tuple[torch.Tensor, ...]:
                xv = c.view(c.shape[0] // NV_BLOCK, NV_BLOCK, k // NV_BLOCK, NV_BLOCK)
                tb, enc = scaler(_scaling.block_amax(xv, (1, 3), ws))
                codes = self._codes(xv, enc[:, None, :, None], ws).view(c.shape[0], k)
                row = pack_fp4_i32(codes) if self.rowwise else codes[:0]
                col = pack_fp4_rows(codes) if self.columnwise else codes[:0]
                return row, col, tb

            row_b, col_b, tile_bytes = map_row_chunks(tiles, xf, NV_BLOCK)
            if self.rowwise:
                out["rowwise_data"] = row_b
                out["rowwise_scale_inv"] = tile_bytes.repeat_interleave(NV_BLOCK, 0)
                out["amax_rowwise"] = gamax
            if self.columnwise:
                out["columnwise_data"] = col_b.t().contiguous()
                out["columnwise_scale_inv"] = tile_bytes.t().repeat_interleave(NV_BLOCK, 0)
                out["amax_columnwise"] = gamax.clone()
            return out
        if self.rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = self._quantize_blocks(xf, gamax, 1)
            out["amax_rowwise"] = gamax
        if self.columnwise:
            if self.with_rht:  # rotate 16-token groups (x^T's rows), round to bf16, own amax
                src = rotate_token_groups(xf)
                camax = _scaling.amax(src).reshape(1)
            else:
                src, camax = xf, gamax.clone()
            data, sbytes = self._quantize_blocks(src, camax, 0)
            out["columnwise_data"] = data.t().contiguous()
            out["columnwise_scale_inv"] = sbytes.t().contiguous()
            out["amax_columnwise"] = camax
        return out

    def __repr__(self) -> str:
        return (
            f"NVFP4Quantizer(role={self.role!r}, rht={self.with_rht}, "
            f"sr={self.stochastic_rounding}, 2d={self.use_2d}, rowwise={self.rowwise}, "
            f"columnwise={self.columnwise})"
        )
