"""The train-eval-checkpoint loop: *when* things happen. *How* a step is done is the engine's
(:class:`lptrain.train.engine.TrainEngine`, same code at one rank or many).

:func:`pretrain` is a sequence of named steps:

1. plan the output folder (:mod:`~lptrain.train.run_dir`: resume / refuse / fresh, nothing
   written yet) and check ``checkpoint.init_from_hf``;
2. build the engine and open this rank's data loaders;
3. :func:`_restore`: the newest valid checkpoint (falling back past incomplete or corrupt
   ones and saying so), or the Hugging Face weights;
4. :func:`_claim` the folder (overwrite applied, metrics trimmed to the resumed step,
   ``resolved_config.yaml``);
5. :class:`_Job` trains: after each step the metrics line (flushed), the console line, eval,
   save and stop, each decided by a policy of :mod:`~lptrain.train.policies` (a stop saves
   before leaving); on every way out, :meth:`_Job.finish` writes the summary and plots.

All of it runs under the run folder's lock (:mod:`~lptrain.train.run_lock`, main rank),
taken before anything is written. A failed save or a full disk is one
:class:`~lptrain.errors.RunFailedError` (exit 3) after the summary is written; a summary or
plot that cannot be written is a line, and exit 3 once the rest is done.

Eval and save go through ``engine.params_synced()`` and change no training state, so a run
with them is bitwise the run without them. Only the main rank writes files or prints; every
rank takes part in saves and stop decisions. Steps are counted from 1 everywhere (metrics,
messages, checkpoint names).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lptrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lptrain.checkpoint.atomic import write_atomically
from lptrain.config import World, derive
from lptrain.config.render import config_yaml
from lptrain.config.schema import LPTrainConfig
from lptrain.data.loader import BatchIterator, data_state, eval_micro_batches, load_data_state
from lptrain.distributed.progress import mark_step
from lptrain.errors import RunFailedError
from lptrain.train.anomalies import AnomalyLog, AnomalyPolicy, RollBack, action_text
from lptrain.train.console import LogWindow, RunLog
from lptrain.train.engine import StepResult, TrainEngine, TrainingDivergedError
from lptrain.train.forensics import (
    NaNInjector,
    SpikeDetector,
    batch_span,
    describe,
    investigate,
    micro_batch_samples,
)
from lptrain.train.metrics import StepMeter, finite_or_none, format_log_line
from lptrain.train.outputs import RunOutputs
from lptrain.train.policies import (
    EvalPolicy,
    LogPolicy,
    NumericsPolicy,
    SavePolicy,
    StopPolicy,
    StopReason,
)
from lptrain.train.run_dir import RunPlan, plan_run, rebase_on_output_dir, start_run
from lptrain.train.run_lock import run_lock
from lptrain.train.signals import StopWatcher, TrainingInterrupted
from lptrain.train.summary import JobState, RunSummary

if TYPE_CHECKING:
    from lptrain.interop.hf_arch import Architecture

__all__ = ["TrainingDivergedError", "TrainingInterrupted", "pretrain"]

Loaders = tuple[BatchIterator, Optional[BatchIterator]]  # (train, valid: None without a split)


def pretrain(cfg: LPTrainConfig, output_dir: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Train (or resume) into ``output_dir``; returns the summary (also ``summary.json``).

    Raises :class:`~lptrain.train.run_dir.RunDirRefused` for a folder it must not touch,
    :class:`TrainingDivergedError` on a non-finite step with ``train.on_nonfinite=stop`` and
    :class:`TrainingInterrupted` (a ``SystemExit``: 143 or 130) after a signal.
    """
    cfg = derive(cfg, World.detect())  # idempotent: the CLI already derived; direct callers may not
    out = Path(output_dir)
    cfg = rebase_on_output_dir(cfg, out)
    main = int(os.environ.get("RANK", "0")) == 0  # rank 0 owns the run folder (and its lock)
    with run_lock(out) if main else contextlib.nullcontext():
        plan = plan_run(cfg, out, overwrite)
        hf_arch = _check_init_from_hf(cfg, plan)
        engine = TrainEngine(cfg)
        log = RunLog(engine.is_main, cfg)
        for note in plan.notes:
            log.line(f"warning: skipping checkpoint {note}")
        if plan.restart:
            log.line(plan.restart)
        loaders = _open_data(cfg, engine)
        train_state = _restore(cfg, engine, plan, loaders, hf_arch, log)
        resolved = config_yaml(cfg)
        _claim(plan, cfg, int(train_state.get("iteration", 0)), resolved, engine.is_main)
        return _Job(cfg, out, engine, log, loaders, train_state, resolved).run()


def _check_init_from_hf(cfg: LPTrainConfig, plan: RunPlan) -> Optional[Architecture]:
    """The architecture of ``checkpoint.init_from_hf`` when a fresh run will read it; checked
    before the engine is built (one line, exit 2). A resumed run does not read it."""
    if not cfg.checkpoint.init_from_hf or plan.candidates:
        return None
    from lptrain.interop.hf_import import check_init_from_hf

    return check_init_from_hf(cfg)


def _open_data(cfg: LPTrainConfig, engine: TrainEngine) -> Loaders:
    """This rank's ``(train, valid)`` loaders; ``valid`` is None without a validation split.

    ``build_train_valid_loaders`` is looked up on :mod:`lptrain.data` at call time: the
    multi-rank resume tests wrap it there to record every sample position a rank reads."""
    from lptrain.data import build_train_valid_loaders

    t = cfg.train
    return build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=engine.dp_rank, dp_size=engine.dp_size,
        vocab_size=cfg.model.vocab_size,
    )


def _restore(cfg: LPTrainConfig, engine: TrainEngine, plan: RunPlan, loaders: Loaders,
             hf_arch: Optional[Architecture], log: RunLog) -> dict[str, Any]:
    """Resume from the plan's checkpoints (engine and data positions), or start from the
    Hugging Face weights; returns the checkpoint's train state (empty for a fresh run)."""
    if plan.candidates:
        train_state = _resume(engine, plan.candidates, log, cfg.checkpoint.load_optimizer)
        load_data_state(train_state["data"], *loaders)
        if cfg.checkpoint.init_from_hf:
            log.line(f"note: checkpoint.init_from_hf={cfg.checkpoint.init_from_hf} not read: the "
                     "run resumes from its own checkpoint (its weights started from that folder)")
        return train_state
    if hf_arch is not None:
        from lptrain.interop.hf_import import init_engine_from_hf

        log.line(init_engine_from_hf(engine, cfg, hf_arch))
    return {}


def _resume(engine: TrainEngine, candidates: list[Path], log: RunLog,
            load_optimizer: bool = True) -> dict[str, Any]:
    """Load the newest loadable checkpoint into the engine; returns its train state.

    Any failure on any rank -- a checksum mismatch, an unreadable file, a load error -- falls
    back to the next older checkpoint on every rank (they agree after each try), naming the
    file and what failed. ``load_optimizer=False`` keeps the weights and drops the saved
    optimizer state (``checkpoint.load_optimizer=false``)."""
    failures = []
    for i, folder in enumerate(candidates):
        error = None
        notes: list[str] = []
        try:
            state, train_state = load_checkpoint(folder, engine.rank, engine.world_size)
            if not load_optimizer:
                state["global"]["optimizer"] = {}
            notes = engine.load_checkpoint_state(state)
        except (CheckpointError, KeyError, RuntimeError, ValueError) as e:
            error = str(e)
        error = _first_error(error)
        if error is not None:
            failures.append(error)
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            log.line(f"warning: could not load checkpoint {folder} ({error}); "
                     + (f"falling back to {nxt}" if nxt else "no older valid checkpoint"))
            continue
        if not state["verified"]:
            log.line(f"note: {folder} has no checksums (written before lptrain recorded them): "
                     "its files could not be verified")
        if state["local"] is None:
            log.line(f"note: {folder} was written at world size {train_state.get('world_size')}; "
                     "per-rank RNG streams start afresh")
        if not load_optimizer:
            log.line("note: checkpoint.load_optimizer=false: the optimizer starts fresh from the "
                     "saved weights")
        for note in notes:  # optimizer state converted (lptrain.optim.precision_aware)
            log.line(f"warning: {note}")
        log.line(f"resuming from {folder} (step {train_state['iteration']})")
        return train_state
    raise CheckpointError("no checkpoint could be loaded: " + "; ".join(failures))


def _first_error(error: Optional[str]) -> Optional[str]:
    """The first rank's error of this try (every rank gets the same answer)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return error
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def _claim(plan: RunPlan, cfg: LPTrainConfig, start_iter: int, resolved: str, main: bool) -> None:
    """The main rank takes the folder (:func:`~lptrain.train.run_dir.start_run`). Every rank
    has planned (read the folder) before: without the barrier a slow rank would see the
    fresh metrics.jsonl of its own run and refuse the folder."""
    _barrier()
    if main:
        start_run(plan, cfg, start_iter, resolved)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class _Job:
    """This job's part of the run, on this rank: the steps from the resumed one to a stop."""

    def __init__(self, cfg: LPTrainConfig, out: Path, engine: TrainEngine, log: RunLog,
                 loaders: Loaders, train_state: dict[str, Any], resolved: str) -> None:
        t = cfg.train
        self.cfg, self.out, self.engine, self.log, self.resolved = cfg, out, engine, log, resolved
        self.train_it, self.valid_it = loaders
        self.num_micro = t.global_batch_size // (t.micro_batch_size * engine.dp_size)
        self.device = next(engine.model.parameters()).device
        self.meter = StepMeter.for_run(cfg, self.device, engine.world_size)
        self.evals = EvalPolicy.from_config(cfg, has_valid_split=self.valid_it is not None)
        self.console_lines = LogPolicy.from_config(cfg)
        self.saves = SavePolicy.from_config(cfg)
        self.stops = StopPolicy.from_config(cfg)
        self.numerics = NumericsPolicy.from_config(cfg)
        self.spikes = SpikeDetector(t.spike_zscore, t.spike_window)
        self.anomaly_policy = AnomalyPolicy(cfg)
        self.anomalies = AnomalyLog(out, engine.is_main)
        engine.returns_anomalies = True  # this loop applies train.on_anomaly
        # per-micro-batch callbacks (the NaN injection, the forensic hooks of a re-run)
        self.dispatch: list[Any] = []
        engine.before_micro_batch = self._before_micro_batch
        self.injector = NaNInjector(cfg, engine.model) if cfg.debug.nan_sample is not None else None
        if self.injector is not None:
            self.dispatch.append(self.injector)
        self.window = LogWindow()
        self.unwritten: list[str] = []  # files of the run's end that could not be written
        self.unwritten_paths: set[str] = set()
        self.outputs = RunOutputs(cfg, out, engine.is_main, train_state.get("wandb_run_id"))
        start_iter = int(train_state.get("iteration", 0))
        self.state = JobState(step=start_iter, start_iter=start_iter)
        self.prior_elapsed = float(train_state.get("elapsed_s", 0.0))
        self._announce()
        self.t_job = time.perf_counter()

    def _announce(self) -> None:
        cfg, t, start = self.cfg, self.cfg.train, self.state.start_iter
        n_params = self.engine.parameter_count()
        self.log.line(
            f"lptrain {cfg.run.name}: {n_params / 1e6:.2f}M params, {t.train_iters} steps x "
            f"{t.global_batch_size} seqs x {cfg.model.seq_length} tokens, "
            f"{self.engine.world_size} rank(s)" + (f"; resuming at step {start + 1}" if start else "")
        )
        if not self.evals.enabled:
            why = ("no validation split (data.split_valid_fraction=0)" if self.valid_it is None
                   else "train.eval_iters=0")
            self.log.line(f"evaluation off: {why}")

    def run(self) -> dict[str, Any]:
        """Steps until a stop; the summary on every way out (then re-raise, or after a
        signal :class:`TrainingInterrupted`)."""
        state = self.state
        self.log.start(state.start_iter, self.cfg.train.train_iters)
        # The watcher also covers finish(): a launcher's SIGTERM while the summary and plots
        # are written is recorded, not raised (it would lose them and the real error).
        with StopWatcher(self.cfg.train.exit_duration_mins) as watcher:
            try:
                while state.step < self.cfg.train.train_iters:
                    try:
                        if self._step(watcher) is not None:
                            break
                    except RollBack as rb:
                        self._rollback(rb)
            except TrainingDivergedError as e:
                state.status, state.error = "diverged", str(e)
                raise
            except RunFailedError as e:  # a failed save, a full disk: one line, exit 3
                state.status, state.error = "failed", str(e)
                raise
            except BaseException as e:
                if state.status == "running":
                    state.status, state.error = "failed", f"{type(e).__name__}: {e}"
                raise
            finally:
                summary = self.finish()
            if state.signum is not None:
                # Every rank stops after the same step; none exits before the main rank has
                # written its summary and plots (a launcher tears the world down at the first
                # rank's exit).
                _barrier()
        if self.unwritten:
            raise RunFailedError(self.unwritten[0], fix="free space on that filesystem or make "
                                 "the run folder writable; the checkpoint and metrics are kept")
        if state.signum is not None:
            raise TrainingInterrupted(state.signum, summary)
        return summary

    def _step(self, watcher: StopWatcher) -> Optional[StopReason]:
        """One step: train, record, print; then the stop and save decisions (every rank
        agrees on them: the watcher all-reduces). Returns why the job stops, if it does."""
        state = self.state
        state.step += 1
        state.job_steps += 1
        rec, dt = self._train_step(state.step)
        if self.evals.due(state.step):
            self.valid_it.load_state_dict({"consumed_samples": 0})  # same batches every eval
            n = eval_micro_batches(self.valid_it, self.cfg.train.eval_iters)  # same samples at any DP
            rec["val_loss"] = self.engine.evaluate(self.valid_it, n)
        self.outputs.write(rec)
        self._print(rec, dt)
        signum, late = watcher.poll(self.device)
        state.signum = signum
        stop = self.stops.reason(state.step, state.job_steps, signum, late)
        if stop is not None:
            state.status = stop
        if self.saves.due(state.step, stop, signum):
            state.saved = self._save(state.step)
        return stop

    def _before_micro_batch(self, i: int) -> None:
        for callback in self.dispatch:
            callback.on_micro_batch(i)

    def _train_step(self, step: int) -> tuple[dict[str, Any], float]:
        """The engine's step on this rank's micro-batches; its metrics line and step time.
        An anomalous step is investigated and ``train.on_anomaly`` applied (a stop raises
        :class:`TrainingDivergedError`, a rollback :class:`RollBack`)."""
        t0 = time.perf_counter()
        mark_step(step)  # progress, for the launcher's hung-rank watchdog
        before = self.train_it.consumed_samples
        micro = [next(self.train_it) for _ in range(self.num_micro)]
        samples = micro_batch_samples(self.train_it.sampler, before, self.num_micro)
        if self.injector is not None:
            self.injector.arm(samples)
        res = self.engine.train_step(micro, step, numerics=self.numerics.due(step),
                                     spike=self.spikes.check if self.spikes.enabled else None)
        dt = time.perf_counter() - t0
        rec = self.meter.record(step, res, dt, self.train_it.consumed_samples)
        if res.numerics is not None:
            rec["numerics"] = res.numerics
        if res.anomaly is not None:
            self._on_anomaly(step, res, micro, samples, before)
            rec["anomaly"] = res.anomaly
        else:
            self.spikes.observe(step, res.loss)
        if res.skipped:
            self.log.line(f"warning: {res.note}")
        return rec, dt

    def _on_anomaly(self, step: int, res: StepResult, micro: list[Any], samples: list[list[int]],
                    before: int) -> None:
        """Investigate (re-run with hooks), record, then stop, skip the batch or roll back."""
        t = self.cfg.train
        found = investigate(self.engine, micro, samples, self.dispatch)
        decision = self.anomaly_policy.decide(step)
        skip_to = self.train_it.consumed_samples
        action = action_text(decision, skip_to, t.on_anomaly or "stop")
        culprit = found["culprit"]
        record: dict[str, Any] = {
            "step": step, "kind": res.anomaly, "note": res.note,
            "rank": culprit["rank"] if culprit else None,
            "samples": culprit["samples"] if culprit else [s for m in samples for s in m],
            "batch": batch_span(before, t.global_batch_size), "culprit": culprit,
            "ranks": found["ranks"], "loss": finite_or_none(res.loss),
            "action": decision.action, "action_text": action,
        }
        if decision.action == "rollback":
            record.update(to_step=decision.to_step, skipped_samples=[decision.from_samples, skip_to])
        record["numerics"] = found["numerics"]
        self.anomalies.write(record)
        res.note = f"{res.note}; {describe(culprit)}; {action}"
        if decision.action == "stop":
            raise TrainingDivergedError(res.note)
        if decision.action == "rollback":
            self.log.line(f"warning: {res.note}")
            raise RollBack(decision, skip_to)

    def _rollback(self, rb: RollBack) -> None:
        """Reload the checkpoint before the anomaly and skip the data since it: the step
        count, metrics and loss history go back to that step, the data position does not."""
        d = rb.decision
        train_state = _resume(self.engine, [d.folder], self.log, True)
        load_data_state(train_state["data"], self.train_it, self.valid_it)
        self.train_it.load_state_dict({"consumed_samples": rb.skip_to})
        self.state.step = d.to_step
        self.outputs.rewind(d.to_step)
        self.spikes.forget_after(d.to_step)
        self.log.rewind(d.to_step)

    def _print(self, rec: dict[str, Any], dt: float) -> None:
        """Advance the progress bar; every ``train.log_interval`` steps a console line."""
        self.window.add(dt, self.meter.tokens_per_step)
        self.log.advance(rec["loss"])
        if self.console_lines.due(rec["step"]):
            tokens_per_s, step_time_s = self.window.take()
            self.log.line(format_log_line(rec, self.cfg.train.train_iters, tokens_per_s, step_time_s))

    def _save(self, iteration: int) -> Path:
        """A checkpoint of the engine (masters synced) and of where the data and W&B are."""
        train_state = {
            "consumed_samples": self.train_it.consumed_samples,
            "consumed_tokens": self.train_it.consumed_samples * self.cfg.model.seq_length,
            "data": data_state(self.train_it, self.valid_it),
            "wandb_run_id": self.outputs.wandb_id,
            "dp_size": self.engine.dp_size,
            "elapsed_s": self.prior_elapsed + time.perf_counter() - self.t_job,
        }
        with self.engine.params_synced():
            engine_state = self.engine.checkpoint_state()
        ck = self.cfg.checkpoint
        folder = save_checkpoint(ck.save, iteration, engine_state, train_state, self.resolved,
                                 rank=self.engine.rank, world_size=self.engine.world_size,
                                 keep_latest=ck.keep_latest)
        self.log.line(f"saved checkpoint {folder}")
        return folder

    def finish(self) -> dict[str, Any]:
        """Close the console and metrics, then :meth:`_finish` the summary of this job."""
        self.log.stop()
        elapsed = time.perf_counter() - self.t_job
        self.outputs.close_metrics()
        memory = self.engine.memory_breakdown()  # local arithmetic on live buffers, no collective
        summary = RunSummary.of_job(self.state, self.outputs.records, elapsed,
                                    self.meter.tokens_per_step, self.outputs.wandb_id, memory)
        summary.anomalies = self.anomalies.summary()
        return self._finish(summary)

    def _try_write(self, path: Path, write: Any) -> None:
        """Run ``write``; a filesystem error becomes a line (and exit 3 once the rest of
        the end is written), never a traceback over what the run already wrote."""
        try:
            write()
        except OSError as e:
            what = f"cannot write {e.filename or path}: {e.strerror or e}"
            self.unwritten.append(what)
            self.unwritten_paths.add(str(e.filename or path))
            self.log.line(f"warning: {what}")

    def _finish(self, summary: RunSummary) -> dict[str, Any]:
        """Summary, plots and W&B close-out (main rank writes); returns the summary."""
        result = summary.to_dict()
        if not self.engine.is_main:
            return result
        out = self.out
        files = [out / "resolved_config.yaml", out / "metrics.jsonl", out / "summary.json",
                 out / "anomalies.jsonl"]
        self._try_write(out / "summary.json",
                        lambda: write_atomically(out / "summary.json", json.dumps(result, indent=2) + "\n"))
        if self.cfg.logging.plots and self.outputs.records:
            from lptrain.train.plots import write_plots

            self._try_write(out, lambda: files.extend(write_plots(out)))
        if self.outputs.finish_wandb(result):
            files.append(out / "wandb")
        written = [p.name for p in files if p.exists() and str(p) not in self.unwritten_paths]
        for line in summary.closing_lines(out, written):
            self.log.line(line)
        return result
