"""torch's grouped scaled GEMM (``scaled_grouped_mm``) on the virtual GPU, checked like CUDA.

``torch.nn.functional.scaled_grouped_mm`` (``aten._scaled_grouped_mm_v2``) exists on CUDA
only, on compute capability 9.x / 10.x, with bf16 output; which kernel runs depends on the
scaling types (torch's ``GroupedBlas.cpp``). The virtual GPU models the one lptrain packs for,
the row-wise E4M3 kernel (a CUTLASS sm90 kernel) in its "2d-3d" form: A ``[M, K]`` row-major,
B ``[G, K, N]`` column-major, ``offs`` the int32 end row of each group, A's scales one fp32
per row (``[M]``, contiguous), B's one per group and output column (``[G, N]``), K and N
multiples of 16, no bias. Where the catalog (:mod:`lptrain.catalog.scaled_gemm`) says the GPU
has no such kernel, or a layout is off, it raises ``scaled_mm.ScaledMMError``; any other scaling
pair is refused as not modelled. A call that passes is computed from the codes and scales
alone: per group, the fp32 product of its rows of A with its B, times the row and column
scales, rounded to bf16. Rows past the last offset are NaN (CUDA leaves them unwritten).
Every call is recorded in ``VirtualCuda.grouped_gemms`` (:class:`GroupedGemmCall`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from lptrain.catalog import scaled_gemm as catalog

from .scaled_mm import _NAMES, _check, _device


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
    _check(ra == rb == ["RowWise"], f"the virtual GPU models the row-wise grouped kernel only, not {ra} x {rb}")
    kern = catalog.grouped_kernel("TensorWise", "TensorWise")
    _check(kern is not None and kern.grouped_on(sm), f"torch has no row-wise FP8 grouped kernel on sm{sm}")
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
    (sa,), (sb,) = list(scale_a), list(scale_b)
    _check(sa.dtype == sb.dtype == torch.float32, "For grouped FP8 rowwise, both scales must be float32 tensors")
    _check(sa.dim() == 1 and sa.is_contiguous() and sa.shape[0] == m,
           f"scale_a must be a contiguous [{m}] vector, got {tuple(sa.shape)}")
    _check(sb.dim() == 2 and sb.stride(1) == 1 and tuple(sb.shape) == (g, n),
           f"scale_b must be [{g}, {n}] contiguous in the last dimension, got {tuple(sb.shape)}")
    ends = [int(e) for e in offs.tolist()]
    _check(all(0 <= a <= b <= m for a, b in zip([0, *ends], ends, strict=False)),
           f"offs must be non-decreasing group ends within {m} rows, got {ends}")
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    av, sa_f, sb_f = mat_a.float(), sa.float(), sb.float()
    for j, (lo, hi) in enumerate(zip([0, *ends], ends, strict=False)):
        part = av[lo:hi] @ mat_b[j].float()
        out[lo:hi] = part * (sa_f[lo:hi].reshape(-1, 1) * sb_f[j].reshape(1, -1))
    vd.grouped_gemms.append(GroupedGemmCall(
        "rowwise", tuple(ends), tuple(mat_a.shape), tuple(mat_a.stride()), tuple(mat_b.shape),
        tuple(mat_b.stride()), tuple(sa.shape), tuple(sb.shape), torch.bfloat16, use_fast_accum))
    return out.to(torch.bfloat16)
