"""``train.on_anomaly``: what an anomalous step leads to, and its record.

:class:`AnomalyPolicy` decides, for an anomaly at step N: ``stop`` (the run fails, exit 3,
naming the step, rank, samples and tensor), ``skip_batch`` (no update for that batch; the
run goes on) or ``rollback`` -- reload the newest checkpoint before the anomaly window (the
steps whose losses led up to N: :meth:`lptrain.train.loss_watch.LossWatch.window_start`) and
skip the data the run read since it (the batches of the steps after the checkpoint up to N),
as PaLM did for loss spikes, at most ``train.max_rollbacks`` times in a job. An anomaly
before the run got past the one it last rolled back for goes further back, before that
rollback's checkpoint: a checkpoint the run fails from again is not rolled back to twice in
a row. A checkpoint that cannot be loaded (a corrupt file) falls back to the next older one,
as a resume does; without a loadable one, or past the limit, the anomaly stops the run
(exit 3). Every decision is the same on every rank.

Each anomaly is one line of ``anomalies.jsonl`` in the run folder (:class:`AnomalyLog`:
step, kind, rank, sample ids, the first non-finite tensor, that step's quantization
statistics and the action), and appears, without the statistics, in ``summary.json``.
``lptrain replay`` reads the file to re-run an anomalous step and to follow the data skips of
rollbacks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from lptrain.checkpoint import find_checkpoints
from lptrain.checkpoint.atomic import write_atomically
from lptrain.checkpoint.store import read_train_state
from lptrain.config.schema import LPTrainConfig
from lptrain.train.jsonl import step_records

ANOMALIES_FILE = "anomalies.jsonl"


@dataclass(frozen=True)
class Decision:
    """``action`` (stop, skip_batch, rollback); for a rollback the checkpoint folder, its
    step and consumed samples; ``why`` when a configured rollback became a stop."""

    action: str
    folder: Optional[Path] = None
    to_step: int = 0
    from_samples: int = 0
    why: str = ""
    # older valid checkpoints before the step, newest first: where a rollback falls back to
    # when ``folder`` cannot be loaded (a corrupt file), as a resume does
    fallbacks: tuple[Path, ...] = ()

    def loaded(self, folder: Path, train_state: dict[str, Any]) -> Decision:
        """This rollback as it happened: to ``folder``, the one that loaded."""
        return replace(self, folder=folder, to_step=int(train_state["iteration"]),
                       from_samples=int(train_state["consumed_samples"]), fallbacks=())


class AnomalyPolicy:
    """``train.on_anomaly`` with its rollback budget (counted per job)."""

    def __init__(self, cfg: LPTrainConfig) -> None:
        t = cfg.train
        self.action = t.on_anomaly or ("skip_batch" if t.on_nonfinite == "skip" else "stop")
        self.max_rollbacks = t.max_rollbacks
        self.save = cfg.checkpoint.save
        self.rollbacks = 0
        self.last: Optional[tuple[int, int]] = None  # (anomaly step, checkpoint step) of the last rollback

    def decide(self, step: int, window_start: Optional[int] = None) -> Decision:
        """The action for an anomaly at ``step`` whose window starts at ``window_start``
        (default: the step itself)."""
        if self.action != "rollback":
            return Decision(self.action)
        if self.rollbacks >= self.max_rollbacks:
            return Decision("stop", why=f"train.max_rollbacks={self.max_rollbacks} reached")
        before = min(step, window_start or step)
        where = f"before step {before}" + (" (the anomaly window began there)" if before < step else "")
        if self.last is not None and step <= self.last[0] and self.last[1] < before:
            before = self.last[1]  # failed again from the last rollback's checkpoint: further back
            where = (f"before step {before} (the run failed again from that checkpoint, before getting "
                     f"past step {self.last[0]})")
        found = [f for f in find_checkpoints(self.save).valid if _iteration(f) < before] if self.save else []
        if not found:
            return Decision("stop", why=f"no checkpoint {where} to roll back to")
        folder = found[0]
        state = read_train_state(folder)
        self.rollbacks += 1
        self.last = (step, int(state["iteration"]))
        return Decision("rollback", folder, int(state["iteration"]), int(state["consumed_samples"]),
                        fallbacks=tuple(found[1:]))


def _iteration(folder: Path) -> int:
    return int(folder.name.rsplit("_", 1)[-1])


class RollBack(Exception):
    """Raised by the step to make the loop roll back (see :class:`Decision`), once the engine
    holds the checkpoint's state (``train_state``: its data positions)."""

    def __init__(self, decision: Decision, skip_to: int, train_state: dict[str, Any]) -> None:
        super().__init__(f"roll back to step {decision.to_step}")
        self.decision = decision
        self.skip_to = skip_to
        self.train_state = train_state


def action_text(d: Decision, skip_to: int, on_anomaly: str) -> str:
    """The action as the log line and the record say it."""
    if d.action == "rollback":
        return (f"rolled back to step {d.to_step} ({d.folder}), skipping samples "
                f"{d.from_samples}-{skip_to - 1}")
    if d.action == "skip_batch":
        return "batch skipped (no update)"
    why = f"; {d.why}" if d.why else ""
    return f"stopping (train.on_anomaly={on_anomaly}{why})"


class AnomalyLog:
    """``anomalies.jsonl`` (main rank; one flushed line per anomaly) and the records of
    the whole run (a resumed job's earlier ones included)."""

    def __init__(self, out: Path, main: bool) -> None:
        self.path = out / ANOMALIES_FILE
        self.main = main
        self.records = read_anomalies(out)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.main:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def summary(self) -> list[dict[str, Any]]:
        """The records without their statistics (for ``summary.json``)."""
        return [{k: v for k, v in r.items() if k != "numerics"} for r in self.records]


def read_anomalies(run_dir: str | Path) -> list[dict[str, Any]]:
    """The anomaly records of a run folder (a torn last line is skipped)."""
    path = Path(run_dir) / ANOMALIES_FILE
    return step_records(path) if path.exists() else []


def trim_anomalies(run_dir: Path, last_step: int) -> None:
    """A resume at ``last_step``: drop the records of steps it redoes, keeping a rollback
    whose target is at or before it (its data skip is part of the history that goes on)."""
    path = Path(run_dir) / ANOMALIES_FILE
    if not path.exists():
        return
    keep = [r for r in read_anomalies(run_dir)
            if int(r["step"]) <= last_step or int(r.get("to_step", last_step + 1)) <= last_step]
    text = "".join(json.dumps(r) + "\n" for r in keep)
    if text != path.read_text():
        write_atomically(path, text)
