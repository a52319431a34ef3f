"""Bit-exact tests of the element casts (numerics.md P1, P6) on hand-derived vectors."""

from __future__ import annotations

import math

import pytest
import torch

from lptrain.precision.formats import (
    E4M3,
    E5M2,
    cast_to_e2m1,
    cast_to_fp8,
    e2m1_to_float,
    fp8_to_float,
    pack_fp4,
    stochastic_round_e2m1,
    unpack_fp4,
)

NAN, INF = float("nan"), float("inf")


def f32(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def u8(*vals: int) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8)


def test_e5m2_overflow_saturates_instead_of_inf() -> None:
    # torch's own e5m2 cast gives inf for >= 61440 and for inf; satfinite gives +-57344 (0x7B).
    out = cast_to_fp8(f32(57344.0, 60000.0, 61440.0, 1e30, INF, -INF, -61440.0), E5M2)
    assert torch.equal(out, u8(0x7B, 0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0xFB))
    assert torch.isinf(torch.tensor([61440.0]).to(torch.float8_e5m2).float()).all()  # why we clamp


def test_e4m3_saturates_and_keeps_nan() -> None:
    out = cast_to_fp8(f32(448.0, 464.0, 1e9, INF, -INF, NAN), E4M3)
    assert torch.equal(out[:5], u8(0x7E, 0x7E, 0x7E, 0x7E, 0xFE))
    assert int(out[5]) & 0x7F == 0x7F  # E4M3 NaN is S.1111.111
    assert torch.isnan(fp8_to_float(out[5:], E4M3)).all()
    e5 = cast_to_fp8(f32(NAN), E5M2)
    assert torch.isnan(fp8_to_float(e5, E5M2)).all()


def test_fp8_rne_ties_and_subnormals() -> None:
    # E4M3 in [1, 2): spacing 1/8. 1 + 1/16 is a tie -> 1 (even), 1 + 3/16 -> 1.25 (even).
    out = fp8_to_float(cast_to_fp8(f32(1.0625, 1.1875, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10), E4M3), E4M3)
    # 2^-10 is the tie between 0 and the min subnormal 2^-9 -> 0; 1.5*2^-10 -> 2^-9.
    assert torch.equal(out, f32(1.0, 1.25, 2.0**-9, 0.0, 2.0**-9))


# (input, expected code) for every E2M1 tie point and its neighbours (numerics.md P6 table).
_TIES = [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
]


@pytest.mark.parametrize(("value", "code"), _TIES)
def test_e2m1_every_tie_rounds_to_even(value: float, code: int) -> None:
    t = f32(value)
    below = torch.nextafter(t, f32(0.0))  # fp32 neighbours of the tie
    above = torch.nextafter(t, f32(INF))
    lo_code = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0].index(value)
    got = cast_to_e2m1(torch.cat([t, below, above, -t]))
    # fp32 nextafter of the tie: strictly below rounds down, strictly above rounds up.
    assert got.tolist() == [code, lo_code, lo_code + 1, code | 8]


def test_e2m1_grid_specials_and_sign() -> None:
    grid = f32(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert cast_to_e2m1(grid).tolist() == list(range(8))
    assert cast_to_e2m1(-grid[1:]).tolist() == list(range(9, 16))
    # NaN -> +6 (no NaN in E2M1), +-inf and overflow saturate, small negatives keep the sign,
    # -0.0 gives code 0 like TE's reference cast.
    got = cast_to_e2m1(f32(NAN, -NAN, INF, -INF, 7.0, -100.0, -0.1, -0.0))
    assert got.tolist() == [7, 7, 7, 15, 7, 15, 8, 0]
    assert torch.equal(e2m1_to_float(torch.arange(16, dtype=torch.uint8))[:8], grid)


def test_fp4_nibble_order_low_first() -> None:
    codes = u8(0x1, 0x2, 0xF, 0x8, 0x0, 0x7)
    packed = pack_fp4(codes)
    assert packed.tolist() == [0x21, 0x8F, 0x70]  # element 2i in the LOW nibble
    assert torch.equal(unpack_fp4(packed), codes)


def test_fp4_pack_roundtrip_2d() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 10), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (6, 5)
    assert torch.equal(unpack_fp4(packed), codes)


def test_sr_exact_on_grid_and_nan() -> None:
    g = torch.Generator().manual_seed(1)
    grid = f32(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -1.5, -6.0)
    for _ in range(3):  # grid points never move, whatever the random bits
        got = e2m1_to_float(stochastic_round_e2m1(grid, g))
        assert torch.equal(got, grid)
    assert stochastic_round_e2m1(f32(NAN, INF, -INF, 9.0), g).tolist() == [7, 7, 15, 7]


def test_sr_explicit_bits_follow_the_software_model() -> None:
    # a = 0.3, step 0.5: t = 0.3 + u * 0.5 >= 0.5 iff u >= 0.4 iff rbits >= 102.4.
    x = f32(0.3, 0.3, 2.2, 2.2, 5.0, 5.0)
    rbits = u8(102, 103, 203, 204, 127, 128)
    # 2.2: step 1, t >= 3 iff u >= 0.8 iff rbits >= 204.8 -> 205; 203/204 stay at 2.
    # 5.0: step 2, t >= 6 iff u >= 0.5 iff rbits >= 128.
    got = e2m1_to_float(stochastic_round_e2m1(x, rbits=rbits))
    assert torch.equal(got, f32(0.0, 0.5, 2.0, 2.0, 4.0, 6.0))


@pytest.mark.parametrize("value", [0.3, 0.8, 1.3, 2.2, 3.3, 4.6, 5.9, -2.7])
def test_sr_unbiased_within_bound(value: float) -> None:
    n = 100_000
    g = torch.Generator().manual_seed(1234)
    x = torch.full((n,), value, dtype=torch.float32)
    mean = e2m1_to_float(stochastic_round_e2m1(x, g)).double().mean().item()
    a = abs(value)
    step = 2.0 if a >= 4 else 1.0 if a >= 2 else 0.5
    # Bound: 8-bit u quantisation biases by at most step/256; the sample mean of a variable
    # with range `step` has std <= step/2/sqrt(n); 6 sigma makes a false failure ~1e-9.
    bound = step / 256 + 6 * (step / 2) / math.sqrt(n)
    assert abs(mean - value) <= bound, (mean, value, bound)


def test_sr_deterministic_per_seed_and_seeds_differ() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    a = stochastic_round_e2m1(x, torch.Generator().manual_seed(7))
    b = stochastic_round_e2m1(x, torch.Generator().manual_seed(7))
    c = stochastic_round_e2m1(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_e2m1_dense_grid_matches_threshold_definition() -> None:
    # The vectorised cast (integer images of 8|y|) against the plain threshold table of
    # numerics.md P6 on a dense grid plus every tie and its fp32 neighbours.
    v = torch.linspace(-8, 8, 200_001)
    ties = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0)
    near = torch.cat([ties, torch.nextafter(ties, f32(0.0)), torch.nextafter(ties, f32(9.0))])
    v = torch.cat([v, near, -near, f32(NAN, INF, -INF, 1e-45, -1e-45, 3e38)])
    a = v.abs()
    ref = sum(
        (a >= t if inclusive else a > t).int()
        for t, inclusive in [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    )
    ref = torch.where(torch.isnan(v), 7, ref) + 8 * (v < 0).int()
    assert torch.equal(cast_to_e2m1(v).int(), ref)
