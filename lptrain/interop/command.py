"""The ``export`` CLI command; ``lptrain.cli.app`` calls :func:`register`.

Errors go through the CLI's one error surface (:mod:`lptrain.cli.errors`): an unusable source,
a model without a Hugging Face architecture or an occupied output folder is one
``error: ...`` line and exit status 2. Importing this module stays light (typer only).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``export`` to ``app``."""

    @app.command("export")
    def export(
        source: str = typer.Argument(
            ..., help="Run folder (with resolved_config.yaml), checkpoint.save folder or one iter_* folder."
        ),
        output: str = typer.Option(..., "--output", "-o", help="Folder to write the model into."),
        fmt: str = typer.Option("hf", "--format", help="Output format: hf (a Hugging Face model folder)."),
        dtype: str = typer.Option("bf16", "--dtype", help="Weight dtype: bf16, fp16 or fp32 (cast from the fp32 masters)."),
        max_shard_size: str = typer.Option(
            "5GB", "--max-shard-size", help="Shard model.safetensors above this size (5GB, 500MB, 2GiB)."
        ),
        tokenizer: Optional[str] = typer.Option(
            None, "--tokenizer", help="tokenizers JSON file to ship (default: the run's data.tokenizer)."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace the files of a non-empty --output."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    ) -> None:
        """Write the newest checkpoint of a run as a Hugging Face model folder.

        Exit status: 0 written, 2 unusable input (no checkpoint, no matching architecture,
        an occupied --output).
        """
        from lptrain.errors import InputError

        if fmt != "hf":
            raise InputError(f"--format {fmt!r} is not supported", fix="pass --format hf")
        from lptrain.interop.hf_export import export_hf

        rep = export_hf(source, output, dtype=dtype, max_shard_size=max_shard_size,
                        tokenizer=tokenizer, overwrite=overwrite, progress=progress and sys.stdout.isatty())
        typer.echo(f"exported {rep.checkpoint} (step {rep.iteration}) as {rep.architecture}, "
                   f"{rep.num_params / 1e6:.2f}M parameters in {rep.dtype}, to {rep.output}: "
                   + ", ".join(rep.files))
        for note in rep.notes:
            typer.echo(f"note: {note}")
