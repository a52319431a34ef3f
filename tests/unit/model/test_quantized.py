"""The model under quantized recipes (emulated backend, via ``build_factory``)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import moe_overrides, quantized_factory, tiny_cfg, tokens

from lptrain.model import build_model, canonical_state_dict, to_canonical

RECIPES = {
    "delayed": {"precision__fp8_format": "hybrid", "precision__fp8_recipe": "delayed"},
    "tensorwise": {"precision__fp8_format": "e4m3", "precision__fp8_recipe": "tensorwise"},
    "blockwise": {"precision__fp8_format": "e4m3", "precision__fp8_recipe": "blockwise"},
    "mxfp8": {"precision__fp8_format": "e4m3", "precision__fp8_recipe": "mxfp8"},
    "nvfp4": {"precision__fp4_format": "e2m1"},
}
LAYOUTS = {
    "single": {"grouped_gemm": True, "single_grouped_weight": True},
    "discrete": {"grouped_gemm": True, "single_grouped_weight": False},
}


def _build(recipe: str, dtype: str = "bf16", layers: int = 2, **over):
    cfg = tiny_cfg(precision__params_dtype=dtype, model__num_layers=layers, **RECIPES[recipe], **over)
    factory = quantized_factory(cfg)
    return build_model(cfg, factory), factory


def _loss_and_grads(model, factory):
    with factory.autocast():
        loss, _aux = model(tokens(), tokens(seed=1))
    loss.backward()
    return loss.detach(), to_canonical({n: p.grad for n, p in model.named_parameters()})


@pytest.mark.parametrize("recipe", ["mxfp8", "delayed"])
def test_quantization_is_active(recipe: str) -> None:
    model, factory = _build(recipe, **moe_overrides(**LAYOUTS["single"]))
    assert factory.grouped_alignment > 1
    assert model.layers[0].mlp.alignment == factory.grouped_alignment
    t = tokens()
    hp = model(t)
    with factory.autocast():
        q = model(t)
    assert not torch.equal(hp, q)  # the GEMMs really ran quantized
    # ... but close: 8-bit GEMMs perturb the (near-uniform) logits by well under 0.05.
    assert (hp - q).abs().max() < 0.05


@pytest.mark.parametrize(
    "recipe,dtype",
    [("mxfp8", "bf16"), ("mxfp8", "fp32"), ("delayed", "bf16"), ("tensorwise", "bf16"),
     ("blockwise", "bf16"), ("nvfp4", "bf16")],
)
def test_single_vs_discrete_bitwise(recipe: str, dtype: str) -> None:
    """One MoE layer (the other recipes' dense paths are the ops worker's tests)."""
    results = []
    for layout in LAYOUTS.values():
        over = moe_overrides(aux_loss_coeff=1e-2, **layout)
        model, factory = _build(recipe, dtype, layers=1, **over)
        results.append((canonical_state_dict(model), *_loss_and_grads(model, factory)))
    (sd_a, loss_a, g_a), (sd_b, loss_b, g_b) = results
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert torch.equal(loss_a, loss_b)
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        assert torch.equal(g_a[k], g_b[k]), k


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_zero_token_expert_no_nan(recipe: str) -> None:
    model, factory = _build(recipe, "bf16", layers=1, **moe_overrides(**LAYOUTS["single"]))
    moe = model.layers[0].mlp
    with torch.no_grad():
        moe.router.weight[3] = -1.0  # inputs > 0: expert 3 never chosen
    x = (torch.rand(2, 32, 64, generator=torch.Generator().manual_seed(0)) + 0.1).requires_grad_(True)
    with factory.autocast():
        out, _ = moe(x)
    # O(1) output grads: delayed scaling's first backward uses scale 1 (no amax history
    # yet), so tiny grads would underflow E5M2 to zero for every expert.
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    grads = to_canonical({n: p.grad for n, p in moe.named_parameters()})
    for k, g in grads.items():
        assert torch.isfinite(g.float()).all(), k
        if k.startswith("experts.") and k.endswith(".3"):
            assert torch.equal(g, torch.zeros_like(g)), k
        elif k.startswith("experts."):
            assert g.float().abs().sum() > 0, k


@pytest.mark.parametrize("recipe,layers,steps", [("mxfp8", 2, 60), ("delayed", 1, 40)])
def test_overfits_one_batch_quantized(recipe: str, layers: int, steps: int) -> None:
    """bf16 params, quantized GEMMs; the 2-layer model has an MoE layer (layer 0)."""
    torch.manual_seed(0)
    model, factory = _build(recipe, "bf16", layers=layers, **moe_overrides(moe_layer_freq=2))
    t = tokens(batch=2, seq=33, seed=3)  # 2 x 32 inputs: MXFP8 needs M % 32 == 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with factory.autocast():
            loss, aux = model(t[:, :-1], t[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(aux["lm_loss"].item())
    # 64 random tokens memorised: ln(259)=5.56 -> below 0.05 (observed ~0.003-0.01).
    assert losses[0] > 5.0 and min(losses[-5:]) < 0.05, losses[::5]


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") else t


@pytest.mark.parametrize("recipe,flag", [("mxfp8", "fp8_param_gather"), ("nvfp4", "fp4_param_gather")])
def test_quantized_primary_weights_layouts_and_checkpoint(recipe: str, flag: str) -> None:
    """FP8/FP4 primary weights: single vs discrete give the same canonical (quantized)
    weights and loss, and a checkpoint of one layout loads into the other exactly."""
    built = {}
    for name, layout in LAYOUTS.items():
        over = {f"precision__{flag}": True, **moe_overrides(**layout)}
        built[name] = _build(recipe, "bf16", layers=1, **over)
    (a, fa), (b, _fb) = built["single"], built["discrete"]
    sa, sb = canonical_state_dict(a), canonical_state_dict(b)
    key = "layers.0.mlp.experts.linear_fc1.weight.2"
    assert hasattr(sa[key], "dequantize") and type(sa[key]) is type(sb[key])
    assert all(torch.equal(_plain(sa[k]), _plain(sb[k])) for k in sa)
    t = tokens()
    with fa.autocast():
        la = a(t, t)[0]
    # Load single's checkpoint into a freshly seeded discrete model and vice versa.
    from lptrain.model import load_canonical_state_dict

    for dst_name, src_sd in (("discrete", sa), ("single", sb)):
        over = {f"precision__{flag}": True, "train__seed": 7, **moe_overrides(**LAYOUTS[dst_name])}
        dst, fd = _build(recipe, "bf16", layers=1, **over)
        load_canonical_state_dict(dst, src_sd)
        sd = canonical_state_dict(dst)
        assert all(torch.equal(_plain(sd[k]), _plain(src_sd[k])) for k in sd)
        with fd.autocast():
            assert torch.equal(dst(t, t)[0], la), dst_name


@pytest.mark.parametrize("recipe", [None, "mxfp8", "nvfp4"])
def test_single_vs_discrete_with_wgrad_fusion(recipe: str | None) -> None:
    """Gradient-accumulation fusion (wgrad into fp32 ``main_grad``, as DDP sets it up):
    the expert ``main_grad``s are bitwise equal between layouts."""
    from lptrain.precision.factory import build_factory

    grads = []
    for layout in LAYOUTS.values():
        over = dict(RECIPES[recipe]) if recipe else {}
        cfg = tiny_cfg(precision__params_dtype="bf16", model__num_layers=1, **over, **moe_overrides(**layout))
        cfg.precision.backend = "emulated"
        factory = build_factory(cfg.precision, num_layers=1, fuse_wgrad_accumulation=True)
        model = build_model(cfg, factory)
        for p in model.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        with factory.autocast():
            loss, _ = model(tokens(), tokens(seed=1))
        loss.backward()
        fused = {}
        for n, p in model.named_parameters():
            if getattr(p, "grad_added_to_main_grad", False):
                fused[n] = p.main_grad
            else:  # not a factory GEMM (embedding, norms, router, head): plain autograd grad
                fused[n] = p.grad.float()
        assert any(getattr(p, "grad_added_to_main_grad", False) for p in model.parameters())
        grads.append(to_canonical(fused))
    a, b = grads
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_layer_context_wiring_first_last_layers_bf16() -> None:
    """Each transformer layer runs in ``factory.layer_context(1-based number)``: with the
    first and last layer kept in bf16 a 2-layer model is entirely unquantized, a 3-layer
    model only in its middle layer."""
    over = {"precision__first_last_layers_bf16": True, **moe_overrides(**LAYOUTS["single"])}
    model, factory = _build("mxfp8", "bf16", layers=2, **over)
    t = tokens()
    with factory.autocast():
        q = model(t)
    assert torch.equal(q, model(t))
    model3, factory3 = _build("mxfp8", "bf16", layers=3, **over)
    with factory3.autocast():
        q3 = model3(t)
    assert not torch.equal(q3, model3(t))
