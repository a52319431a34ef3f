"""The train-eval-checkpoint loop: *when* things happen. *How* a step is done is the engine's
(:class:`lptrain.train.engine.TrainEngine`, same code at one rank or many).

One run: output-folder policy (:mod:`~lptrain.train.run_dir`: resume / refuse / fresh, nothing
written yet) -> engine -> this rank's data loaders -> resume (newest valid checkpoint, falling
back past incomplete or corrupt ones and saying so) -> the folder is claimed (overwrite applied,
metrics trimmed to the resumed step, ``resolved_config.yaml``) -> steps. After each step:
metrics line (flushed), console line every ``train.log_interval``, eval every
``train.eval_interval`` and at the last step, save every ``checkpoint.save_interval``, then the
stop checks (signal, ``train.exit_interval`` steps in this job, ``train.exit_duration_mins``),
each of which saves before leaving. Eval and save go through ``engine.params_synced()`` and
change no training state, so a run with them is bitwise the run without them.

Only the main rank writes files or prints; every rank takes part in saves and stop decisions.
Steps are counted from 1 everywhere (metrics, messages, checkpoint names).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lptrain.config import World, derive
from lptrain.config.schema import LPTrainConfig
from lptrain.train.engine import StepResult, TrainEngine, TrainingDivergedError
from lptrain.train.signals import StopWatcher, TrainingInterrupted, signal_name

__all__ = ["TrainingDivergedError", "TrainingInterrupted", "pretrain"]


class _Log:
    """Console output of the main rank: a rich progress bar on a terminal, plain lines else."""

    def __init__(self, main: bool, cfg: LPTrainConfig) -> None:
        self.main = main
        self.tty = sys.stdout.isatty()
        self.progress: Any = None
        self.task: Any = None
        if main and cfg.logging.progress and self.tty:
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("[progress.description]{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                TimeRemainingColumn(),
            )

    def start(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task("training", total=total, completed=done)

    def advance(self, loss: float | None) -> None:
        if self.progress is not None:
            desc = f"training loss {loss:.3f}" if loss is not None else "training"
            self.progress.update(self.task, advance=1, description=desc)

    def line(self, text: str) -> None:
        if not self.main:
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _start_wandb(cfg: LPTrainConfig, out: Path, run_id: str | None) -> Any:
    """A W&B run when ``logging.wandb`` is on (offline by default); reuses ``run_id`` on resume."""
    if not cfg.logging.wandb:
        return None
    import wandb

    return wandb.init(
        project=cfg.logging.wandb_project, name=cfg.run.name, mode=cfg.logging.wandb_mode,
        dir=str(out), config=dataclasses.asdict(cfg), id=run_id or secrets.token_hex(4),
        resume="allow",
    )


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _resume(engine: TrainEngine, candidates: list[Path], log: _Log) -> dict[str, Any]:
    """Load the newest loadable checkpoint into the engine; returns its train state."""
    from lptrain.checkpoint import CheckpointError, load_checkpoint

    failures = []
    for i, folder in enumerate(candidates):
        try:
            state, train_state = load_checkpoint(folder, engine.rank, engine.world_size)
            engine.load_checkpoint_state(state)
        except (CheckpointError, KeyError, RuntimeError, ValueError) as e:
            failures.append(f"{folder}: {e}")
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            log.line(f"warning: could not load checkpoint {folder} ({e}); "
                     + (f"falling back to {nxt}" if nxt else "no older valid checkpoint"))
            continue
        if state["local"] is None:
            log.line(f"note: {folder} was written at world size {train_state.get('world_size')}; "
                     "per-rank RNG streams start afresh")
        log.line(f"resuming from {folder} (step {train_state['iteration']})")
        return train_state
    raise CheckpointError("no checkpoint could be loaded: " + "; ".join(failures))


def pretrain(cfg: LPTrainConfig, output_dir: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Train (or resume) into ``output_dir``; returns the summary (also ``summary.json``).

    Raises :class:`~lptrain.train.run_dir.RunDirRefused` for a folder it must not touch,
    :class:`TrainingDivergedError` on a non-finite step with ``train.on_nonfinite=stop`` and
    :class:`TrainingInterrupted` (a ``SystemExit``: 143 or 130) after a signal.
    """
    from lptrain.checkpoint import save_checkpoint
    from lptrain.config.render import config_yaml
    from lptrain.data import build_train_valid_loaders
    from lptrain.data.loader import data_state, load_data_state
    from lptrain.model.flops import flops_per_token
    from lptrain.train.metrics import (
        MetricsWriter,
        compute_class,
        finite_or_none,
        format_log_line,
        memory_gib,
        peak_flops,
    )
    from lptrain.train.run_dir import plan_run, rebase_on_output_dir, start_run

    cfg = derive(cfg, World.detect())  # idempotent: the CLI already derived; direct callers may not
    out = Path(output_dir)
    cfg = rebase_on_output_dir(cfg, out)
    t, ck = cfg.train, cfg.checkpoint
    plan = plan_run(cfg, out, overwrite)
    hf_arch = None
    if ck.init_from_hf and not plan.candidates:  # checked (one line, exit 2) before the engine
        from lptrain.interop.hf_import import check_init_from_hf

        hf_arch = check_init_from_hf(cfg)
    engine = TrainEngine(cfg)
    main = engine.is_main
    log = _Log(main, cfg)
    for note in plan.notes:
        log.line(f"warning: skipping checkpoint {note}")
    train_it, valid_it = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=engine.dp_rank, dp_size=engine.dp_size,
        vocab_size=cfg.model.vocab_size,
    )
    train_state: dict[str, Any] = {}
    if plan.candidates:
        train_state = _resume(engine, plan.candidates, log)
        load_data_state(train_state["data"], train_it, valid_it)
        if ck.init_from_hf:
            log.line(f"note: checkpoint.init_from_hf={ck.init_from_hf} not read: the run resumes "
                     "from its own checkpoint (its weights started from that folder)")
    elif hf_arch is not None:
        from lptrain.interop.hf_import import init_engine_from_hf

        log.line(init_engine_from_hf(engine, cfg, hf_arch))
    start_iter = int(train_state.get("iteration", 0))
    resolved = config_yaml(cfg)
    # Every rank has planned (read the folder) before the main rank claims it; without this a
    # slow rank would see the fresh metrics.jsonl of its own run and refuse the folder.
    _barrier()
    if main:
        start_run(plan, cfg, start_iter, resolved)

    num_micro = t.global_batch_size // (t.micro_batch_size * engine.dp_size)
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    eval_on = valid_it is not None and t.eval_iters > 0
    device = next(engine.model.parameters()).device
    peak = peak_flops(device, compute_class(cfg))
    flops_tok = flops_per_token(cfg.model).total
    n_params = sum(p.numel() for p in engine.model.parameters())
    metrics = MetricsWriter(out / "metrics.jsonl") if main else None
    wandb_run = _start_wandb(cfg, out, train_state.get("wandb_run_id")) if main else None
    wandb_id = wandb_run.id if wandb_run is not None else train_state.get("wandb_run_id")
    log.line(
        f"lptrain {cfg.run.name}: {n_params / 1e6:.2f}M params, {t.train_iters} steps x "
        f"{t.global_batch_size} seqs x {cfg.model.seq_length} tokens, {engine.world_size} rank(s)"
        + (f"; resuming at step {start_iter + 1}" if start_iter else "")
    )
    if not eval_on:
        why = "no validation split (data.split_valid_fraction=0)" if valid_it is None else "train.eval_iters=0"
        log.line(f"evaluation off: {why}")

    prior_elapsed = float(train_state.get("elapsed_s", 0.0))
    step, job_steps, status, saved = start_iter, 0, "running", None
    signum: int | None = None
    error: str | None = None
    t_job = time.perf_counter()
    window: list[tuple[float, int]] = []  # (step time, tokens) since the last log line

    def save(iteration: int) -> Path:
        state = {
            "consumed_samples": train_it.consumed_samples,
            "consumed_tokens": train_it.consumed_samples * cfg.model.seq_length,
            "data": data_state(train_it, valid_it),
            "wandb_run_id": wandb_id,
            "dp_size": engine.dp_size,
            "elapsed_s": prior_elapsed + time.perf_counter() - t_job,
        }
        with engine.params_synced():
            engine_state = engine.checkpoint_state()
        folder = save_checkpoint(ck.save, iteration, engine_state, state, resolved,
                                 rank=engine.rank, world_size=engine.world_size,
                                 keep_latest=ck.keep_latest)
        log.line(f"saved checkpoint {folder}")
        return folder

    log.start(start_iter, t.train_iters)
    try:
        with StopWatcher(t.exit_duration_mins) as watcher:
            while step < t.train_iters:
                step += 1
                job_steps += 1
                t0 = time.perf_counter()
                micro = [next(train_it) for _ in range(num_micro)]
                res: StepResult = engine.train_step(micro, step)
                dt = time.perf_counter() - t0
                tps = tokens_per_step / dt
                rec: dict[str, Any] = {
                    "step": step,
                    "loss": finite_or_none(res.loss),
                    "lr": next(iter(res.lrs.values())),
                    "lrs": res.lrs,
                    "grad_norm": finite_or_none(res.grad_norm),
                    "tokens_per_s": tps,
                    "step_time_s": dt,
                    "mem_gib": memory_gib(device),
                    "mfu": flops_tok * tps / (peak * engine.world_size) if peak else None,
                    "consumed_samples": train_it.consumed_samples,
                    **res.extra,
                }
                if res.skipped:
                    rec["skipped"] = True
                    log.line(f"warning: {res.note}")
                if eval_on and (step == t.train_iters or (t.eval_interval and step % t.eval_interval == 0)):
                    valid_it.load_state_dict({"consumed_samples": 0})  # same batches every eval
                    rec["val_loss"] = engine.evaluate(valid_it, t.eval_iters)
                if metrics is not None:
                    metrics.write(rec)
                if wandb_run is not None:
                    wandb_run.log({k: v for k, v in rec.items() if k != "lrs"}, step=step)
                window.append((dt, tokens_per_step))
                log.advance(rec["loss"])
                if t.log_interval and (step % t.log_interval == 0 or step == t.train_iters):
                    secs = sum(w[0] for w in window)
                    log.line(format_log_line(rec, t.train_iters, sum(w[1] for w in window) / secs,
                                             secs / len(window)))
                    window.clear()

                signum, late = watcher.poll(device)
                want_save = bool(ck.save and ck.save_interval and step % ck.save_interval == 0)
                if signum is not None:
                    status = "interrupted"
                    if ck.save and (signum != signal.SIGINT or ck.save_on_interrupt):
                        want_save = True
                elif step >= t.train_iters:
                    status, want_save = "completed", want_save or bool(ck.save)
                elif late:
                    status, want_save = "exit_duration", want_save or bool(ck.save)
                elif t.exit_interval and job_steps >= t.exit_interval:
                    status, want_save = "exit_interval", want_save or bool(ck.save)
                if want_save:
                    saved = save(step)
                if status != "running":
                    break
    except TrainingDivergedError as e:
        status, error = "diverged", str(e)
        raise
    except BaseException as e:
        if status == "running":
            status, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        log.stop()
        elapsed = time.perf_counter() - t_job
        if metrics is not None:
            metrics.close()
        memory = engine.memory_breakdown()  # local arithmetic on live buffers, no collective
        summary = _finish(cfg, out, metrics.records if metrics else [], status, step, start_iter,
                          job_steps, elapsed, tokens_per_step, saved, error, signum, wandb_run,
                          wandb_id, main, log, memory)
    if signum is not None:
        raise TrainingInterrupted(signum, summary)
    return summary


def _finish(cfg: LPTrainConfig, out: Path, records: list[dict[str, Any]], status: str, step: int,
            start_iter: int, job_steps: int, elapsed: float, tokens_per_step: int,
            saved: Path | None, error: str | None, signum: int | None, wandb_run: Any,
            wandb_id: str | None, main: bool, log: _Log,
            memory: dict[str, int] | None = None) -> dict[str, Any]:
    """Summary, plots and W&B close-out (main rank writes); returns the summary."""
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    evals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    summary: dict[str, Any] = {
        "status": status,
        "steps": step,
        "resumed_from_step": start_iter or None,
        "steps_this_job": job_steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "val_loss": evals[-1] if evals and records and "val_loss" in records[-1] else None,
        "tokens_per_s": tokens_per_step * job_steps / elapsed if elapsed > 0 else None,
        "seconds": elapsed,
        "checkpoint": str(saved) if saved else None,
        "wandb_run_id": wandb_id,
        "memory_breakdown_bytes": memory,  # this rank's buffers/optimizer (engine.memory_breakdown)
    }
    if error:
        summary["error"] = error
    if signum is not None:
        summary["signal"] = signal_name(signum)
    if not main:
        return summary
    files = [out / "resolved_config.yaml", out / "metrics.jsonl", out / "summary.json"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.logging.plots and records:
        from lptrain.train.plots import write_plots

        files += write_plots(out)
    if wandb_run is not None:
        wandb_run.summary.update({k: v for k, v in summary.items() if v is not None})
        wandb_run.finish()
        files.append(out / "wandb")
    if status == "diverged":
        log.line(f"stopped: {error}; metrics up to the previous step in {out}")
        return summary
    fl, ll = summary["first_loss"], summary["final_loss"]
    what = {"completed": "done", "interrupted": f"stopped by {summary.get('signal')}",
            "exit_interval": "stopped (train.exit_interval)",
            "exit_duration": "stopped (train.exit_duration_mins)"}.get(status, status)
    parts = [f"{what} at step {step} in {elapsed:.1f}s"]
    if fl is not None and ll is not None:
        parts.append(f"loss {fl:.3f} -> {ll:.3f}")
    if summary["val_loss"] is not None:
        parts.append(f"val {summary['val_loss']:.3f}")
    if summary["tokens_per_s"]:
        parts.append(f"{summary['tokens_per_s']:.0f} tokens/s")
    log.line(", ".join(parts))
    log.line("wrote " + ", ".join(p.name for p in files if p.exists()) + f" in {out}")
    if saved:
        how = ("train further: the same command with a larger train.train_iters"
               if status == "completed" else "resume: the same command again")
        log.line(f"checkpoint: {saved} ({how}, without --overwrite)")
    return summary
