"""Independent slow references shared by the cross-check tests: Python floats, struct bit
logic and a search over the FP8 value table (only the exact decode of FP8 codes uses torch)."""

from __future__ import annotations

import bisect
import math
import struct

import torch


def fl32(v: float) -> float:
    """Round a Python float (fp64) to the nearest fp32 (RNE), via struct."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def e8m0_rceil(v: float) -> int:
    if math.isnan(v):
        return 0xFF
    if math.isinf(v):
        return 0xFE
    if v == 0.0:
        return 0
    b = f32_bits(v)
    e, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    if m > 0 and e != 0xFE and not (e == 0 and m <= 0x400000):
        e += 1
    return e


def exp2f_rcp(code: int) -> float:
    if code == 255:
        return math.nan
    if code == 254:
        return bits_f32(0x00400000)
    return bits_f32((254 - code) << 23)


class FP8Table:
    """All finite FP8 values with their codes; RNE by search, ties to the even code."""

    def __init__(self, dtype: torch.dtype, fmax: float) -> None:
        codes = torch.arange(128, dtype=torch.uint8)
        vals = codes.view(dtype).float().tolist()
        pairs = sorted((v, c) for v, c in zip(vals, range(128), strict=True) if math.isfinite(v) and v <= fmax)
        self.vals = [v for v, _ in pairs]
        self.codes = [c for _, c in pairs]
        self.max = fmax

    def cast(self, y: float) -> int:
        if math.isnan(y):
            return -1  # NaN marker (checked separately)
        sign = 0x80 if y < 0 or (y == 0 and math.copysign(1, y) < 0) else 0
        a = min(abs(y), self.max)
        i = bisect.bisect_left(self.vals, a)
        if i < len(self.vals) and self.vals[i] == a:
            return self.codes[i] | sign
        lo, hi = i - 1, i
        dl, dh = a - self.vals[lo], self.vals[hi] - a
        pick = lo if dl < dh else hi if dh < dl else (lo if self.codes[lo] % 2 == 0 else hi)
        return self.codes[pick] | sign


E4M3_TABLE = FP8Table(torch.float8_e4m3fn, 448.0)
E5M2_TABLE = FP8Table(torch.float8_e5m2, 57344.0)
