"""Muon and layer-wise distributed optimizer rules."""

from __future__ import annotations

from typing import Any

from lptrain.catalog.muon_scaling import update_rms
from lptrain.catalog.ns_coefficients import STEP_RULES, ns_steps_problem, step_rule_text
from lptrain.config.rules import Rule, compact_layout, fp8_on, layer_wise, padded_layout
from lptrain.config.schema import MUON_COEFFICIENTS, MUON_SCALE_MODES, LPTrainConfig
from lptrain.config.world import World

S = "Muon and the layer-wise distributed optimizer"

# Muon's per-element step ``lr * RMS(update)`` in published recipes (RMS from the scale mode,
# for a hidden x hidden matrix: spectral -> extra_scale_factor; shape_scaling and
# unit_rms_norm -> extra_scale_factor / sqrt(hidden)):
#   Moonlight (8K-batch MoE): lr 4.2e-4, spectral x 0.2       -> 8.4e-5
#   Megatron / Emerging-Optimizers: lr 3e-4, spectral x 1.0    -> 3e-4
#   lptrain tiny_cpu calibration: lr 2e-3, spectral x 1.0      -> 2e-3 (best measured 3e-3)
#   Keller / modded-nanogpt: lr 0.02-0.05, shape_scaling, d 768 -> 7e-4 .. 1.8e-3
# so [8e-5, 2e-3]. MUON-LR-SCALE warns a factor 3 beyond either end: Keller's lr 0.02 with
# spectral scaling is a 2e-2 step (measured on tiny_cpu, 400 steps: val 2.507, worse than
# AdamW's 2.345), and an AdamW lr like 1e-3 with shape_scaling at hidden 4096 is 1.6e-5.
MUON_STEP_RANGE = (8e-5, 2e-3)
MUON_STEP_FACTOR = 3.0


def _bad_hparams(c: LPTrainConfig, w: World) -> dict[str, Any]:
    if c.optimizer.name != "muon":
        return {}
    m = c.optimizer.muon
    bad: list[tuple[str, str]] = []
    if not 0.0 <= m.momentum < 1.0:
        bad.append(("optimizer.muon.momentum", f"momentum={m.momentum} not in [0, 1)"))
    problem = ns_steps_problem(m.coefficients, m.ns_steps)
    if problem:
        bad.append(("optimizer.muon.ns_steps", problem))
        if m.ns_steps >= 1:  # the count is fine in itself; the pair is at fault
            bad.append(("optimizer.muon.coefficients", ""))
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
    return {"keys": tuple(k for k, _ in bad), "detail": "; ".join(d for _, d in bad if d)}


def _step_rules_text() -> str:
    return "; ".join(f"{name}: {step_rule_text(name)}" for name in STEP_RULES)


def muon_lr(c: LPTrainConfig) -> float:
    """The Muon group's peak lr: ``optimizer.muon.lr``, else ``optimizer.lr``."""
    m = c.optimizer.muon.lr
    return c.optimizer.lr if m is None else m


def muon_step_size(c: LPTrainConfig) -> float:
    """``lr * RMS(update)`` of a hidden x hidden Muon matrix: the per-element step size."""
    h = c.model.hidden_size
    return muon_lr(c) * update_rms(h, h, c.optimizer.muon.scale_mode,
                                       c.optimizer.muon.extra_scale_factor)


def _lr_scale_mismatch(c: LPTrainConfig, w: World) -> dict[str, Any]:
    o = c.optimizer
    if o.name != "muon" or not muon_lr(c) > 0 or o.muon.scale_mode not in MUON_SCALE_MODES:
        return {}
    if not o.muon.extra_scale_factor > 0 or not c.model.hidden_size > 0:
        return {}
    step = muon_step_size(c)
    lo, hi = MUON_STEP_RANGE
    if step > hi * MUON_STEP_FACTOR:
        side, factor = "above", step / hi
    elif step < lo / MUON_STEP_FACTOR:
        side, factor = "below", lo / step
    else:
        return {}
    rms = step / muon_lr(c)
    return {"step": f"{step:.2g}", "rms": f"{rms:.3g}", "side": side,
            "factor": f"{factor:.1f}", "lr_lo": f"{lo / rms:.1g}", "lr_hi": f"{hi / rms:.1g}"}


RULES = [
    Rule(
        id="MUON-LAYERWISE", severity="derived",
        keys=("optimizer.name", "ddp.use_distributed_optimizer",
              "optimizer.use_layer_wise_optimizer"),
        when=lambda c, w: False,
        message="Muon with a distributed optimizer uses the layer-wise distributed optimizer",
        fix="nothing to do: derive() sets optimizer.use_layer_wise_optimizer",
        condition="optimizer.name=muon and use_distributed_optimizer -> the layer-wise distributed "
                  "optimizer is used (optimizer.use_layer_wise_optimizer=true)",
        why="Newton-Schulz needs whole matrices, so ownership is per parameter, not per byte range",
        section=S,
    ),
    Rule(
        id="MUON-LAYERWISE-ONE-INSTANCE", severity="error",
        keys=("optimizer.use_layer_wise_optimizer", "ddp.num_distributed_optimizer_instances"),
        when=lambda c, w: layer_wise(c) and c.ddp.num_distributed_optimizer_instances != 1,
        message="the layer-wise (Muon) optimizer needs num_distributed_optimizer_instances=1, got "
                "{cfg.ddp.num_distributed_optimizer_instances}: Muon buffers all-reduce within one "
                "instance, so partial sharding would under-reduce Muon gradients",
        fix="set ddp.num_distributed_optimizer_instances=1",
        condition="layer-wise optimizer (either layout) -> num_distributed_optimizer_instances == "
                  "1",
        why="Muon buffers all-reduce within one instance; partial sharding would under-reduce Muon "
            "gradients",
        section=S,
    ),
    Rule(
        id="MUON-COMPACT-NO-FP4PG", severity="error",
        keys=("optimizer.layer_wise_param_layout", "precision.fp4_param_gather"),
        when=lambda c, w: compact_layout(c) and c.precision.fp4_param_gather,
        message="the compact layer-wise layout does not support fp4_param_gather: NVFP4 params "
                "would silently take the raw flatten path",
        fix="set precision.fp4_param_gather=false",
        condition="compact layout -> not fp4_param_gather",
        why="NVFP4 params would take the raw flatten path silently", section=S,
    ),
    Rule(
        id="MUON-COMPACT-FP8PG-RECIPE", severity="error",
        keys=("optimizer.layer_wise_param_layout", "precision.fp8_param_gather",
              "precision.fp8_recipe"),
        when=lambda c, w: compact_layout(c) and c.precision.fp8_param_gather and fp8_on(c)
             and c.precision.fp8_recipe not in ("mxfp8", "blockwise"),
        message="the compact layer-wise layout gathers FP8 params via bf16 staging + requantize, "
                "which is defined only for mxfp8 and blockwise "
                "(fp8_recipe={cfg.precision.fp8_recipe})",
        fix="set precision.fp8_recipe=mxfp8 (or blockwise), or precision.fp8_param_gather=false",
        condition="compact layout and fp8_param_gather -> fp8_recipe in {mxfp8, blockwise}",
        why="the BF16-staged gather + requantize path is defined only for these", section=S,
    ),
    Rule(
        id="MUON-PADDED-NO-PG", severity="error",
        keys=("optimizer.layer_wise_param_layout", "precision.fp8_param_gather",
              "precision.fp4_param_gather"),
        when=lambda c, w: padded_layout(c) and (c.precision.fp8_param_gather or c.precision.fp4_param_gather),
        message="the padded layer-wise layout does not support quantized param gather",
        fix="set optimizer.layer_wise_param_layout=compact, or precision.fp8_param_gather=false "
            "and precision.fp4_param_gather=false",
        condition="padded layout -> no fp8_param_gather and no fp4_param_gather", section=S,
    ),
    Rule(
        id="MUON-COMPACT-NO-MODEL-SPACE", severity="error",
        keys=("optimizer.layer_wise_param_layout", "checkpoint.sharding_type"),
        when=lambda c, w: compact_layout(c) and c.checkpoint.sharding_type == "fully_sharded_model_space",
        message="checkpoint.sharding_type=fully_sharded_model_space cannot describe the compact "
                "layer-wise layout",
        fix="set checkpoint.sharding_type=dp_reshardable (or fully_reshardable)",
        condition="compact layout -> checkpoint.sharding_type != fully_sharded_model_space",
        why="that format cannot describe the compact layout; fail early instead of deep in the "
            "checkpoint code",
        section=S,
    ),
    Rule(
        id="MUON-GROUPED-FP8PG", severity="error",
        keys=("optimizer.layer_wise_param_layout", "precision.fp8_param_gather",
              "model.moe.single_grouped_weight"),
        when=lambda c, w: compact_layout(c) and c.precision.fp8_param_gather
             and c.model.moe.single_grouped_weight,
        message="the compact layer-wise FP8 copy-back handles plain quantized tensors only, not a "
                "single grouped expert weight",
        fix="set model.moe.single_grouped_weight=false, or precision.fp8_param_gather=false",
        condition="compact layout, fp8_param_gather and model.moe.single_grouped_weight",
        why="the copy-back path handles plain quantized tensors only", section=S,
    ),
    Rule(
        id="MUON-HPARAMS", severity="error",
        keys=("optimizer.muon.momentum", "optimizer.muon.ns_steps", "optimizer.muon.coefficients",
              "optimizer.muon.scale_mode", "optimizer.lr"),
        when=_bad_hparams,
        message="invalid Muon hyperparameters (they would fail at the first step): {detail}",
        fix="use momentum in [0, 1), coefficients in {{" + ", ".join(MUON_COEFFICIENTS) + "}} with "
            "ns_steps " + _step_rules_text() + ", scale_mode in {{"
            + ", ".join(MUON_SCALE_MODES) + "}}, lr > 0",
        condition="optimizer.name=muon: momentum in [0, 1), coefficients and scale_mode from the known "
                  "sets, ns_steps allowed for the coefficient set (" + _step_rules_text() + "), lr > 0",
        why="upstream accepted some invalid values and failed at the first step; the step-count "
            "rules are upstream's (quintic's 5 tuples are tuned as one sequence; polar_express's 8 "
            "tuples must all run before its last one repeats); aol's 4 tuples run once: its first "
            "tuple maps a singular value of 1 to -0.585, so a second cycle flips the update",
        section=S,
    ),
    Rule(
        id="MUON-LR-SCALE", severity="warning",
        keys=("optimizer.lr", "optimizer.muon.lr", "optimizer.muon.scale_mode",
              "optimizer.muon.extra_scale_factor"),
        when=_lr_scale_mismatch,
        message="Muon's per-element step lr * update RMS = {step} (scale_mode "
                "{cfg.optimizer.muon.scale_mode}, update RMS {rms} at hidden "
                "{cfg.model.hidden_size}) is {factor}x {side} the "
                f"{MUON_STEP_RANGE[0]:g}..{MUON_STEP_RANGE[1]:g} that published Muon recipes use "
                f"(warned beyond {MUON_STEP_FACTOR:g}x). The lr is tuned for another "
                "scale mode (spectral wants AdamW-like lr ~1e-3, shape_scaling Keller's ~0.02), and "
                "the same lr also drives the AdamW-managed embeddings, output head and norms",
        fix="set optimizer.lr within {lr_lo}..{lr_hi} (min_lr about lr/10) for scale_mode "
            "{cfg.optimizer.muon.scale_mode}, or keep an AdamW-like lr and set "
            "optimizer.muon.scale_mode=spectral (update RMS 1, made to share AdamW's lr)",
        condition="optimizer.name=muon: lr * RMS(update) of a hidden x hidden matrix within "
                  "[8e-5/3, 2e-3*3]; RMS = extra_scale_factor (spectral) or "
                  "extra_scale_factor/sqrt(hidden) (shape_scaling, unit_rms_norm)",
        why="published recipes step 8e-5 (Moonlight: lr 4.2e-4, spectral x 0.2) to 2e-3 (Keller: "
            "lr 0.05, shape_scaling, d 768) per element; Keller's lr 0.02 with spectral scaling "
            "steps 2e-2 and trained worse than AdamW on tiny_cpu (400 steps: val 2.507 vs 2.345; "
            "Muon lr 1e-3: 2.134)",
        section=S,
    ),
]
