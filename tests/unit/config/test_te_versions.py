"""The TE version table of the rule catalog against Transformer Engine's own Python.

The rules accept a ``backend=te`` config exactly when lptrain's TE adapter builds it on TE's
own Python (kernels emulated) and TE runs its GEMM modules: the newest installed release here,
2.8.0 and 2.18.0 in their subprocesses (tests/e2e/test_te_python_releases.py, which
also holds the single-grouped-weight gate to TE 2.18's untrained experts). Releases without a
published wheel in ``make install``'s matrix are held to TE's source instead: every version
gate is the release TE's tagged source introduces the feature in
(tests/unit/precision/test_te_manifest.py), the recipe classes' first releases included. The
hardware facts (MXFP8 on sm120, blockwise on Blackwell and its CUDA minimum) are checked
against the values read from TE's sources (``_compute_*_support`` in quantization.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from lptrain.config import World, check, compose
from lptrain.config.rulesets.te_backend import auto_backend
from lptrain.config.world import parse_version
from lptrain.precision import te_adapter
from lptrain.testing import te_builds, te_python
from lptrain.testing import te_manifest as M
from lptrain.testing.fake_gpu import virtual_gpu

TE = te_builds.TE
RECIPES = te_builds.RECIPES
SGW = te_builds.SINGLE_GROUPED_WEIGHT
_world = te_builds.world
_te_rules = te_builds.refusals


def _newest() -> str:
    """major.minor of the release the in-process tests run (the newest installed)."""
    return ".".join(str(te_python.default_release()).split(".")[:2])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_rules_accept_a_recipe_exactly_when_that_te_builds_it(recipe: str) -> None:
    refused = _te_rules(RECIPES[recipe], _world(te_builds.GPU[recipe], _newest()))
    assert refused in ([], ["PREC-TE-VERSION"]), refused
    assert (refused == []) == te_builds.builds(RECIPES[recipe], te_builds.GPU[recipe]), (recipe, refused)


def test_rules_accept_single_grouped_weight_exactly_when_that_te_trains_it() -> None:
    refused = _te_rules(SGW, _world("sm100", _newest(), cuda="13.3"))
    assert (refused == []) == te_builds.trains_experts(), refused
    for version in M.versions():  # the table: TE 2.19 first runs the GEMMs on the grouped parameter
        refused = _te_rules(SGW, _world("sm100", version, cuda="13.3"))
        assert (refused == []) == (parse_version(version) >= (2, 19)), version


def test_tensorwise_power_2_choice_and_epsilon_reach_the_qparams() -> None:
    """TE keeps ``use_power_2_scales`` on ``Float8CurrentScaling`` from 2.8 (older releases:
    in the QParams, which the adapter reads when the attribute is absent); the adapter keeps
    the choice and adds ``amax_epsilon`` through the QParams (assigning them takes effect)."""
    cfg = compose(None, [TE, *RECIPES["tensorwise"], "precision.amax_epsilon=1e-12"])
    with virtual_gpu("sm90", te=True):
        r = te_adapter.te_recipe(cfg.precision)
        for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
            assert (q.power_2_scale, q.amax_epsilon) == (r.use_power_2_scales, 1e-12)


def test_nvfp4_on_te_before_2_8_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE before 2.8 has no ``NVFP4BlockScaling`` (no such release is installed: the class is
    taken off the newest release's recipe module)."""
    cfg = compose(None, [TE, *RECIPES["nvfp4"]])
    with virtual_gpu("sm100", te=True):
        import transformer_engine.common.recipe as ter

        monkeypatch.delattr(ter, "NVFP4BlockScaling")
        with pytest.raises(te_adapter.BackendUnavailableError, match=r">= 2\.8"):
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
        for version in M.versions():
            world = _world(target, version)
            for recipe, (cfg, te_cfg) in configs.items():
                te_ok = not [v for v in check(te_cfg, world) if v.severity == "error"]
                assert (auto_backend(cfg, world) == "te") == te_ok, (target, version, recipe)


def test_single_param_env_is_set_only_while_constructing(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE (2.15+) turns ``single_grouped_weight`` off with a warning unless
    ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` > 0 at construction; the adapter sets it for the
    constructor only."""
    monkeypatch.setenv(te_adapter.SINGLE_PARAM_ENV, "0")
    with virtual_gpu("sm100", te=True), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*NVTE_GROUPED_LINEAR_SINGLE_PARAM.*")  # TE's fall-back
        m = te_adapter.te_grouped_linear(4, 64, 32, single_grouped_weight=True)
    assert m.single_grouped_weight and tuple(m.weight.shape) == (4, 32, 64)
    assert os.environ[te_adapter.SINGLE_PARAM_ENV] == "0"  # restored


def test_te_that_falls_back_to_per_expert_weights_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(te_adapter.SINGLE_PARAM_ENV, raising=False)
    monkeypatch.setattr(te_adapter, "_single_param_env", lambda enabled: _nullctx())
    with virtual_gpu("sm100", te=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(te_adapter.BackendUnavailableError, match="single_grouped_weight"):
            te_adapter.te_grouped_linear(4, 64, 32, single_grouped_weight=True)


def test_te_single_weight_gets_grouped_tensor_path_and_tensor_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """From 2.19 a single grouped weight runs TE's grouped-tensor path, which takes CUDA
    ``m_splits``: the adapter hands TE's forward a device int64 tensor."""
    with virtual_gpu("sm100", te=True):
        import transformer_engine.pytorch as te

        seen = []
        real = te.GroupedLinear.forward
        monkeypatch.setattr(te.GroupedLinear, "forward",
                            lambda self, inp, m_splits, *a, **kw: seen.append(m_splits) or real(self, inp, m_splits, *a, **kw))
        m = te_adapter.te_grouped_linear(4, 64, 32, single_grouped_weight=True)
        assert m.use_grouped_tensor and m.single_grouped_weight
        m(torch.zeros(8, 64, device="cuda", dtype=m.weight.dtype), [1, 3, 0, 4])
        (splits,) = seen
        assert isinstance(splits, torch.Tensor) and splits.dtype == torch.int64 and splits.is_cuda
    assert splits.tolist() == [1, 3, 0, 4]


def test_autocast_and_model_init_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE 2.9+ spells them ``autocast`` / ``quantized_model_init`` (the ``fp8_*`` spellings of
    2.8 run in its subprocess: tests/e2e/test_te_python_releases.py); the adapter passes the
    recipe, the amax reduction group and keeps the high-precision init values."""
    with virtual_gpu("sm90", te=True):
        import transformer_engine.pytorch as te

        calls: list[tuple[str, dict]] = []
        for name in ("autocast", "quantized_model_init", "fp8_autocast", "fp8_model_init"):
            real = getattr(te, name)
            monkeypatch.setattr(te, name, lambda *a, _n=name, _f=real, **kw: calls.append((_n, kw)) or _f(*a, **kw))
        r = te_adapter.te_recipe(compose(None, [TE, *RECIPES["delayed"]]).precision)
        with te_adapter.te_autocast(r, True, None), te_adapter.te_model_init(r):
            pass
    assert [c[0] for c in calls] == ["autocast", "quantized_model_init"]
    assert calls[0][1] == {"enabled": True, "recipe": r, "amax_reduction_group": None}
    assert calls[1][1]["recipe"] is r and calls[1][1]["preserve_high_precision_init_val"] is True


def test_te_version_reads_the_imported_package() -> None:
    with virtual_gpu("sm90", te=True):
        assert te_adapter.te_version() == tuple(int(x) for x in str(te_python.version()).split(".")[:3])


def _nullctx():
    import contextlib

    return contextlib.nullcontext()
