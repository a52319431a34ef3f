"""Bit-exact tests of the scale primitives (numerics.md P2-P5, NVFP4 global scale)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from lptrain.precision.formats import FLT_MAX
from lptrain.precision.scaling import (
    amax,
    block_amax,
    compute_scale_from_amax,
    e8m0_from_amax,
    e8m0_to_dequant_scale,
    e8m0_to_quant_multiplier,
    float_to_e8m0,
    nvfp4_global_encode_scale,
)

NAN, INF = float("nan"), float("inf")


def f32(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def bits(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.view(torch.int32).tolist()]


def from_bits(*b: int) -> torch.Tensor:
    return torch.tensor([struct.unpack("<f", struct.pack("<I", v))[0] for v in b], dtype=torch.float32)


def test_amax_ignores_nan_keeps_inf() -> None:
    assert amax(f32(1.0, NAN, -3.0)).item() == 3.0
    assert amax(f32(NAN, NAN)).item() == 0.0  # all-NaN -> 0
    assert amax(f32(1.0, -INF, NAN)).item() == INF
    x = torch.tensor([[1.0, NAN, -2.0, 0.5], [NAN, NAN, NAN, NAN]])
    assert torch.equal(block_amax(x, -1), f32(2.0, 0.0))
    assert amax(torch.tensor([[-5.0]], dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("k", [-8, -3, 0, 1, 5, 20])
def test_scale_exact_at_448_times_power_of_two(k: int) -> None:
    a = f32(448.0 * 2.0**k)
    for pow2 in (False, True):
        s = compute_scale_from_amax(a, 448.0, pow2)
        assert torch.equal(s, f32(2.0 ** (-k)))
        assert torch.equal(torch.reciprocal(s), f32(2.0**k))


def test_scale_just_above_448() -> None:
    a = torch.nextafter(f32(448.0), f32(INF))  # 448 + 2^-15
    s = compute_scale_from_amax(a, 448.0, False)
    # 448 / (448 (1 + 0.57 * 2^-23)) = 1 - 1.14 * 2^-24 -> RNE to the fp32 just below 1.
    assert bits(s) == [0x3F7FFFFF]
    # numpy's fp32 division is IEEE: an independent check of the correctly rounded quotient.
    assert s.item() == float(np.float32(448.0) / np.float32(a.item()))
    # pow2 masks the mantissa: the value just below 1 floors to 0.5, not 1.
    assert bits(compute_scale_from_amax(a, 448.0, True)) == [0x3F000000]


def test_pow2_mask_just_below_a_power_of_two() -> None:
    # amax chosen so 448/amax lands just below 2^k: the mask floors to 2^(k-1). log2/floor
    # based code (torchao's) rounds these up to 2^k.
    for k in (1, 4, 10):
        target = torch.nextafter(f32(2.0**k), f32(0.0))
        a = f32(448.0) / target
        s_exact = compute_scale_from_amax(a, 448.0, False)
        assert s_exact.item() < 2.0**k
        assert compute_scale_from_amax(a, 448.0, True).item() == 2.0 ** (k - 1)


def test_scale_zero_inf_nan_amax_give_one() -> None:
    s = compute_scale_from_amax(f32(0.0, INF, NAN), 57344.0, True)
    assert torch.equal(s, f32(1.0, 1.0, 1.0))


def test_tiny_amax_gives_subnormal_scale_inv_with_pow2() -> None:
    tiny = from_bits(0x00000001)  # 2^-149
    s = compute_scale_from_amax(tiny, 448.0, True)  # 448/2^-149 = inf -> FLT_MAX -> 2^127
    assert bits(s) == [0x7F000000]
    assert bits(torch.reciprocal(s)) == [0x00400000]  # 2^-127, an fp32 subnormal
    s_np = compute_scale_from_amax(tiny, 448.0, False)
    assert s_np.item() == FLT_MAX
    # value_for_inf is the input dtype max for blockwise (bf16 max here)
    bf16_max = torch.finfo(torch.bfloat16).max
    assert compute_scale_from_amax(tiny, 448.0, False, value_for_inf=bf16_max).item() == bf16_max


def test_amax_epsilon_floors_amax() -> None:
    s = compute_scale_from_amax(f32(0.0, 1e-20, 2.0), 448.0, False, eps=1e-12)
    ref = f32(448.0) / f32(1e-12)
    assert torch.equal(s, torch.cat([ref, ref, f32(224.0)]))


def test_e8m0_encode_rceil_bits() -> None:
    v = torch.cat(
        [
            f32(0.0, 1.0, 1.5, 2.0, 0.75, INF, NAN),
            from_bits(0x00400000, 0x00400001, 0x00000001, 0x7F000001, 0x7F7FFFFF),
        ]
    )
    # 0->0, 1->127, 1.5 rounds up to 2 -> 128, 2 -> 128, 0.75 -> 2^0 -> 127, inf -> 0xFE,
    # NaN -> 0xFF, 2^-127 -> 0, just above 2^-127 -> 1, 2^-149 -> 0, 2^127(1+eps) saturates
    # at 0xFE, FLT_MAX -> 0xFE.
    assert float_to_e8m0(v).tolist() == [0, 127, 128, 128, 127, 254, 255, 0, 1, 0, 254, 254]


@pytest.mark.parametrize("k", [-120, -5, 0, 3, 100])
def test_e8m0_from_amax_exact_powers(k: int) -> None:
    a = f32(448.0 * 2.0**k)
    assert e8m0_from_amax(a, 448.0).tolist() == [127 + k]
    above = torch.nextafter(a, f32(INF))
    assert e8m0_from_amax(above, 448.0).tolist() == [128 + k]
    assert e8m0_from_amax(f32(57344.0 * 2.0**k), 57344.0).tolist() == [127 + k]


def test_e8m0_decode() -> None:
    codes = torch.tensor([0, 1, 127, 128, 253, 254, 255], dtype=torch.uint8)
    mult = e8m0_to_quant_multiplier(codes)
    assert bits(mult[:6]) == [0x7F000000, 0x7E800000, 0x3F800000, 0x3F000000, 0x00800000, 0x00400000]
    assert torch.isnan(mult[6])
    deq = e8m0_to_dequant_scale(codes)
    assert bits(deq[:6]) == [0x00400000, 0x00800000, 0x3F800000, 0x40000000, 0x7E800000, 0x7F000000]
    assert torch.isnan(deq[6])
    # torch's e8m0 view decodes the same (numerics.md section 5)
    assert torch.equal(deq[:6], codes[:6].view(torch.float8_e8m0fnu).float())


def test_nvfp4_global_scale() -> None:
    s = nvfp4_global_encode_scale(f32(2688.0, 0.0, INF, 1e-45, 1.0))
    assert s[:3].tolist() == [1.0, 1.0, 1.0]  # exact, zero amax, inf amax (2688/inf = 0)
    assert s[3].item() == FLT_MAX  # overflow capped
    assert torch.equal(s[4:], f32(2688.0))


def test_nvfp4_cpu_scaler_python_floats_equal_tensor_path() -> None:
    """The CPU scaler's per-tensor factors in Python floats give the tensor path's bits."""
    from lptrain.precision.scaling import NVFP4BlockScaler, nvfp4_block_scaler

    g = torch.Generator().manual_seed(3)
    blocks = torch.cat((f32(0.0, 1e-45, 1e-40, 2.0**-126, 1.0, 6.0, 448.0, 3e38, FLT_MAX, INF),
                        torch.rand(200, generator=g) * torch.exp2(torch.randint(-140, 127, (200,), generator=g).float())))
    amaxes = [0.0, 1e-45, 1e-40, 2.0**-126, 1.0, 2688.0, 1e30, 3e38, FLT_MAX, INF,
              *(torch.rand(20, generator=g) * torch.exp2(torch.randint(-149, 127, (20,), generator=g).float())).tolist()]
    for a in amaxes:
        t = f32(a)
        want = NVFP4BlockScaler(nvfp4_global_encode_scale(t))(blocks)
        got = nvfp4_block_scaler(t)(blocks)
        assert torch.equal(got[0], want[0]), a
        assert bits(got[1]) == bits(want[1]), a
