"""A resume whose config changes the learning-rate schedule: Megatron-LM's
``--use-checkpoint-opt_param-scheduler`` / ``--override-opt_param-scheduler``.

The schedule is a function of the step and six settings (peak and minimum lr, warmup, decay
length and style, the Muon group's peak). A resume with other settings -- above all a larger
``train.train_iters``, which lengthens a decay that follows it -- would put the lr on another
curve at the step reached: a 30-step run continued to 40 jumped from 1.035e-4 to 2.694e-4,
re-warming a trained model without a word. :func:`lptrain.checkpoint.compat.incompatible_lines`
refuses such a resume before anything is loaded unless one of the two keys says which curve
to follow; here the chosen one is applied (the checkpoint's values written into the config,
every rank alike) and said in one note.
"""

from __future__ import annotations

from typing import Any, Optional

from lptrain.checkpoint.compat import OVERRIDE_KEY, USE_CHECKPOINT_KEY, describe_changes
from lptrain.config.schema import LPTrainConfig


def _set(cfg: LPTrainConfig, key: str, value: Any) -> None:
    *path, last = key.split(".")
    node: Any = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, last, value)


def _lr(cfg: LPTrainConfig, step: int) -> float:
    """The default group's lr at 1-based ``step`` (what ``lr`` in metrics.jsonl shows)."""
    from lptrain.optim.schedule import lr_at

    o = cfg.optimizer
    return lr_at(step - 1, lr=o.lr, min_lr=o.min_lr, warmup_iters=o.warmup_iters,
                 decay_iters=o.decay_iters or cfg.train.train_iters, schedule=o.lr_schedule)


def apply_resumed_schedule(cfg: LPTrainConfig, changes: list[tuple[str, Any, Any]],
                           resume_step: int) -> Optional[str]:
    """Apply the schedule a resume from ``resume_step`` follows, given the settings this
    config ``changes`` against the checkpoint's; the note saying which (None: no change).
    With ``use_checkpoint_opt_param_scheduler`` the saved values replace this config's in
    ``cfg`` (in place, before the engine is built)."""
    if not changes:
        return None
    nxt = resume_step + 1
    what = describe_changes(changes)
    if cfg.optimizer.use_checkpoint_opt_param_scheduler:
        for key, old, _ in changes:
            _set(cfg, key, old)
        return (f"note: {USE_CHECKPOINT_KEY}: the checkpoint's lr schedule goes on ({what}): lr "
                f"{_lr(cfg, nxt):.4g} at step {nxt}")
    saved = _lr(_with(cfg, changes), nxt)
    return (f"note: {OVERRIDE_KEY}: this config's lr schedule from step {nxt} ({what}): lr "
            f"{_lr(cfg, nxt):.4g} at step {nxt}, where the saved schedule gives {saved:.4g}")


def _with(cfg: LPTrainConfig, changes: list[tuple[str, Any, Any]]) -> LPTrainConfig:
    import copy

    out = copy.deepcopy(cfg)
    for key, old, _ in changes:
        _set(out, key, old)
    return out
