"""Value-set rules: every string-valued choice is one of its known values.

The allowed values are the schema's declaration (:func:`lptrain.config.schema.choice`; the
recipe names come from the recipe catalog). Without these rules a typo such as
``precision.fp8_recipe=mxfp88`` would silently disable the rules keyed on it.
"""

from __future__ import annotations

from typing import Any

from lptrain.config.rules import Rule, bad_choices
from lptrain.config.schema import LPTrainConfig, choices_of, show_value
from lptrain.config.world import World

S = "Known value sets"


def choice_table(*keys: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """``(key, allowed values)`` of choice keys, the values as the schema declares them."""
    return tuple((k, choices_of(k)) for k in keys)


PRECISION_CHOICES = choice_table(
    "precision.params_dtype", "precision.backend", "precision.fp8_format", "precision.fp8_recipe",
    "precision.fp4_format", "precision.fp4_recipe", "precision.fp8_amax_compute_algo",
    "precision.quantized_gemm",
)
OPTIMIZER_CHOICES = choice_table(
    "optimizer.name", "optimizer.layer_wise_param_layout", "optimizer.lr_schedule",
    "optimizer.muon.scalar_optimizer", "optimizer.muon.tp_mode", "optimizer.main_grads_dtype",
    "optimizer.main_params_dtype", "optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype",
)
MOE_CHOICES = choice_table("model.moe.load_balancing_type", "model.moe.score_function")
MODEL_CHOICES = choice_table("model.recompute_granularity", "model.recompute_method",
                             "model.pipeline_schedule")
DDP_CHOICES = choice_table("ddp.data_parallel_sharding_strategy")
RUN_CHOICES = choice_table("run.device", "logging.wandb_mode")
TRAIN_CHOICES = choice_table("train.on_anomaly", "debug.nan_tensor")


def _opt_values_bad(c: LPTrainConfig, w: World) -> dict[str, Any]:
    o = c.optimizer
    bad: list[tuple[str, str]] = []
    if not o.lr > 0 and o.name != "muon":  # for Muon, MUON-HPARAMS reports it
        bad.append(("optimizer.lr", f"lr={o.lr} must be > 0"))
    if not 0 <= o.min_lr <= max(o.lr, 0):
        bad.append(("optimizer.min_lr", f"min_lr={o.min_lr} must be in [0, lr]"))
    for key, value in (("optimizer.adam_beta1", o.adam_beta1), ("optimizer.adam_beta2", o.adam_beta2),
                       ("optimizer.lion_beta1", o.lion_beta1), ("optimizer.lion_beta2", o.lion_beta2)):
        if not 0 <= value < 1:
            bad.append((key, f"{key.split('.')[-1]}={value} must be in [0, 1)"))
    if not o.adam_eps > 0:
        bad.append(("optimizer.adam_eps", f"adam_eps={o.adam_eps} must be > 0"))
    for key, value in (("optimizer.weight_decay", o.weight_decay),
                       ("optimizer.clip_grad", o.clip_grad),
                       ("optimizer.warmup_iters", o.warmup_iters)):
        if value < 0:
            bad.append((key, f"{key.split('.')[-1]}={value} must be >= 0"))
    if o.decay_iters is not None and o.decay_iters <= 0:
        bad.append(("optimizer.decay_iters", f"decay_iters={o.decay_iters} must be > 0 or null"))
    if not bad:
        return {}
    return {"keys": tuple(k for k, _ in bad), "detail": "; ".join(d for _, d in bad)}


def _choices_rule(rule_id: str, table: Any, what: str) -> Rule:
    keys = tuple(k for k, _ in table)
    sets = "; ".join(
        f"{k.split('.', 1)[1]} in {{{', '.join(show_value(v) for v in vals)}}}"
        for k, vals in table
    )
    return Rule(
        id=rule_id, severity="error", keys=keys, when=lambda c, w: bad_choices(c, table),
        message=f"unknown {what} setting: {{bad}}",
        fix="use one of the listed values (see `lptrain show-config --explain`)", condition=sets,
        why="a typo would otherwise silently switch the feature off", section=S,
    )


RULES = [
    _choices_rule("PREC-CHOICES", PRECISION_CHOICES, "precision"),
    _choices_rule("OPT-CHOICES", OPTIMIZER_CHOICES, "optimizer"),
    _choices_rule("MOE-CHOICES", MOE_CHOICES, "MoE"),
    _choices_rule("MODEL-CHOICES", MODEL_CHOICES, "model (recompute, pipeline schedule)"),
    _choices_rule("DDP-CHOICES", DDP_CHOICES, "data-parallel"),
    _choices_rule("RUN-CHOICES", RUN_CHOICES, "run/logging"),
    _choices_rule("TRAIN-CHOICES", TRAIN_CHOICES, "anomaly handling"),
    Rule(
        id="OPT-VALUES", severity="error",
        keys=("optimizer.lr", "optimizer.min_lr", "optimizer.adam_beta1", "optimizer.adam_beta2",
              "optimizer.lion_beta1", "optimizer.lion_beta2",
              "optimizer.adam_eps", "optimizer.weight_decay", "optimizer.clip_grad",
              "optimizer.warmup_iters", "optimizer.decay_iters"),
        when=_opt_values_bad, message="invalid optimizer hyperparameters: {detail}",
        fix="use lr > 0, 0 <= min_lr <= lr, betas in [0, 1), adam_eps > 0, non-negative "
            "weight_decay/clip_grad/warmup_iters",
        condition="lr > 0, 0 <= min_lr <= lr, adam and lion betas in [0, 1), adam_eps > 0, "
                  "weight_decay, clip_grad and warmup_iters >= 0, decay_iters > 0 when set",
        section=S,
    ),
    Rule(
        id="OPT-LAYERWISE-NEEDS-MUON", severity="error",
        keys=("optimizer.use_layer_wise_optimizer", "optimizer.name",
              "ddp.use_distributed_optimizer"),
        when=lambda c, w: bool(c.optimizer.use_layer_wise_optimizer)
             and not (c.optimizer.name == "muon" and c.ddp.use_distributed_optimizer),
        message="use_layer_wise_optimizer=true is the Muon + distributed-optimizer path "
                "(optimizer.name={cfg.optimizer.name}, "
                "use_distributed_optimizer={cfg.ddp.use_distributed_optimizer})",
        fix="leave optimizer.use_layer_wise_optimizer=null (derived), or set optimizer.name=muon "
            "and ddp.use_distributed_optimizer=true",
        condition="use_layer_wise_optimizer set explicitly -> optimizer.name=muon and "
                  "use_distributed_optimizer",
        section=S,
    ),
]
