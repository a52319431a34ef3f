"""Model shape, batch, schedule and checkpoint rules."""

from __future__ import annotations

from typing import Any

from lptrain.config.rules import Rule, decay_end
from lptrain.config.schema import RECOMPUTE_MODULES, SHARDING_TYPES, LPTrainConfig
from lptrain.config.world import World

S = "Model, batch, schedule, checkpoint"


def _heads_bad(c: LPTrainConfig, w: World) -> dict[str, Any]:
    m = c.model
    heads = m.num_attention_heads
    groups = m.num_query_groups if m.num_query_groups is not None else heads
    bad: list[tuple[str, str]] = []
    if heads < 1 or m.hidden_size % heads != 0:
        bad.append(("model.num_attention_heads",
                    f"hidden_size={m.hidden_size} is not divisible by num_attention_heads={heads}"))
    elif (m.hidden_size // heads) % 2:
        bad.append(("model.num_attention_heads",
                    f"head_dim = hidden_size / num_attention_heads = {m.hidden_size // heads} is "
                    "odd; rotary embeddings rotate pairs of channels"))
    if groups < 1 or (heads >= 1 and heads % groups != 0):
        bad.append(("model.num_query_groups",
                    f"num_attention_heads={heads} is not divisible by num_query_groups={groups}"))
    if not bad:
        return {}
    keys = ("model.hidden_size", *(k for k, _ in bad))
    return {"keys": keys, "detail": "; ".join(d for _, d in bad)}


def _batch_bad(c: LPTrainConfig, w: World) -> bool:
    # Sizes below 1 are RANGE-TRAIN's to report (its fix names them); here both are >= 1.
    per_step = c.train.micro_batch_size * w.dp
    return per_step >= 1 and c.train.global_batch_size >= 1 and c.train.global_batch_size % per_step != 0


def _intervals_bad(c: LPTrainConfig, w: World) -> dict[str, Any]:
    t = c.train
    bad: list[tuple[str, str]] = []
    if t.train_iters <= 0:
        bad.append(("train.train_iters", f"train_iters={t.train_iters} must be > 0"))
    for key, value in (("train.eval_interval", t.eval_interval),
                       ("train.log_interval", t.log_interval),
                       ("train.exit_interval", t.exit_interval),
                       ("checkpoint.save_interval", c.checkpoint.save_interval)):
        if value is not None and value <= 0:
            bad.append((key, f"{key}={value} must be > 0 (or null)"))
    if t.eval_interval is not None and t.eval_iters <= 0:
        bad.append(("train.eval_iters", f"eval_interval is set but eval_iters={t.eval_iters}"))
    if not bad:
        return {}
    return {"keys": tuple(k for k, _ in bad), "detail": "; ".join(d for _, d in bad)}


def _warmup_not_before_decay(c: LPTrainConfig, w: World) -> dict[str, Any]:
    o = c.optimizer
    end = decay_end(c)
    if o.warmup_iters <= 0 or end <= 0 or o.warmup_iters < end:
        return {}  # negative or zero lengths are OPT-VALUES / TRAIN-INTERVALS findings
    explicit = o.decay_iters is not None
    effect = ("the lr would fall from its peak to min_lr in one step" if explicit
              and o.warmup_iters < c.train.train_iters else "the lr never gets past its warmup")
    return {
        "keys": ("optimizer.warmup_iters", "optimizer.decay_iters" if explicit else "train.train_iters"),
        "end": end, "end_key": "optimizer.decay_iters" if explicit else "train.train_iters",
        "effect": effect, "suggest": max(0, end // 10),
    }


RULES = [
    Rule(
        id="MODEL-HEADS", severity="error",
        keys=("model.hidden_size", "model.num_attention_heads", "model.num_query_groups"),
        when=_heads_bad, message="attention heads do not tile the model: {detail}",
        fix="choose model.num_attention_heads dividing model.hidden_size into an even head_dim, "
            "and model.num_query_groups dividing model.num_attention_heads",
        condition="hidden_size % num_attention_heads == 0 with an even head_dim (RoPE); "
                  "num_attention_heads % num_query_groups == 0",
        why="the attention and rotary-embedding constructors refuse these shapes", section=S,
    ),
    Rule(
        id="BATCH-DIVISIBLE", severity="error",
        keys=("train.global_batch_size", "train.micro_batch_size"), when=_batch_bad,
        message="global_batch_size={cfg.train.global_batch_size} is not a multiple of "
                "micro_batch_size * dp = {cfg.train.micro_batch_size} * {world.dp}",
        fix="set train.global_batch_size to a multiple of {cfg.train.micro_batch_size} * "
            "{world.dp}, or change train.micro_batch_size",
        condition="global_batch_size % (micro_batch_size * dp) == 0", section=S,
    ),
    Rule(
        id="TRAIN-INTERVALS", severity="error",
        keys=("train.train_iters", "train.eval_interval", "train.log_interval", "train.exit_interval",
              "checkpoint.save_interval", "train.eval_iters"),
        when=_intervals_bad, message="invalid loop lengths: {detail}",
        fix="use positive values (null turns an interval off)",
        condition="train_iters > 0; eval_interval, save_interval, log_interval (and exit_interval) "
                  "> 0 when set; eval_interval set -> eval_iters > 0",
        section=S,
    ),
    Rule(
        id="TRAIN-SAVE-NEEDS-DIR", severity="error",
        keys=("checkpoint.save_interval", "checkpoint.save"),
        when=lambda c, w: c.checkpoint.save_interval is not None and not c.checkpoint.save,
        message="checkpoint.save_interval={cfg.checkpoint.save_interval} but checkpoint.save is "
                "not set: there is nowhere to write checkpoints",
        fix="set checkpoint.save=<folder> (e.g. checkpoint.save=${{run.output_dir}}/ckpt), or "
            "checkpoint.save_interval=null",
        condition="save_interval set -> checkpoint.save set", section=S,
    ),
    Rule(
        id="SCHED-WARMUP-DECAY", severity="error",
        keys=("optimizer.warmup_iters", "optimizer.decay_iters", "train.train_iters"),
        when=_warmup_not_before_decay,
        message="warmup_iters={cfg.optimizer.warmup_iters} is not shorter than the decay, which "
                "ends at step {end} ({end_key}): {effect}",
        fix="set optimizer.warmup_iters below {end} (e.g. {suggest}), or lengthen the decay "
            "(optimizer.decay_iters, train.train_iters)",
        condition="warmup_iters < decay_iters (decay_iters null: train_iters)",
        why="Megatron-LM's OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps; "
            "otherwise the lr never reaches its peak, or drops from peak to min_lr in one step",
        section=S, supersedes=("SCHED-WARMUP",),
    ),
    Rule(
        id="SCHED-OVERRIDE-OR-CHECKPOINT", severity="error",
        keys=("optimizer.override_opt_param_scheduler", "optimizer.use_checkpoint_opt_param_scheduler"),
        when=lambda c, w: c.optimizer.override_opt_param_scheduler and c.optimizer.use_checkpoint_opt_param_scheduler,
        message="override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set: a "
                "resume can follow this config's lr schedule or the checkpoint's, not both",
        fix="set optimizer.use_checkpoint_opt_param_scheduler=false (this config's schedule), or "
            "optimizer.override_opt_param_scheduler=false (the checkpoint's)",
        condition="not (override_opt_param_scheduler and use_checkpoint_opt_param_scheduler)",
        why="Megatron-LM's OptimizerParamScheduler asserts the same ('both override and "
            "use-checkpoint are set')",
        section=S,
    ),
    Rule(
        id="SCHED-WARMUP", severity="warning", keys=("optimizer.warmup_iters", "train.train_iters"),
        when=lambda c, w: c.optimizer.warmup_iters > c.train.train_iters,
        message="warmup_iters={cfg.optimizer.warmup_iters} exceeds "
                "train_iters={cfg.train.train_iters}: the learning rate never reaches its peak in "
                "this job",
        fix="set optimizer.warmup_iters <= train.train_iters (fine when a later job continues the "
            "run with more train_iters)",
        condition="warmup_iters <= train_iters", section=S,
    ),
    Rule(
        id="CKPT-SHARDING-TYPE", severity="error", keys=("checkpoint.sharding_type",),
        when=lambda c, w: c.checkpoint.sharding_type not in SHARDING_TYPES,
        message="checkpoint.sharding_type={cfg.checkpoint.sharding_type!r} is not a known sharding "
                "type",
        fix="set checkpoint.sharding_type to one of " + ", ".join(SHARDING_TYPES),
        condition="sharding_type in the allowed set (" + ", ".join(SHARDING_TYPES) + ")", section=S,
    ),
    Rule(
        id="RECOMPUTE-NUM-LAYERS", severity="error",
        keys=("model.recompute_num_layers", "model.num_layers"),
        when=lambda c, w: c.model.recompute_granularity == "full"
             and not 1 <= c.model.recompute_num_layers <= c.model.num_layers,
        message="recompute_num_layers={cfg.model.recompute_num_layers} must be in [1, "
                "num_layers={cfg.model.num_layers}]",
        fix="set model.recompute_num_layers between 1 and {cfg.model.num_layers}",
        condition="recompute_granularity=full -> 1 <= recompute_num_layers <= num_layers", section=S,
    ),
    Rule(
        id="RECOMPUTE-MODULES", severity="error", keys=("model.recompute_modules",),
        when=lambda c, w: c.model.recompute_granularity == "selective"
             and (not c.model.recompute_modules
                  or any(m not in RECOMPUTE_MODULES for m in c.model.recompute_modules)),
        message="recompute_modules={cfg.model.recompute_modules}: selective recompute needs a "
                "non-empty list of " + ", ".join(RECOMPUTE_MODULES),
        fix="set model.recompute_modules to a list of " + ", ".join(RECOMPUTE_MODULES),
        condition="recompute_granularity=selective -> recompute_modules non-empty, each known",
        section=S,
    ),
]
