"""The fused E2M1 kernels (RNE and stochastic rounding) give the same codes, bit for bit, as
the kernels they replaced, whose op chains are kept here as the references: every rbits
value on the grid points and ties, plus NaN, +-inf, +-0, subnormals and random fp32 bit
patterns with random rbits, with and without the NaN pass (``may_have_nan=False`` is only
promised on NaN-free inputs)."""

from __future__ import annotations

import pytest
import torch

from lptrain.precision.formats import E2M1_GRID, e2m1_codes_i32, sr_e2m1_codes_i32
from lptrain.precision.scratch import Workspace


def _old_sign(y: torch.Tensor) -> torch.Tensor:
    y.nan_to_num_(nan=6.0).add_(0.0)
    return torch.bitwise_right_shift(y.view(torch.int32), 28).bitwise_and_(8)


def _old_rne(y: torch.Tensor) -> torch.Tensor:
    """The previous 15-op RNE kernel (magic-constant rounding per grid segment)."""
    y = y.clone()
    sign = _old_sign(y)
    a = y.abs_().clamp_(max=6.0)
    code = torch.add(a, 2.0**22).view(torch.int32).sub_(0x4A800000)
    cand = torch.add(a, 2.0**23).view(torch.int32).sub_(0x4B000000 - 2)
    code = torch.minimum(code, cand)
    cand = torch.add(a, 2.0**24).view(torch.int32).sub_(0x4B800000 - 4)
    return torch.minimum(code, cand).bitwise_or_(sign)


def _old_sr(y: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """The previous 19-op stochastic-rounding kernel (TE's software model on fp32 bits)."""
    y = y.clone()
    sign = _old_sign(y)
    a = y.abs_().view(torch.int32)
    step = torch.bitwise_and(a, 0x7F800000).clamp_(0x3F800000, 0x40800000).sub_(9 << 23)
    t = rbits.reshape(y.shape).float().mul_(step.view(torch.float32)).add_(a.view(torch.float32))
    tb = t.view(torch.int32)
    code = torch.bitwise_right_shift(tb, 22).sub_(252)
    small = torch.bitwise_right_shift(tb, 23).sub_(125).clamp_(0, 1)
    return torch.maximum(code, small).clamp_(max=7).bitwise_or_(sign)


def _probe() -> torch.Tensor:
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.375, 0.5 - 2**-25, 0.75 - 2**-24]
    base = torch.tensor(list(E2M1_GRID) + ties + [7.0, 8.0, 1e-40, 1e-45, 2**-126, 3e38, float("inf")])
    up = torch.nextafter(base, torch.tensor(float("inf")))
    down = torch.nextafter(base, torch.tensor(0.0))
    pos = torch.cat([base, up, down])
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31, (30000,), generator=g, dtype=torch.int64).to(torch.int32)
    small = torch.rand(30000, generator=g) * 8
    return torch.cat([pos, -pos, torch.tensor([0.0, -0.0]), bits.view(torch.float32), small, -small])


@pytest.mark.parametrize("ws", [False, True])
def test_fused_rne_kernel_equals_the_previous_kernel(ws: bool) -> None:
    y = torch.cat([_probe(), torch.tensor([float("nan"), -float("nan")])])
    want = _old_rne(y)
    got = e2m1_codes_i32(y.clone(), Workspace() if ws else None)
    assert torch.equal(got, want)
    finite = y[~y.isnan()]
    assert torch.equal(e2m1_codes_i32(finite.clone(), Workspace(), may_have_nan=False), _old_rne(finite))


def test_fused_sr_kernel_equals_the_previous_kernel_for_every_rbits_value() -> None:
    y = _probe()
    g = torch.Generator().manual_seed(2)
    rb = torch.randint(0, 256, y.shape, generator=g, dtype=torch.uint8)
    nan = torch.tensor([float("nan"), -float("nan"), float("nan")])
    y_nan = torch.cat([y, nan])
    rb_nan = torch.cat([rb, torch.tensor([0, 255, 7], dtype=torch.uint8)])
    assert torch.equal(sr_e2m1_codes_i32(y_nan.clone(), rb_nan), _old_sr(y_nan, rb_nan))
    keep = ~y.isnan()  # the random bit patterns include NaNs
    y_ok, rb_ok = y[keep], rb[keep]
    assert torch.equal(sr_e2m1_codes_i32(y_ok.clone(), rb_ok, Workspace(), may_have_nan=False),
                       _old_sr(y_ok, rb_ok))
    # every rbits value on the grid neighbourhood (the rounding boundaries)
    head = torch.cat([y[:120], nan])
    yy = head.repeat_interleave(256)
    rr = torch.arange(256, dtype=torch.uint8).repeat(head.numel())
    assert torch.equal(sr_e2m1_codes_i32(yy.clone(), rr, Workspace()), _old_sr(yy, rr))
