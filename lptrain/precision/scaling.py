"""Scale computation primitives (numerics.md P2-P5 and the NVFP4 global scale).

Every function is vectorised over tensors of amaxes/codes so the per-recipe quantizers can
compute all block scales of a tensor in one shot. All math is fp32 (``torch.div`` and
``torch.reciprocal`` on fp32 are correctly rounded, matching ``__fdiv_rn``/``__frcp_rn``).
Pitfall avoided here: ``python_float / tensor`` in torch is ``tensor.reciprocal() * float``
(two roundings), so divisions always use an fp32 tensor numerator.
"""

from __future__ import annotations

import math
import struct
from typing import Optional, Union

import torch

from .formats import E8M0_MAX_CODE, E8M0_NAN, FLT_MAX, e4m3_bits_to_float
from .scratch import Workspace, host_shortcuts, operand

# 0xFF800000 as a signed int32: keeps sign + exponent, i.e. floors a float to a power of two.
_POW2_MASK = -8388608
_SUBNORMAL_2_POW_M127 = 0x00400000  # bits of 2^-127 in fp32
_ABS_MASK = 0x7FFFFFFF  # clears the fp32 sign bit
_INF_BITS = 0x7F800000  # bits of +inf; larger patterns (sign cleared) are NaN
_ABS_MASK_BF16 = 0x7FFF  # the same two for the 16-bit bfloat16 patterns
_INF_BITS_BF16 = 0x7F80

Number = Union[float, torch.Tensor]


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def abs_nan_to_zero(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN -> 0 and inf kept (a fresh tensor; P2's NaN-ignoring rule)."""
    a = x.float().abs()
    return a.nan_to_num_(nan=0.0, posinf=float("inf"))


def block_amax(
    x: torch.Tensor, dim: int | tuple[int, ...] | None = None, ws: Optional[Workspace] = None
) -> torch.Tensor:
    """NaN-ignoring fp32 max|x| over ``dim`` (P2): NaN elements do not count, inf does.

    Fast path on the fp32 bit patterns: with the sign bit cleared, int32 order is |x| order
    (inf included), and torch's int32 ``amax`` over a short inner dim is several times faster
    than the float one (no NaN bookkeeping). Exact: it only selects values. NaN patterns sort
    above inf, so a result above inf's bits means the slice held a NaN; those slices are
    recomputed with NaN -> 0 (an all-NaN slice gives 0). The result is never -0.0 (a negative
    zero amax would make NVFP4's block scale the E4M3 byte 0x80 and its encode factor -inf).
    ``ws`` (optional) holds the |x| bits temporary (reused across chunks).
    """
    if x.numel() == 0:
        if dim is None:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        keep = [s for i, s in enumerate(x.shape) if i not in ((dim,) if isinstance(dim, int) else dim)]
        return torch.zeros(keep, dtype=torch.float32, device=x.device)
    return block_amax_nan(x, dim, ws)[0]


def block_amax_nan(
    x: torch.Tensor, dim: int | tuple[int, ...] | None = None, ws: Optional[Workspace] = None
) -> tuple[torch.Tensor, bool]:
    """:func:`block_amax` and whether ``x`` may hold a NaN: exactly known on the CPU (the
    check the amax makes anyway), always True elsewhere (asking would be a host sync).
    Callers use it to skip NaN handling passes that cannot change anything."""
    if x.numel() == 0:
        return block_amax(x, dim), not host_shortcuts(x)
    d = () if dim is None else dim
    if x.dtype == torch.bfloat16:
        return _block_amax_nan_bf16(x, d, ws)
    xf = x.float()
    out = None if ws is None else ws.get("amax", xf.shape, torch.int32)
    bits = xf.view(torch.int32)
    a = torch.bitwise_and(bits, operand(_ABS_MASK, bits), out=out).amax(dim=d)
    # On the CPU the NaN-free common case skips the recompute (asked as one max and one
    # read of the int amaxes); elsewhere asking would be a host sync per quantization, so
    # the (value-identical) select always runs.
    has_nan = not host_shortcuts(x) or int(a.max()) > _INF_BITS
    if has_nan:
        a = torch.where(a > _INF_BITS, abs_nan_to_zero(xf).amax(dim=d).view(torch.int32), a)
    return a.view(torch.float32), has_nan


def _block_amax_nan_bf16(
    x: torch.Tensor, d: int | tuple[int, ...], ws: Optional[Workspace]
) -> tuple[torch.Tensor, bool]:
    """:func:`block_amax_nan` of bf16 ``x`` on its int16 bit patterns (the same fp32 result).

    Why: the NVFP4 RHT operand is rounded to bf16 and its amax was taken after widening it
    back to fp32, a pass that writes twice the bytes the amax reads; bf16 widens to fp32 by
    appending 16 zero bits, so the int16 order of the sign-cleared patterns is the fp32 one
    and the widened max is the int16 max shifted left by 16 (exact). NaN patterns sort above
    inf's 0x7F80 as in the fp32 case and are recomputed the same way."""
    out = None if ws is None else ws.get("amax16", x.shape, torch.int16)
    bits = x.view(torch.int16)
    a16 = torch.bitwise_and(bits, operand(_ABS_MASK_BF16, bits), out=out).amax(dim=d)
    nan = a16 > _INF_BITS_BF16
    has_nan = not host_shortcuts(x) or bool(nan.any())
    a = a16.to(torch.int32).bitwise_left_shift_(16)
    if has_nan:
        a = torch.where(nan, abs_nan_to_zero(x).amax(dim=d).view(torch.int32), a)
    return a.view(torch.float32), has_nan


_AMAX_CHUNK = 1 << 19  # elements per pass: the |x| temporary stays small and is reused


def amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring fp32 amax of the whole tensor (0-d fp32; empty or all-NaN gives 0).

    Contiguous inputs are reduced in chunks with one reused scratch buffer (a full-size
    temporary would be page-faulted in on every call); max of maxes is exact.
    """
    if x.numel() <= _AMAX_CHUNK or not x.is_contiguous():
        return block_amax(x, None)
    flat, ws = x.float().view(-1), Workspace(x.device)
    parts = [block_amax(flat[i : i + _AMAX_CHUNK], 0, ws) for i in range(0, flat.numel(), _AMAX_CHUNK)]
    return torch.stack(parts).amax()


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
    # in place on the fresh quotient, masks as single ops: the per-tensor and per-block
    # quantizers call this on tiny grids, where each dispatcher call costs more than the math
    s = torch.full_like(a, fp8_max).div_(a)
    s.masked_fill_(torch.isinf(s), value_for_inf)  # value_for_inf is an fp32 value: exact
    if pow2:
        s.view(torch.int32).bitwise_and_(_POW2_MASK)
    good = torch.isfinite(a).logical_and_(a != 0)  # not inf, not NaN, not zero
    return s.masked_fill_(good.logical_not_(), 1.0)


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


_RCP_CACHE: dict[float, torch.Tensor] = {}
_E8M0_CEIL = 0x7FFFFF  # added to the fp32 bits, rounds the exponent up when any mantissa bit is set
_MAX_MULT_BITS = E8M0_MAX_CODE << 23  # bits of 2^(254 - 127) ... minus code << 23 gives 2^(127-code)


def mxfp8_block_scales(block_amax: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 codes uint8, fp32 quantize multipliers) of NaN-free, non-negative block amaxes:
    the bits of ``e8m0_from_amax`` and ``e8m0_to_quant_multiplier`` in six integer ops.

    Why: the MXFP8 quantizer calls this once per orientation on a tensor 32x smaller than the
    operand, so on a small model its ~30 generic ops (NaN, sign and subnormal cases as
    separate masks) cost more than the block math itself. With v = fp32(amax * fl32(1/max))
    >= 0 and never NaN (:func:`block_amax` ignores NaN), RCEIL is ``(bits(v) + 0x7FFFFF) >> 23``
    (the exponent, plus one when a mantissa bit is set; inf and the top binade give 0xFF and
    are clamped to 0xFE), except for subnormals up to 2^-127 (bits <= 0x400000), which
    ``float_to_e8m0`` does not round up: ``(0x400000 - bits) >> 31`` is 0 exactly for them
    (and for +0, where the clamp at 0 absorbs it) and -1 otherwise, so adding it and one
    subtracts the spurious step. The multiplier 2^(127-code) is the fp32 with bits
    (254 - code) << 23, and 2^-127 (subnormal bits 0x400000) for code 254, i.e. the max of the
    two. Equality with the generic functions is tested on every exponent and edge mantissa.
    """
    code, mult = mxfp8_block_scales_i32(block_amax, fp8_max)
    return code.to(torch.uint8), mult


def mxfp8_block_scales_i32(block_amax: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mxfp8_block_scales` with the codes left as int32 (callers that cut one
    computation over several grids into parts convert each part to uint8 themselves)."""
    rcp = _RCP_CACHE.get(fp8_max)
    if rcp is None:  # fl32 of the fp64 1/max (TE's max_norm_rcp), a CPU scalar usable anywhere
        rcp = _RCP_CACHE.setdefault(fp8_max, torch.tensor(1.0 / fp8_max, dtype=torch.float32, device="cpu"))
    bits = torch.mul(block_amax, rcp).view(torch.int32)
    fix = torch.sub(_SUBNORMAL_2_POW_M127, bits).bitwise_right_shift_(31).add_(1)
    code = bits.add_(_E8M0_CEIL).bitwise_right_shift_(23).sub_(fix).clamp_(0, E8M0_MAX_CODE)
    mult = torch.bitwise_left_shift(code, 23, out=fix).neg_().add_(_MAX_MULT_BITS)
    return code, mult.clamp_(min=_SUBNORMAL_2_POW_M127).view(torch.float32)


def abs_bits(x: torch.Tensor, ws: Optional[Workspace] = None) -> torch.Tensor:
    """int32 bit patterns of |fp32 x| (sign cleared; int order is |x| order, NaN above inf):
    what :func:`block_amax_nan` reduces, for callers that reduce one pass over several grids."""
    out = None if ws is None else ws.get("amax", x.shape, torch.int32)
    return torch.bitwise_and(x.view(torch.int32), _ABS_MASK, out=out)


def has_nan_bits(amax_bits: torch.Tensor) -> bool:
    """Whether int32 block amaxes of :func:`abs_bits` saw a NaN (a pattern above inf's)."""
    return bool(amax_bits.numel()) and int(amax_bits.max()) > _INF_BITS


def e8m0_to_quant_multiplier(code: torch.Tensor) -> torch.Tensor:
    """Quantize multiplier 2^(127-code) (TE ``exp2f_rcp``, P5): 254 -> 2^-127 (fp32 subnormal),
    255 -> NaN, 0 -> 2^127."""
    c = code.to(torch.int32)
    bits = (254 - c).clamp_(min=0) << 23
    bits = torch.where(c == 254, _SUBNORMAL_2_POW_M127, bits)
    out = bits.view(torch.float32)
    return out.masked_fill(c == E8M0_NAN, float("nan"))


def _e8m0_dequant_bits(code: torch.Tensor) -> torch.Tensor:
    c = code.to(torch.int32)
    bits = torch.where(c == 0, _SUBNORMAL_2_POW_M127, c << 23)
    out = bits.view(torch.float32)
    return out.masked_fill(c == E8M0_NAN, float("nan"))


# every code's dequant scale, made by the elementwise rule once
_E8M0_DEQUANT_LUT = _e8m0_dequant_bits(torch.arange(256, dtype=torch.int32, device="cpu").to(torch.uint8))


def e8m0_to_dequant_scale(code: torch.Tensor) -> torch.Tensor:
    """Dequantization scale 2^(code-127) (TE ``exp2f``, P5): 0 -> 2^-127 (subnormal), 255 -> NaN.

    On the CPU one gather from the 256-entry table the elementwise rule fills (the same bits):
    the MXFP8 operands of a small model are dequantized several times per GEMM, and the
    rule's seven ops on a grid 32x smaller than the operand cost more than the gather.
    """
    if not host_shortcuts(code):
        return _e8m0_dequant_bits(code)
    flat = torch.index_select(_E8M0_DEQUANT_LUT, 0, code.reshape(-1).to(torch.int32))
    return flat.view(code.shape)


# ---------------------------------------------------------------------------------------------
# NVFP4 two-level scales (numerics.md 2.5)

NVFP4_GLOBAL_NUM = 448.0 * 6.0  # 2688
# fl32 constants as CPU 0-d tensors (usable with tensors on any device), made once: a fresh
# torch.tensor per call is three dispatcher calls, on a small model more than the math
_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32, device="cpu")
_INV_GLOBAL_NUM = torch.tensor(1.0 / NVFP4_GLOBAL_NUM, dtype=torch.float32, device="cpu")


def nvfp4_global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S_enc = min(fp32(2688 / amax), FLT_MAX); amax == 0 or S_enc == 0 (inf amax) -> 1."""
    a = global_amax.to(torch.float32)
    s = torch.full_like(a, NVFP4_GLOBAL_NUM).div_(a).clamp_(max=FLT_MAX)
    return s.masked_fill_((a == 0) | (s == 0), 1.0)


def nvfp4_global_encode_scale_value(global_amax: float) -> float:
    """:func:`nvfp4_global_encode_scale` of one (fp32-valued) amax, in Python floats.

    fp64 quotient then one rounding to fp32 equals the fp32 division (53 >= 2 * 24 + 2
    bits: double rounding of +-*/ is innocuous), and a quotient at or above FLT_MAX rounds
    to FLT_MAX or inf, which the clamp makes FLT_MAX either way."""
    if global_amax == 0.0:
        return 1.0
    q = NVFP4_GLOBAL_NUM / global_amax
    s = FLT_MAX if q >= FLT_MAX else fp32_value(q)
    return 1.0 if s == 0.0 else s


def fp32_value(v: float) -> float:
    """``v`` rounded to the nearest fp32 (ties to even), as a Python float; a value that
    rounds past FLT_MAX gives +-inf, as the fp32 operation would."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


_SIXTH_VALUE = float(_SIXTH)


def nvfp4_block_scaler(global_amax: torch.Tensor) -> NVFP4BlockScaler:
    """The :class:`NVFP4BlockScaler` of a (1,) global amax.

    On the CPU its per-tensor factors are Python floats (the same fp32 values; a tensor op
    with a Python scalar multiplies in fp32): the ~11 tiny tensor ops of the tensor path
    are most of an NVFP4 quantization's scale set-up on a small model, and it runs once per
    orientation and quantization. Elsewhere the tensor path (reading the amax would sync)."""
    if host_shortcuts(global_amax) and global_amax.numel() == 1:
        s_enc = nvfp4_global_encode_scale_value(float(global_amax))
        return NVFP4BlockScaler(s_enc)
    return NVFP4BlockScaler(nvfp4_global_encode_scale(global_amax))


class NVFP4BlockScaler:
    """Per-block E4M3 decode-scale bytes and fp32 encode multipliers for one global scale.

    sdec_b = e4m3_satfinite(min(fp32(vmax * fp32(S_enc * fl32(1/6))), FLT_MAX)),
    enc_b = min(fp32(1 / fp32(float(sdec_b) * S_dec)), FLT_MAX) with S_dec = fp32(1/S_enc).
    The per-tensor factors are computed once (the quantizer calls this per row chunk).
    Block amaxes are >= +0 and the factor is finite and positive, so min(v, FLT_MAX) followed
    by the E4M3 saturation at 448 is one clamp to 448 (inf -> 448 either way).
    """

    def __init__(self, s_enc: torch.Tensor | float) -> None:
        self.s_dec: torch.Tensor | float
        self.k: torch.Tensor | float
        if isinstance(s_enc, float):  # an fp32 value: the same two fp32 roundings in fp64
            self.s_dec = fp32_value(1.0 / s_enc) if s_enc != 0.0 else float("inf")
            self.k = fp32_value(s_enc * _SIXTH_VALUE)
            return
        s_enc = s_enc.to(torch.float32)
        self.s_dec = torch.reciprocal(s_enc)
        self.k = s_enc * _SIXTH

    def __call__(self, block_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = (block_amax.to(torch.float32) * self.k).clamp_(max=448.0)
        sdec_bits = v.to(torch.float8_e4m3fn).view(torch.uint8)
        enc = e4m3_bits_to_float(sdec_bits).mul_(self.s_dec)
        return sdec_bits, enc.reciprocal_().clamp_(max=FLT_MAX)


def nvfp4_inv_global_num() -> torch.Tensor:
    """fl32(1/2688) (0-d, CPU): the per-tensor decode factor of an NVFP4 amax."""
    return _INV_GLOBAL_NUM


def nvfp4_dequant_block_scale(scale_bits: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """fp32(fp32(float(sdec_b) * amax) * fl32(1/2688)), TE's ``dequantize_nvfp4`` block factor."""
    sdec = e4m3_bits_to_float(scale_bits)
    return (sdec * global_amax.to(torch.float32)) * _INV_GLOBAL_NUM


def nvfp4_dequant_block_scale_into(
    scale_bits: torch.Tensor, global_amax: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """:func:`nvfp4_dequant_block_scale` computed in ``out`` (fp32, ``scale_bits``' shape):
    the same ops in place, for callers that evaluate it chunk by chunk into a reused buffer."""
    e4m3_bits_to_float(scale_bits, out)
    return out.mul_(global_amax.to(torch.float32)).mul_(_INV_GLOBAL_NUM)


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


class AmaxOverGroups:
    """An ``amax_reduction`` that MAX-reduces over several process groups in turn: the MAX
    over their product (an operand split both by tensor parallelism and along the sequence by
    context parallelism reduces over TP, then over CP)."""

    def __init__(self, *groups: object) -> None:
        self.groups = tuple(g for g in groups if g is not None)

    def __call__(self, amax_t: torch.Tensor) -> torch.Tensor:
        for g in self.groups:
            amax_t = maybe_reduce_amax(amax_t, g)
        return amax_t
