"""torch's scaled GEMMs on the virtual GPU: CUDA's rules for them, computed on the CPU.

``torch.nn.functional.scaled_mm`` (``aten._scaled_mm_v2``) and ``torch._scaled_mm`` exist on
CUDA only for some scaling types, GPUs and CUDA versions, with exact layouts for the codes
and the scales. On the virtual GPU they are checked the way torch's CUDA implementation
checks them (``ScaledBlas.cpp``): which kernel the scaling types select and whether the GPU
has it (:mod:`lptrain.catalog.scaled_gemm`), row-major A by column-major B below compute
capability 10.0, no E5M2 x E5M2, dimensions divisible by 16, and each scale tensor's dtype,
shape, strides and swizzle. A call that passes is computed here from the codes and scales
alone, the way the kernel does: per K-block products of the codes in fp32, times the block's
two scales, summed in fp32; the swizzled scales are read back through cuBLAS's documented
offset formula, an implementation independent of the one that wrote them. Every call is
recorded in ``VirtualCuda.scaled_gemms`` (which kernel, which layouts), for dispatch tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from lptrain.catalog import scaled_gemm as catalog

_NAMES = {0: "TensorWise", 1: "RowWise", 2: "BlockWise1x16", 3: "BlockWise1x32",
          4: "BlockWise1x128", 5: "BlockWise128x128"}
_SWIZZLES = {0: "NO_SWIZZLE", 1: "SWIZZLE_32_4_4"}
_KERNELS = {
    ("TensorWise", "TensorWise"): "tensorwise",
    ("BlockWise1x128", "BlockWise128x128"): "blockwise",
    ("BlockWise128x128", "BlockWise1x128"): "blockwise",
    ("BlockWise1x128", "BlockWise1x128"): "blockwise",
    ("BlockWise1x32", "BlockWise1x32"): "mxfp8",
    ("BlockWise1x16", "BlockWise1x16"): "nvfp4",
}
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                      -4.0, -6.0])


@dataclass(frozen=True)
class ScaledGemmCall:
    """One scaled GEMM the virtual GPU ran: the kernel, both scaling types, whether each
    operand was K-major (A row-major, B column-major), the output dtype and K."""

    kernel: str
    scaling_a: str
    scaling_b: str
    a_k_major: bool
    b_k_major: bool
    out_dtype: torch.dtype
    k: int


class ScaledMMError(RuntimeError):
    """What torch raises on CUDA for a scaled GEMM this GPU or layout has no kernel for."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ScaledMMError(f"virtual CUDA scaled_mm: {msg}")


def _device() -> tuple[int, Optional[str], Any]:
    from .device import active

    vd = active()
    assert vd is not None, "a virtual CUDA op ran without the virtual device"
    return vd.capability[0] * 10 + vd.capability[1], vd.cuda_version, vd


def _unswizzle(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] grid of a 128x4-tiled scale tensor, read by cuBLAS's offset formula."""
    flat = scale.reshape(-1).view(torch.uint8)
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    tiles = _ceil(cols, 4)
    off = ((r // 128) * tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return flat[off.reshape(-1)].view(rows, cols).view(scale.dtype)


def _block_scale(name: str, s: list[torch.Tensor], sw: list[str], rows: int, k: int) -> torch.Tensor:
    """Check one operand's scales against the kernel's layout; return them as a fp32
    [rows, K-blocks] grid (TensorWise: [1, 1])."""
    s0 = s[0]
    if name == "TensorWise":
        _check(s0.dtype == torch.float32 and s0.numel() == 1, "TensorWise scales are one fp32 value")
        return s0.reshape(1, 1).float()
    if name == "BlockWise1x128":
        kb = _ceil(k, 128)
        _check(s0.dtype == torch.float32 and tuple(s0.shape) == (rows, kb)
               and s0.stride(0) == 1 and (kb == 1 or s0.stride(1) == rows),
               f"BlockWise1x128 scales must be ({rows}, {kb}) outer-dim-major, got "
               f"{tuple(s0.shape)} strides {s0.stride()}")
        return s0.float()
    if name == "BlockWise128x128":
        kb4, rb = _ceil(_ceil(k, 128), 4) * 4, _ceil(rows, 128)
        _check(s0.dtype == torch.float32 and tuple(s0.shape) == (kb4, rb) and s0.stride(0) == 1
               and (rb == 1 or s0.stride(1) == kb4),
               f"BlockWise128x128 scales must be ({kb4}, {rb}) with strides (1, {kb4}), got "
               f"{tuple(s0.shape)} strides {s0.stride()}")
        return s0.t()[:, : _ceil(k, 128)].float().repeat_interleave(128, 0)[:rows]
    block, dtype = (32, getattr(torch, "float8_e8m0fnu", None)) if name == "BlockWise1x32" else (16, torch.float8_e4m3fn)
    kb = k // block
    _check(s0.dtype == dtype and s0.is_contiguous()
           and s0.numel() == _ceil(rows, 128) * 128 * _ceil(kb, 4) * 4,
           f"{name} scales must be {dtype}, contiguous, {_ceil(rows, 128) * 128} x {_ceil(kb, 4) * 4}")
    _check(sw[0] == "SWIZZLE_32_4_4", f"{name} scales must be swizzled (SWIZZLE_32_4_4)")
    grid = _unswizzle(s0, rows, kb).float()
    if name == "BlockWise1x16":
        _check(len(s) == 2 and s[1].dtype == torch.float32 and s[1].numel() == 1,
               "NVFP4 takes its per-tensor fp32 scale as a second TensorWise scale")
        grid = grid * s[1].reshape(()).float()
    return grid


def _values(mat: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP8 codes, or of packed E2M1 pairs (element 2i in the low nibble)."""
    if mat.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        b = mat.contiguous().view(torch.uint8).to(torch.int64)
        lo, hi = _E2M1[b & 0xF], _E2M1[b >> 4]
        return torch.stack((lo, hi), -1).reshape(mat.shape[0], mat.shape[1] * 2)
    return mat.float()


def block_product(av: torch.Tensor, bv: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                  block: int) -> torch.Tensor:
    """The kernel's math: ``av [M, K] @ bv [N, K]^T`` in fp32 per K-block of ``block``, each
    block's product times its row scales ``sa [M, blocks]`` and column scales ``sb [N, blocks]``
    (a 1-wide grid: one scale for every block), summed in fp32."""
    m, k = av.shape
    out = torch.zeros(m, bv.shape[0], dtype=torch.float32)
    for j, k0 in enumerate(range(0, k, block)):
        part = av[:, k0 : k0 + block] @ bv[:, k0 : k0 + block].t()
        ja, jb = min(j, sa.shape[1] - 1), min(j, sb.shape[1] - 1)
        out += part * (sa[:, ja : ja + 1] * sb[:, jb].reshape(1, -1))
    return out


def scaled_mm_v2(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: list, recipe_a: list,
                 swizzle_a: list, scale_b: list, recipe_b: list, swizzle_b: list,
                 bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                 contraction_dim: Any = (), use_fast_accum: bool = False) -> torch.Tensor:
    """``aten._scaled_mm_v2`` on the virtual GPU (see the module doc)."""
    sm, cuda_version, vd = _device()
    ra = [_NAMES[int(r)] for r in recipe_a]
    rb = [_NAMES[int(r)] for r in recipe_b]
    wa = [_SWIZZLES[int(w)] for w in swizzle_a] or ["NO_SWIZZLE"] * len(ra)
    wb = [_SWIZZLES[int(w)] for w in swizzle_b] or ["NO_SWIZZLE"] * len(rb)
    name = _KERNELS.get((ra[0], rb[0]))
    _check(name is not None and (name != "nvfp4" or ra[1:] == rb[1:] == ["TensorWise"]),
           f"no scaled kernel for scaling types {ra} x {rb}")
    kern = catalog.kernel(name)
    assert kern is not None
    why = catalog.refusal(kern, sm, cuda_version)
    _check(why is None, f"{why}")
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    _check((mat_a.dtype == fp4) == (name == "nvfp4") == (mat_b.dtype == fp4),
           f"{name} operands must be {'float4_e2m1fn_x2' if name == 'nvfp4' else 'FP8'}")
    _check(not (mat_a.dtype == mat_b.dtype == torch.float8_e5m2),
           "Multiplication of two Float8_e5m2 matrices is not supported")
    pack = 2 if name == "nvfp4" else 1
    m, k, n = mat_a.shape[0], mat_a.shape[1] * pack, mat_b.shape[1]
    _check(mat_b.shape[0] * pack == k, "mat_a and mat_b shapes cannot be multiplied")
    _check(k % 16 == 0 and n % 16 == 0, f"K ({k}) and N ({n}) must be divisible by 16")
    a_k_major = mat_a.stride(1) == 1
    b_k_major = mat_b.stride(0) == 1
    if sm < catalog.TN_ONLY_BELOW_SM:
        _check(a_k_major and b_k_major, "Only multiplication of row-major and column-major matrices "
               "is supported by cuBLASLt")
    _check(not (use_fast_accum and name == "nvfp4"), "use_fast_accum is not supported with Float4")
    sa = _block_scale(ra[0], list(scale_a), wa, m, k)
    sb = _block_scale(rb[0], list(scale_b), wb, n, k)
    block = k if name == "tensorwise" else {"blockwise": 128, "mxfp8": 32, "nvfp4": 16}[name]
    out = block_product(_values(mat_a), _values(mat_b.t()), sa, sb, block)
    vd.scaled_gemms.append(ScaledGemmCall(name, ra[0], rb[0], a_k_major, b_k_major,
                                          out_dtype or torch.bfloat16, k))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or torch.bfloat16)


def scaled_mm_v1(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 scale_result: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                 use_fast_accum: bool = False) -> torch.Tensor:
    """``aten._scaled_mm`` on the virtual GPU: per-tensor scales (the block-scaled forms of
    the old entry point are not modelled: lptrain calls them through ``F.scaled_mm``)."""
    _check(scale_a.numel() == 1 and scale_b.numel() == 1,
           "the virtual GPU models torch._scaled_mm with TensorWise scales only")
    return scaled_mm_v2(mat_a, mat_b, [scale_a], [0], [], [scale_b], [0], [], bias,
                        out_dtype or mat_a.dtype, (), use_fast_accum)
