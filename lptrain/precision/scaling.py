"""Scale computation primitives (numerics.md P2-P5 and the NVFP4 global scale).

Every function is vectorised over tensors of amaxes/codes so the per-recipe quantizers can
compute all block scales of a tensor in one shot. All math is fp32 (``torch.div`` and
``torch.reciprocal`` on fp32 are correctly rounded, matching ``__fdiv_rn``/``__frcp_rn``).
Pitfall avoided here: ``python_float / tensor`` in torch is ``tensor.reciprocal() * float``
(two roundings), so divisions always use an fp32 tensor numerator.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .formats import E8M0_MAX_CODE, E8M0_NAN, FLT_MAX

# 0xFF800000 as a signed int32: keeps sign + exponent, i.e. floors a float to a power of two.
_POW2_MASK = -8388608
_SUBNORMAL_2_POW_M127 = 0x00400000  # bits of 2^-127 in fp32

Number = Union[float, torch.Tensor]


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def abs_nan_to_zero(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN -> 0 and inf kept (a fresh tensor; P2's NaN-ignoring rule)."""
    a = x.float().abs()
    return a.nan_to_num_(nan=0.0, posinf=float("inf"))


def block_amax(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """NaN-ignoring fp32 max|x| over ``dim`` (P2): NaN elements do not count, inf does.

    Fast path max(amax, -amin) (no |x| temporary; exact, it only selects values). ``amax``
    propagates NaN, so a NaN result means the slice held a NaN and those slices are recomputed
    with NaN -> 0. An all-NaN slice gives 0.
    """
    if x.numel() == 0:
        if dim is None:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        keep = [s for i, s in enumerate(x.shape) if i not in ((dim,) if isinstance(dim, int) else dim)]
        return torch.zeros(keep, dtype=torch.float32, device=x.device)
    xf = x.float()
    d = () if dim is None else dim
    a = torch.maximum(xf.amax(dim=d), xf.amin(dim=d).neg_())
    nan = torch.isnan(a)
    if bool(nan.any()):
        a = torch.where(nan, abs_nan_to_zero(xf).amax(dim=d), a)
    # abs: an all-zero slice gives max(0, -0.0), which may be -0.0; a negative zero amax would
    # make NVFP4's block scale the E4M3 byte 0x80 and its encode factor -inf (0 * -inf = NaN).
    return a.abs_()


def amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring fp32 amax of the whole tensor (0-d fp32; empty or all-NaN gives 0)."""
    return block_amax(x, None)


def compute_scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    pow2: bool = False,
    eps: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """Quantization scale s from amax, exactly as TE's ``compute_scale_from_amax`` (P3).

    ``amax < eps -> eps`` first (NaN is left alone); inf/NaN/zero amax give s = 1; otherwise
    s = fp32(fp8_max / amax), inf replaced by ``value_for_inf``, and with ``pow2`` floored to a
    power of two by masking the mantissa bits (never log2/floor, which rounds up just below a
    power of two). Elementwise over any shape; returns fp32. scale_inv is ``torch.reciprocal(s)``.
    """
    a = amax.to(torch.float32)
    if eps > 0.0:
        a = torch.where(a < eps, _f32(eps, a), a)
    s = torch.full_like(a, fp8_max).div_(a)
    s = torch.where(torch.isinf(s), _f32(value_for_inf, a), s)
    if pow2:
        s = (s.view(torch.int32) & _POW2_MASK).view(torch.float32)
    bad = torch.isinf(a) | torch.isnan(a) | (a == 0)
    return s.masked_fill_(bad, 1.0)


def float_to_e8m0(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E8M0 code (uint8), rounding toward +inf with saturation (P4, RCEIL).

    NaN -> 0xFF, inf -> 0xFE, 0 -> 0x00; otherwise the biased exponent, plus one when any
    mantissa bit is set (except at 0xFE, and for subnormals <= 2^-127). Pure int32 bit logic:
    torch's ``.to(float8_e8m0fnu)`` rounds to nearest (ties up) and must not be used here.
    """
    v = v.to(torch.float32).abs()  # amaxes are non-negative; abs makes -0 -> 0
    bits = v.view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    round_up = (m > 0) & (e != E8M0_MAX_CODE) & ~((e == 0) & (m <= _SUBNORMAL_2_POW_M127))
    code = e + round_up.to(torch.int32)
    code = torch.where(torch.isinf(v), E8M0_MAX_CODE, code)
    code = torch.where(torch.isnan(v), E8M0_NAN, code)
    return code.to(torch.uint8)


def e8m0_from_amax(block_amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """MXFP8 block code: ``float_to_e8m0(fp32(amax * fl32(1/fp8_max)))`` (a multiply, as TE)."""
    rcp = torch.tensor(1.0 / fp8_max, dtype=torch.float32)  # fl32 of the fp64 1/max (max_norm_rcp)
    return float_to_e8m0(block_amax.to(torch.float32) * rcp)


def e8m0_to_quant_multiplier(code: torch.Tensor) -> torch.Tensor:
    """Quantize multiplier 2^(127-code) (TE ``exp2f_rcp``, P5): 254 -> 2^-127 (fp32 subnormal),
    255 -> NaN, 0 -> 2^127."""
    c = code.to(torch.int32)
    bits = (254 - c).clamp_(min=0) << 23
    bits = torch.where(c == 254, _SUBNORMAL_2_POW_M127, bits)
    out = bits.view(torch.float32)
    return out.masked_fill(c == E8M0_NAN, float("nan"))


def e8m0_to_dequant_scale(code: torch.Tensor) -> torch.Tensor:
    """Dequantization scale 2^(code-127) (TE ``exp2f``, P5): 0 -> 2^-127 (subnormal), 255 -> NaN."""
    c = code.to(torch.int32)
    bits = torch.where(c == 0, _SUBNORMAL_2_POW_M127, c << 23)
    out = bits.view(torch.float32)
    return out.masked_fill(c == E8M0_NAN, float("nan"))


# ---------------------------------------------------------------------------------------------
# NVFP4 two-level scales (numerics.md 2.5)

NVFP4_GLOBAL_NUM = 448.0 * 6.0  # 2688


def nvfp4_global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = min(fp32(2688 / amax), FLT_MAX); amax == 0 or S_enc == 0 (inf amax) -> 1."""
    a = global_amax.to(torch.float32)
    s = torch.full_like(a, NVFP4_GLOBAL_NUM).div_(a).clamp_(max=FLT_MAX)
    return s.masked_fill_((a == 0) | (s == 0), 1.0)


def nvfp4_block_scales(
    block_amax: torch.Tensor, s_enc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block E4M3 decode scale bytes and fp32 encode multipliers.

    sdec_b = e4m3_satfinite(min(fp32(vmax * fp32(S_enc * fl32(1/6))), FLT_MAX)),
    enc_b = min(fp32(1 / fp32(float(sdec_b) * S_dec)), FLT_MAX) with S_dec = fp32(1/S_enc).
    Returns (scale bytes uint8, enc_b fp32), both shaped like ``block_amax``.
    """
    s_enc = s_enc.to(torch.float32)
    s_dec = torch.reciprocal(s_enc)
    k = s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32)
    v = (block_amax.to(torch.float32) * k).clamp_(max=FLT_MAX)
    sdec_bits = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    sdec = sdec_bits.view(torch.float8_e4m3fn).float()
    enc = torch.reciprocal(sdec * s_dec).clamp_(max=FLT_MAX)
    return sdec_bits, enc


def nvfp4_dequant_block_scale(scale_bits: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """fp32(fp32(float(sdec_b) * amax) * fl32(1/2688)), TE's ``dequantize_nvfp4`` block factor."""
    sdec = scale_bits.view(torch.float8_e4m3fn).float()
    return (sdec * global_amax.to(torch.float32)) * torch.tensor(
        1.0 / NVFP4_GLOBAL_NUM, dtype=torch.float32
    )


def maybe_reduce_amax(amax_t: torch.Tensor, reduction: Optional[object]) -> torch.Tensor:
    """MAX-reduce ``amax_t`` with a callable (returns the result or reduces in place) or a
    ``torch.distributed`` process group (all_reduce MAX when its size > 1)."""
    if reduction is None:
        return amax_t
    if callable(reduction):
        out = reduction(amax_t)
        return amax_t if out is None else out.to(torch.float32)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(reduction) > 1:
        dist.all_reduce(amax_t, op=dist.ReduceOp.MAX, group=reduction)
    return amax_t
