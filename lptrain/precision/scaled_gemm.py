"""Quantized GEMMs on torch's scaled-GEMM kernels: the operands as stored, never dequantized.

``precision.quantized_gemm=scaled_mm`` sends each GEMM of the emulated backend's quantized
linear (:mod:`lptrain.precision.linear_ops`) here, with the operand orientations of
numerics.md section 4 (y = x W^T, dx = dy W, dW = dy^T x)::

    fprop  A = x  row-wise [M, K]    B = W  row-wise [N, K]      -> y  [M, N]
    dgrad  A = dy row-wise [M, N]    B = W  column-wise [K, N]   -> dx [M, K]
    wgrad  A = dy column-wise [N, M] B = x  column-wise [K, M]   -> dW [N, K]

Each operand comes from ``QuantizedTensor.gemm_operand`` (codes and a compact scale grid, per
family); this module puts the grid in the layout the kernel of its scaling type takes and
calls ``torch.nn.functional.scaled_mm`` -- or ``torch._scaled_mm`` on a torch without it
(every recipe but NVFP4, whose second-level scale only the former takes). Layouts, per
scaling type (torch's ``ScaledBlas.cpp`` checks):

* TensorWise: the fp32 ``scale_inv`` as is;
* BlockWise1x128: ``[rows, K/128]`` outer-dim-major (strides ``(1, rows)``);
* BlockWise128x128: ``F.scaled_mm`` takes the ``[rows/128, K/128]`` grid with K/128 padded to
  a multiple of 4, transposed (strides ``(1, padded)``); ``torch._scaled_mm`` the grid itself;
* BlockWise1x32 / BlockWise1x16: cuBLAS's tiled layout (``SWIZZLE_32_4_4``: 128 rows x 4
  scale columns per 512-byte tile, the rows interleaved 32 x 4), padded to whole tiles.

On compute capability 8.9 / 9.0 cuBLASLt multiplies only a row-major A by a column-major B,
so an operand stored transposed is copied K-major there (bytes, not values). The GEMMs
accumulate in fp32; fprop and dgrad write the activation dtype, wgrad fp32 (for
``main_grad``). fprop of per-tensor FP8 uses the fast accumulation TE and torchao use there;
the gradient GEMMs never do.

MoE experts (:func:`grouped`): where torch has a grouped kernel for the recipe on this GPU
(``ScaledKernel.grouped_runs``, :mod:`lptrain.catalog.scaled_gemm`), the experts' fprop and
dgrad run as one ``torch.nn.functional.scaled_grouped_mm`` ("2d-3d"): A the experts' rows
stacked ``[M, K]`` row-major, B the experts' matrices ``[G, K, N]`` column-major, ``offs``
the int32 end row of each expert (an expert without tokens repeats the previous end), bf16
out. The row-wise E4M3 kernel (per-tensor FP8 on sm90) takes each expert's per-tensor scale
repeated over its rows: A's as a ``[M]`` fp32 vector, B's as ``[G, N]``. The MXFP8 kernel
(sm100, a torch built with MSLK) takes each expert's E8M0 grid in the 128x4 tiles, A's
concatenated expert after expert, B's one row per expert. Operands whose rows are dropped for
backward (``linear_ops._only_columnwise``) are dropped only after these GEMMs read them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F

from lptrain.catalog.scaled_gemm import TN_ONLY_BELOW_SM, grouped_kernel
from lptrain.precision.tensors.scaled_operand import (
    BLOCK_1X128,
    BLOCK_128X128,
    MX_1X32,
    NV_1X16,
    TENSORWISE,
    ScaledOperand,
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def swizzle_scales(grid: torch.Tensor) -> torch.Tensor:
    """A ``[rows, cols]`` block-scale grid (1-byte codes) in cuBLAS's 128x4 tiled layout:
    padded with zero codes to whole tiles (rows to 128, columns to 4), tile (i, j) at
    512 * (i * tiles_per_row + j), row r of a tile at byte (r % 32) * 16 + (r // 32) * 4."""
    rows, cols = grid.shape
    r128, c4 = _ceil_div(rows, 128) * 128, _ceil_div(cols, 4) * 4
    raw = grid.view(torch.uint8)
    if (r128, c4) != (rows, cols):
        raw = F.pad(raw, (0, c4 - cols, 0, r128 - rows))
    tiles = raw.reshape(r128 // 128, 4, 32, c4 // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(r128, c4).view(grid.dtype)


def _outer_dim_major(grid: torch.Tensor) -> torch.Tensor:
    """``grid`` with strides ``(1, rows)``: the same values, column-major storage."""
    return grid.t().contiguous().t()


def _padded_tiles_t(grid: torch.Tensor) -> torch.Tensor:
    """A ``[rows/128, K/128]`` grid as ``F.scaled_mm`` takes 128x128 scales: the columns
    padded to a multiple of 4, transposed (shape ``[pad4(K/128), rows/128]``, strides
    ``(1, pad4(K/128))``)."""
    cols = grid.shape[1]
    c4 = _ceil_div(cols, 4) * 4
    padded = F.pad(grid, (0, c4 - cols)) if c4 != cols else grid.contiguous()
    return padded.t()


def kernel_scales(op: ScaledOperand, v2: bool) -> tuple[list[torch.Tensor], list[str], list[str]]:
    """(scales, scaling types, swizzles) of one operand as the kernel takes them (``v2``:
    ``F.scaled_mm``'s layouts; else ``torch._scaled_mm``'s, an operand on the A side)."""
    s = op.scale
    if op.scaling == TENSORWISE:
        return [s.reshape(())], [TENSORWISE], ["NO_SWIZZLE"]
    if op.scaling == BLOCK_1X128:
        return [_outer_dim_major(s)], [BLOCK_1X128], ["NO_SWIZZLE"]
    if op.scaling == BLOCK_128X128:
        return [_padded_tiles_t(s) if v2 else s.contiguous()], [BLOCK_128X128], ["NO_SWIZZLE"]
    if op.scaling == MX_1X32:
        return [swizzle_scales(s)], [MX_1X32], ["SWIZZLE_32_4_4"]
    if op.scaling == NV_1X16:
        assert op.global_scale is not None
        return ([swizzle_scales(s), op.global_scale.reshape(())], [NV_1X16, TENSORWISE],
                ["SWIZZLE_32_4_4", "NO_SWIZZLE"])
    raise ValueError(f"no scaled-GEMM layout for scaling type {op.scaling!r}")


def _sm(t: torch.Tensor) -> int:
    """The compute capability (x10) of ``t``'s CUDA device."""
    major, minor = torch.cuda.get_device_capability(t.device.index or 0)
    return major * 10 + minor


def _tn_only(t: torch.Tensor) -> bool:
    """Whether the GEMM on ``t``'s device takes only K-major operands (cuBLASLt below sm100)."""
    return t.is_cuda and _sm(t) < TN_ONLY_BELOW_SM


def scaled_mm(a: ScaledOperand, b: ScaledOperand, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """``a.data @ b.data^T`` ([rows_a, rows_b]) on torch's scaled GEMM, in ``out_dtype``."""
    mat_a, mat_b_t = a.data, b.data
    if _tn_only(mat_a):
        mat_a, mat_b_t = mat_a.contiguous(), mat_b_t.contiguous()
    fast = fast_accum and a.scaling == TENSORWISE
    fn = getattr(F, "scaled_mm", None)
    if fn is not None:
        sa, ra, wa = kernel_scales(a, True)
        sb, rb, wb = kernel_scales(b, True)
        st, sw = F.ScalingType, F.SwizzleType
        return fn(mat_a, mat_b_t.t(), sa, [getattr(st, r) for r in ra], sb, [getattr(st, r) for r in rb],
                  swizzle_a=[getattr(sw, w) for w in wa], swizzle_b=[getattr(sw, w) for w in wb],
                  output_dtype=out_dtype, use_fast_accum=fast)
    return _scaled_mm_v1(a, b, mat_a, mat_b_t, out_dtype, fast)


def _scaled_mm_v1(a: ScaledOperand, b: ScaledOperand, mat_a: torch.Tensor, mat_b_t: torch.Tensor,
                  out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    """``torch._scaled_mm`` (a torch without ``F.scaled_mm``): one scale tensor per operand,
    B's 1x128 / 128x128 grid transposed (its check reads it through ``mat_b.t()``)."""
    if a.scaling == NV_1X16:
        raise RuntimeError("NVFP4 scaled GEMMs need torch.nn.functional.scaled_mm (a newer torch); "
                           "fix: precision.quantized_gemm=dequantized")
    (sa,), _, _ = kernel_scales(a, False)
    (sb,), _, _ = kernel_scales(b, False)
    if b.scaling in (BLOCK_1X128, BLOCK_128X128):
        sb = (_outer_dim_major(b.scale) if b.scaling == BLOCK_1X128 else b.scale.contiguous()).t()
    return torch._scaled_mm(mat_a, mat_b_t.t(), sa, sb, out_dtype=out_dtype, use_fast_accum=fast)


# ---- the three GEMMs of a quantized linear -------------------------------------------------


def fprop(qx: Any, qw: Any, out_dtype: torch.dtype) -> torch.Tensor:
    """y = x W^T."""
    return scaled_mm(qx.gemm_operand("rowwise"), qw.gemm_operand("rowwise"), out_dtype, True)


def dgrad(qdy: Any, qw: Any, out_dtype: torch.dtype) -> torch.Tensor:
    """dx = dy W (W's column-wise copy: reduction over the output features)."""
    return scaled_mm(qdy.gemm_operand("rowwise"), qw.gemm_operand("columnwise"), out_dtype)


def wgrad(qdy: Any, qx: Any) -> torch.Tensor:
    """dW = dy^T x in fp32 (both column-wise: reduction over the tokens)."""
    return scaled_mm(qdy.gemm_operand("columnwise"), qx.gemm_operand("columnwise"), torch.float32)


# ---- the experts' GEMMs as one grouped GEMM -------------------------------------------------

# the operand orientations (A, B) of each grouped GEMM, as in fprop / dgrad above
_GROUPED_ORIENTATIONS = {"fprop": ("rowwise", "rowwise"), "dgrad": ("rowwise", "columnwise")}
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn}


def grouped(gemm: str, qas: Sequence[Optional[Any]], qbs: Sequence[Any],
            out_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The experts' ``gemm`` (``fprop``: y_g = x_g W_g^T; ``dgrad``: dx_g = dy_g W_g) as one
    ``scaled_grouped_mm``: the ``[sum rows, N]`` result, experts in order; ``qas[g]`` None for
    an expert without tokens. None where torch has no grouped kernel for these operands on
    this device (the caller runs one scaled GEMM per expert)."""
    fn = getattr(F, "scaled_grouped_mm", None)
    if fn is None or len(qbs) < 2 or out_dtype != torch.bfloat16 or not qbs[0].is_cuda:
        return None
    oa, ob = _GROUPED_ORIENTATIONS[gemm]
    a_ops = [None if q is None else q.gemm_operand(oa) for q in qas]
    b_ops = [q.gemm_operand(ob) for q in qbs]
    if not _grouped_kernel_here(gemm, a_ops, b_ops):
        return None
    pack, recipe, swizzle = _GROUPED_PACKING[b_ops[0].scaling]
    mat_a, scale_a, mat_b, scale_b, offs = pack(a_ops, b_ops)
    st, sw = F.ScalingType, F.SwizzleType
    return fn(mat_a, mat_b, scale_a, getattr(st, recipe), scale_b, getattr(st, recipe),
              swizzle_a=getattr(sw, swizzle), swizzle_b=getattr(sw, swizzle), offs=offs,
              output_dtype=torch.bfloat16,
              use_fast_accum=gemm == "fprop" and b_ops[0].scaling == TENSORWISE)


@functools.cache
def torch_built_with(flag: str) -> bool:
    """Whether this torch was built with ``flag`` (``USE_MSLK``: the MXFP8 grouped kernel)."""
    return flag in torch.__config__.show()


def _grouped_kernel_here(gemm: str, a_ops: Sequence[Optional[ScaledOperand]],
                         b_ops: Sequence[ScaledOperand]) -> bool:
    """Whether torch's grouped kernel takes these operands on their GPU: one scaling pair
    with a grouped kernel for ``gemm`` there (the catalog) that this torch was built with, its
    element format, at least one expert with tokens, each expert's rows and K multiples of
    the kernel's alignment, N of 16, fewer than 1024 experts."""
    present = [a for a in a_ops if a is not None and a.rows > 0]
    ops = [*present, *b_ops]
    if not present or len({o.scaling for o in ops}) != 1 or len(b_ops) >= 1024:
        return False
    k = grouped_kernel(b_ops[0].scaling, b_ops[0].scaling)
    if k is None or not k.grouped_runs(gemm, _sm(b_ops[0].data)) or b_ops[0].scaling not in _GROUPED_PACKING:
        return False
    if k.grouped_build and not any(torch_built_with(f) for f in k.grouped_build.split("|")):
        return False
    fmt = _FP8_DTYPES.get(k.grouped_format or "")
    if fmt is None or any(o.data.dtype != fmt for o in ops):
        return False
    rows_align, k_align = k.grouped_align
    return (all(a.rows % rows_align == 0 for a in present) and present[0].k % k_align == 0
            and b_ops[0].rows % 16 == 0)


def group_offsets(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``offs`` of a 2d-3d grouped GEMM: the int32 end row of each group in the stacked A
    (the splits are host integers: one host-to-device copy, no stream sync)."""
    ends, total = [], 0
    for r in rows:
        total += r
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)


def _rows(a_ops: Sequence[Optional[ScaledOperand]]) -> list[int]:
    return [0 if a is None else a.rows for a in a_ops]


def pack_rowwise(a_ops: Sequence[Optional[ScaledOperand]], b_ops: Sequence[ScaledOperand]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mat_a ``[M, K]`` row-major, scale_a ``[M]``, mat_b ``[G, K, N]`` column-major, scale_b
    ``[G, N]``, offs ``[G]``) for the row-wise grouped kernel, from per-tensor operands: each
    expert's fp32 decode scale repeated over its rows (A) and its output columns (B)."""
    n = b_ops[0].rows
    present = [a for a in a_ops if a is not None and a.rows > 0]
    mat_a = torch.cat([a.data for a in present]) if len(present) > 1 else present[0].data.contiguous()
    scale_a = torch.cat([a.scale.reshape(1).float().expand(a.rows) for a in present])
    mat_b = torch.stack([b.data for b in b_ops]).transpose(1, 2)
    scale_b = torch.stack([b.scale.reshape(1).float().expand(n) for b in b_ops])
    return mat_a, scale_a, mat_b, scale_b, group_offsets(_rows(a_ops), mat_a.device)


def pack_mx(a_ops: Sequence[Optional[ScaledOperand]], b_ops: Sequence[ScaledOperand]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mat_a, scale_a, mat_b, scale_b, offs) for the MXFP8 grouped kernel: the codes as for
    the row-wise one; A's scales each expert's own grid in cuBLAS's 128x4 tiles (its rows
    padded to 128), concatenated and viewed ``[-, K/32]``; B's ``[G, tiles]``, one tiled grid
    per expert."""
    present = [a for a in a_ops if a is not None and a.rows > 0]
    mat_a = torch.cat([a.data for a in present]) if len(present) > 1 else present[0].data.contiguous()
    kb, e8m0 = present[0].k // 32, present[0].scale.dtype

    def tiles(op: ScaledOperand) -> torch.Tensor:  # (bytes: cat / stack of E8M0 go by uint8)
        return swizzle_scales(op.scale).view(torch.uint8).reshape(-1)

    scale_a = torch.cat([tiles(a) for a in present]).view(e8m0).view(-1, kb)
    mat_b = torch.stack([b.data for b in b_ops]).transpose(1, 2)
    scale_b = torch.stack([tiles(b) for b in b_ops]).view(e8m0)
    return mat_a, scale_a, mat_b, scale_b, group_offsets(_rows(a_ops), mat_a.device)


# per scaling type of the experts' operands: the packing, the kernel's scaling type, swizzle
_GROUPED_PACKING = {TENSORWISE: (pack_rowwise, "RowWise", "NO_SWIZZLE"),
                    MX_1X32: (pack_mx, "BlockWise1x32", "SWIZZLE_32_4_4")}
