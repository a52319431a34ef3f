"""TE recipe construction from config, checked on CPU against a stand-in ``transformer_engine``.

The stand-in mimics the one TE behaviour that matters here (numerics.md 2.3): the
``fp8_quant_*`` QParams of Float8CurrentScaling / Float8BlockScaling are class attributes
that constructor arguments do not set, so ``amax_epsilon`` must be assigned after
construction. The real classes are exercised by the GPU tests in test_te_backend.py.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types

import pytest

from lptrain.config.schema import PrecisionConfig
from lptrain.precision import te_adapter


@pytest.fixture
def fake_te(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    rec = types.ModuleType("transformer_engine.common.recipe")

    class Format(enum.Enum):
        E4M3 = "e4m3"
        HYBRID = "hybrid"

    @dataclasses.dataclass(frozen=True)
    class QParams:
        power_2_scale: bool = False
        amax_epsilon: float = 0.0

    class _Base:
        def __init__(self, **kw):
            for k, v in kw.items():
                if k not in self.FIELDS:  # like pydantic: only annotated fields are settable
                    raise TypeError(k)
                setattr(self, k, v)

    class DelayedScaling(_Base):
        FIELDS = ("margin", "fp8_format", "amax_history_len", "amax_compute_algo")

    class Float8CurrentScaling(_Base):
        FIELDS = ("fp8_format",)
        use_power_2_scales = False
        fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams()

    class Float8BlockScaling(_Base):
        FIELDS = ("fp8_format",)
        fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams(power_2_scale=True)

    class MXFP8BlockScaling(_Base):
        FIELDS = ("fp8_format",)

    class NVFP4BlockScaling(_Base):
        FIELDS = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")

    for name, obj in list(locals().items()):
        if isinstance(obj, type):
            setattr(rec, name, obj)
    te = types.ModuleType("transformer_engine")
    common = types.ModuleType("transformer_engine.common")
    common.recipe = rec
    te.common = common
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", rec)
    return rec


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
