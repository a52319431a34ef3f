"""Low-precision element formats and their bit-faithful CPU casts (numerics.md section 0, P1, P6).

Why hand-written casts: torch's CPU casts differ from the GPU kernels in ways that matter for
bit-exact emulation (E5M2 never saturates, E4M3 saturation depends on the torch version, E8M0
rounds ties up, E2M1 has no cast at all). Everything here takes and produces fp32 values and
stores low-precision data as raw ``uint8`` bits, so buffers can be placed in flat byte buffers.
All arithmetic is fp32; nothing goes through fp64.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from .scratch import Workspace, host_shortcuts, operand

FLT_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class FP8Format:
    """An FP8 element format: its name, largest finite value and torch storage dtype."""

    name: str
    max: float
    torch_dtype: torch.dtype

    def __repr__(self) -> str:
        return f"FP8Format({self.name})"


E4M3 = FP8Format("e4m3", 448.0, torch.float8_e4m3fn)
E5M2 = FP8Format("e5m2", 57344.0, torch.float8_e5m2)

# E8M0 (MX block scales): value = 2^(code-127), 0xFF = NaN, no zero, no sign.
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MAX_CODE = 0xFE

# E2M1 (FP4): magnitude grid indexed by the 3-bit magnitude code; bit 3 is the sign.
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def rounding_limit(max_value: float, eps: float) -> float:
    """The smallest scaled magnitude round-to-nearest cannot bring to the largest finite code:
    ``max`` plus half the step below it (``eps * 2^floor(log2 max)``): E4M3 464, E5M2 61440,
    E2M1 7. A value beyond it was clamped (saturated), not rounded."""
    step = eps * 2.0 ** math.floor(math.log2(max_value))
    return max_value + step / 2


class Format(str, enum.Enum):
    """Recipe-level FP8 format choice (TE ``recipe.Format``). Pure E5M2 is not allowed."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"  # E4M3 forward (input, weight), E5M2 backward (grad)

    @classmethod
    def parse(cls, value: str | Format) -> Format:
        if isinstance(value, Format):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"fp8_format must be 'e4m3' or 'hybrid' (pure E5M2 is rejected), got {value!r}"
            ) from None

    def for_role(self, role: str) -> FP8Format:
        """Element format used for tensors of ``role`` (grad is the only backward role)."""
        if self is Format.HYBRID and role == "grad":
            return E5M2
        return E4M3


# ---------------------------------------------------------------------------------------------
# FP8 (P1)


def cast_to_fp8(x: torch.Tensor, fmt: FP8Format, *, inplace: bool = False) -> torch.Tensor:
    """fp32 -> FP8 bits (uint8) with satfinite round-to-nearest-even.

    Clamping to +-MAX first makes inf saturate and overflow saturate on every torch version
    (E5M2's torch cast would produce inf otherwise); ``clamp`` keeps NaN, so NaN stays NaN.
    ``inplace`` clamps ``x`` itself (for temporaries: saves a full fp32 allocation).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"cast_to_fp8 expects fp32 input, got {x.dtype}")
    c = x.clamp_(-fmt.max, fmt.max) if inplace else x.clamp(-fmt.max, fmt.max)
    return c.to(fmt.torch_dtype).view(torch.uint8)


RowScale = Callable[[torch.Tensor, int, int], None]


_DECODE_CHUNK = 1 << 18  # elements per pass: the int16 scratch and fp32 rows stay cache-resident
_F16_TO_E4M3 = 256.0  # fp16 built from E4M3 bits is the E4M3 value times 2^-8 (bias 15 vs 7)
# fp32 value of every E4M3 byte, by torch's own conversion (so NaN payloads are torch's)
_E4M3_LUT = torch.arange(256, dtype=torch.int32, device="cpu").to(torch.uint8).view(torch.float8_e4m3fn).float()
# Elements x threads up to which the table gather beats the int16 passes: the gather is one
# serial op, the int16 decode ~12 threaded ones whose fixed cost (~5 us each) dominates below
# a few 10^5 elements (a small model's operands); both give torch's bits.
GATHER_DECODE_ELEMS = 1 << 18


def e4m3_bits_gather(
    bits: torch.Tensor, out: Optional[torch.Tensor] = None, table: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """E4M3 bytes (uint8, CPU) -> fp32 values by one table gather (torch's conversion bits);
    ``out`` (contiguous fp32, ``bits``' numel) receives them when given. ``table``: the 256
    values to gather instead (e.g. :func:`e4m3_scaled_table`)."""
    lut = _E4M3_LUT if table is None else table
    idx = bits.reshape(-1).to(torch.int32)
    if out is not None:
        torch.index_select(lut, 0, idx, out=out.view(-1))
        return out
    return torch.index_select(lut, 0, idx).view(bits.shape)


def e4m3_scaled_table(scale: torch.Tensor) -> torch.Tensor:
    """The 256 E4M3 values times one fp32 ``scale`` ((1,) or 0-d, CPU): gathering from it is
    decode-then-multiply bit for bit (the same fp32 product per element, NaNs included),
    with the operand-sized multiply done on 256 elements instead."""
    return _E4M3_LUT * scale.reshape(())


def e4m3_bits_to_float(bits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E4M3 bytes (uint8) -> fp32 values, bit-identical to torch's cast, into ``out`` if given.

    Why: torch's E4M3 -> fp32 cast is a serial per-element conversion on the CPU (~4.5 ns an
    element, 3-4x the int32 table gather), and NVFP4 converts one scale byte per 16 elements
    twice per quantize-dequantize; elsewhere the cast is a cheap kernel."""
    if host_shortcuts(bits):
        return e4m3_bits_gather(bits, out)
    v = bits.view(torch.float8_e4m3fn)
    return v.float() if out is None else out.copy_(v)


def _e4m3_bits_to_f32(bits: torch.Tensor, out: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
    """E4M3 bytes -> exact fp32 values in ``out`` via fp16 bit patterns (``v``, ``s`` int16
    scratch of the same numel).

    E4M3 ``s eeee mmm`` becomes the fp16 pattern ``s 0eeee mmm 0000000``: exponent bias 15
    instead of 7, so the fp16 value is the E4M3 value times 2^-8, subnormals included (fp16
    subnormals have the same 2^-24 * mantissa form). The NaN magnitude 0x7F additionally gets
    bit 14 (pattern 0x7F80: an fp16 NaN whose fp32 widening, 0x7FF00000, is exactly the NaN
    torch's own E4M3 conversion yields). All steps are int16 ops and torch's fp16 -> fp32
    widening, which torch runs on every thread (the byte-table gather it replaces is serial);
    the final x256 is exact.
    """
    v.copy_(bits)  # zero-extended byte b
    torch.bitwise_and(v, 0x80, out=s)
    v.add_(s)  # sign moves from bit 7 to bit 8
    torch.bitwise_and(v, 0x7F, out=s)
    s.add_(1).bitwise_and_(0x80)  # 0x80 iff the magnitude is 0x7F (NaN)
    v.add_(s).bitwise_left_shift_(7)
    out.copy_(v.view(torch.float16)).mul_(_F16_TO_E4M3)


def e5m2_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """E5M2 bytes (uint8) -> fp32 values, bit-identical to torch's cast (NaN payloads too).

    E5M2 is the top byte of fp16 (same sign, exponent and bias, two mantissa bits), so the
    byte shifted left by 8 is the fp16 pattern of the same value and torch's vectorised
    fp16 -> fp32 widening finishes it. Why: on the CPU torch's E5M2 cast is ~2.5x slower
    than this on a small model's operands (a few 10^5 elements, one thread); on large ones
    its threaded cast wins over the int16 temporaries, so :func:`fp8_to_float` uses this
    below ``GATHER_DECODE_ELEMS`` only."""
    h = bits.to(torch.int16)
    h.bitwise_left_shift_(8)
    return h.view(torch.float16).float()


def fp8_to_float(
    bits: torch.Tensor, fmt: FP8Format, scale_rows: Optional[RowScale] = None, align: int = 1,
    *, scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FP8 bits (uint8) -> fp32 values (exact), optionally scaled in place row chunk by chunk.

    ``scale_rows(out_rows, r0, r1)`` (2-D ``bits`` only) multiplies rows [r0, r1) of the
    result by their scales while they are still cached (chunks are multiples of ``align``
    rows, e.g. a block height); without a fused path it is called once on all rows.

    Why not torch's E4M3 -> fp32 cast: on CPU it costs ~2.5x a copy. E4M3 maps to fp16 by
    integer ops (see :func:`_e4m3_bits_to_f32`) and fp16 -> fp32 is a cheap threaded cast;
    the result is bit-identical to torch's conversion (NaN payloads included, tested). Small
    operands (``GATHER_DECODE_ELEMS``) take a 256-entry table gather instead: serial, but one
    op against the int16 path's dozen, whose per-op cost is what a small model pays. Small
    E5M2 operands take :func:`e5m2_bits_to_float` (a shift into fp16), large ones torch's cast.

    ``scale`` (one fp32 value for the whole tensor, on ``bits``' device; instead of
    ``scale_rows``): every value times it. Small E4M3 operands then gather from the scaled
    table (:func:`e4m3_scaled_table`: no operand-sized multiply); elsewhere it is a multiply.
    """
    small = host_shortcuts(bits) and bits.numel() * torch.get_num_threads() <= GATHER_DECODE_ELEMS
    if scale is not None:
        if scale_rows is not None:
            raise ValueError("fp8_to_float takes scale or scale_rows, not both")
        if small and fmt.torch_dtype == torch.float8_e4m3fn and scale.device.type == "cpu":
            return e4m3_bits_gather(bits, table=e4m3_scaled_table(scale))
        s = scale.reshape(())
        return fp8_to_float(bits, fmt, lambda o, r0, r1: o.mul_(s), align)
    if fmt.torch_dtype == torch.float8_e5m2 and small:
        out = e5m2_bits_to_float(bits)
        if scale_rows is not None:
            scale_rows(out, 0, out.shape[0])
        return out
    if (
        fmt.torch_dtype != torch.float8_e4m3fn  # large E5M2: torch's threaded cast
        or not host_shortcuts(bits)
        or bits.dim() != 2
        or not bits.is_contiguous()
    ):
        out = bits.view(fmt.torch_dtype).float()
        if scale_rows is not None:
            scale_rows(out, 0, out.shape[0])
        return out
    if small:
        out = e4m3_bits_gather(bits)
        if scale_rows is not None:
            scale_rows(out, 0, out.shape[0])
        return out
    rows, cols = bits.shape
    out = torch.empty(bits.shape, dtype=torch.float32)
    step = max(align, (_DECODE_CHUNK // max(cols, 1)) // align * align)
    n = min(rows, step) * cols
    v = torch.empty(n, dtype=torch.int16)
    s = torch.empty(n, dtype=torch.int16)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        k = (r1 - r0) * cols
        _e4m3_bits_to_f32(bits[r0:r1].view(torch.uint8).view(-1), out[r0:r1].view(-1), v[:k], s[:k])
        if scale_rows is not None:
            scale_rows(out[r0:r1], r0, r1)
    return out


# ---------------------------------------------------------------------------------------------
# E2M1 / FP4 (P6)

_E2M1_LUT = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32, device="cpu")


# fp32 bit patterns used by the integer E2M1 kernels below.
_MAGIC_HALF = 4194304.0  # 2^22: ulp 0.5, so a + 2^22 rounds a to a multiple of 0.5 (RNE)
_BITS_MAGIC_HALF = 0x4A800000
_BITS_2P23 = 0x4B000000  # 2^23: ulp 1
_BITS_2P24 = 0x4B800000  # 2^24: ulp 2
_EXP_MASK = 0x7F800000  # sign cleared, exponent kept: floors a positive fp32 to a power of two
_BIAS_CODE2 = 252  # (biased exponent 127 << 1) - 2: bits >> 22 of 1.0 minus its E2M1 code




def _sign_mask(y: torch.Tensor, ws: Workspace, may_have_nan: bool) -> torch.Tensor:
    """Canonicalise ``y`` in place and return int32 -1 where y < 0, else 0 (``ws`` slot "sign").

    In place: NaN -> +6 (E2M1 has no NaN; TE's satfinite gives +MAX) and -0.0 -> +0.0 (adding
    +0.0 changes nothing else). After that the sign bit alone says y < 0, and an arithmetic
    shift by 31 spreads it: one int32 op (comparisons producing bool are several times slower
    on CPU), and the caller folds it into the code with one ``code - 8 * mask``. Without
    ``may_have_nan`` (the caller knows ``y`` holds no NaN, e.g. from the block amax pass) the
    NaN replacement is skipped: it changes nothing then. Infinities need no replacement: both
    kernels below saturate them to code 7 exactly as they do FLT_MAX.
    """
    if may_have_nan:
        y.nan_to_num_(nan=E2M1_MAX, posinf=float("inf"), neginf=float("-inf"))
    y.add_(operand(0.0, y))
    bits = y.view(torch.int32)
    return torch.bitwise_right_shift(bits, operand(31, bits), out=ws.get("sign", y.shape, torch.int32))


def e2m1_codes_i32(y: torch.Tensor, ws: Optional[Workspace] = None, may_have_nan: bool = True) -> torch.Tensor:
    """fp32 -> E2M1 codes as int32 (RNE, satfinite, NaN -> +6); see :func:`cast_to_e2m1`.

    With a workspace ``y`` is consumed (overwritten) and the result lives in ``ws`` (valid
    until the next call with it); without one, ``y`` is left alone and the result is fresh.
    ``may_have_nan=False`` promises ``y`` holds no NaN (skips one pass; see :func:`_sign_mask`).

    Magnitude a = min(|y|, 6). The grid is uniform in three segments, step 0.5 on [0, 2], 1 on
    [2, 4], 2 on [4, 6], and the code is linear in each: 2a, a + 2, a/2 + 4. With R = round
    half to even (RNE on the grid: even code = even mantissa) the code is
    min(R(2a), R(a) + 2, R(a/2) + 4): R is monotone and R(x + 2k) = R(x) + 2k, so the
    smallest candidate is always the one of a's own segment. Each R is one exact fp32 add
    of a magic constant whose ulp is the step (2^22: 0.5, 2^23: 1, 2^24: 2); the rounded
    multiple is then the integer difference of the bit patterns.
    """
    if ws is None:
        ws, y = Workspace(y.device), y.clone()
    sign = _sign_mask(y, ws, may_have_nan)
    a = y.abs_().clamp_(max=E2M1_MAX)
    code = torch.add(a, operand(_MAGIC_HALF, a), out=ws.get("t1", y.shape, torch.float32)).view(torch.int32)
    code.sub_(operand(_BITS_MAGIC_HALF, code))
    cand = torch.add(a, operand(2.0**23, a), out=ws.get("t2", y.shape, torch.float32)).view(torch.int32)
    torch.minimum(code, cand.sub_(operand(_BITS_2P23 - 2, cand)), out=code)
    cand = torch.add(a, operand(2.0**24, a), out=cand.view(torch.float32)).view(torch.int32)
    torch.minimum(code, cand.sub_(operand(_BITS_2P24 - 4, cand)), out=code)
    return torch.sub(code, sign, alpha=8, out=code)  # | 8 where y < 0


def cast_to_e2m1(y: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8 in [0, 15], one per element), RNE with satfinite.

    Thresholds on |y| (numerics.md P6): ties go to the even mantissa, so 0.25->0, 0.75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. E2M1 has no NaN: NaN becomes +6 (TE's satfinite).
    Negative values that round to zero keep the sign (code 8); -0.0 gives code 0, as TE's
    reference ``cast_to_fp4x2`` does. ``y`` is never modified (``inplace`` is accepted for
    compatibility; the integer kernel needs no fp32 scratch). Math: :func:`e2m1_codes_i32`.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"cast_to_e2m1 expects fp32 input, got {y.dtype}")
    del inplace
    return e2m1_codes_i32(y).to(torch.uint8)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) -> fp32 values."""
    return _E2M1_LUT.to(codes.device)[codes.long()]


def draw_rbits(
    n: int, generator: Optional[torch.Generator], device: torch.device, ws: Optional[Workspace] = None
) -> torch.Tensor:
    """``n`` uniform random bytes (uint8), deterministic for a seeded ``generator``.

    Drawn as int64 words over the full int64 range (every byte uniform) and viewed as bytes:
    one generator call per 8 elements is ~6x cheaper than per-element uint8 draws. The words
    are drawn where ``generator`` lives (a seeded CPU generator: the same bits whatever
    ``device`` is, so a CUDA run quantizes bit-identically to the CPU emulation; a CUDA
    kernel cannot draw from a CPU generator) and copied to ``device``. With ``ws`` (a
    workspace on the generator's device) the words go into its reused ``"rbits"`` slot
    instead of a fresh buffer per chunk (the same draw, so the same bits).
    """
    where = generator.device if generator is not None else device
    words_n = (n + 7) // 8
    if ws is not None and ws.device == torch.device(where):
        words = ws.get("rbits", (words_n,), torch.int64)
    else:
        words = torch.empty(words_n, dtype=torch.int64, device=where)
    words.random_(-(2**63), None, generator=generator)
    return words.view(torch.uint8)[:n].to(device)


def sr_e2m1_codes_i32(
    y: torch.Tensor, rbits: torch.Tensor, ws: Optional[Workspace] = None, may_have_nan: bool = True
) -> torch.Tensor:
    """Stochastic-rounding E2M1 codes as int32 (see :func:`stochastic_round_e2m1`); ``ws``
    and ``may_have_nan`` as in :func:`e2m1_codes_i32` (with a workspace, ``y`` is consumed).

    Same math, in 14 elementwise passes (the software model's 19 op chain before): with
    a = |y|, the grid spacing at a over 256 is p * 2^-9 where p = pow2floor(clamp(a, 1, 4))
    (spacing 0.5 below 2, 1 on [2, 4), 2 from 4; the fp32 exponent mask makes p; inf -> 4,
    NaN -> inf, whose t is NaN either way), so rbits * p * 2^-9 is exact and
    t = a + rbits * p * 2^-9 (one ``addcmul``) is the fma's single rounding. Truncating t to
    the grid at t is a shift: code = (bits(t) >> 22) - 252 from 1 up, and for t < 1 the step
    is 0.5, where the shift would split [0.5, 1) in two: t' = max(t, min(1.5 t, 0.75)) moves
    [0.5, 0.75) to 0.75 (code 1), keeps t >= 0.75 and keeps t < 0.5 below 0.75 (code 0; 1.5 t
    rounds below 0.75 there), so code = clamp((bits(t') >> 22) - 252, 0, 7) everywhere (inf
    and NaN give 7). Equality with the 19-op kernel is tested on every rbits value, specials
    and random bit patterns.
    """
    if ws is None:
        ws, y = Workspace(y.device), y.clone()
    sign = _sign_mask(y, ws, may_have_nan)
    a = y.abs_()
    p = torch.clamp(a, 1.0, 4.0, out=ws.get("t1", y.shape, torch.float32))
    pb = p.view(torch.int32)
    pb.bitwise_and_(operand(_EXP_MASK, pb))
    # the bytes are widened into the output buffer first and the sum is taken in place: given
    # uint8, addcmul would cast them into a fresh chunk-sized temporary on every call
    # (page-faulted in on the CPU), which cost more than the addcmul itself; the widening is
    # exact, so the sum is the same
    t = ws.get("t2", y.shape, torch.float32)
    t = torch.addcmul(a, t.copy_(rbits.reshape(y.shape)), p, value=2.0**-9, out=t)
    low = torch.mul(t, operand(1.5, t), out=p).clamp_(max=0.75)
    torch.maximum(t, low, out=t)
    tb = t.view(torch.int32)
    code = torch.bitwise_right_shift(tb, operand(22, tb), out=a.view(torch.int32))
    code.sub_(operand(_BIAS_CODE2, code)).clamp_(0, 7)
    return torch.sub(code, sign, alpha=8, out=code)  # | 8 where y < 0


def stochastic_round_e2m1(
    y: torch.Tensor, generator: Optional[torch.Generator] = None, rbits: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp32 -> E2M1 codes with stochastic rounding (TE's software model of ``cvt.rs``).

    Uses 8 random bits per element (``rbits``, uint8, drawn from ``generator`` with
    :func:`draw_rbits` if not given): t = fma(u, step, |y|) with u = rbits/256 and step the
    grid spacing at |y|, then truncation to the grid spacing at t, saturated to 6. ``u * step``
    is exact in fp32, so the fma is one fp32 addition. NaN becomes +6. The GPU's Philox bits
    cannot be reproduced on CPU; only the distribution matches.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"stochastic_round_e2m1 expects fp32 input, got {y.dtype}")
    if rbits is None:
        rbits = draw_rbits(y.numel(), generator, y.device)
    return sr_e2m1_codes_i32(y, rbits).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte along the last dim: element 2i in the LOW nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack FP4, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def pack_fp4_i32(
    codes: torch.Tensor, out: Optional[torch.Tensor] = None, ws: Optional[Workspace] = None
) -> torch.Tensor:
    """:func:`pack_fp4` for contiguous int32 codes in [0, 15]: each int64 word holds a pair
    (c0 | c1 << 32, little-endian), so the byte is (w | w >> 28) & 0xFF, with no strided
    slicing (several times cheaper). ``out`` (uint8, the packed shape, any strides) receives
    the bytes; ``ws`` holds the int64 temporary (slot "pack")."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack FP4, got {codes.shape[-1]}")
    shape = (*codes.shape[:-1], codes.shape[-1] // 2)
    if codes.numel() == 0:
        z = torch.zeros(shape, dtype=torch.uint8, device=codes.device)
        return z if out is None else out.copy_(z)
    w = codes.contiguous().view(torch.int64)
    tmp = None if ws is None else ws.get("pack", w.shape, torch.int64)
    packed = torch.bitwise_right_shift(w, operand(28, w), out=tmp).bitwise_or_(w)
    return packed.to(torch.uint8) if out is None else out.copy_(packed)


def pack_fp4_rows(
    codes: torch.Tensor, out: Optional[torch.Tensor] = None, ws: Optional[Workspace] = None
) -> torch.Tensor:
    """Packed bytes of ``codes.t()`` transposed back: [M, K] codes (M even) -> [M/2, K] bytes
    pairing rows 2i and 2i+1 (row slices: contiguous inner dim, cheap). ``.t()`` of the
    result is ``pack_fp4(codes.t())``. ``out`` (uint8 [M/2, K], any strides, e.g. a transposed
    view of the final [K, M/2] buffer) receives the bytes; ``ws`` holds the temporary."""
    if codes.shape[0] % 2:
        raise ValueError(f"dim 0 must be even to pack FP4, got {codes.shape[0]}")
    hi = codes[1::2]
    tmp = None if ws is None else ws.get("pack", hi.shape, codes.dtype)
    packed = torch.bitwise_left_shift(hi, operand(4, hi), out=tmp).bitwise_or_(codes[0::2])
    return packed.to(torch.uint8) if out is None else out.copy_(packed)


def pack_fp4_col_words(codes: torch.Tensor, out: torch.Tensor, ws: Optional[Workspace] = None) -> torch.Tensor:
    """Columnwise packing as int32 words: [r, K] int32 codes (r divisible by 8) -> ``out``
    [r/8, K] int32, word q of column j holding rows 8q..8q+7 of column j, two per byte
    (row 8q+2s in the low nibble of byte s, little-endian). Hence ``out.t()`` made
    contiguous and viewed as uint8 is ``pack_fp4(codes.t())``.

    Why: the columnwise copy must end up transposed ([K, r/2] bytes); torch transposes a
    4-byte element several times faster than a byte, and packing four byte-rows into a word
    is three shift-or passes over row slices (contiguous inner dim), each half the last.
    The top byte's shift into the sign bit is a plain bit pattern (torch shifts the
    unsigned representation), so the words are bitwise what the bytes would be.
    """
    r, k = codes.shape
    if r % 8:
        raise ValueError(f"dim 0 must be divisible by 8 to pack FP4 words, got {r}")
    if r == 0:
        return out
    def scratch(slot: str, shape: tuple[int, int]) -> Optional[torch.Tensor]:
        return None if ws is None else ws.get(slot, shape, torch.int32)
    p = torch.bitwise_left_shift(codes[1::2], operand(4, codes), out=scratch("pack", (r // 2, k)))
    p.bitwise_or_(codes[0::2])
    q = torch.bitwise_left_shift(p[1::2], operand(8, p), out=scratch("pack2", (r // 4, k))).bitwise_or_(p[0::2])
    hi = torch.bitwise_left_shift(q[1::2], operand(16, q), out=scratch("pack3", (r // 8, k)))
    return torch.bitwise_or(hi, q[0::2], out=out)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: [..., n] bytes -> [..., 2n] codes."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
