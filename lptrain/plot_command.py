"""The ``plot`` CLI command; ``lptrain.cli`` calls :func:`register`.

Kept outside ``lptrain.train`` so that importing the CLI stays light (no torch, no
matplotlib): the plotting code is imported inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add ``plot`` to ``app``."""

    @app.command("plot")
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
