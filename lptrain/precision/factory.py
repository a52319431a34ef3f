"""Build the run's layer factory and recipe from ``PrecisionConfig``.

``recipe_from_config`` is the single place where config strings become a recipe object: it
finds the selected recipe's entry in :mod:`lptrain.catalog.recipes`
(``recipes.selected_recipe``) and builds the class that entry names with the fields the entry
says it reads.
``build_factory`` adds the backend, the bf16 first/last layers and quantized primary weights.
Model code only sees the returned ``LayerFactory``.

``precision.backend=auto`` is decided by :func:`lptrain.config.derive.derive` and nowhere
else. A config that went through ``derive`` (everything the CLI and ``pretrain`` build) reaches
the factory with ``te`` or ``emulated``. A direct caller that passes ``auto`` gets exactly what
``derive`` decides for this machine (:func:`runtime_backend` derives the config with
``World.detect()``), or ``emulated`` at once when no CUDA device or no importable Transformer
Engine makes the answer certain.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lptrain.precision.layers import LayerFactory
from lptrain.precision.recipes import RECIPES, config_fields, selected_recipe

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def params_dtype_of(name: str) -> torch.dtype:
    """``precision.params_dtype`` (bf16 | fp16 | fp32) as a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"precision.params_dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def recipe_from_config(cfg: Any) -> Optional[Any]:
    """The emulated ``Recipe`` for ``cfg`` (a ``PrecisionConfig``), or ``None`` if unquantized.

    The recipe gets the fields its catalog entry says it reads (``recipes.config_fields``):
    ``amax_epsilon`` only for the recipes whose scale comes from an amax division (tensorwise,
    blockwise), the history settings only for delayed scaling.
    """
    spec = selected_recipe(cfg)
    if spec is None:
        return None
    return RECIPES[spec.name](**config_fields(spec, cfg))


def runtime_backend(precision_cfg: Any, run_cfg: Optional[Any] = None) -> str:
    """The backend that runs: ``te`` or ``emulated``. ``auto`` (normally already resolved by
    ``derive``) is resolved by ``derive`` here, on ``run_cfg`` (the whole ``LPTrainConfig``;
    without it, on ``precision_cfg`` and default model/run settings) and this machine's world.
    ``te`` without CUDA or TE raises ``BackendUnavailableError`` naming the setting and the
    install hint."""
    from lptrain.precision import te_adapter

    backend = precision_cfg.backend
    if backend == "auto":
        if not te_adapter.te_available():
            return "emulated"
        from lptrain.config import World, derive
        from lptrain.config.schema import LPTrainConfig

        full = run_cfg if run_cfg is not None else LPTrainConfig(precision=precision_cfg)
        backend = derive(full, World.detect()).precision.backend
    return te_adapter.resolve_backend(backend)


def runtime_quantized_gemm(precision_cfg: Any, backend: str, run_cfg: Optional[Any] = None) -> str:
    """What runs the emulated backend's quantized GEMMs: ``dequantized`` or ``scaled_mm``.
    ``auto`` (normally resolved by ``derive``) is resolved for this machine's GPU, the way
    ``derive`` does (:func:`lptrain.catalog.scaled_gemm.resolve`); a CPU run (``run.device``
    cpu, or no CUDA) stays dequantized. Transformer Engine runs its own GEMMs."""
    choice = getattr(precision_cfg, "quantized_gemm", "dequantized")
    if backend == "te":
        return "dequantized"  # unused: TE's modules run their own (scaled) GEMMs
    if choice != "auto":
        return choice
    from lptrain.catalog.scaled_gemm import resolve

    spec = selected_recipe(precision_cfg)
    device = getattr(getattr(run_cfg, "run", None), "device", "auto")
    sm = 0
    if device != "cpu" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        sm = major * 10 + minor
    return resolve("auto", spec.name if spec is not None else None, sm,
                   torch.version.cuda if sm else None, backend)


def build_factory(
    precision_cfg: Any,
    *,
    num_layers: int,
    fuse_wgrad_accumulation: bool = False,
    run_cfg: Optional[Any] = None,
) -> LayerFactory:
    """The run's ``LayerFactory``: recipe, backend (:func:`runtime_backend`), bf16 first/last
    layers, primary weights."""
    from lptrain.precision.te_adapter import te_recipe

    cfg = precision_cfg
    recipe = recipe_from_config(cfg)
    backend = runtime_backend(cfg, run_cfg)
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
        quantized_gemm=runtime_quantized_gemm(cfg, backend, run_cfg) if recipe is not None else "dequantized",
    )
