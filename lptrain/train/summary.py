"""The end of a job: what it did (:class:`JobState`, updated step by step) and the summary
made of it (:class:`RunSummary`: ``summary.json``, the W&B summary, the closing lines).

The summary is written on every way out of the loop (completed, stopped by an interval or a
signal, diverged, failed), so a killed or crashed job still says how far it got.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lptrain.train.signals import signal_name

# The closing line's first words per status ("failed" is printed as it is).
_STOPPED = {"completed": "done", "exit_interval": "stopped (train.exit_interval)",
            "exit_duration": "stopped (train.exit_duration_mins)"}


@dataclass
class JobState:
    """Where this job is: the last step started, how it ends and the newest save."""

    step: int
    start_iter: int
    job_steps: int = 0
    status: str = "running"  # running | a StopReason | diverged | failed
    saved: Optional[Path] = None
    signum: Optional[int] = None
    error: Optional[str] = None


@dataclass
class RunSummary:
    """``summary.json`` of one job, keys in field order; ``error`` and ``signal`` only
    appear when set."""

    status: str
    steps: int
    resumed_from_step: Optional[int]
    steps_this_job: int
    first_loss: Optional[float]
    final_loss: Optional[float]
    val_loss: Optional[float]
    tokens_per_s: Optional[float]
    seconds: float
    checkpoint: Optional[str]
    wandb_run_id: Optional[str]
    memory_breakdown_bytes: Optional[dict[str, int]]  # this rank's buffers and optimizer
    error: Optional[str] = None
    signal: Optional[str] = None
    # every anomaly of the run and what was done about it (anomalies.jsonl, without the
    # statistics); [] when there was none
    anomalies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # the ranks' layout: tp, cp, pp, dp, ep, etp sizes and the world size (ParallelDims)
    parallel: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_job(cls, job: JobState, records: list[dict[str, Any]], seconds: float,
               tokens_per_step: int, wandb_run_id: Optional[str],
               memory: Optional[dict[str, int]]) -> RunSummary:
        """The summary of ``job`` from the run's metrics lines (empty off the main rank).
        ``val_loss`` is the last step's, so a run that stopped between evals has none."""
        losses = [r["loss"] for r in records if r.get("loss") is not None]
        evals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
        return cls(
            status=job.status, steps=job.step, resumed_from_step=job.start_iter or None,
            steps_this_job=job.job_steps,
            first_loss=losses[0] if losses else None, final_loss=losses[-1] if losses else None,
            val_loss=evals[-1] if evals and records and "val_loss" in records[-1] else None,
            tokens_per_s=tokens_per_step * job.job_steps / seconds if seconds > 0 else None,
            seconds=seconds, checkpoint=str(job.saved) if job.saved else None,
            wandb_run_id=wandb_run_id, memory_breakdown_bytes=memory,
            error=job.error,
            signal=signal_name(job.signum) if job.signum is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not d["error"]:
            del d["error"]
        if d["signal"] is None:
            del d["signal"]
        return d

    def closing_lines(self, out: Path, written: list[str],
                      schedule_follows_train_iters: bool = False) -> list[str]:
        """The main rank's last lines: how the job ended, the files ``written`` and, after
        a save, how to go on (with a decay that follows ``train.train_iters``, a larger one
        changes the lr schedule: which of the two to follow must be said)."""
        if self.status == "diverged":
            return [f"stopped: {self.error}; metrics up to the previous step in {out}"]
        what = f"stopped by {self.signal}" if self.status == "interrupted" else _STOPPED.get(self.status, self.status)
        parts = [f"{what} at step {self.steps} in {self.seconds:.1f}s"]
        if self.first_loss is not None and self.final_loss is not None:
            parts.append(f"loss {self.first_loss:.3f} -> {self.final_loss:.3f}")
        if self.val_loss is not None:
            parts.append(f"val {self.val_loss:.3f}")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:.0f} tokens/s")
        lines = [", ".join(parts), "wrote " + ", ".join(written) + f" in {out}"]
        if self.checkpoint:
            how = ("train further: the same command with a larger train.train_iters"
                   if self.status == "completed" else "resume: the same command again")
            if self.status == "completed" and schedule_follows_train_iters:
                how += (" and optimizer.use_checkpoint_opt_param_scheduler=true (the saved lr "
                        "schedule goes on) or optimizer.override_opt_param_scheduler=true (the "
                        "decay re-planned over the longer run)")
            lines.append(f"checkpoint: {self.checkpoint} ({how}, without --overwrite)")
        return lines
