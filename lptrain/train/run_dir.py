"""Output-directory policy: resume, refuse or start fresh -- decided before anything is written.

* a folder whose checkpoint folder (``checkpoint.save``, or ``checkpoint.load`` when set)
  holds a valid checkpoint resumes from it (what a SLURM requeue needs: same command again);
* a folder holding a finished run (newest checkpoint at ``train.train_iters``) or a run
  that ended without a checkpoint (``summary.json`` but nothing to resume) is refused with a
  message naming ``--overwrite`` and a new folder;
* a run that was killed before its first checkpoint (``metrics.jsonl`` but neither a
  ``summary.json`` nor a valid checkpoint: SIGKILL, a node failure, a kill during the first
  save) is started over, saying so -- it cannot be resumed, and a SLURM requeue of the same
  command must not stop at a refusal; its unfinished step folders and metrics go;
* ``--overwrite`` starts over: the old run's files and checkpoints are removed, but only once
  the new run is known to start (:func:`start_run`, after the engine is built).

* a resume whose config cannot load the checkpoint (another model shape, another optimizer,
  precision state that does not carry over) is refused with one line per key
  (:mod:`lptrain.checkpoint.compat`), before anything is loaded or written.

Only :func:`start_run` modifies the folder, so a refused or crashed-at-startup run leaves the
previous one untouched. (``lptrain pretrain`` writes ``resolved_config.yaml`` before it calls
the loop when the folder has none yet, so that a fresh run's file is there even when the
start-up fails; :func:`write_resolved_config` makes that the run's one write of it.) Small
files are replaced atomically (temp file + rename): a full disk never leaves a torn one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lptrain.checkpoint.atomic import remove_stale_temps, write_atomically
from lptrain.checkpoint.compat import check_resume_compatible, saved_config, schedule_changes
from lptrain.checkpoint.store import LATEST, find_checkpoints, read_train_state, step_dirs, validate
from lptrain.errors import OutputDirError
from lptrain.train.anomalies import trim_anomalies
from lptrain.train.jsonl import read_lines, step_records

RUN_FILES = ("metrics.jsonl", "summary.json", "anomalies.jsonl")
PLOT_FILES = ("loss.png", "lr.png", "grad_norm.png", "memory.png")
NUMERICS_PLOTS = "numerics_*.png"  # the heatmaps of lptrain.train.numerics_report
RESOLVED_CONFIG = "resolved_config.yaml"
OUTPUT_DIR_KEY = "run.output_dir"
OUTPUT_DIR_FIX = "choose a writable folder with --output-dir (or run.output_dir)"


class RunDirRefused(OutputDirError):
    """The output folder cannot be used as asked; the message says why and what to do (exit 2)."""


@dataclass
class RunPlan:
    """What :func:`plan_run` decided: checkpoints to try (newest first) and notes to print."""

    out: Path
    candidates: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    overwrite: bool = False
    source: str = "fresh"  # fresh | auto (checkpoint.save) | explicit (checkpoint.load)
    restart: str | None = None  # a killed run without a checkpoint is replaced: the note saying so
    resume_step: int = 0  # the newest checkpoint's step
    # lr schedule settings this config changes against the newest checkpoint's: (key, saved,
    # new); a resume goes on only with override_ or use_checkpoint_opt_param_scheduler
    schedule_changes: list[tuple[str, Any, Any]] = field(default_factory=list)


def _existing_run_files(out: Path) -> list[str]:
    return [f for f in RUN_FILES if (out / f).exists()]


def plan_run(cfg: Any, out: str | Path, overwrite: bool = False) -> RunPlan:
    """Decide how a run into ``out`` starts; raises :class:`RunDirRefused`. Writes nothing."""
    out = Path(out)
    ck = cfg.checkpoint
    plan = RunPlan(out=out, overwrite=overwrite)
    if ck.save and (Path(ck.save) / LATEST).is_dir():  # the first save would fail on it
        raise RunDirRefused(
            f"checkpoint.save={ck.save}: {Path(ck.save) / LATEST} is a folder, where lptrain "
            "writes the file naming the newest checkpoint; remove or rename it")
    if ck.load:
        src = Path(ck.load)
        if not src.exists():
            raise RunDirRefused(
                f"checkpoint.load={ck.load}: no such folder; point it at a checkpoint folder "
                "(a save folder with iter_* folders, or one iter_* folder), or unset it"
            )
        found = find_checkpoints(src)
        if not found.valid:
            why = "; ".join(found.skipped) or "no iter_* checkpoint folders in it"
            raise RunDirRefused(f"checkpoint.load={ck.load} holds no valid checkpoint ({why})")
        plan.candidates, plan.notes, plan.source = found.valid, found.skipped, "explicit"
    elif ck.save and not overwrite:
        found = find_checkpoints(ck.save)
        plan.candidates, plan.notes = found.valid, found.skipped
        plan.source = "auto" if found.valid else "fresh"
    previous = _existing_run_files(out)
    if plan.source == "fresh" and previous and not overwrite and "summary.json" not in previous:
        # Killed (SIGKILL, node failure) before its first checkpoint: nothing to resume and it
        # never ended, so the same command (a SLURM requeue) starts over instead of refusing.
        plan.restart = (f"note: {out} holds a run that was stopped before its first checkpoint "
                        f"({', '.join(previous)} but no summary.json); nothing to resume, "
                        "starting over")
    elif plan.source == "fresh" and previous and not overwrite:
        where = f"checkpoint.save={ck.save} holds none" if ck.save else "checkpoint.save is not set"
        if plan.notes:
            where += " valid: " + "; ".join(plan.notes)
        raise RunDirRefused(
            f"{out} already holds a run ({', '.join(previous)}) with no checkpoint to resume "
            f"from ({where}); pass --overwrite to replace it, or choose a new --output-dir"
        )
    if plan.candidates:
        newest = plan.candidates[0]
        try:
            done = int(read_train_state(newest)["iteration"])
        except (OSError, ValueError, KeyError) as e:
            raise RunDirRefused(f"checkpoint {newest}: unreadable train_state.json ({e})") from None
        if done >= cfg.train.train_iters:
            raise RunDirRefused(
                f"the run in {out} already finished: checkpoint {newest} is at step {done} >= "
                f"train.train_iters={cfg.train.train_iters}; raise train.train_iters to train "
                "further (with optimizer.use_checkpoint_opt_param_scheduler=true or "
                "optimizer.override_opt_param_scheduler=true where the lr decay follows it), pass "
                "--overwrite to start over, or choose a new --output-dir"
            )
        check_resume_compatible(newest, _as_dict(cfg))
        for name in ("metrics.jsonl", "anomalies.jsonl"):  # damage named before anything is read
            if (out / name).exists():
                step_records(out / name)
        saved = saved_config(newest)
        plan.resume_step = done
        plan.schedule_changes = schedule_changes(saved, _as_dict(cfg)) if saved else []
    return plan


def _as_dict(cfg: Any) -> Any:
    """A config (dataclasses, or namespaces in tests) as nested dicts."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if hasattr(cfg, "__dict__"):
        return {k: _as_dict(v) for k, v in vars(cfg).items()}
    return cfg


def start_run(plan: RunPlan, cfg: Any, resumed_iteration: int, config_yaml: str) -> None:
    """The new run is starting: apply ``--overwrite``, trim metrics past the resumed step,
    write ``resolved_config.yaml``. Main rank only; a filesystem error is
    :class:`OutputDirError` (exit 2, the run has not started)."""
    try:
        _start_run(plan, cfg, resumed_iteration, config_yaml)
    except OSError as e:
        raise OutputDirError(f"cannot prepare run folder {plan.out}: {e.strerror or e}"
                             + (f" ({e.filename})" if e.filename else ""),
                             key=OUTPUT_DIR_KEY, fix=OUTPUT_DIR_FIX) from None


def _start_run(plan: RunPlan, cfg: Any, resumed_iteration: int, config_yaml: str) -> None:
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    if plan.overwrite:
        for name in (*RUN_FILES, *PLOT_FILES):
            (out / name).unlink(missing_ok=True)
        for path in out.glob(NUMERICS_PLOTS):
            path.unlink(missing_ok=True)
        shutil.rmtree(out / "wandb", ignore_errors=True)
        save = cfg.checkpoint.save
        if save and plan.source != "explicit":
            for p in step_dirs(save):
                shutil.rmtree(p, ignore_errors=True)
            (Path(save) / LATEST).unlink(missing_ok=True)
    if plan.restart and cfg.checkpoint.save:  # the killed run's unfinished saves
        for p in step_dirs(cfg.checkpoint.save):
            if validate(p) is not None:
                shutil.rmtree(p, ignore_errors=True)
    _remove_killed_writers_temps(out, cfg.checkpoint.save)
    trim_metrics(out / "metrics.jsonl", resumed_iteration)
    trim_anomalies(out, resumed_iteration)
    write_resolved_config(out, config_yaml)


def _remove_killed_writers_temps(out: Path, save: str | None) -> None:
    """Temp files of atomic writes whose writer was killed (``.resolved_config.yaml.tmp1234``),
    in the run folder and the checkpoint folders."""
    folders = [out]
    if save:
        folders += [Path(save), *step_dirs(save)]
    for folder in folders:
        remove_stale_temps(folder)


def write_resolved_config(out: Path, config_yaml: str) -> Path:
    """``out/resolved_config.yaml`` holding ``config_yaml``; returns its path.

    Written once per run: a file that already holds this text (the CLI wrote it before
    calling the loop) is left as it is. An OS failure is :class:`OutputDirError` (exit 2).
    """
    path = out / RESOLVED_CONFIG
    try:
        if not (path.is_file() and path.read_text() == config_yaml):
            write_atomically(path, config_yaml)
    except OSError as e:
        raise OutputDirError(
            f"cannot write {path}: {e.strerror or e}", key=OUTPUT_DIR_KEY, fix=OUTPUT_DIR_FIX
        ) from None
    return path


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep the lines of steps ``<= last_step`` (steps after the checkpoint are redone) and
    drop a torn last line left by a kill."""
    if not path.exists():
        return
    step_records(path)  # a damaged line is one error naming it (exit 2), before anything changes
    lines = read_lines(path)
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and int(rec.get("step", 0)) <= last_step:
            keep.append(line)
    if keep != lines:
        write_atomically(path, "".join(line + "\n" for line in keep))


def rebase_on_output_dir(cfg: Any, out: str | Path) -> Any:
    """``cfg`` with ``run.output_dir = out`` and checkpoint paths that lay under the old
    ``run.output_dir`` (``${run.output_dir}/checkpoints``, resolved at compose time) moved
    under ``out``, so ``pretrain(cfg, other_dir)`` never writes into the recipe's folder."""
    old, new = Path(cfg.run.output_dir), Path(out)
    if old == new:
        return cfg

    def move(p: str | None) -> str | None:
        if p and Path(p).is_relative_to(old):
            return str(new / Path(p).relative_to(old))
        return p

    ck = dataclasses.replace(cfg.checkpoint, save=move(cfg.checkpoint.save), load=move(cfg.checkpoint.load))
    run = dataclasses.replace(cfg.run, output_dir=str(new))
    return dataclasses.replace(cfg, run=run, checkpoint=ck)

