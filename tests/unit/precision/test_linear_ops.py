"""Quantized linear op: accuracy per recipe, operand orientation, wgrad fusion."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _linear_helpers import IN, OUT, RECIPES, data, rel_err

from lptrain.precision import linear_ops
from lptrain.precision.autocast import autocast
from lptrain.precision.layers import Linear
from lptrain.precision.tensors.base import QuantizedTensor

# Worst-case relative rounding error of one element (RNE, value in the normal range):
# half an ulp = 2^-(mantissa bits + 1). E4M3: 3 bits -> 2^-4; E5M2: 2 bits -> 2^-3.
# E2M1 (NVFP4): 1 mantissa bit -> 2^-2 for grid points >= 1 block unit (vmax/6); smaller
# elements carry up to 0.25 unit absolute error, and stochastic rounding doubles the
# per-element bound (error < one step) while staying unbiased.
U = {"e4m3": 2.0**-4, "e5m2": 2.0**-3, "e2m1": 2.0**-2, "e2m1_sr": 2.0**-1}

# Element format of (input, weight, grad) per recipe.
FORMATS = {
    "delayed": ("e4m3", "e4m3", "e5m2"),  # HYBRID
    "tensorwise": ("e4m3", "e4m3", "e5m2"),  # HYBRID
    "blockwise": ("e4m3", "e4m3", "e4m3"),
    "mxfp8": ("e4m3", "e4m3", "e4m3"),
    "nvfp4": ("e2m1", "e2m1", "e2m1"),
    "nvfp4_rht": ("e2m1", "e2m1", "e2m1"),
    "nvfp4_sr": ("e2m1", "e2m1", "e2m1_sr"),
    "nvfp4_rht_sr": ("e2m1", "e2m1", "e2m1_sr"),
}


def _run(recipe, x, w, dy, steps: int = 1, **lin_kw):
    """fwd+bwd of one Linear under autocast; returns (y, dx, dW, module) of the last step."""
    lin = Linear(IN, OUT, params_dtype=torch.float32, **lin_kw)
    with torch.no_grad():
        lin.weight.copy_(w)
    for _ in range(steps):
        lin.weight.grad = None
        xx = x.clone().requires_grad_(True)
        with autocast(recipe):
            y = lin(xx)
        y.backward(dy)
    return y.detach(), xx.grad, lin.weight.grad, lin


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_quantized_linear_close_to_fp64(name: str) -> None:
    """Normwise error of each GEMM within the sum of its two operands' element bounds.

    For y = sum_k a_k b_k with relative operand errors da, db, the error is
    sum_k a_k b_k (da_k + db_k) (+ second order); with random signs its normwise size is
    about sqrt(E[da^2] + E[db^2]) <= u_a + u_b, so ``u_a + u_b`` is a safe bound (the
    expected error is ~2-3x below it), while a wrong scale, a wrong operand or a missing
    dequantization gives O(1) errors. The error must also be clearly non-zero: the GEMM
    really ran on quantized operands (fp32 GEMM error alone is ~1e-7).
    Delayed scaling runs two steps: step 1 uses scale 1 (TE's initial scale), step 2 the
    scales computed from step 1's amaxes.
    """
    x, w, dy = data()
    y, dx, dw, _ = _run(RECIPES[name](), x, w, dy, steps=2 if name == "delayed" else 1)
    xr, wr, dyr = x.double(), w.double(), dy.double()
    fi, fw, fg = (U[f] for f in FORMATS[name])
    checks = {
        "fprop": (rel_err(y, xr @ wr.t()), fi + fw),
        "dgrad": (rel_err(dx, dyr @ wr), fg + fw),
        "wgrad": (rel_err(dw, dyr.t() @ xr), fg + fi),
    }
    for gemm, (err, tol) in checks.items():
        assert 1e-4 < err < tol, (name, gemm, err, tol)


def test_nvfp4_sr_is_unbiased_on_average() -> None:
    """SR wgrad: averaging 8 independent SR draws shrinks the error (unbiased rounding).

    With RNE the error is deterministic and cannot shrink; with SR the mean of n draws has
    its random part reduced by ~sqrt(n), so the averaged error must drop below the
    single-draw error (by a margin: 0.8x) -- a biased rounding would not.
    """
    x, w, dy = data()
    ref = dy.double().t() @ x.double()
    recipe = RECIPES["nvfp4_rht_sr"]()
    lin = Linear(IN, OUT, params_dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(w)
    grads = []
    for _ in range(8):
        lin.weight.grad = None
        with autocast(recipe):
            y = lin(x)
        y.backward(dy)
        grads.append(lin.weight.grad.clone())
    single = rel_err(grads[0], ref)
    mean = rel_err(torch.stack(grads).mean(0), ref)
    assert not torch.equal(grads[0], grads[1])  # the draws really differ
    assert mean < 0.8 * single, (mean, single)


class _Spy:
    """Records (role, orientation) of every dequantization of a quantized operand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        orig = QuantizedTensor.dequantize

        def spy(qt: QuantizedTensor, orientation: str = "rowwise") -> torch.Tensor:
            # The orientation must really be stored: no silent fallback to the other one.
            assert qt.has_orientation(orientation), (qt.quantizer.role, orientation)
            self.calls.append((qt.quantizer.role, orientation))
            return orig(qt, orientation)

        monkeypatch.setattr(QuantizedTensor, "dequantize", spy)


EXPECTED_FWD = {("input", "rowwise"), ("weight", "rowwise")}
EXPECTED_BWD = {("grad", "rowwise"), ("weight", "columnwise"), ("grad", "columnwise"),
                ("input", "columnwise")}


def _check_orientations(fwd: list, bwd: list) -> None:
    assert set(fwd) == EXPECTED_FWD and len(fwd) == 2, fwd
    assert sorted(set(bwd)) == sorted(EXPECTED_BWD) and len(bwd) == 4, bwd


def test_mxfp8_gemms_use_the_specified_orientations(monkeypatch: pytest.MonkeyPatch) -> None:
    """fprop: x, W rowwise; dgrad: dy rowwise, W columnwise; wgrad: x, dy columnwise."""
    x, w, dy = data()
    spy = _Spy(monkeypatch)
    lin = Linear(IN, OUT, params_dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(w)
    with autocast(RECIPES["mxfp8"]()):
        y = lin(x.requires_grad_(True))
    fwd = list(spy.calls)
    spy.calls.clear()
    y.backward(dy)
    _check_orientations(fwd, spy.calls)


def test_wrong_wgrad_orientation_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken op using rowwise operands for wgrad fails the orientation check, and its
    MXFP8 wgrad differs from the correct one (rowwise 1x32 and columnwise 32x1 blocks are
    quantized independently), so the tests above can fail.

    With power-of-two block scales, an element's E4M3 rounding does not depend on its block
    unless it falls out of the normal range; so x gets a per-channel dynamic range of 1e4
    (outlier channels): 1x32 rowwise blocks then flush the small channels that 32x1
    columnwise blocks keep.
    """
    x, w, dy = data()
    x = x * torch.logspace(-4, 0, IN)
    _, _, dw_good, _ = _run(RECIPES["mxfp8"](), x, w, dy)
    # The broken op keeps x rowwise for backward and feeds it (and dy rowwise) to wgrad.
    monkeypatch.setattr(linear_ops, "_only_columnwise", lambda q: q)
    monkeypatch.setattr(linear_ops, "col_operand_t", lambda q: q.dequantize("rowwise").t())
    spy = _Spy(monkeypatch)
    _, _, dw_bad, _ = _run(RECIPES["mxfp8"](), x, w, dy)
    assert not torch.equal(dw_good, dw_bad)
    with pytest.raises(AssertionError):
        _check_orientations(spy.calls[:2], spy.calls[2:])


@pytest.mark.parametrize("name", ["tensorwise", "nvfp4_rht"])
def test_orientations_other_recipes(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Same orientation contract for per-tensor FP8 and NVFP4 (RHT operands are the
    columnwise data, read through ``columnwise_rht_operand``)."""
    x, _w, dy = data()
    spy = _Spy(monkeypatch)
    rot: list[str] = []
    from lptrain.precision.tensors.nvfp4 import NVFP4Tensor

    orig = NVFP4Tensor.columnwise_rht_operand

    def rot_spy(qt):  # type: ignore[no-untyped-def]
        rot.append(qt.quantizer.role)
        return orig(qt)

    monkeypatch.setattr(NVFP4Tensor, "columnwise_rht_operand", rot_spy)
    lin = Linear(IN, OUT, params_dtype=torch.float32)
    with autocast(RECIPES[name]()):
        y = lin(x.requires_grad_(True))
    fwd = list(spy.calls)
    spy.calls.clear()
    y.backward(dy)
    bwd = spy.calls + [(r, "columnwise") for r in rot]
    _check_orientations(fwd, bwd)


def _fp32_linear(w: torch.Tensor, *, fuse: bool) -> Linear:
    """An fp32 Linear holding ``w``, with a zero ``main_grad`` (the engine's fp32 grad buffer)."""
    lin = Linear(IN, OUT, params_dtype=torch.float32, fuse_wgrad_accumulation=fuse)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.weight.main_grad = torch.zeros(OUT, IN)
    return lin


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_wgrad_fusion_matches_manual_accumulation_bitwise(name: str) -> None:
    """main_grad after 2 micro-batches with fusion == sum of .grad by hand, bitwise.

    fp32 params: the unfused grad is the fp32 wgrad itself, so both paths add the same fp32
    tensors in the same order.
    """
    x, w, dy = data()
    x2, _, dy2 = data(seed=1)

    recipe_a, recipe_b = RECIPES[name](), RECIPES[name]()
    fused, manual = _fp32_linear(w, fuse=True), _fp32_linear(w, fuse=False)
    for xi, dyi in ((x, dy), (x2, dy2)):
        with autocast(recipe_a):
            fused(xi).backward(dyi)
        with autocast(recipe_b):
            manual(xi).backward(dyi)
        manual.weight.main_grad += manual.weight.grad
        manual.weight.grad = None
    assert fused.weight.grad_added_to_main_grad is True
    assert not getattr(manual.weight, "grad_added_to_main_grad", False)
    assert torch.equal(fused.weight.grad, torch.zeros(OUT, IN))
    assert torch.equal(fused.weight.main_grad, manual.weight.main_grad)
    assert fused.weight.main_grad.abs().sum() > 0


def test_forward_quantizes_weight_once_for_both_orientations(monkeypatch: pytest.MonkeyPatch) -> None:
    """W and x are each quantized once per forward (both orientations), dy once per backward."""
    x, _w, dy = data()
    roles: list[tuple[str, bool, bool]] = []
    from lptrain.precision.tensors.base import Quantizer

    orig = Quantizer.quantize

    def count(q, t, **kw):  # type: ignore[no-untyped-def]
        roles.append((q.role, q.rowwise, q.columnwise))
        return orig(q, t, **kw)

    monkeypatch.setattr(Quantizer, "quantize", count)
    lin = Linear(IN, OUT, params_dtype=torch.float32)
    with autocast(RECIPES["mxfp8"]()):
        y = lin(x.requires_grad_(True))
    y.backward(dy)
    assert sorted(roles) == [("grad", True, True), ("input", True, True), ("weight", True, True)]


def test_no_dgrad_operands_when_input_needs_no_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """First layer: x needs no grad -> W columnwise and dy rowwise are never produced."""
    x, _w, dy = data()
    spy = _Spy(monkeypatch)
    lin = Linear(IN, OUT, params_dtype=torch.float32)
    with autocast(RECIPES["mxfp8"]()):
        y = lin(x)
    y.backward(dy)
    assert ("weight", "columnwise") not in spy.calls and ("grad", "rowwise") not in spy.calls
    assert lin.weight.grad is not None


def test_leading_dims_and_bf16_io() -> None:
    """[b, s, h] bf16 input: output/dx are bf16 with the input's shape; dW in the param dtype."""
    x, _w, dy = data()
    lin = Linear(IN, OUT, params_dtype=torch.bfloat16)
    xb = x.reshape(4, 32, IN).to(torch.bfloat16).requires_grad_(True)
    with autocast(RECIPES["tensorwise"]()):
        y = lin(xb)
    assert y.shape == (4, 32, OUT) and y.dtype == torch.bfloat16
    y.backward(dy.reshape(4, 32, OUT).to(torch.bfloat16))
    assert xb.grad.shape == xb.shape and xb.grad.dtype == torch.bfloat16
    assert lin.weight.grad.dtype == torch.bfloat16


def test_no_grad_forward_quantizes_rowwise_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eval forward (torch.no_grad): no columnwise operands are made, output unchanged."""
    x, _w, _ = data()
    usages: list[tuple[str, bool, bool]] = []
    from lptrain.precision.tensors.base import Quantizer

    orig = Quantizer.quantize

    def record(q, t, **kw):  # type: ignore[no-untyped-def]
        usages.append((q.role, q.rowwise, q.columnwise))
        return orig(q, t, **kw)

    lin = Linear(IN, OUT, params_dtype=torch.float32)
    recipe = RECIPES["mxfp8"]()
    with autocast(recipe):
        y_train = lin(x.clone().requires_grad_(True)).detach()
    monkeypatch.setattr(Quantizer, "quantize", record)
    with torch.no_grad(), autocast(recipe):
        y_eval = lin(x.clone().requires_grad_(True))
    assert sorted(usages) == [("input", True, False), ("weight", True, False)]
    assert torch.equal(y_eval, y_train)


def test_unaligned_tokens_raise_a_clear_error() -> None:
    """MXFP8 needs token counts that are multiples of 32 (32x1 columnwise blocks)."""
    lin = Linear(IN, OUT, params_dtype=torch.float32, name="decoder.layers.0.mlp.linear_fc1")
    x = torch.randn(40, IN, requires_grad=True)
    with autocast(RECIPES["mxfp8"]()), pytest.raises(ValueError, match=r"linear_fc1.*mxfp8.*32"):
        lin(x)


@pytest.mark.parametrize("name", [None, "tensorwise", "mxfp8"])
def test_fused_wgrad_under_an_engine_hands_autograd_no_weight_grad(name: str | None) -> None:
    """With ``weight.main_grad_hooked`` (set by the data-parallel engine next to its
    post-accumulate hook), a fused linear returns no weight grad: ``.grad`` stays None, the
    hook still runs exactly once per backward (it resets the flag and marks readiness), and
    ``main_grad`` is bitwise the unfused sum. With the placeholder forced back to a zero
    tensor, the hook sees a zero ``.grad`` instead, which this test refuses."""
    assert linear_ops._hooks_fire_without_grad(), "this torch skips post-accumulate hooks on None grads"
    x, w, dy = data()
    x2, _, dy2 = data(seed=1)

    fused, manual = _fp32_linear(w, fuse=True), _fp32_linear(w, fuse=False)
    seen: list[tuple[bool, bool]] = []

    def hook(p: torch.Tensor) -> None:  # the engine's hook, reduced to what this test needs
        seen.append((p.grad is None, bool(p.grad_added_to_main_grad)))
        p.grad = None
        p.grad_added_to_main_grad = False

    fused.weight.register_post_accumulate_grad_hook(hook)
    fused.weight.main_grad_hooked = True
    recipes = (RECIPES[name](), RECIPES[name]()) if name else (None, None)
    for xi, dyi in ((x, dy), (x2, dy2)):
        for lin, r in zip((fused, manual), recipes, strict=True):
            with autocast(r) if r is not None else contextlib.nullcontext():
                lin(xi).backward(dyi)
        manual.weight.main_grad += manual.weight.grad
        manual.weight.grad = None
    assert seen == [(True, True), (True, True)]
    assert fused.weight.grad is None
    assert torch.equal(fused.weight.main_grad, manual.weight.main_grad)
    assert fused.weight.main_grad.abs().sum() > 0
