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
from typing import Any, Optional

import torch

from .. import scaling as _scaling
from ..byte_transpose import transposed_copy
from ..formats import (
    E2M1_MAX,
    draw_rbits,
    e2m1_codes_i32,
    pack_fp4_col_words,
    pack_fp4_i32,
    pack_fp4_rows,
    rounding_limit,
    sr_e2m1_codes_i32,
)
from ..rht import rht_rows_from_chunks, rotate_group_rows_keep, rotated_scratch
from ..scratch import Workspace
from ._chunks import map_row_chunks, row_ranges
from .base import BlockCut, Orientation, QuantizedTensor, Quantizer, Role, rows_of
from .fp4_decode import (  # noqa: F401  (re-exported: the decode's public names)
    NV_BLOCK,
    chunk_threads,
    decode_chunk_elems,
    decode_fp4_chunks,
    unpack_fp4_values,
)
from .scaled_operand import NV_1X16, ScaledOperand, as_dtype, fp4_dtype

# Row chunk of the quantize passes, per intra-op thread (elements): 1 MiB of fp32 per buffer
# and thread, so each op's share of a chunk stays cache-sized while its fork/join and Python
# dispatch are paid once per chunk, not once per thread's worth. At 1 thread 1 MiB and 2 MiB
# chunks measured within 5-10% of each other, which one ahead depending on the machine (much
# smaller ones pay the per-op overhead); at 2 threads a fixed 1 MiB chunk made each op's halves
# too small to amortise the fork/join (4096^2 rht+sr grad q+dq: 2 MiB chunks 8.1 / 7.7x a copy
# against 8.9 / 8.5x in interleaved A/B runs).
# Elementwise math, 16-row-aligned RHT groups and word-aligned SR draws, so the chunking never
# changes a bit (tested over chunk sizes).
_ROW_CHUNK_ELEMS_PER_THREAD = 1 << 18
_chunk_threads = chunk_threads


def row_chunk_elems() -> int:
    """Elements per row chunk of the NVFP4 quantize passes for this process's intra-op threads."""
    return _ROW_CHUNK_ELEMS_PER_THREAD * _chunk_threads()


def _global_amax(block_amaxes: torch.Tensor) -> torch.Tensor:
    """(1,) global amax from NaN-ignoring block amaxes (>= +0, never NaN): their max."""
    if block_amaxes.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=block_amaxes.device)
    return block_amaxes.amax().reshape(1)


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
        return unpack_fp4_values(data, scale_bits=sbytes, gamax=gamax)

    def columnwise_rht_operand(self) -> torch.Tensor:
        """The columnwise [K, M] fp32 GEMM operand as stored (rotated when RHT is on)."""
        return self._values("columnwise")

    def gemm_operand(self, orientation: Orientation) -> ScaledOperand:
        """BlockWise1x16: packed E2M1 pairs (element 2i in the low nibble, as torch's
        ``float4_e2m1fn_x2`` and cuBLAS read them), E4M3 block scales and the per-tensor
        decode scale amax / 2688. Both orientations are stored K-major (``[K, M/2]``
        column-wise; after the Hadamard rotation when RHT is on, which cancels in dy^T x)."""
        data, sbytes = self._buffers(orientation)
        gamax = self._fields[f"amax_{orientation}"]
        assert gamax is not None
        return ScaledOperand(as_dtype(data, fp4_dtype()), NV_1X16,
                             as_dtype(sbytes, torch.float8_e4m3fn),
                             gamax.to(torch.float32) * _scaling.nvfp4_inv_global_num())

    @property
    def clamp_limit(self) -> float:
        return rounding_limit(E2M1_MAX, 0.5)  # E2M1: one mantissa bit, 7

    def stat_layout(self, orientation: Orientation) -> tuple[BlockCut, torch.Tensor, bool]:
        """1x16 blocks along K (row-wise; a 16x16 weight tile's scale is stored per row) or
        16 tokens of x^T (column-wise), each scaled by e4m3(scale byte) * amax / 2688. A
        column-wise copy quantized after the Hadamard rotation has no blocks of x."""
        sbytes = self._buffers(orientation)[1]
        gamax = self._fields[f"amax_{orientation}"]
        assert gamax is not None
        scales = _scaling.nvfp4_dequant_block_scale(sbytes, gamax)
        if orientation == "rowwise":
            return (lambda t: t.reshape(-1, NV_BLOCK)), scales, False
        if self.with_rht:
            raise ValueError("an NVFP4 column-wise copy quantized after the random Hadamard "
                             "transform has no blocks of the untransformed values")
        return (lambda t: t.t().reshape(-1, NV_BLOCK)), scales, False

    def _dequantize_2d(self, orientation: Orientation) -> torch.Tensor:
        if orientation == "columnwise" and self.with_rht:
            # undo the rotation so values compare with the logical tensor: the decoded chunks
            # feed the inverse RHT GEMMs directly (no full-size intermediate)
            data, sbytes = self._buffers(orientation)
            gamax = self._fields["amax_columnwise"]
            assert gamax is not None
            fill = rht_rows_from_chunks(data.shape[0], data.shape[1] * 2, True, data.device)
            decode_fp4_chunks(data, None, fill.sink, fill.chunk_elems, scale_bits=sbytes, gamax=gamax)
            return fill.out.t()
        vals = self._values(orientation)
        return vals if orientation == "rowwise" else vals.t()


class NVFP4Quantizer(Quantizer):
    """NVFP4 quantizer; ``with_rht`` applies to the columnwise copy only, ``use_2d`` = 16x16
    tiles (weights), ``stochastic_rounding`` draws 8 bits per element from ``generator``.
    ``amax_reduction`` (a process group or a callable, as :func:`scaling.maybe_reduce_amax`):
    the per-tensor (second-level) amaxes of both orientations are MAX-reduced over it, in one
    collective, before any scale is computed -- a tensor-parallel shard then gets the whole
    tensor's global scale."""

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
        amax_reduction: Optional[Any] = None,
    ) -> None:
        super().__init__(role, rowwise, columnwise)
        self.amax_reduction = amax_reduction
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

    def _codes(
        self, x: torch.Tensor, enc: torch.Tensor, ws: Workspace, may_have_nan: bool = True,
        in_place: bool = False,
    ) -> torch.Tensor:
        """int32 E2M1 codes of fp32(x * enc) (RNE, or SR with fresh bits), in ``ws``.

        ``may_have_nan=False``: ``x`` is known NaN-free (from its block amax pass); then so is
        x * enc (enc is finite and positive), and the kernels skip their NaN pass.
        ``in_place``: ``x`` is the workspace's "y" buffer itself (a widened copy) and is
        scaled where it is (the same multiply, one chunk-sized buffer fewer in cache)."""
        y = x.mul_(enc) if in_place else torch.mul(x, enc, out=ws.get("y", x.shape, torch.float32))
        if self.stochastic_rounding:
            rbits = draw_rbits(y.numel(), self.generator, y.device, ws)
            return sr_e2m1_codes_i32(y, rbits, ws, may_have_nan)
        return e2m1_codes_i32(y, ws, may_have_nan)

    def _quantize_blocks(
        self, xf: torch.Tensor, gamax: torch.Tensor, dim: int, bamax: torch.Tensor,
        rotated: Optional[torch.Tensor] = None, may_have_nan: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed bytes, scale bytes) with 16-element blocks along ``dim`` of ``xf`` [M, K],
        given their block amaxes ``bamax`` ([M, K/16] for dim=1, [M/16, K] for dim=0).

        dim=1: rowwise 1x16 blocks; bytes [M, K/2] packed along K, scales [M, K/16].
        dim=0: blocks of 16 rows computed in place on [M, K] (elementwise math, so identical
        to quantizing x^T); the bytes pair rows 2i, 2i+1 and are stored transposed, i.e. the
        [K, M/2] packing of x^T, with scales [K, M/16]. ``rotated`` (dim=0 only): the RHT of
        ``xf`` as bf16, kept by :meth:`_block_amaxes`; each chunk is read from it (widened to
        fp32 in a scratch buffer) instead of from ``xf``. ``may_have_nan``: whether the
        quantized values (``rotated`` when given) may hold a NaN (see :meth:`_codes`).
        """
        m, k = xf.shape
        chunk = row_chunk_elems()
        scaler = _scaling.nvfp4_block_scaler(gamax)
        ws = Workspace.shared(xf.device)
        # Every block's scale byte and encode factor at once (elementwise on the amaxes, so
        # the same values as chunk by chunk, in ~8 ops per orientation instead of per chunk);
        # the scale bytes are the returned buffer (dim=1) or the transpose's source (dim=0).
        scales, enc_all = scaler(bamax)
        # The packed output is allocated once and every chunk writes its slice: no per-chunk
        # results to concatenate; the same bytes land in the same places.
        if dim == 1:
            data = torch.empty(m, k // 2, dtype=torch.uint8, device=xf.device)
            for r0, r1 in row_ranges(m, k, 1, chunk):
                xv = xf[r0:r1].view(r1 - r0, k // NV_BLOCK, NV_BLOCK)
                enc = enc_all[r0:r1]
                codes = self._codes(xv, enc[:, :, None], ws, may_have_nan).view(r1 - r0, k)
                pack_fp4_i32(codes, data[r0:r1], ws)
            return data, scales
        # [M/8, K] int32 words (4 bytes each: rows 8q..8q+7, two per byte) are transposed
        # into the returned buffer below, so they are workspace scratch (a fresh one would be
        # page-faulted in on every call)
        words = ws.get("col_words", (m // 8, k), torch.int32)
        for r0, r1 in row_ranges(m, k, NV_BLOCK, chunk):
            c = xf[r0:r1]
            if rotated is not None:  # widened where _codes scales it
                c = ws.get("y", c.shape, torch.float32).copy_(rotated[r0:r1])
            xv = c.view((r1 - r0) // NV_BLOCK, NV_BLOCK, k)
            enc = enc_all[r0 // NV_BLOCK : r1 // NV_BLOCK]
            codes = self._codes(xv, enc[:, None, :], ws, may_have_nan, rotated is not None).view(r1 - r0, k)
            pack_fp4_col_words(codes, words[r0 // 8 : r1 // 8], ws)
        # one whole-tensor transpose of int32 words, viewed as the [K, M/2] bytes after it:
        # torch transposes 4-byte elements ~5x faster than bytes, and a contiguous source
        # beats chunk by chunk into column slices (transposed_copy: the scale bytes go four
        # rows per word too; the results never alias the workspace)
        return transposed_copy(words).view(torch.uint8), transposed_copy(scales)

    @staticmethod
    def _block_amaxes(
        xf: torch.Tensor, rowwise: bool, columnwise: bool, rotated: Optional[torch.Tensor] = None
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], bool, bool]:
        """(rowwise [M, K/16], columnwise [M/16, K]) block amaxes of ``xf`` [M, K] (see
        :meth:`_quantize_blocks`; with ``rotated`` ([M, K] bf16): columnwise ones of its
        RHT-rotated chunks, whose bf16 values are left in ``rotated`` for the codes pass),
        both from one chunked pass over ``xf``. Their max is the global amax (exact: a max of
        NaN-ignoring maxes), so no separate amax pass is needed. The chunks are those of
        :meth:`_quantize_blocks` (16-row aligned). The two flags say whether the rowwise and
        the columnwise (rotated) values may hold a NaN (:func:`scaling.block_amax_nan`)."""
        m, k = xf.shape
        if m == 0:
            z = xf.new_zeros(0, k // NV_BLOCK), xf.new_zeros(0, k)
            return (z[0] if rowwise else None), (z[1] if columnwise else None), False, False
        ws = Workspace.shared(xf.device)
        nan = [False, False]

        def both(c: torch.Tensor, r0: int) -> tuple[torch.Tensor, ...]:
            res: list[torch.Tensor] = []
            if rowwise:
                a, has_nan = _scaling.block_amax_nan(c.view(c.shape[0], k // NV_BLOCK, NV_BLOCK), 2, ws)
                res.append(a)
                nan[0] |= has_nan
            if columnwise:
                if rotated is not None:
                    c = rotate_group_rows_keep(c, ws.get("rot", c.shape, torch.float32),
                                               rotated[r0 : r0 + c.shape[0]])
                a, has_nan = _scaling.block_amax_nan(c.view(c.shape[0] // NV_BLOCK, NV_BLOCK, k), 1, ws)
                res.append(a)
                nan[1] |= has_nan
            return tuple(res)

        ranges = row_ranges(m, k, NV_BLOCK, row_chunk_elems())
        if len(ranges) == 1:
            res = iter(both(xf, 0))
            return (next(res) if rowwise else None), (next(res) if columnwise else None), nan[0], nan[1]
        # Several chunks: each chunk's amaxes land in their slice of a reused workspace buffer
        # (they are consumed by this quantization's codes pass), instead of a per-chunk list
        # concatenated into fresh full-size tensors (a cat that is mostly page faults on CPU).
        row_out = ws.get("bamax_row", (m, k // NV_BLOCK), torch.float32) if rowwise else None
        col_out = ws.get("bamax_col", (m // NV_BLOCK, k), torch.float32) if columnwise else None
        for r0, r1 in ranges:
            res = iter(both(xf[r0:r1], r0))
            if row_out is not None:
                row_out[r0:r1].copy_(next(res))
            if col_out is not None:
                col_out[r0 // NV_BLOCK : r1 // NV_BLOCK].copy_(next(res))
        return row_out, col_out, nan[0], nan[1]

    def _quantize_fields(self, x2d: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        xf = x2d.float()
        k = xf.shape[1]
        out: dict[str, Optional[torch.Tensor]] = dict.fromkeys(NVFP4Tensor._field_names())
        if self.use_2d:
            gamax = _scaling.maybe_reduce_amax(_scaling.amax(xf).reshape(1), self.amax_reduction)
            scaler = _scaling.nvfp4_block_scaler(gamax)
            ws = Workspace.shared(xf.device)

            def tiles(c: torch.Tensor) -> tuple[torch.Tensor, ...]:
                xv = c.view(c.shape[0] // NV_BLOCK, NV_BLOCK, k // NV_BLOCK, NV_BLOCK)
                tile_amax, has_nan = _scaling.block_amax_nan(xv, (1, 3), ws)
                tb, enc = scaler(tile_amax)
                codes = self._codes(xv, enc[:, None, :, None], ws, has_nan).view(c.shape[0], k)
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
        # Block amaxes first, in their own chunked pass: the global amax is their max, so no
        # separate amax pass is needed (with RHT the columnwise ones come from rotated chunks).
        # columnwise with RHT: 16-token groups of x^T, rounded to bf16, with their own amax
        rotate = self.with_rht and self.columnwise
        rotated = rotated_scratch(tuple(xf.shape), xf.device) if rotate else None
        row_bamax, col_bamax, row_nan, col_nan = self._block_amaxes(
            xf, self.rowwise, self.columnwise, rotated)
        gamax = _global_amax(row_bamax) if row_bamax is not None else None
        camax: Optional[torch.Tensor] = None
        if col_bamax is not None and (gamax is None or rotate):
            camax = _global_amax(col_bamax)
        if self.amax_reduction is not None:
            gamax, camax = self._reduced(gamax, camax)
        if row_bamax is not None:
            assert gamax is not None
            out["rowwise_data"], out["rowwise_scale_inv"] = self._quantize_blocks(
                xf, gamax, 1, row_bamax, may_have_nan=row_nan)
            out["amax_rowwise"] = gamax
        if col_bamax is not None:
            camax = gamax.clone() if camax is None and gamax is not None else camax
            assert camax is not None
            out["columnwise_data"], out["columnwise_scale_inv"] = self._quantize_blocks(
                xf, camax, 0, col_bamax, rotated=rotated, may_have_nan=col_nan)
            out["amax_columnwise"] = camax
        return out

    def _reduced(self, *amaxes: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        """The given (1,) amaxes MAX-reduced over :attr:`amax_reduction` in one collective."""
        present = [a for a in amaxes if a is not None]
        if not present:
            return amaxes
        packed = _scaling.maybe_reduce_amax(torch.cat(present), self.amax_reduction)
        out, i = [], 0
        for a in amaxes:
            out.append(None if a is None else packed[i : i + 1].clone())
            i += a is not None
        return tuple(out)

    def __repr__(self) -> str:
        return (
            f"NVFP4Quantizer(role={self.role!r}, rht={self.with_rht}, "
            f"sr={self.stochastic_rounding}, 2d={self.use_2d}, rowwise={self.rowwise}, "
            f"columnwise={self.columnwise})"
        )
