"""The quantization statistics on inputs whose answers are known by hand, for every recipe.

Each case builds a tensor with a chosen amax per scaling block, so the scales are known
exactly (MXFP8: 2^ceil(log2(amax/448)); blockwise: the power of two at or below 448/amax;
per-tensor: 448/amax, or the delayed-scaling state's scale; NVFP4: the E4M3 rounding of
amax_block / 6 times the global factor), a known number of elements below half the smallest
subnormal step (underflow), elements beyond the clamp limit (saturation), and all-zero blocks
-- the all-zero gradient block of Megatron-LM's blockwise E5M2 report must show as a zero
block with finite statistics, never NaN. Counts and exponents are compared exactly; the SNR is
the fp64 formula on the same values (abs 1e-9 dB: the sums are fp64 over exact fp32 squares).
"""

from __future__ import annotations

import math

import pytest
import torch

from lptrain.precision import operand_stats as S
from lptrain.precision.delayed_scaling import DelayedScalingState
from lptrain.precision.formats import E4M3, E5M2, rounding_limit
from lptrain.precision.tensors import (
    BlockwiseQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

TINY = 2.0**-20  # below half the smallest subnormal step of every format at the scales used


def stats(x: torch.Tensor, q: object) -> dict[str, float | None]:
    return S.finish(S.quantized_stats(x, q.quantize(x)).tolist())  # type: ignore[attr-defined]


def snr(x: torch.Tensor, deq: torch.Tensor) -> float:
    x64, d64 = x.double(), deq.double()
    return 10 * math.log10(float((x64 * x64).sum() / ((d64 - x64) ** 2).sum()))


def test_clamp_limits_are_max_plus_half_the_last_step() -> None:
    assert rounding_limit(E4M3.max, 0.125) == 464.0  # 448 + 32/2
    assert rounding_limit(E5M2.max, 0.25) == 61440.0  # 57344 + 8192/2
    assert rounding_limit(6.0, 0.5) == 7.0  # E2M1: 6 + 2/2


def test_mxfp8_blocks_underflow_and_a_zero_block() -> None:
    x = torch.ones(32, 64)
    x[0, 0] = 256.0  # block (0, 0): amax 256 -> scale 2^ceil(log2(256/448)) = 2^0
    x[0, 1:5] = TINY  # 2^-20 / 1 is below 2^-10 (half of E4M3's smallest subnormal): 0
    x[0, 32:] = 0.0  # block (0, 1): all zero
    q = MXFP8Quantizer("input", True, False, fp8_format=E4M3)
    got = stats(x, q)
    # the other 62 blocks: amax 1 -> 2^ceil(log2(1/448)) = 2^-8, and 1.0 is exact
    assert got["scale_exp_min"] == -8 and got["scale_exp_median"] == -8 and got["scale_exp_max"] == 0
    assert got["zero_blocks"] == 1 / 64
    assert got["underflow"] == 4 / (32 * 64 - 32)  # of the nonzero values
    assert got["saturation"] == 0.0 and got["amax"] == 256.0 and got["nonfinite"] == 0
    assert got["scale"] is None  # block-scaled: no per-tensor scale
    assert abs(got["snr_db"] - snr(x, q.quantize(x).dequantize())) < 1e-9


def test_tensorwise_current_scaling_never_saturates_and_reports_its_scale() -> None:
    x = torch.full((16, 16), 3.0)
    x[0, 0] = 448.0  # amax 448 -> scale 448/448 = 1
    x[1, :3] = 2.0**-12  # below 2^-10: 0
    got = stats(x, Float8Quantizer("input", True, False, fp8_format=E4M3))
    assert got["scale"] == 1.0 and got["scale_exp_min"] == got["scale_exp_max"] == 0
    assert got["underflow"] == 3 / 256 and got["saturation"] == 0.0 and got["zero_blocks"] == 0.0


def test_delayed_scaling_with_a_stale_scale_saturates() -> None:
    state = DelayedScalingState(1, E4M3)  # scale 1 until the first update
    x = torch.full((16, 16), 2.0)
    x[0, :4] = 1000.0  # 1000 * 1 > 464: clamped to 448
    x[1, 0] = 450.0  # above 448 but rounds to it: an ordinary rounding error, not counted
    q = Float8Quantizer("input", True, False, fp8_format=E4M3, state=state)
    qt = q.quantize(x)
    got = S.finish(S.quantized_stats(x, qt).tolist())
    assert got["saturation"] == 4 / 256 and got["amax"] == 1000.0 and got["scale"] == 1.0
    assert abs(got["snr_db"] - snr(x, qt.dequantize())) < 1e-9


def test_blockwise_pow2_scales_and_the_zero_gradient_block() -> None:
    """Megatron-LM's blockwise E5M2 wgrad report: an all-zero gradient block (amax 0) must be
    a zero block with finite statistics (TE: scale 1, zero data), not an inf scale and NaN."""
    x = torch.full((4, 256), 3.0)  # E5M2: 57344/3 = 19114.7 -> pow2 2^14 -> scale_inv 2^-14
    x[0, 0] = 448.0  # block (0, 0): 57344/448 = 128 = 2^7 -> exponent -7
    x[1, 5] = TINY  # 2^-20 * 2^14 = 2^-6: representable in E5M2 (subnormals down to 2^-16)
    x[2, 128:] = 0.0  # the all-zero gradient block
    got = stats(x, BlockwiseQuantizer("grad", True, False, fp8_format=E5M2, block_dim=1))
    assert got["zero_blocks"] == 1 / 8 and got["nonfinite"] == 0
    assert all(v is None or math.isfinite(v) for v in got.values()), got
    assert got["scale_exp_min"] == -14 and got["scale_exp_median"] == -14 and got["scale_exp_max"] == -7
    assert got["underflow"] == 0.0 and got["saturation"] == 0.0


def test_blockwise_e4m3_underflow() -> None:
    x = torch.full((4, 256), 3.0)
    x[1, 5] = TINY  # 2^-20 * 128 = 2^-13, below E4M3's half-subnormal 2^-10: 0
    got = stats(x, BlockwiseQuantizer("input", True, False, fp8_format=E4M3, block_dim=1))
    assert got["underflow"] == 1 / 1024 and got["zero_blocks"] == 0.0


def test_nvfp4_block_scales_underflow_and_clamp_limit() -> None:
    x = torch.full((16, 32), 1.5)
    x[0, :16] = 0.0
    x[0, 0] = 2688.0  # global amax 2688: S_enc = 2688 / 2688 = 1
    x[0, 1:4] = 1.0  # block scale e4m3(2688/6 = 448): 1/448 rounds to 0 in E2M1
    x[0, 16:] = 3.0
    x[0, 16] = 6.36  # block scale e4m3(6.36/6 = 1.06) = 1.0: 6.36 < 7 rounds to 6 (not clamped)
    x[1, :16] = 0.0  # a zero block
    q = NVFP4Quantizer("input", True, False)
    got = stats(x, q)
    inv = torch.tensor(1 / 2688, dtype=torch.float32)  # TE: sdec * amax * fl(1/2688), fp32

    def exp_of(sdec: float) -> int:
        return math.frexp(float(torch.tensor(sdec) * torch.tensor(2688.0) * inv))[1] - 1

    assert got["scale_exp_max"] == exp_of(448.0) and got["scale_exp_min"] == exp_of(0.25)
    assert got["scale_exp_median"] == exp_of(0.25)  # 29 of the 31 nonzero blocks hold 1.5s
    assert got["zero_blocks"] == 1 / 32
    nonzero = 16 * 32 - 16 - 12  # the zero block and the 12 zeros of block (0, 0)
    assert got["underflow"] == 3 / nonzero
    assert got["saturation"] == 0.0 and got["amax"] == 2688.0


def test_nvfp4_global_scale_clamps_values_past_the_limit() -> None:
    # block scale bytes are computed from the block amax; a value past 7 * scale can only come
    # from a stored scale that does not fit the values: quantize one tensor, reuse its scale
    # grid for the statistics of a larger one (what a stale or wrong scale does)
    x = torch.full((16, 16), 1.5)
    qt = NVFP4Quantizer("input", True, False).quantize(x)
    big = x.clone()
    big[0, :2] = 12.0  # 12 / 0.25 = 48 > 7
    blocks = qt.stat_blocks(big)
    got = S.finish(S.blocks_stats(blocks, big.numel()).tolist())
    assert got["saturation"] == 2 / 256


@pytest.mark.parametrize("make", [
    lambda: Float8Quantizer("grad", True, False, fp8_format=E5M2),
    lambda: Float8Quantizer("grad", True, False, fp8_format=E5M2, state=DelayedScalingState(1, E5M2)),
    lambda: BlockwiseQuantizer("grad", True, False, fp8_format=E5M2, block_dim=1),
    lambda: BlockwiseQuantizer("weight", True, False, fp8_format=E4M3, block_dim=2),
    lambda: MXFP8Quantizer("grad", True, False, fp8_format=E4M3),
    lambda: NVFP4Quantizer("grad", True, False, stochastic_rounding=True),
], ids=["tensorwise", "delayed", "blockwise-1d", "blockwise-2d", "mxfp8", "nvfp4-sr"])
def test_all_zero_operand_is_zero_blocks_never_nan(make: object) -> None:
    """The seed-003 class taken to its end: an operand that is all zero (an expert's gradient
    with no tokens, padding) has only zero blocks, no scale exponents, no error, no NaN."""
    x = torch.zeros(128, 128)
    got = stats(x, make())  # type: ignore[operator]
    assert got["zero_blocks"] == 1.0 and got["amax"] == 0.0 and got["nonfinite"] == 0
    assert got["underflow"] == 0.0 and got["saturation"] == 0.0 and got["snr_db"] is None
    assert got["scale_exp_min"] is None


def test_nonfinite_values_are_counted_and_kept_out_of_the_other_figures() -> None:
    x = torch.ones(32, 32)
    x[3, 3], x[4, 4] = float("nan"), float("inf")
    got = stats(x, MXFP8Quantizer("input", True, False, fp8_format=E4M3))
    assert got["nonfinite"] == 2 and got["amax"] == 1.0 and math.isfinite(got["snr_db"] or 0.0)


def test_column_wise_only_operands_use_their_own_blocks() -> None:
    """A grad quantized column-wise only (no dgrad) is cut into 32x1 MXFP8 blocks."""
    x = torch.ones(64, 32)
    x[:32, 0] = 0.0  # one 32x1 column block all zero; row-wise it would be no zero block
    qt = MXFP8Quantizer("grad", False, True, fp8_format=E4M3).quantize(x)
    got = S.finish(S.quantized_stats(x, qt).tolist())
    assert got["zero_blocks"] == 1 / 64


def test_recorder_merges_micro_batches_and_reads_once() -> None:
    """Two micro-batches of one operand: counts add, amax is the max, the median exponent
    comes from the merged histogram; one device-to-host read for everything."""
    q = MXFP8Quantizer("input", True, False, fp8_format=E4M3)
    a, b = torch.ones(32, 32), torch.full((32, 32), 256.0)
    rec = S.OperandRecorder()
    with S.recording(rec):
        S.record("m", "input", None, a, q.quantize(a))
        S.record("m", "input", None, b, q.quantize(b))
        S.record("m", "weight", None, a)  # unquantized: amax only
    got = {k: S.finish(v) for k, v in rec.read().items()}
    assert list(got) == ["m.input", "m.weight"]
    assert got["m.input"]["amax"] == 256.0 and got["m.input"]["scale_exp_min"] == -8
    assert got["m.input"]["scale_exp_max"] == 0 and got["m.input"]["scale_exp_median"] == -8  # lower median
    assert got["m.weight"]["amax"] == 1.0 and got["m.weight"]["snr_db"] is None
    assert S.active() is None


def test_nothing_is_recorded_without_an_active_recorder() -> None:
    S.record("m", "input", None, torch.ones(4))
    rec = S.OperandRecorder()
    assert rec.read() == {}
