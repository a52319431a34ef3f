"""Muon and layer-wise distributed optimizer rules."""

from __future__ import annotations

from typing import Any

from lptrain.config.rules import (
    MUON_COEFFICIENTS,
    MUON_SCALE_MODES,
    Rule,
    fp8_on,
    layer_wise,
)
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Muon and the layer-wise distributed optimizer"


def _compact(c: LPTrainConfig) -> bool:
    return layer_wise(c) and c.optimizer.layer_wise_param_layout == "compact"


def _padded(c: LPTrainConfig) -> bool:
    return layer_wise(c) and c.optimizer.layer_wise_param_layout == "padded"


def _bad_hparams(c: LPTrainConfig, w: World) -> dict[str, Any]:
    if c.optimizer.name != "muon":
        return {}
    m = c.optimizer.muon
    bad: list[tuple[str, str]] = []
    if not 0.0 <= m.momentum < 1.0:
        bad.append(("optimizer.muon.momentum", f"momentum={m.momentum} not in [0, 1)"))
    if m.ns_steps < 1:
        bad.append(("optimizer.muon.ns_steps", f"ns_steps={m.ns_steps} < 1"))
    if m.coefficients not in MUON_COEFFICIENTS:
        bad.append(("optimizer.muon.coefficients",
                    f"coefficients={m.coefficients!r} not one of {', '.join(MUON_COEFFICIENTS)}"))
    if m.scale_mode not in MUON_SCALE_MODES:
        bad.append(("optimizer.muon.scale_mode",
                    f"scale_mode={m.scale_mode!r} not one of {', '.join(MUON_SCALE_MODES)}"))
    if not c.optimizer.lr > 0:
        bad.append(("optimizer.lr", f"lr={c.optimizer.lr} must be > 0"))
    if not bad:
        return {}
    return {"keys": tuple(k for k, _ in bad), "detail": "; ".join(d for _, d in bad)}


RULES = [
    Rule(
        "MUON-LAYERWISE", "derived",
        ("optimizer.name", "ddp.use_distributed_optimizer", "optimizer.use_layer_wise_optimizer"),
        lambda c, w: False,
        "Muon with a distributed optimizer uses the layer-wise distributed optimizer",
        "nothing to do: derive() sets optimizer.use_layer_wise_optimizer",
        "optimizer.name=muon and use_distributed_optimizer -> the layer-wise distributed "
        "optimizer is used (optimizer.use_layer_wise_optimizer=true)",
        "Newton-Schulz needs whole matrices, so ownership is per parameter, not per byte range", S),
    Rule(
        "MUON-LAYERWISE-ONE-INSTANCE", "error",
        ("optimizer.use_layer_wise_optimizer", "ddp.num_distributed_optimizer_instances"),
        lambda c, w: layer_wise(c) and c.ddp.num_distributed_optimizer_instances != 1,
        "the layer-wise (Muon) optimizer needs num_distributed_optimizer_instances=1, got "
        "{cfg.ddp.num_distributed_optimizer_instances}: Muon buffers all-reduce within one "
        "instance, so partial sharding would under-reduce Muon gradients",
        "set ddp.num_distributed_optimizer_instances=1",
        "layer-wise optimizer (either layout) -> num_distributed_optimizer_instances == 1",
        "Muon buffers all-reduce within one instance; partial sharding would under-reduce Muon "
        "gradients", S),
    Rule(
        "MUON-COMPACT-NO-FP4PG", "error",
        ("optimizer.layer_wise_param_layout", "precision.fp4_param_gather"),
        lambda c, w: _compact(c) and c.precision.fp4_param_gather,
        "the compact layer-wise layout does not support fp4_param_gather: NVFP4 params would "
        "silently take the raw flatten path",
        "set precision.fp4_param_gather=false",
        "compact layout -> not fp4_param_gather",
        "NVFP4 params would take the raw flatten path silently", S),
    Rule(
        "MUON-COMPACT-FP8PG-RECIPE", "error",
        ("optimizer.layer_wise_param_layout", "precision.fp8_param_gather", "precision.fp8_recipe"),
        lambda c, w: _compact(c) and c.precision.fp8_param_gather and fp8_on(c)
        and c.precision.fp8_recipe not in ("mxfp8", "blockwise"),
        "the compact layer-wise layout gathers FP8 params via bf16 staging + requantize, which is "
        "defined only for mxfp8 and blockwise (fp8_recipe={cfg.precision.fp8_recipe})",
        "set precision.fp8_recipe=mxfp8 (or blockwise), or precision.fp8_param_gather=false",
        "compact layout and fp8_param_gather -> fp8_recipe in {mxfp8, blockwise}",
        "the BF16-staged gather + requantize path is defined only for these", S),
    Rule(
        "MUON-PADDED-NO-PG", "error",
        ("optimizer.layer_wise_param_layout", "precision.fp8_param_gather",
         "precision.fp4_param_gather"),
        lambda c, w: _padded(c) and (c.precision.fp8_param_gather or c.precision.fp4_param_gather),
        "the padded layer-wise layout does not support quantized param gather",
        "set optimizer.layer_wise_param_layout=compact, or precision.fp8_param_gather=false and "
        "precision.fp4_param_gather=false",
        "padded layout -> no fp8_param_gather and no fp4_param_gather", "", S),
    Rule(
        "MUON-COMPACT-NO-MODEL-SPACE", "error",
        ("optimizer.layer_wise_param_layout", "checkpoint.sharding_type"),
        lambda c, w: _compact(c) and c.checkpoint.sharding_type == "fully_sharded_model_space",
        "checkpoint.sharding_type=fully_sharded_model_space cannot describe the compact "
        "layer-wise layout",
        "set checkpoint.sharding_type=dp_reshardable (or fully_reshardable)",
        "compact layout -> checkpoint.sharding_type != fully_sharded_model_space",
        "that format cannot describe the compact layout; fail early instead of deep in the "
        "checkpoint code", S),
    Rule(
        "MUON-GROUPED-FP8PG", "error",
        ("optimizer.layer_wise_param_layout", "precision.fp8_param_gather",
         "model.moe.single_grouped_weight"),
        lambda c, w: _compact(c) and c.precision.fp8_param_gather
        and c.model.moe.single_grouped_weight,
        "the compact layer-wise FP8 copy-back handles plain quantized tensors only, not a single "
        "grouped expert weight",
        "set model.moe.single_grouped_weight=false, or precision.fp8_param_gather=false",
        "compact layout, fp8_param_gather and model.moe.single_grouped_weight",
        "the copy-back path handles plain quantized tensors only", S),
    Rule(
        "MUON-HPARAMS", "error",
        ("optimizer.muon.momentum", "optimizer.muon.ns_steps", "optimizer.muon.coefficients",
         "optimizer.muon.scale_mode", "optimizer.lr"),
        _bad_hparams,
        "invalid Muon hyperparameters (they would fail at the first step): {detail}",
        "use momentum in [0, 1), ns_steps >= 1, coefficients in {{simple, quintic}}, "
        "scale_mode in {{shape_scaling, spectral, unit_rms_norm}}, lr > 0",
        "optimizer.name=muon: momentum in [0, 1), ns_steps >= 1, coefficients and scale_mode "
        "from the known sets, lr > 0",
        "upstream accepted some invalid values and failed at the first step", S),
]
