"""Training-loop and checkpoint-policy rules (keys read by lptrain.train.loop and
lptrain.checkpoint). ``checkpoint.keep_latest >= 2`` is a range rule (rulesets/ranges.py)."""

from __future__ import annotations

from lptrain.config.rules import Rule
from lptrain.config.rulesets.muon import _compact

S = "Loop, checkpoints, signals"

ON_NONFINITE = ("stop", "skip")

RULES = [
    Rule(
        "TRAIN-ON-NONFINITE", "error", ("train.on_nonfinite",),
        lambda c, w: c.train.on_nonfinite not in ON_NONFINITE,
        "train.on_nonfinite={cfg.train.on_nonfinite!r} is not one of stop, skip",
        "set train.on_nonfinite=stop (raise, naming the step and tensor) or skip",
        "on_nonfinite in (stop, skip)", "", S),
    Rule(
        "TRAIN-EXIT-DURATION", "error", ("train.exit_duration_mins",),
        lambda c, w: c.train.exit_duration_mins is not None and c.train.exit_duration_mins <= 0,
        "train.exit_duration_mins={cfg.train.exit_duration_mins} must be > 0 (or null)",
        "set train.exit_duration_mins to a positive number of minutes, or null",
        "exit_duration_mins > 0 when set", "", S),
    Rule(
        "CKPT-ASYNC-SAVE", "error", ("checkpoint.async_save",),
        lambda c, w: c.checkpoint.async_save,
        "checkpoint.async_save=true: background saving is not implemented yet (saves are "
        "synchronous, with the completion marker written last)",
        "set checkpoint.async_save=false",
        "async_save=false (not implemented)", "refused rather than silently saving in the "
        "foreground", S),
    Rule(
        "CKPT-MODEL-SPACE", "error", ("checkpoint.sharding_type",),
        # (the compact layer-wise Muon layout has its own, more specific rule)
        lambda c, w: c.checkpoint.sharding_type == "fully_sharded_model_space" and not _compact(c),
        "checkpoint.sharding_type=fully_sharded_model_space is not implemented: lptrain "
        "checkpoints hold each tensor whole under its canonical name (fp32 masters, optimizer "
        "state gathered from the shards), which reshards across DP and EP sizes -- what "
        "dp_reshardable and fully_reshardable both ask for",
        "set checkpoint.sharding_type=dp_reshardable (or fully_reshardable: same files)",
        "sharding_type != fully_sharded_model_space (not implemented)",
        "refused rather than writing another format than the one asked for", S),
    Rule(
        "CKPT-INIT-FROM-HF-LOAD", "error", ("checkpoint.init_from_hf", "checkpoint.load"),
        lambda c, w: bool(c.checkpoint.init_from_hf and c.checkpoint.load),
        "checkpoint.init_from_hf={cfg.checkpoint.init_from_hf} and checkpoint.load="
        "{cfg.checkpoint.load} are two sources of initial weights",
        "unset checkpoint.load to start from the Hugging Face folder, or unset "
        "checkpoint.init_from_hf to resume from the checkpoint",
        "init_from_hf -> load unset",
        "a fresh run starts from the folder; a run resuming from checkpoint.save ignores it", S),
]
