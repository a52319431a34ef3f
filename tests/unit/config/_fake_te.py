"""A stand-in ``transformer_engine`` package of a chosen version, for CPU tests.

It reproduces, per release, the parts of TE's Python surface that lptrain's adapter touches
and that changed between 2.2 and 2.19 (read from TE's tagged sources):

- recipe classes: ``DelayedScaling`` and ``MXFP8BlockScaling`` (all), ``Float8CurrentScaling``
  (2.2+; its ``use_power_2_scales`` attribute 2.8+), ``Float8BlockScaling`` (2.3+),
  ``NVFP4BlockScaling`` (2.8+); the ``fp8_quant_*`` QParams are class attributes that
  constructor arguments do not set;
- ``GroupedLinear``: ``single_grouped_weight`` 2.14+; from 2.15 honoured only when
  ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` > 0 at construction (else turned off with a
  warning); ``use_grouped_tensor`` 2.19+, required by single grouped weights, whose native
  path rejects host ``m_splits``;
- ``autocast`` / ``quantized_model_init`` 2.9+ (``fp8_autocast`` / ``fp8_model_init`` always).

Modules are CPU ``nn.Module``s that record their constructor arguments; nothing numeric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

VERSIONS = ("2.2", "2.3", "2.7", "2.8", "2.9", "2.13", "2.14", "2.15", "2.18", "2.19")


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def make(version: str) -> dict[str, types.ModuleType]:
    """The ``sys.modules`` entries of a stand-in TE ``version``."""
    v = _v(version)
    rec = types.ModuleType("transformer_engine.common.recipe")

    class Format(enum.Enum):
        E4M3 = "e4m3"
        HYBRID = "hybrid"

    @dataclasses.dataclass(frozen=True)
    class QParams:
        power_2_scale: bool = False
        amax_epsilon: float = 0.0

    class _Recipe:
        FIELDS: tuple[str, ...] = ()

        def __init__(self, **kw: Any) -> None:
            for k, val in kw.items():
                if k not in self.FIELDS:  # pydantic: only annotated fields are settable
                    raise TypeError(f"{type(self).__name__} got unexpected keyword {k!r}")
                setattr(self, k, val)

    class DelayedScaling(_Recipe):
        FIELDS = ("margin", "fp8_format", "amax_history_len", "amax_compute_algo", "reduce_amax")

    class MXFP8BlockScaling(_Recipe):
        FIELDS = ("fp8_format", "margin")

    rec.Format, rec.QParams = Format, QParams
    rec.DelayedScaling, rec.MXFP8BlockScaling = DelayedScaling, MXFP8BlockScaling
    if v >= (2, 2):

        class Float8CurrentScaling(_Recipe):
            FIELDS = ("fp8_format",)
            fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams()

        if v >= (2, 8):
            Float8CurrentScaling.use_power_2_scales = False
        rec.Float8CurrentScaling = Float8CurrentScaling
    if v >= (2, 3):

        class Float8BlockScaling(_Recipe):
            FIELDS = ("fp8_format",)
            fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams(power_2_scale=True)

        rec.Float8BlockScaling = Float8BlockScaling
    if v >= (2, 8):

        class NVFP4BlockScaling(_Recipe):
            FIELDS = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")

        rec.NVFP4BlockScaling = NVFP4BlockScaling

    pt = types.ModuleType("transformer_engine.pytorch")

    class _Module(nn.Module):
        def __init__(self, *args: Any, device: Any = "cuda", **kw: Any) -> None:
            super().__init__()
            self.args, self.kw, self.device_arg = args, kw, device
            self.fuse_wgrad_accumulation = kw.get("fuse_wgrad_accumulation", False)
            self.fake_version = v

    class Linear(_Module):
        def __init__(self, in_features: int, out_features: int, bias: bool = True,
                     init_method: Any = None, params_dtype: Any = None,
                     fuse_wgrad_accumulation: bool = False, device: Any = "cuda",
                     name: Optional[str] = None) -> None:
            super().__init__(in_features, out_features, device=device, name=name,
                             fuse_wgrad_accumulation=fuse_wgrad_accumulation)
            self.weight = nn.Parameter(torch.zeros(out_features, in_features))

    if v < (2, 3):  # ``name`` arrived in 2.3

        class Linear(Linear):  # type: ignore[no-redef]
            def __init__(self, in_features: int, out_features: int, bias: bool = True,
                         init_method: Any = None, params_dtype: Any = None,
                         fuse_wgrad_accumulation: bool = False, device: Any = "cuda") -> None:
                super().__init__(in_features, out_features, bias, init_method, params_dtype,
                                 fuse_wgrad_accumulation, device)

    def _grouped_init(self: Any, num_gemms: int, in_features: int, out_features: int,
                      kw: dict[str, Any]) -> None:
        single = kw.pop("single_grouped_weight", False)
        if v >= (2, 15) and single and int(os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "0")) <= 0:
            warnings.warn("NVTE_GROUPED_LINEAR_SINGLE_PARAM is not set; falling back", UserWarning,
                          stacklevel=3)
            single = False
        self.single_grouped_weight = single
        self.use_grouped_tensor = bool(kw.pop("use_grouped_tensor", None) or False)
        self.num_gemms = num_gemms
        if single:
            self.weight = nn.Parameter(torch.zeros(num_gemms, out_features, in_features))
        else:
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", nn.Parameter(torch.zeros(out_features, in_features)))

    def _grouped_forward(self: Any, inp: torch.Tensor, m_splits: Any) -> torch.Tensor:
        if self.single_grouped_weight and v >= (2, 19) and not self.use_grouped_tensor:
            raise RuntimeError("single_grouped_weight and single_grouped_bias require use_grouped_tensor=True")
        if self.use_grouped_tensor and not isinstance(m_splits, torch.Tensor):
            raise ValueError("The native grouped_tensor path requires CUDA m_splits")
        self.last_m_splits = m_splits
        return inp


    class GroupedLinear(_Module):
        """2.19+: ``single_grouped_weight`` and ``use_grouped_tensor``."""

        def __init__(self, num_gemms: int, in_features: int, out_features: int,
                     bias: bool = True, init_method: Any = None, params_dtype: Any = None,
                     fuse_wgrad_accumulation: bool = False, device: Any = "cuda",
                     single_grouped_weight: bool = False, name: Optional[str] = None,
                     use_grouped_tensor: Optional[bool] = None) -> None:
            super().__init__(num_gemms, in_features, out_features, device=device, name=name,
                             fuse_wgrad_accumulation=fuse_wgrad_accumulation)
            _grouped_init(self, num_gemms, in_features, out_features,
                          {"single_grouped_weight": single_grouped_weight,
                           "use_grouped_tensor": use_grouped_tensor})

        forward = _grouped_forward

    if (2, 14) <= v < (2, 19):

        class GroupedLinear(GroupedLinear):  # type: ignore[no-redef]
            def __init__(self, num_gemms: int, in_features: int, out_features: int,
                         bias: bool = True, init_method: Any = None, params_dtype: Any = None,
                         fuse_wgrad_accumulation: bool = False, device: Any = "cuda",
                         single_grouped_weight: bool = False, name: Optional[str] = None) -> None:
                super().__init__(num_gemms, in_features, out_features, bias, init_method,
                                 params_dtype, fuse_wgrad_accumulation, device,
                                 single_grouped_weight, name)
    elif v < (2, 14):

        class GroupedLinear(GroupedLinear):  # type: ignore[no-redef]
            def __init__(self, num_gemms: int, in_features: int, out_features: int,
                         bias: bool = True, init_method: Any = None, params_dtype: Any = None,
                         fuse_wgrad_accumulation: bool = False, device: Any = "cuda") -> None:
                super().__init__(num_gemms, in_features, out_features, bias, init_method,
                                 params_dtype, fuse_wgrad_accumulation, device)

    calls: list[tuple[str, dict[str, Any]]] = []

    @contextlib.contextmanager
    def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Any = None,
                     fp8_group: Any = None) -> Iterator[None]:
        calls.append(("fp8_autocast", {"enabled": enabled, "recipe": fp8_recipe, "group": fp8_group}))
        yield

    @contextlib.contextmanager
    def fp8_model_init(enabled: bool = True, recipe: Any = None,
                       preserve_high_precision_init_val: bool = False) -> Iterator[None]:
        calls.append(("fp8_model_init", {"recipe": recipe, "preserve": preserve_high_precision_init_val}))
        yield

    pt.Linear, pt.GroupedLinear = Linear, GroupedLinear
    pt.fp8_autocast, pt.fp8_model_init, pt.calls = fp8_autocast, fp8_model_init, calls
    if v >= (2, 9):

        @contextlib.contextmanager
        def autocast(enabled: bool = True, calibrating: bool = False, recipe: Any = None,
                     amax_reduction_group: Any = None) -> Iterator[None]:
            calls.append(("autocast", {"enabled": enabled, "recipe": recipe, "group": amax_reduction_group}))
            yield

        @contextlib.contextmanager
        def quantized_model_init(enabled: bool = True, recipe: Any = None,
                                 preserve_high_precision_init_val: bool = False) -> Iterator[None]:
            calls.append(("quantized_model_init",
                          {"recipe": recipe, "preserve": preserve_high_precision_init_val}))
            yield

        pt.autocast, pt.quantized_model_init = autocast, quantized_model_init

    te = types.ModuleType("transformer_engine")
    te.__version__ = f"{version}.0"
    common = types.ModuleType("transformer_engine.common")
    common.recipe = rec
    te.common, te.pytorch = common, pt
    return {
        "transformer_engine": te,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": rec,
        "transformer_engine.pytorch": pt,
    }


@contextlib.contextmanager
def installed(version: str) -> Iterator[dict[str, types.ModuleType]]:
    """Make the stand-in TE ``version`` importable for the duration of the block."""
    from lptrain.precision import te_adapter

    mods = make(version)
    saved = {k: sys.modules.get(k) for k in mods}
    sys.modules.update(mods)
    te_adapter._te_grouped_linear_cls.cache_clear()
    try:
        yield mods
    finally:
        te_adapter._te_grouped_linear_cls.cache_clear()
        for k, old in saved.items():
            if old is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = old
