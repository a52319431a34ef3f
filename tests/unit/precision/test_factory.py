"""Factory from PrecisionConfig: recipe per config, backend resolution, layer contexts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lptrain.config.schema import PrecisionConfig
from lptrain.precision import autocast as ac
from lptrain.precision import te_adapter
from lptrain.precision.factory import build_factory, recipe_from_config
from lptrain.precision.layers import GroupedLinear, LayerFactory, Linear

RECIPE_CONFIGS = {
    "delayed": dict(fp8_format="hybrid", fp8_recipe="delayed"),
    "tensorwise": dict(fp8_format="hybrid", fp8_recipe="tensorwise"),
    "blockwise": dict(fp8_format="e4m3", fp8_recipe="blockwise"),
    "mxfp8": dict(fp8_format="e4m3", fp8_recipe="mxfp8"),
    "nvfp4": dict(fp4_format="e2m1", fp4_recipe="nvfp4"),
}


def _cfg(**kw) -> PrecisionConfig:
    return dataclasses.replace(PrecisionConfig(backend="emulated", params_dtype="fp32"), **kw)


def test_unquantized_config_gives_no_recipe_and_unit_alignment() -> None:
    f = build_factory(_cfg(), num_layers=4)
    assert recipe_from_config(_cfg()) is None
    assert f.recipe is None and f.alignment == 1 and f.grouped_alignment == 1
    assert isinstance(f.linear(8, 4), Linear)
    assert isinstance(f.grouped_linear(2, 8, 4), GroupedLinear)
    with f.autocast():
        assert ac.active_recipe() is None


def test_default_layer_factory_is_backward_compatible() -> None:
    f = LayerFactory(params_dtype=torch.float32)
    lin = f.linear(8, 4, name="x")
    assert lin.weight.dtype == torch.float32 and type(lin.weight) is torch.nn.Parameter
    with f.layer_context(1), f.model_init():
        pass


@pytest.mark.parametrize("name", sorted(RECIPE_CONFIGS))
def test_factory_from_config_per_recipe(name: str) -> None:
    cfg = _cfg(**RECIPE_CONFIGS[name])
    f = build_factory(cfg, num_layers=2)
    assert f.backend == "emulated"
    assert f.recipe is not None and f.recipe.name == name
    assert f.alignment == f.recipe.alignment > 1
    assert f.grouped_alignment == f.recipe.grouped_alignment > 1
    # The run's autocast turns this recipe on; layers see it at forward time.
    with f.autocast():
        assert ac.active_recipe() is f.recipe
    assert ac.active_recipe() is None


def test_config_fields_reach_the_recipe() -> None:
    r = recipe_from_config(_cfg(fp8_format="hybrid", fp8_recipe="delayed", fp8_margin=2,
                                fp8_amax_history_len=16, fp8_amax_compute_algo="max"))
    assert (r.margin, r.amax_history_len, r.amax_compute_algo) == (2, 16, "max")
    r = recipe_from_config(_cfg(fp8_format="e4m3", fp8_recipe="blockwise", amax_epsilon=1e-12))
    assert r.amax_epsilon == 1e-12
    r = recipe_from_config(_cfg(fp4_format="e2m1", nvfp4_rht=False,
                                nvfp4_stochastic_rounding=False, nvfp4_2d_weights=False))
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (True,) * 3


def test_bad_recipe_name_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"precision\.fp8_recipe"):
        recipe_from_config(_cfg(fp8_format="e4m3", fp8_recipe="rowwise"))


def test_layer_context_honours_first_last_bf16_layers() -> None:
    cfg = _cfg(**RECIPE_CONFIGS["tensorwise"], first_last_layers_bf16=True,
               num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    f = build_factory(cfg, num_layers=6)
    seen = {}
    with f.autocast():
        for n in range(1, 7):
            with f.layer_context(n):
                seen[n] = ac.active_recipe() is not None
        assert ac.active_recipe() is f.recipe  # restored after each layer
    assert seen == {1: False, 2: True, 3: True, 4: True, 5: False, 6: False}


def test_layer_context_without_bf16_layers_keeps_all_quantized() -> None:
    f = build_factory(_cfg(**RECIPE_CONFIGS["mxfp8"]), num_layers=3)
    with f.autocast():
        for n in (1, 2, 3):
            with f.layer_context(n):
                assert ac.active_recipe() is f.recipe


def test_model_init_only_with_param_gather() -> None:
    f = build_factory(_cfg(**RECIPE_CONFIGS["tensorwise"]), num_layers=1)
    with f.model_init():
        assert ac.model_init_recipe()[0] is None
    f = build_factory(_cfg(**RECIPE_CONFIGS["tensorwise"], fp8_param_gather=True), num_layers=1)
    with f.model_init():
        assert ac.model_init_recipe()[0] is f.recipe
    assert ac.model_init_recipe()[0] is None


def test_params_dtype_from_config() -> None:
    assert build_factory(_cfg(params_dtype="bf16"), num_layers=1).params_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"precision\.params_dtype"):
        build_factory(_cfg(params_dtype="int8"), num_layers=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_te_backend_without_cuda_raises_clear_error() -> None:
    with pytest.raises(te_adapter.BackendUnavailableError) as err:
        build_factory(_cfg(backend="te", **RECIPE_CONFIGS["mxfp8"]), num_layers=1)
    msg = str(err.value)
    assert "precision.backend=te" in msg and "pip install" in msg and "emulated" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks te on CUDA machines with TE")
def test_auto_backend_falls_back_to_emulated() -> None:
    assert build_factory(_cfg(backend="auto"), num_layers=1).backend == "emulated"


def test_unknown_backend_rejected() -> None:
    with pytest.raises(ValueError, match=r"precision\.backend"):
        te_adapter.resolve_backend("cuda")


def test_import_has_no_te_dependency() -> None:
    """A fresh interpreter: this one may hold TE's own Python (the TE-backend tests import it
    once per process)."""
    import subprocess
    import sys

    code = ("import sys, lptrain, lptrain.precision.factory, lptrain.precision.layers, lptrain.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('transformer_engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_te_backend_dispatches_to_te_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend=te: linear/grouped_linear/autocast/model_init/layer_context go through the TE
    adapter (stand-ins record the calls; the real modules are covered by the GPU tests)."""
    calls: list[tuple] = []
    monkeypatch.setattr(te_adapter, "te_linear", lambda i, o, **kw: calls.append(("linear", i, o, kw)))
    monkeypatch.setattr(te_adapter, "te_grouped_linear",
                        lambda n, i, o, **kw: calls.append(("grouped", n, i, o, kw)))

    class _Ctx:
        def __init__(self, tag: str, *a, **kw) -> None:
            self.tag, self.a, self.kw = tag, a, kw

        def __enter__(self):
            calls.append((self.tag, self.a, self.kw))

        def __exit__(self, *exc) -> None:
            return None

    monkeypatch.setattr(te_adapter, "te_autocast", lambda *a, **kw: _Ctx("autocast", *a, **kw))
    monkeypatch.setattr(te_adapter, "te_model_init", lambda *a, **kw: _Ctx("model_init", *a, **kw))
    te_r = object()
    f = LayerFactory(params_dtype=torch.bfloat16, recipe=recipe_from_config(_cfg(**RECIPE_CONFIGS["mxfp8"])),
                     backend="te", te_recipe=te_r, num_layers=2, bf16_layers_at_start=1,
                     quantized_params=True)
    f.linear(64, 32, name="fc")
    f.grouped_linear(4, 64, 32, single_grouped_weight=True)
    with f.model_init(), f.autocast(), f.layer_context(1), f.layer_context(2):
        pass
    assert calls[0] == ("linear", 64, 32, dict(name="fc", params_dtype=torch.bfloat16,
                                               fuse_wgrad_accumulation=False))
    assert calls[1][:4] == ("grouped", 4, 64, 32) and calls[1][4]["single_grouped_weight"]
    assert calls[2] == ("model_init", (te_r,), dict(preserve_high_precision_init_val=True))
    assert calls[3] == ("autocast", (te_r, True, None), {})
    assert calls[4] == ("autocast", (te_r,), dict(enabled=False))  # layer 1 is a bf16 layer
    assert len(calls) == 5  # layer 2 runs quantized: no extra context
