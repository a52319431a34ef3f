"""lptrain command line (Typer). Commands are registered here; their logic lives in the packages."""

from __future__ import annotations

import typer

app = typer.Typer(help="lptrain: low-precision LLM pretraining.", no_args_is_help=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
