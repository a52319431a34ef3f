"""Grouped quantized linear: == N separate linears, single grouped == discrete weights, bitwise."""

from __future__ import annotations

import pytest
import torch
from _linear_helpers import IN, OUT, RECIPES

from lptrain.precision.autocast import autocast
from lptrain.precision.layers import GroupedLinear, Linear

N = 3
# Member 1 gets no tokens (an MoE expert nobody routed to). 64 is a multiple of every
# recipe's token alignment that matters here (MXFP8 32x1 blocks, NVFP4 16-token RHT groups).
SPLITS = [64, 0, 64]
CASES = [*sorted(RECIPES), None]  # None: high precision (no autocast)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SPLITS), IN, generator=g)
    ws = [torch.randn(OUT, IN, generator=g) / IN**0.5 for _ in range(N)]
    dy = torch.randn(sum(SPLITS), OUT, generator=g)
    return x, ws, dy


def _ctx(name):
    return autocast(RECIPES[name]()) if name is not None else autocast(None, enabled=False)


def _grouped(name, single: bool, x, ws, dy, fuse: bool = False):
    g = GroupedLinear(N, IN, OUT, single_grouped_weight=single, params_dtype=torch.float32,
                      fuse_wgrad_accumulation=fuse)
    with torch.no_grad():
        for i in range(N):
            g.member_weight(i).copy_(ws[i])
    xx = x.clone().requires_grad_(True)
    with _ctx(name):
        y = g(xx, SPLITS)
    y.backward(dy)
    if single:
        dws = [g.weight.grad[i] for i in range(N)]
    else:
        dws = [getattr(g, f"weight{i}").grad for i in range(N)]
    return y.detach(), xx.grad, dws, g


def _separate(name, x, ws, dy):
    ys, dxs, dws = [], [], []
    for i, (xi, dyi) in enumerate(zip(torch.split(x, SPLITS), torch.split(dy, SPLITS), strict=False)):
        lin = Linear(IN, OUT, params_dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(ws[i])
        xx = xi.clone().requires_grad_(True)
        with _ctx(name):
            y = lin(xx)
        y.backward(dyi)
        ys.append(y.detach())
        dxs.append(xx.grad)
        dws.append(lin.weight.grad)
    return torch.cat(ys), torch.cat(dxs), dws


@pytest.mark.parametrize("name", CASES)
def test_grouped_equals_separate_linears_bitwise(name) -> None:
    x, ws, dy = _data()
    y_s, dx_s, dw_s = _separate(name, x, ws, dy)
    for single in (False, True):
        y, dx, dws, _ = _grouped(name, single, x, ws, dy)
        assert torch.equal(y, y_s) and torch.equal(dx, dx_s), (name, single)
        for i in range(N):
            assert torch.equal(dws[i], dw_s[i]), (name, single, i)
    # Zero-token member: exact zero gradient, and nothing anywhere is NaN/inf.
    assert torch.equal(dws[1], torch.zeros(OUT, IN))
    assert all(torch.isfinite(t).all() for t in (y, dx, *dws))
    assert y.shape == (sum(SPLITS), OUT)


@pytest.mark.parametrize("name", ["tensorwise", "mxfp8", "nvfp4_rht_sr", None])
def test_grouped_wgrad_fusion_single_and_discrete(name) -> None:
    """Fusion into main_grad: single grouped buffer [N,out,in] and discrete buffers agree
    bitwise with the unfused grads (one micro-batch into zeroed fp32 buffers)."""
    x, ws, dy = _data()
    _, _, ref_dws, _ = _grouped(name, False, x, ws, dy)
    for single in (False, True):
        g = GroupedLinear(N, IN, OUT, single_grouped_weight=single, params_dtype=torch.float32,
                          fuse_wgrad_accumulation=True)
        with torch.no_grad():
            for i in range(N):
                g.member_weight(i).copy_(ws[i])
        params = g.weights()
        for p in params:
            p.main_grad = torch.zeros(p.shape)
        with _ctx(name):
            # x needs grad as in the reference: SR draws depend on which usages are made.
            y = g(x.clone().requires_grad_(True), SPLITS)
        y.backward(dy)
        for p in params:
            assert p.grad_added_to_main_grad is True
            assert torch.equal(p.grad, torch.zeros(p.shape))
        mg = [params[0].main_grad[i] for i in range(N)] if single else [p.main_grad for p in params]
        for i in range(N):
            assert torch.equal(mg[i], ref_dws[i]), (name, single, i)


def test_all_members_empty() -> None:
    g = GroupedLinear(2, IN, OUT, params_dtype=torch.float32)
    x = torch.zeros(0, IN, requires_grad=True)
    with autocast(RECIPES["mxfp8"]()):
        y = g(x, [0, 0])
    assert y.shape == (0, OUT)
    y.sum().backward()
    assert torch.equal(g.weight0.grad, torch.zeros(OUT, IN))
