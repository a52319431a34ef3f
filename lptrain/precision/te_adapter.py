"""Transformer Engine backend: TE modules, TE recipe objects and TE contexts from lptrain config.

Everything here imports ``transformer_engine`` lazily, inside functions, so ``import lptrain``
and every emulated path work on machines without TE or CUDA. The factory calls
:func:`resolve_backend` once; only when it answers ``"te"`` does any other function here run.

Recipe construction follows numerics.md 2.3: some TE recipes declare their ``QParams``
(``fp8_quant_fwd_inp`` / ``_fwd_weight`` / ``_bwd_grad``) as un-annotated class attributes,
so constructor arguments do not set them; ``amax_epsilon`` (and the blockwise pow2 choice)
is applied by assigning the attributes after construction.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import nn

INSTALL_HINT = (
    "install Transformer Engine on a CUDA machine with `pip install 'lptrain[te]'` "
    "(or `pip install --no-build-isolation transformer_engine[pytorch]`), or set "
    "precision.backend=emulated (or auto) to run the bit-faithful CPU emulation"
)


class BackendUnavailableError(RuntimeError):
    """``precision.backend=te`` was requested where TE or CUDA is missing."""


def te_importable() -> bool:
    """Whether ``transformer_engine.pytorch`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def te_available() -> bool:
    """CUDA present and ``transformer_engine.pytorch`` importable."""
    if not torch.cuda.is_available() or not te_importable():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(backend: str) -> str:
    """Map ``precision.backend`` (auto | te | emulated) to the backend that will run.

    ``auto`` picks te when CUDA and TE are both present, else emulated. ``te`` without them
    raises :class:`BackendUnavailableError` naming the setting and the install hint.
    """
    if backend == "emulated":
        return "emulated"
    if backend == "auto":
        return "te" if te_available() else "emulated"
    if backend == "te":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "precision.backend=te needs a CUDA device, but torch.cuda.is_available() is "
                f"False; {INSTALL_HINT}"
            )
        if not te_available():
            raise BackendUnavailableError(
                "precision.backend=te needs Transformer Engine, but transformer_engine.pytorch "
                f"cannot be imported; {INSTALL_HINT}"
            )
        return "te"
    raise ValueError(f"precision.backend must be auto, te or emulated, got {backend!r}")


def te_recipe(cfg: Any) -> Optional[Any]:
    """The TE recipe object for a ``PrecisionConfig`` (``None`` when unquantized)."""
    from transformer_engine.common import recipe as ter

    from lptrain.precision import recipes as _R

    if cfg.fp4_format is not None:
        return ter.NVFP4BlockScaling(**_R.nvfp4_config_kwargs(cfg))
    if cfg.fp8_format is None:
        return None
    fmt = ter.Format.HYBRID if cfg.fp8_format == "hybrid" else ter.Format.E4M3
    name = cfg.fp8_recipe
    if name == "delayed":
        return ter.DelayedScaling(fp8_format=fmt, **_R.delayed_config_kwargs(cfg))
    if name == "tensorwise":
        r = ter.Float8CurrentScaling(fp8_format=fmt)
        _set_qparams(r, ter, power_2=r.use_power_2_scales, eps=cfg.amax_epsilon)
        return r
    if name == "blockwise":
        r = ter.Float8BlockScaling(fp8_format=fmt)
        # Pow2 is on by default (env NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset); keep what the
        # class attribute says and only add the epsilon (assigning is what takes effect).
        _set_qparams(r, ter, power_2=r.fp8_quant_fwd_inp.power_2_scale, eps=cfg.amax_epsilon)
        return r
    if name == "mxfp8":
        return ter.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"precision.fp8_recipe must be delayed, tensorwise, blockwise or mxfp8, got {name!r}")


def _set_qparams(r: Any, ter: Any, *, power_2: bool, eps: float) -> None:
    """Assign the three fp8 QParams after construction (numerics.md 2.3 pitfall)."""
    for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        setattr(r, attr, ter.QParams(power_2_scale=power_2, amax_epsilon=float(eps)))


@contextlib.contextmanager
def te_autocast(recipe: Any, enabled: bool = True, amax_reduction_group: Any = None) -> Iterator[None]:
    """``te.pytorch.autocast`` (``fp8_autocast`` on older TE)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        ctx = te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)
    else:  # older TE: only the deprecated spelling exists
        ctx = te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)
    with ctx:
        yield


@contextlib.contextmanager
def te_model_init(recipe: Any, preserve_high_precision_init_val: bool = True) -> Iterator[None]:
    """``te.pytorch.quantized_model_init`` (``fp8_model_init`` on older TE)."""
    import transformer_engine.pytorch as te

    fn = getattr(te, "quantized_model_init", None) or te.fp8_model_init
    with fn(enabled=True, recipe=recipe,
            preserve_high_precision_init_val=preserve_high_precision_init_val):
        yield


def _call(cls: Any, *args: Any, **kw: Any) -> Any:
    """Construct a TE module, dropping optional kwargs this TE version does not know
    (``name`` and ``single_grouped_weight`` are recent additions)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for opt in ("name", "single_grouped_weight"):
            if opt in kw and opt not in params:
                kw.pop(opt)
    return cls(*args, **kw)


def _te_module(
    cls: Any,
    *args: Any,
    params_dtype: torch.dtype,
    init_method: Optional[Callable[[torch.Tensor], None]],
    fuse_wgrad_accumulation: bool,
    name: str,
    **kw: Any,
) -> nn.Module:
    """One TE module on the current CUDA device with the arguments every lptrain TE layer
    shares (dtype, init, fused wgrad accumulation, optional name); ``kw`` adds the rest."""
    return _call(
        cls,
        *args,
        init_method=init_method,
        params_dtype=params_dtype,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        device="cuda",
        name=name or None,
        **kw,
    )


def te_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool = False,
    params_dtype: torch.dtype = torch.bfloat16,
    init_method: Optional[Callable[[torch.Tensor], None]] = None,
    fuse_wgrad_accumulation: bool = False,
    name: str = "",
) -> nn.Module:
    """A ``te.pytorch.Linear`` on the current CUDA device."""
    import transformer_engine.pytorch as te

    return _te_module(
        te.Linear,
        in_features,
        out_features,
        bias=bias,
        params_dtype=params_dtype,
        init_method=init_method,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        name=name,
    )


@functools.cache
def _te_grouped_linear_cls() -> type:
    """``te.pytorch.GroupedLinear`` plus lptrain's ``member_weight`` accessor (made once)."""
    import transformer_engine.pytorch as te

    class TEGroupedLinear(te.GroupedLinear):
        def member_weight(self, i: int) -> torch.Tensor:
            if getattr(self, "single_grouped_weight", False):
                return self.weight[i]
            return getattr(self, f"weight{i}")

    return TEGroupedLinear


def te_grouped_linear(
    num_gemms: int,
    in_features: int,
    out_features: int,
    *,
    single_grouped_weight: bool = False,
    params_dtype: torch.dtype = torch.bfloat16,
    init_method: Optional[Callable[[torch.Tensor], None]] = None,
    fuse_wgrad_accumulation: bool = False,
    name: str = "",
) -> nn.Module:
    """A ``te.pytorch.GroupedLinear`` (bias-free) with lptrain's ``member_weight`` accessor."""
    kw: dict[str, Any] = {}
    if single_grouped_weight:
        kw["single_grouped_weight"] = True
    return _te_module(
        _te_grouped_linear_cls(),
        num_gemms,
        in_features,
        out_features,
        bias=False,
        params_dtype=params_dtype,
        init_method=init_method,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        name=name,
        **kw,
    )


def te_layernorm_linear(
    in_features: int,
    out_features: int,
    *,
    eps: float = 1e-5,
    normalization: str = "RMSNorm",
    params_dtype: torch.dtype = torch.bfloat16,
    init_method: Optional[Callable[[torch.Tensor], None]] = None,
    fuse_wgrad_accumulation: bool = False,
    name: str = "",
) -> nn.Module:
    """A ``te.pytorch.LayerNormLinear`` (norm fused into the GEMM's input cast)."""
    import transformer_engine.pytorch as te

    return _te_module(
        te.LayerNormLinear,
        in_features,
        out_features,
        eps=eps,
        bias=False,
        normalization=normalization,
        params_dtype=params_dtype,
        init_method=init_method,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        name=name,
    )
