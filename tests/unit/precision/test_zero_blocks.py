"""Seed 003 bug class: all-zero (and tiny) gradient blocks must give finite scales and no NaN.

Megatron-LM PR #7523: with blockwise FP8 an all-zero wgrad block had amax = 0, a naive scale
fp8_max / 0 = inf, and 0 * inf = NaN poisoned the weight gradient. TE maps amax == 0 to scale 1
(numerics.md P3, section 7.1-7.2); ``amax_epsilon`` floors amax as an extra guard.
"""

from __future__ import annotations

import pytest
import torch

import lptrain.precision.scaling as scaling
from lptrain.precision import QuantizedTensor, quantize
from lptrain.precision.formats import unpack_fp4

CASES = [
    ("tensorwise", {"fp8_format": "hybrid"}),
    ("blockwise", {}),
    ("blockwise", {"fp8_format": "hybrid"}),
    ("blockwise", {"power_2_scale": False}),
    ("mxfp8", {}),
    ("mxfp8", {"fp8_format": "hybrid"}),
    ("nvfp4", {"stochastic_rounding": True, "rht": True, "seed": 0}),
    ("nvfp4", {}),
]


def grad_with_zero_block(all_zero: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g)
    x[:128, :128] = 0.0  # a zero block for every block shape (1x16 ... 128x128, 32x1 ...)
    x[200, :128] = 1e-40  # a tiny (fp32 subnormal) row block
    return torch.zeros_like(x) if all_zero else x


def assert_finite_everywhere(qt: QuantizedTensor) -> None:
    for name, t in qt.storage_views().items():
        if t.dtype == torch.float32:
            assert torch.isfinite(t).all(), name
    name = type(qt).__name__
    v = qt.storage_views()
    for o in ("rowwise", "columnwise"):
        data = v[f"{o}_data"]
        if name == "NVFP4Tensor":
            assert (v[f"{o}_scale_inv"] & 0x7F != 0x7F).all()  # E4M3 scale bytes not NaN
            assert unpack_fp4(data).max() <= 15  # E2M1 cannot encode NaN at all
        else:
            fmt = qt.fp8_format  # type: ignore[attr-defined]
            assert not torch.isnan(data.view(fmt.torch_dtype).float()).any(), o
            if name == "MXFP8Tensor":
                assert (v[f"{o}_scale_inv"] != 0xFF).all()
        dq = qt.dequantize(o)
        assert torch.isfinite(dq).all(), o


@pytest.mark.parametrize(("recipe", "kw"), CASES)
@pytest.mark.parametrize("all_zero", [False, True])
def test_zero_gradient_block_is_finite(recipe: str, kw: dict, all_zero: bool) -> None:
    x = grad_with_zero_block(all_zero)
    qt = quantize(x, recipe, role="grad", **kw)
    assert_finite_everywhere(qt)
    assert (qt.dequantize()[:128, :128] == 0).all()
    assert (qt.dequantize("columnwise")[:128, :128] == 0).all()
    # the stored bytes of a zero block are +0 (not saturated codes that only dequantize to 0)
    v = qt.storage_views()
    if recipe == "nvfp4":
        assert (unpack_fp4(v["rowwise_data"])[:128, :128] == 0).all()
        assert (v["rowwise_scale_inv"][:128, :8] == 0).all()  # E4M3 +0, not -0 (0x80)
        assert (unpack_fp4(v["columnwise_data"])[:128, :128] == 0).all() or kw.get("rht")
    else:
        assert (v["rowwise_data"][:128, :128] == 0).all()


def test_zero_block_scale_is_one_blockwise() -> None:
    qt = quantize(grad_with_zero_block(), "blockwise", role="grad", fp8_format="hybrid")
    s = qt.storage_views()["rowwise_scale_inv"]
    assert (s[:128, 0] == 1.0).all()  # amax == 0 -> scale 1 (TE), not inf
    assert s[200, 0].item() == 2.0**-127  # tiny amax: subnormal scale_inv, still finite


def test_amax_epsilon_floors_only_small_blocks() -> None:
    x = grad_with_zero_block()
    base = quantize(x, "blockwise", role="grad", fp8_format="hybrid").storage_views()
    eps = quantize(x, "blockwise", role="grad", fp8_format="hybrid", amax_epsilon=1e-12).storage_views()
    s0, s1 = base["rowwise_scale_inv"], eps["rowwise_scale_inv"]
    # zero block: amax floored to 1e-12 -> scale = pow2floor(57344 / 1e-12), finite
    expect = scaling.compute_scale_from_amax(torch.tensor([1e-12]), 57344.0, True)
    assert torch.equal(s1[:128, 0], torch.reciprocal(expect).expand(128))
    assert torch.equal(s1[200, 0:1], torch.reciprocal(expect))  # 1e-40 < eps: floored too
    # every block with amax >= eps is unaffected, bit for bit
    big = torch.ones_like(s0, dtype=torch.bool)
    big[:128, 0] = False
    big[200, 0] = False
    assert torch.equal(s0[big], s1[big])
    d0, d1 = base["rowwise_data"], eps["rowwise_data"]
    assert torch.equal(d0[:200], d1[:200]) and torch.equal(d0[201:], d1[201:])
    # the tiny block now uses the epsilon scale: 1e-40 * 2^55 underflows to 0 in E5M2
    assert (d1[200, :128] == 0).all() and (d0[200, :128] != 0).all()
    assert torch.equal(base["columnwise_data"][128:], eps["columnwise_data"][128:])


def test_guard_regression_naive_scale_produces_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove the zero-amax guard (naive fp8_max / amax) and show the NaN appears: the tests
    above would catch the bug of all-zero gradient blocks turning into NaN scales (0/0)."""

    def naive(amax: torch.Tensor, fp8_max: float, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.full_like(amax, fp8_max) / amax

    monkeypatch.setattr(scaling, "compute_scale_from_amax", naive)
    for recipe in ("blockwise", "tensorwise"):
        x = grad_with_zero_block(all_zero=(recipe == "tensorwise"))
        qt = quantize(x, recipe, role="grad", fp8_format="hybrid")
        with pytest.raises(AssertionError):
            assert_finite_everywhere(qt)
        assert torch.isnan(qt.dequantize()).any()


def test_guard_regression_naive_nvfp4_global_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        scaling, "nvfp4_global_encode_scale", lambda a: torch.full_like(a, 2688.0) / a
    )
    # the CPU scaler's Python-float path, equally naive (IEEE: 2688 / 0 = inf)
    monkeypatch.setattr(
        scaling, "nvfp4_global_encode_scale_value", lambda a: 2688.0 / a if a else float("inf")
    )
    qt = quantize(torch.zeros(32, 32), "nvfp4", role="grad")
    with pytest.raises(AssertionError):
        assert_finite_everywhere(qt)
