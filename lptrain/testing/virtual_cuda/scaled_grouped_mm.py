"""torch's grouped scaled GEMM (``scaled_grouped_mm``) on the virtual GPU, checked like CUDA.

``torch.nn.functional.scaled_grouped_mm`` (``aten._scaled_grouped_mm_v2``) exists on CUDA
only, on compute capability 9.x / 10.x, with bf16 output; which kernel runs depends on the
scaling types (torch's ``GroupedBlas.cpp``). The virtual GPU models the one lptrain packs for,
the row-wise E4M3 kernel (a CUTLASS sm90 kernel) and the MXFP8 one (sm100, torch built with
MSLK / FBGEMM GenAI), in their "2d-3d" form: A ``[M, K]`` row-major, B ``[G, K, N]``
column-major, ``offs`` the int32 end row of each group, K and N multiples of 16, no bias.
Row-wise: A's scales one fp32 per row (``[M]``, contiguous), B's one per group and output
column (``[G, N]``). MXFP8: E8M0 scales in cuBLAS's 128x4 tiles, A's each group's own tiled
grid concatenated in one 2D tensor, B's ``[G, tiles]`` (torch's own grouped-GEMM tests build
them so). Where the catalog (:mod:`lptrain.catalog.scaled_gemm`) says the GPU has no such
kernel, or a layout is off, it raises ``scaled_mm.ScaledMMError``; any other scaling pair is
refused as not modelled. A call that passes is computed from the codes and scales alone, per
group, with the dense model's math (``scaled_mm.block_product``), rounded to bf16. Rows past
the last offset are NaN (CUDA leaves them unwritten). Every call is recorded in ``VirtualCuda.grouped_gemms`` (:class:`GroupedGemmCall`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lptrain.catalog import scaled_gemm as catalog

from .scaled_mm import _NAMES, _ceil, _check, _device, _unswizzle, block_product


@dataclass(frozen=True)
class GroupedGemmCall:
    """One grouped scaled GEMM the virtual GPU ran: the kernel, the group end rows, the shapes
    and strides of A and B, the scale shapes, and whether fast accumulation was asked for."""

    kernel: str
    offs: tuple[int, ...]
    a_shape: tuple[int, ...]
    a_stride: tuple[int, ...]
    b_shape: tuple[int, ...]
    b_stride: tuple[int, ...]
    scale_a_shape: tuple[int, ...]
    scale_b_shape: tuple[int, ...]
    out_dtype: torch.dtype
    fast_accum: bool


def scaled_grouped_mm_v2(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: list, recipe_a: list,
                         swizzle_a: list, scale_b: list, recipe_b: list, swizzle_b: list,
                         offs: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                         out_dtype: Optional[torch.dtype] = None, contraction_dim: Any = (),
                         use_fast_accum: bool = False) -> torch.Tensor:
    """``aten._scaled_grouped_mm_v2`` on the virtual GPU (see the module doc)."""
    sm, _, vd = _device()
    _check(sm // 10 in (9, 10), f"torch._scaled_grouped_mm is only supported on compute capability "
           f"9.x / 10.x, not sm{sm}")
    ra = [_NAMES[int(r)] for r in recipe_a]
    rb = [_NAMES[int(r)] for r in recipe_b]
    name = _KERNELS.get((tuple(ra), tuple(rb)))
    _check(name is not None, f"the virtual GPU models the row-wise and MXFP8 grouped kernels only, not {ra} x {rb}")
    assert name is not None
    kern = catalog.grouped_kernel(*_CATALOG_PAIR[name])
    _check(kern is not None and kern.grouped_on(sm), f"torch has no {name} grouped kernel on sm{sm}")
    _check(mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn,
           f"Expected mat_a / mat_b to be Float8_e4m3 matrices, got {mat_a.dtype} / {mat_b.dtype}")
    _check(mat_a.dim() == 2 and mat_b.dim() == 3, "the virtual GPU models the 2d-3d grouped GEMM only")
    _check(mat_a.stride(1) == 1 and mat_a.stride(0) >= mat_a.shape[1], "Expected mat1 to not be transposed")
    _check(mat_b.stride(1) == 1 and mat_b.stride(2) >= mat_b.shape[1], "Expected mat2 to be transposed")
    m, k = mat_a.shape
    g, kb, n = mat_b.shape
    _check(kb == k, "contraction dimension of mat_a and mat_b must match")
    _check(k % 16 == 0 and n % 16 == 0, f"K ({k}) and N ({n}) must be divisible by 16")
    _check(bias is None, "Bias not supported yet")
    _check((out_dtype or torch.bfloat16) == torch.bfloat16,
           "Only bf16 high precision output types are supported for grouped gemm")
    _check(offs is not None and offs.dim() == 1 and offs.dtype == torch.int32 and offs.numel() == g,
           f"offs must be a 1D int32 tensor of {g} group ends")
    assert offs is not None
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    _check(all(0 <= a <= b <= m for a, b in zip(starts, ends, strict=True)),
           f"offs must be non-decreasing group ends within {m} rows, got {ends}")
    (sa,), (sb,) = list(scale_a), list(scale_b)
    grids = (_rowwise_grids if name == "rowwise" else _mx_grids)(sa, sb, list(swizzle_a), list(swizzle_b),
                                                                 starts, ends, m, k, n)
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    block = k if name == "rowwise" else 32
    for j, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        if hi > lo:
            ga, gb = grids(j)
            out[lo:hi] = block_product(mat_a[lo:hi].float(), mat_b[j].t().float(), ga, gb, block)
    vd.grouped_gemms.append(GroupedGemmCall(
        name, tuple(ends), tuple(mat_a.shape), tuple(mat_a.stride()), tuple(mat_b.shape),
        tuple(mat_b.stride()), tuple(sa.shape), tuple(sb.shape), torch.bfloat16, use_fast_accum))
    return out.to(torch.bfloat16)


_KERNELS = {(("RowWise",), ("RowWise",)): "rowwise", (("BlockWise1x32",), ("BlockWise1x32",)): "mxfp8"}
# the catalog's scaling pair of each grouped kernel (the row-wise one serves per-tensor FP8)
_CATALOG_PAIR = {"rowwise": ("TensorWise", "TensorWise"), "mxfp8": ("BlockWise1x32", "BlockWise1x32")}
Grids = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _rowwise_grids(sa: torch.Tensor, sb: torch.Tensor, wa: list, wb: list, starts: list[int],
                   ends: list[int], m: int, k: int, n: int) -> Grids:
    """Check the row-wise kernel's scales (A ``[M]`` fp32 contiguous, B ``[G, N]``); per group,
    its ``[rows, 1]`` and ``[N, 1]`` scale grids."""
    g = len(ends)
    _check(sa.dtype == sb.dtype == torch.float32, "For grouped FP8 rowwise, both scales must be float32 tensors")
    _check(sa.dim() == 1 and sa.is_contiguous() and sa.shape[0] == m,
           f"scale_a must be a contiguous [{m}] vector (one scale per row), got {tuple(sa.shape)}")
    _check(sb.dim() == 2 and sb.stride(1) == 1 and tuple(sb.shape) == (g, n),
           f"scale_b must be [{g}, {n}] contiguous in the last dimension, got {tuple(sb.shape)}")
    return lambda j: (sa[starts[j] : ends[j]].float().reshape(-1, 1), sb[j].float().reshape(-1, 1))


def _mx_grids(sa: torch.Tensor, sb: torch.Tensor, wa: list, wb: list, starts: list[int],
              ends: list[int], m: int, k: int, n: int) -> Grids:
    """Check the MXFP8 kernel's scales: E8M0, swizzled; A's one 2D tensor of every group's
    own 128x4-tiled grid, concatenated (a group's tiles start after the previous groups' rows
    padded to 128); B's ``[G, tiles]``, one tiled grid per group. Per group, the E8M0 grids
    read back through cuBLAS's offset formula."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    kb, c4, g = k // 32, _ceil(k // 32, 4) * 4, len(ends)
    _check(sa.dtype == sb.dtype == e8m0, "For MXFP8 grouped gemm, both scales must be float8_e8m0fnu tensors")
    _check([int(w) for w in wa] == [int(w) for w in wb] == [1], "For CUDA MXFP8 grouped gemm, both scale "
           "swizzle types must be SWIZZLE_32_4_4")
    _check(k % 32 == 0, f"K ({k}) must be a multiple of the block (32)")
    rows = [e - s for s, e in zip(starts, ends, strict=True)]
    tiles_a = [_ceil(r, 128) * 128 * c4 for r in rows]
    _check(sa.dim() == 2 and sa.is_contiguous() and sa.numel() == sum(tiles_a),
           f"scale_a must hold each group's tiled grid ({sum(tiles_a)} codes), got {tuple(sa.shape)}")
    _check(sb.dim() == 2 and sb.is_contiguous() and tuple(sb.shape) == (g, _ceil(n, 128) * 128 * c4),
           f"scale_b must be [{g}, {_ceil(n, 128) * 128 * c4}], got {tuple(sb.shape)}")
    flat = sa.reshape(-1)
    first = [sum(tiles_a[:j]) for j in range(g)]

    def grids(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        ga = _unswizzle(flat[first[j] : first[j] + tiles_a[j]], rows[j], kb).float()
        return ga, _unswizzle(sb[j], n, kb).float()

    return grids
