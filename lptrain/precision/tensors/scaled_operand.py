"""One operand of torch's scaled GEMM, as a quantized tensor stores it.

``QuantizedTensor.gemm_operand(orientation)`` answers, per family, how its stored codes and
scales feed ``torch.nn.functional.scaled_mm`` without a dequantize: the logical matrix whose
last dimension is the GEMM's reduction dimension (``rowwise``: the tensor's own ``[M, K]``;
``columnwise``: its transpose ``[K, M]``, reducing over M, as the wgrad and dgrad GEMMs read
it), the scaling type of its scales, and the scales as a compact grid over that matrix.
Turning the grid into the exact layout a torch kernel checks for (outer-dim-major 1x128
scales, padded 128x128 tiles, cuBLAS's swizzled 128x4 tiles) is the dispatch's job
(:mod:`lptrain.precision.scaled_gemm`), since it depends on the scaling type and the torch
API only, not on the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Scaling types (torch.nn.functional.ScalingType member names) and the scale grid each one
# takes here, for an operand [rows, K]:
TENSORWISE = "TensorWise"  # (1,) fp32
BLOCK_1X128 = "BlockWise1x128"  # [rows, ceil(K/128)] fp32
BLOCK_128X128 = "BlockWise128x128"  # [ceil(rows/128), ceil(K/128)] fp32
MX_1X32 = "BlockWise1x32"  # [rows, K/32] float8_e8m0fnu
NV_1X16 = "BlockWise1x16"  # [rows, K/16] float8_e4m3fn, plus a (1,) fp32 global scale


@dataclass(frozen=True)
class ScaledOperand:
    """``data``: ``[rows, K]`` FP8 (or ``[rows, K/2]`` packed ``float4_e2m1fn_x2``) in the
    stored layout -- K-major when row-major, a transposed view otherwise (the dispatch copies
    it where the GPU takes only K-major operands); ``scale``: the compact grid of
    ``scaling``; ``global_scale``: NVFP4's per-tensor decode scale (amax / 2688)."""

    data: torch.Tensor
    scaling: str
    scale: torch.Tensor
    global_scale: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def k(self) -> int:
        """The reduction length (elements, not packed bytes)."""
        return self.data.shape[1] * (2 if self.data.dtype == fp4_dtype() else 1)

    @property
    def k_major(self) -> bool:
        return self.data.stride(1) == 1 or self.data.shape[1] == 1


def fp4_dtype() -> Optional[torch.dtype]:
    """torch's packed E2M1 pair dtype (None on a torch without it)."""
    return getattr(torch, "float4_e2m1fn_x2", None)


def as_dtype(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A uint8 buffer viewed as ``dtype`` (the same bytes)."""
    if dtype is None:
        raise RuntimeError("this torch has no dtype for these codes (float4_e2m1fn_x2 / float8_e8m0fnu)")
    return t.view(dtype)
