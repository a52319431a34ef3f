"""Emulated backend vs real Transformer Engine, layer by layer (GPU only).

The conftest skips these without CUDA and TE; each case also skips, with the reason, where
TE on this GPU does not support the recipe (``_te_gpu.require_te_for``: sm89/sm90/sm100,
CUDA and TE versions, from the rule catalog). Checks:

- quantizer bytes and scales for all three roles (input, weight and the gradient
  quantizer of the backward pass): exact on the compact region of every buffer; NVFP4's
  RHT'd columnwise operands (input, grad) within 0.1% of bytes (rare 1-ulp bf16 RHT
  differences, numerics.md 2.5); stochastic rounding is off (GPU Philox bits cannot be
  reproduced);
- ``Linear`` and ``GroupedLinear`` forward/backward: normwise relative difference of y, dx
  and dW within ``GEMM_RTOL`` (4e-3, one bf16 ulp; see ``_te_gpu``), NVFP4 dW within
  ``NVFP4_WGRAD_RTOL``.
"""

from __future__ import annotations

import _te_gpu as G
import pytest
import torch

from lptrain.precision.factory import build_factory, recipe_from_config

pytestmark = [pytest.mark.gpu, pytest.mark.te]

NAMES = sorted(G.CONFIGS)


def _data(tokens: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x [tokens, k] with columns spanning 3 decades (exercises per-block scales), dy."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, k, generator=g) * torch.logspace(-2, 1, k)).to(torch.bfloat16)
    dy = torch.randn(tokens, n, generator=g).to(torch.bfloat16)
    return x, dy


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_quantizer_bytes_match_te(name: str, role: str) -> None:
    from lptrain.precision.te_adapter import te_recipe

    cfg = G.prec("te", name)
    G.require_te_for(cfg)
    ours_recipe = recipe_from_config(cfg)
    x, _ = _data(256, 512, 8)
    if role == "grad":  # backward quantizers per GEMM: [grad_output, grad_input]
        te_q = G.te_quantizers(te_recipe(cfg), "backward", 2)[0]
    else:  # forward quantizers per GEMM: [input, weight, output]
        te_q = G.te_quantizers(te_recipe(cfg), "forward", 3)[0 if role == "input" else 1]
    theirs = te_q(x.cuda())
    kw = {"state": ours_recipe.make_state(role)} if name == "delayed" else {}
    ours = ours_recipe.make_quantizer(role, True, True, **kw).quantize(x)
    assert G.compare_buffers(name, ours, theirs, role=role) >= 2


def _pair(name: str, make) -> tuple:
    emu = build_factory(G.prec("emulated", name), num_layers=1)
    te_f = build_factory(G.prec("te", name), num_layers=1)
    assert te_f.backend == "te"
    return emu, te_f, make(emu), make(te_f)


def _run(factory, module, x: torch.Tensor, dy: torch.Tensor, *extra) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    with factory.autocast():
        y = module(x, *extra)
    y.backward(dy)
    return y, x.grad


@pytest.mark.parametrize("name", NAMES)
def test_linear_fwd_bwd_matches_te(name: str) -> None:
    G.require_te_for(G.prec("te", name))
    torch.manual_seed(0)
    emu, te_f, ours, theirs = _pair(name, lambda f: f.linear(256, 128))
    with torch.no_grad():
        theirs.weight.copy_(ours.weight.detach().cuda())
    x, dy = _data(256, 256, 128, seed=1)
    ya, dxa = _run(emu, ours, x, dy)
    yb, dxb = _run(te_f, theirs, x.cuda(), dy.cuda())
    assert G.rel(ya, yb) < G.GEMM_RTOL
    assert G.rel(dxa, dxb) < G.GEMM_RTOL
    wtol = G.NVFP4_WGRAD_RTOL if name == "nvfp4" else G.GEMM_RTOL
    assert G.rel(ours.weight.grad, theirs.weight.grad) < wtol


@pytest.mark.parametrize("name", NAMES)
def test_grouped_linear_matches_te(name: str) -> None:
    """4 experts on uneven, recipe-aligned token splits (one expert empty)."""
    G.require_te_for(G.prec("te", name))
    torch.manual_seed(0)
    emu, te_f, ours, theirs = _pair(name, lambda f: f.grouped_linear(4, 128, 64))
    a = emu.grouped_alignment
    splits = [2 * a, 0, a, 3 * a]
    with torch.no_grad():
        for i in range(4):
            theirs.member_weight(i).copy_(ours.member_weight(i).detach().cuda())
    x, dy = _data(sum(splits), 128, 64, seed=2)
    ya, dxa = _run(emu, ours, x, dy, splits)
    yb, dxb = _run(te_f, theirs, x.cuda(), dy.cuda(), splits)
    assert G.rel(ya, yb) < G.GEMM_RTOL
    assert G.rel(dxa, dxb) < G.GEMM_RTOL
    wtol = G.NVFP4_WGRAD_RTOL if name == "nvfp4" else G.GEMM_RTOL
    for i in (0, 2, 3):
        assert G.rel(ours.member_weight(i).grad, theirs.member_weight(i).grad) < wtol, i
    empty = theirs.member_weight(1).grad
    assert empty is None or not empty.any()  # zero tokens: no (or an exact zero) wgrad
