"""Can a run resume from a checkpoint written under another config? Decided from the two
resolved configs before anything is loaded or written.

Why before loading: a changed model width used to fail deep inside the load with raw tensor
messages (``The size of tensor a (33152) must match ...``) naming no key, and a changed
optimizer resumed silently with the wrong state (AdamW -> Muon) or died on ``KeyError:
'exp_avg'`` (Muon -> AdamW). Comparing ``resolved_config.yaml`` of the checkpoint with the
new config names every incompatible key in one line each, with the fix.

What is compared (everything else -- learning rate, batch sizes, intervals, the data-parallel
and expert-parallel sizes, quantization formats of the GEMMs -- carries over: the checkpoint
holds fp32 masters under canonical names, resharded on load):

* the model's shape (``SHAPE_KEYS``): the saved weights have other shapes or names; no
  override (a new shape is a new run);
* the optimizer (``OPTIMIZER_KEYS``): the saved state belongs to another optimizer;
  ``checkpoint.load_optimizer=false`` starts a fresh optimizer from the saved weights;
* precision state that cannot carry over (:func:`_precision_problems`): the delayed-scaling
  amax histories have the recorded length, Transformer Engine's per-module state is TE's;
* the learning-rate schedule (:func:`schedule_changes`: peak and minimum lr, warmup, decay
  length and style), as Megatron-LM's ``OptimizerParamScheduler`` compares it on load: a
  larger ``train.train_iters`` lengthens a decay that follows it, and the run would jump
  back up the curve (from 1.035e-4 at step 30 to 2.694e-4 at step 31 in a 30 -> 40 step
  continuation). Refused unless ``optimizer.use_checkpoint_opt_param_scheduler`` (go on
  with the saved schedule) or ``optimizer.override_opt_param_scheduler`` (this config's
  schedule from the step reached) says which.

Plain dicts in, lines out: this module knows key names, not the config classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lptrain.checkpoint.store import CONFIG, CheckpointError

SHAPE_KEYS = (
    "model.num_layers", "model.hidden_size", "model.ffn_hidden_size",
    "model.num_attention_heads", "model.num_query_groups", "model.vocab_size",
    "model.make_vocab_size_divisible_by", "model.qk_layernorm", "model.tie_embeddings",
    "model.moe.num_experts", "model.moe.ffn_hidden_size", "model.moe.moe_layer_freq",
)
OPTIMIZER_KEYS = ("optimizer.name",)
LOAD_OPTIMIZER_KEY = "checkpoint.load_optimizer"
# What defines the lr schedule (optimizer.decay_iters: the effective decay length, null
# meaning train.train_iters).
SCHEDULE_KEYS = ("optimizer.lr", "optimizer.min_lr", "optimizer.warmup_iters",
                 "optimizer.decay_iters", "optimizer.lr_schedule", "optimizer.muon.lr")
OVERRIDE_KEY = "optimizer.override_opt_param_scheduler"
USE_CHECKPOINT_KEY = "optimizer.use_checkpoint_opt_param_scheduler"


class IncompatibleCheckpointError(CheckpointError):
    """The new config cannot resume from the checkpoint: one line per incompatible key
    (``lines``; the CLI prints each as an ``error:`` line, exit 2)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def _get(cfg: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _changed(saved: Mapping[str, Any], new: Mapping[str, Any], key: str) -> Optional[tuple[Any, Any]]:
    has_old, old = _get(saved, key)
    has_new, now = _get(new, key)
    if has_old and has_new and old != now:
        return old, now
    return None


def _delayed_fp8(cfg: Mapping[str, Any]) -> bool:
    p = cfg.get("precision") or {}
    return p.get("fp8_format") is not None and p.get("fp8_recipe") == "delayed"


def _precision_problems(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any, str]]:
    out = []
    hist = _changed(saved, new, "precision.fp8_amax_history_len")
    if hist and _delayed_fp8(saved) and _delayed_fp8(new):
        out.append(("precision.fp8_amax_history_len", *hist,
                    "the saved delayed-scaling amax histories have the recorded length"))
    backend = _changed(saved, new, "precision.backend")
    if backend and "te" in backend:
        out.append(("precision.backend", *backend,
                    "Transformer Engine's per-module scaling state does not map to the other backend"))
    return out


def _schedule_value(cfg: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    has, value = _get(cfg, key)
    if key == "optimizer.decay_iters" and has and value is None:
        return _get(cfg, "train.train_iters")
    return has, value


def schedule_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` of every schedule setting the new config changes
    (``optimizer.decay_iters`` as the decay length it means)."""
    out = []
    for key in SCHEDULE_KEYS:
        (has_old, old), (has_new, now) = _schedule_value(saved, key), _schedule_value(new, key)
        if has_old and has_new and old != now:
            out.append((key, old, now))
    return out


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """``optimizer.decay_iters 30 there, 40 now (null: train.train_iters), ...``."""
    parts = []
    for key, old, now in changes:
        note = " (null: train.train_iters)" if key == "optimizer.decay_iters" else ""
        parts.append(f"{key} {old!r} there, {now!r} now{note}")
    return ", ".join(parts)


def incompatible_lines(saved: Mapping[str, Any], new: Mapping[str, Any], where: str) -> list[str]:
    """One line per key whose change makes ``new`` unable to resume from the checkpoint
    ``where`` written under ``saved`` (empty when it can)."""
    lines = []
    for key in SHAPE_KEYS:
        ch = _changed(saved, new, key)
        if ch:
            lines.append(f"cannot resume from {where}: {key} is {ch[0]!r} there, {ch[1]!r} now "
                         f"(the saved weights have other shapes); fix: resume with {key}={ch[0]}, "
                         "or start a new run in another --output-dir")
    _, load_optimizer = _get(new, LOAD_OPTIMIZER_KEY)
    if load_optimizer is not False:
        for key in OPTIMIZER_KEYS:
            ch = _changed(saved, new, key)
            if ch:
                lines.append(f"cannot resume from {where}: {key} is {ch[0]!r} there, {ch[1]!r} now "
                             f"(the saved optimizer state is {ch[0]}'s); fix: resume with "
                             f"{key}={ch[0]}, or pass {LOAD_OPTIMIZER_KEY}=false to start a fresh "
                             f"{ch[1]} optimizer from the saved weights")
    for key, old, now, why in _precision_problems(saved, new):
        lines.append(f"cannot resume from {where}: {key} is {old!r} there, {now!r} now ({why}); "
                     f"fix: resume with {key}={old}, or start a new run in another --output-dir")
    changes = schedule_changes(saved, new)
    if changes and not (_get(new, OVERRIDE_KEY)[1] or _get(new, USE_CHECKPOINT_KEY)[1]):
        lines.append(f"cannot resume from {where}: the learning-rate schedule changed "
                     f"({describe_changes(changes)}), and the lr would jump to the new curve at "
                     f"the step reached; fix: pass {USE_CHECKPOINT_KEY}=true to go on with the "
                     f"saved schedule, or {OVERRIDE_KEY}=true to follow this config's from the "
                     "step reached")
    return lines


def saved_config(folder: str | Path) -> Optional[Mapping[str, Any]]:
    """The checkpoint's ``resolved_config.yaml`` as nested dicts (None when unreadable)."""
    import yaml

    from lptrain.config.errors import ConfigError
    from lptrain.config.yaml_files import load_bounded

    path = Path(folder) / CONFIG
    try:
        saved = load_bounded(path.read_text(), str(path))
    except (OSError, ValueError, yaml.YAMLError):  # UnicodeDecodeError is a ValueError
        return None
    except ConfigError:  # an alias bomb: not a config lptrain wrote; loading judges the rest
        return None
    return saved if isinstance(saved, Mapping) else None


def check_resume_compatible(folder: str | Path, new: Mapping[str, Any]) -> None:
    """Raise :class:`IncompatibleCheckpointError` when ``new`` (a resolved config as nested
    dicts) cannot resume from the checkpoint ``folder``. A folder without a readable
    ``resolved_config.yaml`` is not judged here (loading still checks shapes)."""
    saved = saved_config(folder)
    if saved is not None:
        lines = incompatible_lines(saved, new, str(folder))
        if lines:
            raise IncompatibleCheckpointError(lines)
