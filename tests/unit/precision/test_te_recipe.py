"""TE recipe construction from config, checked on CPU against TE's own recipe classes (TE's
own Python, newest release installed: ``lptrain.testing.te_python``).

The one TE behaviour that matters here: the ``fp8_quant_*`` QParams of Float8CurrentScaling /
Float8BlockScaling are class attributes that constructor arguments do not set, so
``amax_epsilon`` must be assigned after construction.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator

import pytest

from lptrain.config.schema import PrecisionConfig
from lptrain.precision import te_adapter
from lptrain.testing import te_python


@pytest.fixture
def fake_te() -> Iterator[types.ModuleType]:
    with te_python.installed():
        import transformer_engine.common.recipe as ter

        yield ter


def _cfg(**kw) -> PrecisionConfig:
    return dataclasses.replace(PrecisionConfig(), **kw)


def test_te_recipes_from_config(fake_te: types.ModuleType) -> None:
    assert te_adapter.te_recipe(_cfg()) is None
    r = te_adapter.te_recipe(_cfg(fp8_format="hybrid", fp8_recipe="delayed", fp8_margin=1,
                                  fp8_amax_history_len=8, fp8_amax_compute_algo="max"))
    assert isinstance(r, fake_te.DelayedScaling) and r.fp8_format is fake_te.Format.HYBRID
    assert (r.margin, r.amax_history_len, r.amax_compute_algo) == (1, 8, "max")
    assert isinstance(te_adapter.te_recipe(_cfg(fp8_format="e4m3", fp8_recipe="mxfp8")),
                      fake_te.MXFP8BlockScaling)
    r = te_adapter.te_recipe(_cfg(fp4_format="e2m1", nvfp4_rht=False))
    assert isinstance(r, fake_te.NVFP4BlockScaling)
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (True, False, False)


@pytest.mark.parametrize("name, pow2", [("tensorwise", False), ("blockwise", True)])
def test_amax_epsilon_is_assigned_after_construction(fake_te: types.ModuleType, name: str, pow2: bool) -> None:
    r = te_adapter.te_recipe(_cfg(fp8_format="e4m3", fp8_recipe=name, amax_epsilon=1e-12))
    for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        q = getattr(r, attr)
        assert q.amax_epsilon == 1e-12 and q.power_2_scale is pow2
    # The class default is untouched (assignment is per instance).
    assert type(r).fp8_quant_bwd_grad.amax_epsilon == 0.0


def test_te_module_kwargs_unknown_to_older_te_are_dropped() -> None:
    """``name`` / ``single_grouped_weight`` only reach TE modules whose constructor has them."""

    class OldLinear:
        def __init__(self, i: int, o: int, bias: bool = True) -> None:
            self.args = (i, o, bias)

    class NewLinear:
        def __init__(self, i: int, o: int, bias: bool = True, name: str | None = None) -> None:
            self.args = (i, o, bias, name)

    assert te_adapter._call(OldLinear, 4, 2, bias=False, name="fc").args == (4, 2, False)
    assert te_adapter._call(NewLinear, 4, 2, bias=False, name="fc").args == (4, 2, False, "fc")
    with pytest.raises(TypeError):  # anything else unknown still fails loudly
        te_adapter._call(OldLinear, 4, 2, params_dtype=None)
