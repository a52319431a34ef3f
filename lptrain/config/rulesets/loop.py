"""Training-loop and checkpoint-policy rules (keys read by lptrain.train.loop and
lptrain.checkpoint). ``checkpoint.keep_latest >= 2`` is a range rule (rulesets/ranges.py)."""

from __future__ import annotations

from lptrain.config.rules import Rule, compact_layout
from lptrain.config.schema import ON_NONFINITE

S = "Loop, checkpoints, signals"

RULES = [
    Rule(
        id="TRAIN-ON-NONFINITE", severity="error", keys=("train.on_nonfinite",),
        when=lambda c, w: c.train.on_nonfinite not in ON_NONFINITE,
        message="train.on_nonfinite={cfg.train.on_nonfinite!r} is not one of "
                + ", ".join(ON_NONFINITE),
        fix="set train.on_nonfinite=stop (raise, naming the step and tensor) or skip",
        condition=f"on_nonfinite in ({', '.join(ON_NONFINITE)})", section=S,
    ),
    Rule(
        id="TRAIN-ON-ANOMALY", severity="derived", keys=("train.on_anomaly", "train.on_nonfinite"),
        when=lambda c, w: False,
        message="train.on_anomaly=null follows train.on_nonfinite",
        fix="nothing to do: derive() fills it in",
        condition="on_anomaly=null -> stop if on_nonfinite=stop else skip_batch",
        why="on_anomaly (non-finite steps and loss spikes) supersedes the older on_nonfinite",
        section=S,
    ),
    Rule(
        id="TRAIN-ANOMALY-VS-NONFINITE", severity="error",
        keys=("train.on_anomaly", "train.on_nonfinite"),
        when=lambda c, w: c.train.on_nonfinite == "skip" and c.train.on_anomaly not in (None, "skip_batch"),
        message="train.on_nonfinite=skip and train.on_anomaly={cfg.train.on_anomaly} disagree on "
                "what a non-finite step does",
        fix="drop train.on_nonfinite (train.on_anomaly decides for non-finite steps and spikes)",
        condition="on_nonfinite=skip -> on_anomaly null or skip_batch",
        why="on_anomaly supersedes on_nonfinite; two settings that disagree cannot both be honoured",
        section=S,
    ),
    Rule(
        id="TRAIN-ROLLBACK-NEEDS-CHECKPOINTS", severity="error",
        keys=("train.on_anomaly", "checkpoint.save", "checkpoint.save_interval"),
        when=lambda c, w: c.train.on_anomaly == "rollback"
             and not (c.checkpoint.save and c.checkpoint.save_interval),
        message="train.on_anomaly=rollback reloads the last checkpoint before the anomaly, but "
                "checkpoint.save={cfg.checkpoint.save} and checkpoint.save_interval="
                "{cfg.checkpoint.save_interval} write none during the run",
        fix="set checkpoint.save=<folder> and checkpoint.save_interval=N (or train.on_anomaly=stop)",
        condition="on_anomaly=rollback -> checkpoint.save and save_interval set",
        why="a rollback with nothing to roll back to would stop anyway", section=S,
    ),
    Rule(
        id="DEBUG-NAN-MODULE", severity="error", keys=("debug.nan_sample", "debug.nan_module"),
        when=lambda c, w: c.debug.nan_sample is not None and not c.debug.nan_module,
        message="debug.nan_sample={cfg.debug.nan_sample} injects a NaN but debug.nan_module names "
                "no module to put it in",
        fix="set debug.nan_module=<a module's state-dict name, e.g. layers.0.mlp.linear_fc2>",
        condition="nan_sample set -> nan_module set", section=S,
    ),
    Rule(
        id="TRAIN-EXIT-DURATION", severity="error", keys=("train.exit_duration_mins",),
        when=lambda c, w: c.train.exit_duration_mins is not None and c.train.exit_duration_mins <= 0,
        message="train.exit_duration_mins={cfg.train.exit_duration_mins} must be > 0 (or null)",
        fix="set train.exit_duration_mins to a positive number of minutes, or null",
        condition="exit_duration_mins > 0 when set", section=S,
    ),
    Rule(
        id="CKPT-ASYNC-SAVE", severity="error", keys=("checkpoint.async_save",),
        when=lambda c, w: c.checkpoint.async_save,
        message="checkpoint.async_save=true: background saving is not implemented yet (saves are "
                "synchronous, with the completion marker written last)",
        fix="set checkpoint.async_save=false", condition="async_save=false (not implemented)",
        why="refused rather than silently saving in the foreground", section=S,
    ),
    Rule(
        id="CKPT-MODEL-SPACE", severity="error", keys=("checkpoint.sharding_type",),
        # (the compact layer-wise Muon layout has its own, more specific rule)
        when=lambda c, w: c.checkpoint.sharding_type == "fully_sharded_model_space"
             and not compact_layout(c),
        message="checkpoint.sharding_type=fully_sharded_model_space is not implemented: lptrain "
                "checkpoints hold each tensor whole under its canonical name (fp32 masters, "
                "optimizer state gathered from the shards), which reshards across DP and EP "
                "sizes -- what dp_reshardable and fully_reshardable both ask for",
        fix="set checkpoint.sharding_type=dp_reshardable (or fully_reshardable: same files)",
        condition="sharding_type != fully_sharded_model_space (not implemented)",
        why="refused rather than writing another format than the one asked for", section=S,
    ),
    Rule(
        id="CKPT-INIT-FROM-HF-LOAD", severity="error",
        keys=("checkpoint.init_from_hf", "checkpoint.load"),
        when=lambda c, w: bool(c.checkpoint.init_from_hf and c.checkpoint.load),
        message="checkpoint.init_from_hf={cfg.checkpoint.init_from_hf} and "
                "checkpoint.load={cfg.checkpoint.load} are two sources of initial weights",
        fix="unset checkpoint.load to start from the Hugging Face folder, or unset "
            "checkpoint.init_from_hf to resume from the checkpoint",
        condition="init_from_hf -> load unset",
        why="a fresh run starts from the folder; a run resuming from checkpoint.save ignores it",
        section=S,
    ),
]
