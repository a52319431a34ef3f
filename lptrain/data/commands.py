"""The ``prepare-data`` CLI command; ``lptrain.cli.app`` calls :func:`register`.

Importing this module stays light (typer only): numpy, tokenizers and the pipeline modules
are imported inside the command.
"""

from __future__ import annotations

from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``prepare-data`` to ``app``."""

    @app.command("prepare-data")
    def prepare_data(
        input: Optional[list[str]] = typer.Option(
            None, "--input", "-i",
            help="Text, JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or .parquet file, directory or quoted "
            "glob pattern such as 'data/*.parquet' (repeat for several).",
        ),
        output: Optional[str] = typer.Option(
            None, "--output", "-o", help="Output prefix: writes PREFIX.bin and PREFIX.idx."
        ),
        tokenizer: str = typer.Option("byte", help="byte or a path to a tokenizers JSON file."),
        train_tokenizer: Optional[str] = typer.Option(
            None, "--train-tokenizer", help="Train a tokenizer on the input first: bpe."
        ),
        vocab_size: Optional[int] = typer.Option(None, help="Vocabulary size for --train-tokenizer."),
        workers: int = typer.Option(
            0, help="Tokenizer threads (1 = all in this thread; 0 = one per available CPU)."
        ),
        text_key: str = typer.Option("text", help="JSONL key / parquet column holding the document text."),
        glob: Optional[list[str]] = typer.Option(
            None, "--glob", help="File patterns inside directories (repeat; default *.txt *.md *.rst *.py *.jsonl "
            "*.jsonl.gz *.jsonl.zst *.parquet)."
        ),
        skip_bad_lines: bool = typer.Option(
            False, "--skip-bad-lines", help="Warn about and skip bad JSONL lines instead of failing."
        ),
        builtin: Optional[str] = typer.Option(
            None, "--builtin", help="Prepare a built-in corpus (python-stdlib) instead of --input."
        ),
        cache_dir: Optional[str] = typer.Option(
            None, help="Cache for --builtin without --output (default $LPTRAIN_CACHE_DIR, else "
            "$XDG_CACHE_HOME/lptrain, else ~/.cache/lptrain)."
        ),
        max_mb: float = typer.Option(32.0, help="--builtin: cap the corpus at its first N MB (sorted order)."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    ) -> None:
        """Tokenize text into an indexed dataset (PREFIX.bin + PREFIX.idx)."""
        import sys

        from lptrain.data.errors import DataError
        from lptrain.data.prepare import prepare_dataset, print_report
        from lptrain.data.sources import DEFAULT_GLOBS
        from lptrain.errors import LPTrainError

        try:
            if builtin is not None:
                if input:
                    raise DataError("give either --builtin or --input, not both")
                from lptrain.data.builtin import builtin_files, ensure_builtin_dataset

                max_bytes = int(max_mb * 1e6)
                if output is None:
                    if train_tokenizer:
                        raise DataError("--train-tokenizer with --builtin needs --output")
                    prefix = ensure_builtin_dataset(
                        builtin, cache_dir, tokenizer, max_bytes, progress=progress, workers=workers
                    )
                    typer.echo(f"built-in dataset {builtin} ready at {prefix}")
                    return
                files = builtin_files(builtin, max_bytes)
                report = prepare_dataset(
                    [], output, tokenizer, train_tokenizer=train_tokenizer, vocab_size=vocab_size,
                    workers=workers, files=files, extra={"builtin": builtin}, progress=progress,
                )
            else:
                if not input or output is None:
                    raise DataError("prepare-data needs --input PATH (repeatable) and --output PREFIX")
                report = prepare_dataset(
                    input, output, tokenizer, train_tokenizer=train_tokenizer, vocab_size=vocab_size,
                    workers=workers, text_key=text_key, globs=tuple(glob) if glob else DEFAULT_GLOBS,
                    skip_bad_lines=skip_bad_lines, progress=progress,
                )
        except LPTrainError as exc:  # one line and the documented status (2: unusable input)
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        print_report(report, sys.stdout)
