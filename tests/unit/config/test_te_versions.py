"""The TE version table of the rule catalog against a stand-in TE of each listed version.

For every listed TE release (``lptrain.testing.te_standin.VERSIONS``) and every recipe / feature: the rules
accept a ``backend=te`` config exactly when lptrain's TE adapter can build it against that
release's Python surface (recipe classes, GroupedLinear arguments, environment gating). The
hardware facts (MXFP8 on sm120, blockwise on Blackwell and its CUDA minimum) are checked
against the values read from TE's sources (``_compute_*_support`` in quantization.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from lptrain.config import World, check, compose
from lptrain.config.rulesets.precision import auto_backend
from lptrain.config.world import parse_version
from lptrain.precision import te_adapter
from lptrain.testing import te_standin as _fake_te

TE = "precision.backend=te"
RECIPES = {
    "delayed": ["precision.fp8_format=hybrid", "precision.fp8_recipe=delayed"],
    "tensorwise": ["precision.fp8_format=hybrid", "precision.fp8_recipe=tensorwise"],
    "blockwise": ["precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"],
    "mxfp8": ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"],
    "nvfp4": ["precision.fp4_format=e2m1"],
}
# A GPU each recipe runs on (blockwise: Hopper, where TE 2.3+ runs it).
GPU = {"delayed": "sm90", "tensorwise": "sm90", "blockwise": "sm90", "mxfp8": "sm100", "nvfp4": "sm100"}
SGW = ["model.moe.num_experts=4", "model.moe.grouped_gemm=true", "model.moe.single_grouped_weight=true",
       *RECIPES["mxfp8"]]


def _world(target: str, te: str, cuda: str = "12.9") -> World:
    return World(target=target, te_version=te, cuda=True, cuda_version=cuda)


def _te_rules(overrides: list[str], world: World) -> list[str]:
    return [v.rule for v in check(compose(None, [TE, *overrides]), world)
            if v.rule.startswith("PREC-TE") or v.rule in ("PREC-MXFP8-SM120", "PREC-BLOCKWISE-CUDA")]


def _builds(overrides: list[str], version: str) -> bool:
    """Whether the adapter builds the recipe and its GEMM modules against stand-in TE ``version``."""
    cfg = compose(None, [TE, *overrides])
    with _fake_te.installed(version):
        try:
            te_adapter.te_recipe(cfg.precision)
            te_adapter.te_linear(64, 32, name="fc")
            moe = cfg.model.moe
            if moe.num_experts:
                m = te_adapter.te_grouped_linear(moe.num_experts, 64, 32, name="experts",
                                                 single_grouped_weight=moe.single_grouped_weight)
                m(torch.zeros(8, 64), [2, 2, 2, 2])
        except te_adapter.BackendUnavailableError:
            return False
    return True


@pytest.mark.parametrize("version", _fake_te.VERSIONS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_rules_accept_a_recipe_exactly_when_that_te_builds_it(recipe: str, version: str) -> None:
    overrides = RECIPES[recipe]
    refused = _te_rules(overrides, _world(GPU[recipe], version))
    assert refused in ([], ["PREC-TE-VERSION"]), refused
    assert (refused == []) == _builds(overrides, version), (recipe, version, refused)


def _trains_experts(version: str) -> bool:
    """Whether a single grouped expert weight built against stand-in TE ``version`` gets a
    weight gradient from a backward (TE 2.14-2.18 run its GEMMs on the members, made with
    ``requires_grad=False``: the grouped parameter never gets one)."""
    with _fake_te.installed(version):
        try:
            m = te_adapter.te_grouped_linear(4, 64, 32, single_grouped_weight=True)
        except te_adapter.BackendUnavailableError:
            return False
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        m(x, [2, 2, 2, 2]).sum().backward()
    grad = m.weight.grad
    return grad is not None and bool(grad.abs().sum() > 0)


@pytest.mark.parametrize("version", _fake_te.VERSIONS)
def test_rules_accept_single_grouped_weight_exactly_when_that_te_trains_it(version: str) -> None:
    refused = _te_rules(SGW, _world("sm100", version, cuda="13.3"))
    assert (refused == []) == _trains_experts(version), (version, refused)
    assert (refused == []) == (parse_version(version) >= (2, 19))


def test_single_grouped_weight_gate_regression(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 3: with the gate lptrain had (2.14), TE 2.18 is accepted and its experts train
    on nothing. The gate at 2.19 is what keeps the predicate above true."""
    from lptrain.config.rulesets import precision as rules_precision

    assert not _trains_experts("2.18")
    assert _te_rules(SGW, _world("sm100", "2.18", cuda="13.3")) == ["PREC-TE-VERSION"]
    monkeypatch.setattr(rules_precision, "SINGLE_GROUPED_WEIGHT_MIN_TE", "2.14")
    assert _te_rules(SGW, _world("sm100", "2.18", cuda="13.3")) == []  # accepted, trains nothing


def test_catalog_minima_are_tes_release_history() -> None:
    """First releases with each recipe class (stand-in: read from TE's v2.x tags)."""
    first = {}
    for recipe, overrides in RECIPES.items():
        first[recipe] = next(v for v in _fake_te.VERSIONS if _builds(overrides, v))
    assert first == {"delayed": "2.2", "tensorwise": "2.2", "blockwise": "2.3", "mxfp8": "2.2",
                     "nvfp4": "2.8"}


def test_tensorwise_power_2_choice_read_on_every_release() -> None:
    """``use_power_2_scales`` exists from 2.8 only; older TE keeps it in the QParams."""
    cfg = compose(None, [TE, *RECIPES["tensorwise"], "precision.amax_epsilon=1e-12"])
    for version in ("2.2", "2.7", "2.8", "2.19"):
        with _fake_te.installed(version):
            r = te_adapter.te_recipe(cfg.precision)
        q = r.fp8_quant_bwd_grad
        assert (q.power_2_scale, q.amax_epsilon) == (False, 1e-12), version


def test_nvfp4_on_te_before_2_8_is_a_clear_error() -> None:
    cfg = compose(None, [TE, *RECIPES["nvfp4"]])
    with _fake_te.installed("2.7"), pytest.raises(te_adapter.BackendUnavailableError, match=r">= 2\.8"):
        te_adapter.te_recipe(cfg.precision)


def test_blockwise_on_blackwell_needs_te_2_9() -> None:
    """TE 2.3-2.8: 'FP8 block scaled GEMM requires Hopper'; 2.9 adds sm100+ via MXFP8 GEMMs."""
    (v,) = check(compose(None, [TE, *RECIPES["blockwise"]]), _world("sm100", "2.8"))
    assert v.rule == "PREC-TE-VERSION" and "2.9" in v.fix and "sm100" in v.message
    assert check(compose(None, [TE, *RECIPES["blockwise"]]), _world("sm100", "2.9")) == []
    assert check(compose(None, [TE, *RECIPES["blockwise"]]), _world("sm90", "2.8")) == []


@pytest.mark.parametrize(("cuda", "ok"), [("12.8", False), ("12.9", True), ("13.0", True), (None, True)])
def test_blockwise_cuda_minimum(cuda: str | None, ok: bool) -> None:
    found = _te_rules(RECIPES["blockwise"], World(target="sm90", te_version="2.19", cuda=True,
                                                  cuda_version=cuda))
    assert found == ([] if ok else ["PREC-BLOCKWISE-CUDA"])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_sm120_refuses_only_mxfp8(recipe: str) -> None:
    found = _te_rules(RECIPES[recipe], _world("sm120", "2.19"))
    assert found == (["PREC-MXFP8-SM120"] if recipe == "mxfp8" else [])


def test_grouped_amax_epsilon_needs_te_2_3() -> None:
    """GroupedLinear applies the QParams' amax_epsilon from 2.3 (Linear already in 2.2)."""
    moe = ["model.moe.num_experts=4", "model.moe.grouped_gemm=true", "precision.amax_epsilon=1e-6",
           *RECIPES["tensorwise"]]
    (v,) = check(compose(None, [TE, *moe]), _world("sm90", "2.2"))
    assert v.rule == "PREC-TE-VERSION" and "precision.amax_epsilon" in v.keys and "2.3" in v.fix
    assert check(compose(None, [TE, *moe]), _world("sm90", "2.3")) == []
    dense = [*RECIPES["tensorwise"], "precision.amax_epsilon=1e-6"]
    assert check(compose(None, [TE, *dense]), _world("sm90", "2.2")) == []


def test_auto_never_derives_a_te_config_the_rules_refuse() -> None:
    """``backend=auto`` resolves to te only where ``backend=te`` would pass every rule."""
    configs = {r: (compose(None, o), compose(None, [TE, *o])) for r, o in RECIPES.items()}
    for target in ("sm89", "sm90", "sm100", "sm120"):
        for version in _fake_te.VERSIONS:
            world = _world(target, version)
            for recipe, (cfg, te_cfg) in configs.items():
                te_ok = not [v for v in check(te_cfg, world) if v.severity == "error"]
                assert (auto_backend(cfg, world) == "te") == te_ok, (target, version, recipe)


def test_single_param_env_is_set_only_while_constructing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(te_adapter.SINGLE_PARAM_ENV, "0")
    with _fake_te.installed("2.15"), warnings.catch_warnings():
        warnings.simplefilter("error")  # TE's fall-back warning would fail the test
        m = te_adapter.te_grouped_linear(4, 64, 32, single_grouped_weight=True)
    assert m.single_grouped_weight and tuple(m.weight.shape) == (4, 32, 64)
    assert os.environ[te_adapter.SINGLE_PARAM_ENV] == "0"  # restored


def test_te_that_falls_back_to_per_expert_weights_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(te_adapter.SINGLE_PARAM_ENV, raising=False)
    monkeypatch.setattr(te_adapter, "_single_param_env", lambda enabled: _nullctx())
    with _fake_te.installed("2.15"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(te_adapter.BackendUnavailableError, match="single_grouped_weight"):
            te_adapter.te_grouped_linear(4, 64, 32, single_grouped_weight=True)


def test_te_2_19_single_weight_gets_grouped_tensor_path_and_tensor_splits() -> None:
    with _fake_te.installed("2.19"):
        m = te_adapter.te_grouped_linear(4, 64, 32, single_grouped_weight=True)
        assert m.use_grouped_tensor and m.single_grouped_weight
        m(torch.zeros(8, 64), [1, 3, 0, 4])
    assert isinstance(m._lptrain_last_m_splits, torch.Tensor) and m._lptrain_last_m_splits.dtype == torch.int64
    assert m._lptrain_last_m_splits.tolist() == [1, 3, 0, 4]


@pytest.mark.parametrize(("version", "new_api"), [("2.8", False), ("2.9", True)])
def test_autocast_and_model_init_spellings(version: str, new_api: bool) -> None:
    with _fake_te.installed(version) as mods:
        r, group = object(), object()
        with te_adapter.te_autocast(r, True, group), te_adapter.te_model_init(r):
            pass
        calls = mods["transformer_engine.pytorch"]._lptrain_calls
    names = [c[0] for c in calls]
    assert names == (["autocast", "quantized_model_init"] if new_api else ["fp8_autocast", "fp8_model_init"])
    assert calls[0][1] == {"enabled": True, "recipe": r, "group": group}
    assert calls[1][1] == {"recipe": r, "preserve": True}


def test_te_version_reads_the_imported_package() -> None:
    with _fake_te.installed("2.15"):
        assert te_adapter.te_version() == (2, 15, 0)


def _nullctx():
    import contextlib

    return contextlib.nullcontext()
