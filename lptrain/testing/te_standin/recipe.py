"""Stand-in ``transformer_engine.common.recipe`` of one TE release.

Per release (read from TE's tagged sources): ``DelayedScaling`` and ``MXFP8BlockScaling``
(all), ``Float8CurrentScaling`` (2.2+; its ``use_power_2_scales`` attribute 2.8+),
``Float8BlockScaling`` (2.3+), ``NVFP4BlockScaling`` (2.8+). As in TE, the ``fp8_quant_*``
QParams are class attributes that constructor arguments do not set (pydantic: only annotated
fields are settable), so lptrain must assign them after construction.

Each recipe knows the lptrain emulated recipe that computes what it would
(:meth:`_to_emulated`); the stand-in modules run their GEMMs through it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any


class Format(enum.Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclasses.dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


class _Recipe:
    _TE_FIELDS: tuple[str, ...] = ()

    def __init__(self, **kw: Any) -> None:
        for k, val in kw.items():
            if k not in self._TE_FIELDS:
                raise TypeError(f"{type(self).__name__} got unexpected keyword {k!r}")
            setattr(self, k, val)

    def delayed(self) -> bool:
        return False

    def _format(self) -> str:
        fmt = getattr(self, "fp8_format", Format.HYBRID)
        return fmt.value if isinstance(fmt, Format) else str(fmt)

    def _to_emulated(self) -> Any:
        raise NotImplementedError


class DelayedScaling(_Recipe):
    _TE_FIELDS = ("margin", "fp8_format", "amax_history_len", "amax_compute_algo", "reduce_amax")
    margin = 0
    amax_history_len = 1024
    amax_compute_algo = "max"
    reduce_amax = True

    def delayed(self) -> bool:
        return True

    def _to_emulated(self) -> Any:
        from lptrain.precision.recipes import DelayedScaling as Emu

        return Emu(fp8_format=self._format(), margin=self.margin, amax_history_len=self.amax_history_len,
                   amax_compute_algo=self.amax_compute_algo, reduce_amax=self.reduce_amax)


class MXFP8BlockScaling(_Recipe):
    _TE_FIELDS = ("fp8_format", "margin")

    def _to_emulated(self) -> Any:
        from lptrain.precision.recipes import MXFP8Scaling

        return MXFP8Scaling(fp8_format=self._format())


class Float8CurrentScaling(_Recipe):
    _TE_FIELDS = ("fp8_format",)
    fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams()

    def _to_emulated(self) -> Any:
        from lptrain.precision.recipes import TensorwiseScaling

        q = self.fp8_quant_fwd_inp
        return TensorwiseScaling(fp8_format=self._format(), power_2_scale=q.power_2_scale,
                                 amax_epsilon=q.amax_epsilon)


class Float8BlockScaling(_Recipe):
    _TE_FIELDS = ("fp8_format",)
    fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams(power_2_scale=True)

    def _to_emulated(self) -> Any:
        from lptrain.precision.recipes import BlockwiseScaling

        return BlockwiseScaling(fp8_format=self._format(), amax_epsilon=self.fp8_quant_fwd_inp.amax_epsilon)


class NVFP4BlockScaling(_Recipe):
    _TE_FIELDS = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")
    disable_rht = False
    disable_stochastic_rounding = False
    disable_2d_quantization = False

    def _to_emulated(self) -> Any:
        return _nvfp4_on_cuda_rng(self)


def _nvfp4_on_cuda_rng(r: NVFP4BlockScaling) -> Any:
    """lptrain's NVFP4 recipe whose stochastic rounding draws from CUDA's default generator
    (as TE's kernels do), instead of per-quantizer generators."""
    from lptrain.precision.recipes import NVFP4Scaling

    from .modules import cuda_generator

    class TEStyleNVFP4(NVFP4Scaling):
        def make_quantizer(self, role: Any, rowwise: bool = True, columnwise: bool = True,
                           generator: Any = None) -> Any:
            sr = role == "grad" and not self.disable_stochastic_rounding
            return super().make_quantizer(role, rowwise, columnwise,
                                          generator=cuda_generator() if sr else generator)

    return TEStyleNVFP4(disable_rht=r.disable_rht,
                        disable_stochastic_rounding=r.disable_stochastic_rounding,
                        disable_2d_quantization=r.disable_2d_quantization)


def make(v: tuple[int, ...]) -> types.ModuleType:
    rec = types.ModuleType("transformer_engine.common.recipe")
    rec.Format, rec.QParams = Format, QParams
    rec.DelayedScaling, rec.MXFP8BlockScaling = DelayedScaling, MXFP8BlockScaling
    if v >= (2, 2):
        cls = Float8CurrentScaling
        if v >= (2, 8):
            cls = type("Float8CurrentScaling", (Float8CurrentScaling,), {"use_power_2_scales": False})
        rec.Float8CurrentScaling = cls
    if v >= (2, 3):
        rec.Float8BlockScaling = Float8BlockScaling
    if v >= (2, 8):
        rec.NVFP4BlockScaling = NVFP4BlockScaling
    for name in ("DelayedScaling", "MXFP8BlockScaling", "Float8CurrentScaling", "Float8BlockScaling",
                 "NVFP4BlockScaling", "Format", "QParams"):
        if hasattr(rec, name):
            getattr(rec, name).__module__ = rec.__name__
    return rec
