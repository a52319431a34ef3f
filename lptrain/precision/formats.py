"""Low-precision element formats and their bit-faithful CPU casts (numerics.md section 0, P1, P6).

Why hand-written casts: torch's CPU casts differ from the GPU kernels in ways that matter for
bit-exact emulation (E5M2 never saturates, E4M3 saturation depends on the torch version, E8M0
rounds ties up, E2M1 has no cast at all). Everything here takes and produces fp32 values and
stores low-precision data as raw ``uint8`` bits, so buffers can be placed in flat byte buffers.
All arithmetic is fp32; nothing goes through fp64.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

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


def fp8_to_float(bits: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """FP8 bits (uint8) -> fp32 values (exact)."""
    return bits.view(fmt.torch_dtype).float()


# ---------------------------------------------------------------------------------------------
# E2M1 / FP4 (P6)

_E2M1_LUT = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32)


def cast_to_e2m1(y: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8 in [0, 15], one per element), RNE with satfinite.

    Thresholds on |y| (numerics.md P6): ties go to the even mantissa, so 0.25->0, 0.75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. E2M1 has no NaN: NaN becomes +6 (TE's satfinite).
    Negative values that round to zero keep the sign (code 8); -0.0 gives code 0, as TE's
    reference ``cast_to_fp4x2`` does. ``inplace`` overwrites ``y`` (for temporaries).

    Arithmetic form (no comparisons; in-place fp32 ops are far cheaper than comparisons on
    CPU): the magnitude grid is uniform in three segments, step 0.5 on [0, 2], 1 on [2, 4],
    2 on [4, 6], and the code is linear in each: 2a, a + 2, a/2 + 4. With R = round half to
    even (which is RNE on the grid, even code = even mantissa) the code is
    min(R(2a), R(a) + 2, R(a/2) + 4, 7): R is monotone and R(x + 2k) = R(x) + 2k, so the
    smallest candidate is always the one of a's own segment. Every step is exact in fp32.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"cast_to_e2m1 expects fp32 input, got {y.dtype}")
    neg = (y < 0).view(torch.uint8)
    a = (y.abs_() if inplace else y.abs()).clamp_(max=8.0).nan_to_num_(nan=8.0)
    code = torch.mul(a, 0.5).round_().add_(4.0)
    torch.minimum(code, torch.round(a).add_(2.0), out=code)
    torch.minimum(code, a.mul_(2.0).round_(), out=code)
    idx = code.clamp_(max=7.0).to(torch.uint8)
    neg.bitwise_left_shift_(3)
    return idx.bitwise_or_(neg)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) -> fp32 values."""
    return _E2M1_LUT.to(codes.device)[codes.long()]


def _sr_step(v: torch.Tensor) -> torch.Tensor:
    """E2M1 grid spacing at |v| >= 0: 0.5 below 2, 1 in [2, 4), 2 from 4 (NaN/inf -> 2).

    Read off the fp32 exponent: 2^floor(log2 v) / 2 clamped to [0.5, 2] (exact bit ops, one
    temporary; cheaper than nested ``where``).
    """
    p2 = (v.view(torch.int32) & 0x7F800000).view(torch.float32)
    return p2.mul_(0.5).clamp_(0.5, 2.0)


def stochastic_round_e2m1(
    y: torch.Tensor, generator: Optional[torch.Generator] = None, rbits: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp32 -> E2M1 codes with stochastic rounding (TE's software model of ``cvt.rs``).

    Uses 8 random bits per element (``rbits``, uint8, drawn from ``generator`` if not given):
    t = fma(u, step, |y|) with u = rbits/256 and step the grid spacing at |y|, then truncation
    to the grid spacing at t, saturated to 6. ``u * step`` is exact in fp32, so the fma is one
    fp32 addition. NaN becomes +6. The GPU's Philox bits cannot be reproduced on CPU; only the
    distribution matches.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"stochastic_round_e2m1 expects fp32 input, got {y.dtype}")
    if rbits is None:
        rbits = torch.randint(0, 256, y.shape, generator=generator, dtype=torch.uint8, device=y.device)
    u = rbits.to(torch.float32).mul_(1.0 / 256.0)
    a = y.abs()
    t = u.mul_(_sr_step(a)).add_(a)  # fma(u, step, a): u * step is exact, so one rounding
    st = _sr_step(t)
    q = t.div_(st).floor_().mul_(st)  # division by a power of two: exact
    q = q.masked_fill_(torch.isnan(q) | (q > E2M1_MAX), E2M1_MAX)
    codes = cast_to_e2m1(q, inplace=True)  # q is on the grid: exact lookup, never a tie
    codes &= 0x7
    codes |= (y < 0).view(torch.uint8) << 3
    return codes


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte along the last dim: element 2i in the LOW nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack FP4, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: [..., n] bytes -> [..., 2n] codes."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
