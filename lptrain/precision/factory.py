"""Build the run's layer factory and recipe from ``PrecisionConfig``.

``recipe_from_config`` is the single place where config strings become a recipe object;
``build_factory`` adds the backend choice (emulated or TE), the bf16 first/last layers and
quantized primary weights. Model code only sees the returned ``LayerFactory``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lptrain.precision.layers import LayerFactory

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def params_dtype_of(name: str) -> torch.dtype:
    """``precision.params_dtype`` (bf16 | fp16 | fp32) as a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"precision.params_dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def recipe_from_config(cfg: Any) -> Optional[Any]:
    """The emulated ``Recipe`` for ``cfg`` (a ``PrecisionConfig``), or ``None`` if unquantized.

    FP4 (``fp4_format``) takes precedence over FP8, as one run has one GEMM recipe.
    ``amax_epsilon`` applies to the recipes whose scale comes from an amax division
    (tensorwise, blockwise); delayed scaling uses its history instead.
    """
    if cfg.fp4_format is None and cfg.fp8_format is None:
        return None
    from lptrain.precision import recipes as R

    if cfg.fp4_format is not None:
        if cfg.fp4_format != "e2m1" or cfg.fp4_recipe != "nvfp4":
            raise ValueError(
                f"precision.fp4_format/fp4_recipe: only e2m1/nvfp4 is supported, got "
                f"{cfg.fp4_format!r}/{cfg.fp4_recipe!r}"
            )
        return R.NVFP4Scaling(**R.nvfp4_config_kwargs(cfg))
    fmt = cfg.fp8_format
    name = cfg.fp8_recipe
    if name == "delayed":
        return R.DelayedScaling(fp8_format=fmt, **R.delayed_config_kwargs(cfg))
    if name == "tensorwise":
        return R.TensorwiseScaling(fp8_format=fmt, amax_epsilon=cfg.amax_epsilon)
    if name == "blockwise":
        return R.BlockwiseScaling(fp8_format=fmt, amax_epsilon=cfg.amax_epsilon)
    if name == "mxfp8":
        return R.MXFP8Scaling(fp8_format=fmt)
    raise ValueError(
        f"precision.fp8_recipe must be delayed, tensorwise, blockwise or mxfp8, got {name!r}"
    )


def build_factory(
    precision_cfg: Any,
    *,
    num_layers: int,
    fuse_wgrad_accumulation: bool = False,
    run_cfg: Optional[Any] = None,
) -> LayerFactory:
    """The run's ``LayerFactory``: recipe, backend, bf16 first/last layers, primary weights.

    ``precision.backend=te`` without CUDA or TE raises ``BackendUnavailableError`` naming the
    setting and the install hint. ``auto`` (normally already resolved by ``derive``) picks TE
    only for a quantized recipe that TE supports on this machine, judged on ``run_cfg`` (the
    whole ``LPTrainConfig``; without it, on ``precision_cfg`` and default model/run
    settings), else the emulated backend -- plain PyTorch GEMMs for an unquantized run.
    """
    from lptrain.precision.te_adapter import resolve_backend, te_recipe

    cfg = precision_cfg
    recipe = recipe_from_config(cfg)
    backend = resolve_backend(cfg.backend, run_cfg if run_cfg is not None else cfg)
    bf16_start = bf16_end = 0
    if cfg.first_last_layers_bf16:
        bf16_start = cfg.num_layers_at_start_in_bf16
        bf16_end = cfg.num_layers_at_end_in_bf16
    return LayerFactory(
        params_dtype=params_dtype_of(cfg.params_dtype),
        fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        recipe=recipe,
        backend=backend,
        te_recipe=te_recipe(cfg) if backend == "te" and recipe is not None else None,
        num_layers=num_layers,
        bf16_layers_at_start=bf16_start,
        bf16_layers_at_end=bf16_end,
        quantized_params=bool(cfg.fp8_param_gather or cfg.fp4_param_gather) and recipe is not None,
    )
