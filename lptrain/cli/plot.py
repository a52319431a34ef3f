"""``lptrain plot RUN_DIR``: the run's curves as PNG, from its ``metrics.jsonl``.

Importing this module stays light (no torch, no matplotlib): the plotting code
(:mod:`lptrain.train.plots`) is imported inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer


def plot(run_dir: str = typer.Argument(..., help="Run folder holding metrics.jsonl.")) -> None:
    """Write loss, lr and grad-norm curves (and the memory breakdown) as PNG into RUN_DIR."""
    path = Path(run_dir)
    if not (path / "metrics.jsonl").is_file():
        typer.echo(f"error: {path / 'metrics.jsonl'} not found: pass a run folder written by "
                   "lptrain pretrain", err=True)
        raise typer.Exit(2)
    from lptrain.train.plots import write_plots

    written = write_plots(path)
    if not written:
        typer.echo(f"error: {path / 'metrics.jsonl'} holds no step lines to plot", err=True)
        raise typer.Exit(2)
    typer.echo("wrote " + ", ".join(str(p) for p in written))
