"""Where the main rank's records go: ``metrics.jsonl`` (one flushed line per step) and, with
``logging.wandb``, a W&B run (offline by default) that a resumed job continues.

The other ranks get an :class:`RunOutputs` that writes nothing but still knows the W&B run id
from the checkpoint, so every rank saves the same train state.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any, Optional

from lptrain.config.schema import LPTrainConfig
from lptrain.train.metrics import MetricsWriter


def start_wandb(cfg: LPTrainConfig, out: Path, run_id: Optional[str]) -> Any:
    """A W&B run when ``logging.wandb`` is on (offline by default); reuses ``run_id`` on resume."""
    if not cfg.logging.wandb:
        return None
    import wandb

    return wandb.init(
        project=cfg.logging.wandb_project, name=cfg.run.name, mode=cfg.logging.wandb_mode,
        dir=str(out), config=dataclasses.asdict(cfg), id=run_id or secrets.token_hex(4),
        resume="allow",
    )


class RunOutputs:
    """``metrics.jsonl`` and the W&B run of one job (main rank only; empty elsewhere)."""

    def __init__(self, cfg: LPTrainConfig, out: Path, main: bool, wandb_run_id: Optional[str]) -> None:
        self.metrics = MetricsWriter(out / "metrics.jsonl") if main else None
        self.wandb = start_wandb(cfg, out, wandb_run_id) if main else None
        self.wandb_id = self.wandb.id if self.wandb is not None else wandb_run_id

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every metrics line of the run so far (a resumed run's earlier lines included)."""
        return self.metrics.records if self.metrics is not None else []

    def write(self, rec: dict[str, Any]) -> None:
        """One step's line: appended to ``metrics.jsonl`` and logged to W&B (there without
        the per-group ``lrs`` dict -- ``lr`` is the first group's --, without the anomaly's
        kind (a string; ``skipped`` says it), and with the quantization statistics as
        ``numerics/<operand>/<statistic>`` scalars)."""
        if self.metrics is not None:
            self.metrics.write(rec)
        if self.wandb is not None:
            from lptrain.train.numerics import flat_for_wandb

            logged = {k: v for k, v in rec.items() if k not in ("lrs", "numerics", "anomaly")}
            logged.update(flat_for_wandb(rec.get("numerics") or {}))
            self.wandb.log(logged, step=rec["step"])

    def rewind(self, step: int) -> None:
        """A rollback to ``step``: ``metrics.jsonl`` keeps the lines up to it (the later
        steps are redone), reopened for appending."""
        if self.metrics is None:
            return
        from lptrain.train.metrics import MetricsWriter
        from lptrain.train.run_dir import trim_metrics

        self.metrics.close()
        trim_metrics(self.metrics.path, step)
        self.metrics = MetricsWriter(self.metrics.path)

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def finish_wandb(self, summary: dict[str, Any]) -> bool:
        """Close the W&B run with the summary's set values; True when there was one."""
        if self.wandb is None:
            return False
        self.wandb.summary.update({k: v for k, v in summary.items() if v is not None})
        self.wandb.finish()
        import wandb

        # the W&B service process outlives finish() and keeps polling (a tenth of a core each,
        # for as long as the Python process lives: a notebook, a test worker, a sweep driver)
        wandb.teardown()
        self.wandb = None
        return True
