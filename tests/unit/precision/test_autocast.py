"""Autocast semantics, delayed-scaling update timing, quantized primary weights."""

from __future__ import annotations

import pytest
import torch
from _linear_helpers import IN, OUT, RECIPES, data

from lptrain.precision import recipes as R
from lptrain.precision.autocast import active_recipe, autocast, quantized_model_init
from lptrain.precision.layers import GroupedLinear, Linear
from lptrain.precision.tensors.base import QuantizedTensor, Quantizer


def _lin(w: torch.Tensor, **kw) -> Linear:
    lin = Linear(IN, OUT, params_dtype=torch.float32, **kw)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def _fwd_bwd(lin, x, dy, ctx):
    xx = x.clone().requires_grad_(True)
    lin.weight.grad = None
    with ctx:
        y = lin(xx)
    y.backward(dy)
    return y.detach(), xx.grad, lin.weight.grad


@pytest.mark.parametrize("name", ["delayed", "mxfp8", "nvfp4_rht_sr"])
def test_disabled_autocast_is_high_precision_bitwise(name: str) -> None:
    x, w, dy = data()
    ref = _fwd_bwd(_lin(w), x, dy, autocast(None, enabled=False))
    plain = _lin(w)
    xx = x.clone().requires_grad_(True)
    y = plain(xx)  # no autocast at all
    y.backward(dy)
    assert all(torch.equal(a, b) for a, b in zip(ref, (y.detach(), xx.grad, plain.weight.grad), strict=False))
    recipe = RECIPES[name]()
    off = _fwd_bwd(_lin(w), x, dy, autocast(recipe, enabled=False))
    nested = _lin(w)
    xx = x.clone().requires_grad_(True)
    with autocast(recipe):
        with autocast(enabled=False):
            y = nested(xx)
        assert active_recipe() is recipe  # restored
    y.backward(dy)
    on = _fwd_bwd(_lin(w), x, dy, autocast(recipe))
    for a, b, c in zip(ref, off, (y.detach(), xx.grad, nested.weight.grad), strict=False):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(on[0], ref[0])  # enabled really quantizes


def test_nested_autocast_inherits_recipe_and_group() -> None:
    recipe = RECIPES["tensorwise"]()
    assert active_recipe() is None
    with autocast(recipe):
        with autocast():
            assert active_recipe() is recipe
        with autocast(enabled=False):
            assert active_recipe() is None
            with autocast():
                assert active_recipe() is recipe
    assert active_recipe() is None


def _slots(lin: Linear, recipe) -> dict:
    return lin.delayed_scaling_states(recipe)[0]


def test_delayed_forward_scales_update_on_outermost_exit() -> None:
    """Step t quantizes with the scale from step t-1 (1 at first); the forward roles' amax
    history and scale change only when the *outermost* autocast exits (numerics.md 2.1)."""
    x, w, dy = data()
    recipe = RECIPES["delayed"]()  # HYBRID, history 4, algo max
    lin = _lin(w)
    st = _slots(lin, recipe)
    xx = x.clone().requires_grad_(True)
    with autocast(recipe):
        with autocast(recipe):  # nested region: its exit must not update
            y = lin(xx)
        amax_x = x.abs().max()
        assert torch.equal(st["input"].amax_history[0], amax_x)
        assert torch.equal(st["weight"].amax_history[0], w.abs().max())
        assert torch.equal(st["input"].scale, torch.ones(1))
    # Outermost exit: rolled history and scale = fp32(448 / amax).
    assert torch.equal(st["input"].scale, torch.tensor([448.0]) / amax_x)
    assert torch.equal(st["input"].amax_history, torch.tensor([0.0, 0.0, 0.0, float(amax_x)]))
    assert torch.equal(st["weight"].scale, torch.tensor([448.0]) / w.abs().max())
    # Grad role untouched until backward.
    assert torch.equal(st["grad"].scale, torch.ones(1)) and st["grad"].amax_history.abs().sum() == 0
    y.backward(dy)
    assert torch.equal(st["grad"].scale, torch.tensor([57344.0]) / dy.abs().max())  # E5M2 grads


def test_delayed_grad_update_runs_after_the_whole_backward() -> None:
    """Two chained modules: grad scales update when the first module's backward ends, i.e.
    after every module has recorded its dy amax; no grad update before that."""
    x, w, _ = data()
    recipe = RECIPES["delayed"]()
    first = _lin(w)
    second = Linear(OUT, OUT, params_dtype=torch.float32)
    seen: list[torch.Tensor] = []

    def probe(grad: torch.Tensor) -> torch.Tensor:  # runs between the two backwards
        seen.append(_slots(second, recipe)["grad"].scale.clone())
        return grad

    with autocast(recipe):
        h = first(x.clone().requires_grad_(True))
        h.register_hook(probe)
        y = second(h)
    dy = torch.randn(y.shape)
    y.backward(dy)
    assert torch.equal(seen[0], torch.ones(1))  # second's backward done, update not yet run
    assert torch.equal(_slots(second, recipe)["grad"].scale, torch.tensor([57344.0]) / dy.abs().max())
    assert not torch.equal(_slots(first, recipe)["grad"].scale, torch.ones(1))


def test_delayed_amax_reduction_hook_receives_the_amaxes() -> None:
    """The region's amax_reduction_group reaches the update (MAX over ranks): a callable
    that stands in for a 2-rank all-reduce where the other rank saw 2x the amax."""
    x, w, _dy = data()
    recipe = RECIPES["delayed"]()
    lin = _lin(w)
    packed: list[torch.Tensor] = []

    def fake_allreduce(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.clone())
        return t * 2

    with autocast(recipe, amax_reduction_group=fake_allreduce):
        lin(x)
    assert len(packed) == 1 and packed[0].numel() == 2  # input + weight, packed together
    st = _slots(lin, recipe)
    assert torch.equal(st["input"].scale, torch.tensor([448.0]) / (2 * x.abs().max()))


def test_delayed_scales_persist_across_steps_and_are_used() -> None:
    x, w, dy = data()
    recipe = RECIPES["delayed"]()
    lin = _lin(w)
    y1 = _fwd_bwd(lin, x, dy, autocast(recipe))[0]
    y2 = _fwd_bwd(lin, x, dy, autocast(recipe))[0]
    cur = _fwd_bwd(_lin(w), x, dy, autocast(RECIPES["tensorwise"]()))[0]
    assert not torch.equal(y1, y2)  # step 2 uses the updated scales
    assert torch.equal(y2, cur)  # same amax as current scaling -> same scale, same bytes


@pytest.mark.parametrize("name", ["tensorwise", "blockwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_model_init_primary_weights(name: str, dtype: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    with quantized_model_init(recipe):
        lin = Linear(IN, OUT, params_dtype=dtype)
        grp = GroupedLinear(2, IN, OUT, single_grouped_weight=True, params_dtype=dtype)
    torch.manual_seed(0)
    ref = Linear(IN, OUT, params_dtype=dtype)  # same init draws, not quantized
    w = lin.weight
    assert isinstance(w, QuantizedTensor) and isinstance(w, torch.nn.Parameter)
    assert w.dtype == dtype and w.shape == (OUT, IN) and w.requires_grad
    assert torch.equal(w.high_precision_init_value(), ref.weight.detach())
    assert isinstance(grp.weight, QuantizedTensor)
    assert grp.weight.high_precision_init_value().shape == (2, OUT, IN)
    # Forward uses the stored bytes: no weight quantization happens, and the output is
    # exactly x_q @ W_stored^T.
    roles: list[str] = []
    orig = Quantizer.quantize
    monkeypatch.setattr(Quantizer, "quantize", lambda q, t, **kw: (roles.append(q.role), orig(q, t, **kw))[1])
    x = torch.randn(64, IN).to(dtype)
    with autocast(recipe):
        y = lin(x)
    assert "weight" not in roles
    xq = recipe.make_quantizer("input", True, False).quantize(x).dequantize("rowwise")
    assert torch.equal(y, (xq @ w.dequantize("rowwise").t()).to(dtype))
    # Rewriting the stored bytes changes the output (the bytes really are what is used).
    w.requantize_from(torch.zeros(OUT, IN, dtype=dtype))
    with autocast(recipe):
        assert torch.equal(lin(x), torch.zeros(64, OUT, dtype=dtype))


def test_quantized_model_init_backward_gives_plain_grads() -> None:
    recipe = RECIPES["mxfp8"]()
    with quantized_model_init(recipe):
        lin = Linear(IN, OUT, params_dtype=torch.bfloat16)
    x = torch.randn(64, IN, dtype=torch.bfloat16, requires_grad=True)
    with autocast(recipe):
        y = lin(x)
    y.float().sum().backward()
    g = lin.weight.grad
    assert type(g) is torch.Tensor and g.shape == (OUT, IN) and g.dtype == torch.bfloat16
    assert torch.isfinite(g).all() and x.grad is not None


def test_model_init_disabled_gives_plain_parameters() -> None:
    with quantized_model_init(R.MXFP8Scaling(), enabled=False):
        lin = Linear(IN, OUT)
    assert type(lin.weight) is torch.nn.Parameter


def test_delayed_scaling_state_round_trips_for_resume() -> None:
    """Saved delayed-scaling state restored into a fresh module (before its first forward)
    gives bitwise the same next step as the module that kept running."""
    x, w, dy = data()
    x2, _, dy2 = data(seed=1)
    recipe = RECIPES["delayed"]()
    a = _lin(w)
    _fwd_bwd(a, x, dy, autocast(recipe))
    sd = a.scaling_state_dict()
    assert set(sd) == {f"0.{r}.{k}" for r in ("input", "weight", "grad") for k in ("scale", "amax_history")}
    b = _lin(w)
    b.load_scaling_state_dict(sd)
    fresh = _lin(w)
    ya = _fwd_bwd(a, x2, dy2, autocast(recipe))
    yb = _fwd_bwd(b, x2, dy2, autocast(recipe))
    yc = _fwd_bwd(fresh, x2, dy2, autocast(recipe))
    assert all(torch.equal(p, q) for p, q in zip(ya, yb, strict=False))
    assert not torch.equal(ya[0], yc[0])  # without the state, step 1 would use scale 1
    assert Linear(IN, OUT).scaling_state_dict() == {}
