"""What every ``lptrain`` subcommand shares: option types and help texts, loading a recipe,
the world a config is checked for, and the violations report.

Public so the subcommand modules (``slurm``, ``estimate-memory``, ...) import it instead of
reaching into the module that builds the Typer app: the app imports the subcommands, never
the other way round. Importing this module stays light (typer only); the config package,
rich and everything else are imported inside the functions.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from typing import TYPE_CHECKING, Optional

import typer

from lptrain.config.compose import DEFAULT_RECIPE

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from lptrain.config.compose import Composed
    from lptrain.config.rules import Violation
    from lptrain.config.world import World


class Target(str, enum.Enum):
    """Hardware a config is checked for."""

    cpu = "cpu"
    sm89 = "sm89"
    sm90 = "sm90"
    sm100 = "sm100"
    sm120 = "sm120"


RECIPE_HELP = (
    "Recipe YAML: a bare name (mxfp8_muon.yaml) is looked up in ./recipes, then the "
    "repo's recipes/; anything with a '/' is a path."
)
OVERRIDES_HELP = "Overrides as dotted key=value (e.g. model.num_layers=4 precision.fp8_format=e4m3); last wins."
DP_HELP = ("Data-parallel size to check for; the world is tensor x context x pipeline parallel "
           "size x it (default: $WORLD_SIZE ranks, or 1 data-parallel rank).")
TARGET_HELP = (
    "Hardware to check for (a GPU target assumes CUDA and a recent Transformer Engine); "
    "default: this machine."
)
TE_HELP = "Transformer Engine version to assume (default: installed, or recent with --target)."
CUDA_HELP = (
    "CUDA (and cuBLAS) version to assume (default: torch's build, or 13.3 with --target); "
    "TE's grouped-tensor path needs cuBLASLt 13.3+, blockwise FP8 CUDA 12.9+."
)

def complete_recipe(incomplete: str) -> list[str]:
    """Shell completion of ``--recipe``: the recipes ``--recipe NAME`` finds."""
    from lptrain.config.compose import available_recipes

    return [r for r in available_recipes() if r.startswith(incomplete)]


def complete_override(incomplete: str) -> list[str]:
    """Shell completion of an override: the dotted keys (``model.tensor_model_parallel_size=``),
    then, after ``=``, a choice key's values."""
    from lptrain.config.compose import all_keys
    from lptrain.config.schema import choice_keys

    key, eq, value = incomplete.partition("=")
    if eq:
        choices = choice_keys().get(key, ())
        return [f"{key}={c}" for c in map(str, choices) if c.startswith(value)]
    keys = all_keys()
    sections = {k.rsplit(".", 1)[0] for k in keys if "." in k}
    return [f"{k}." if k in sections else f"{k}=" for k in keys if k.startswith(key)]


RecipeOpt = typer.Option(DEFAULT_RECIPE, "--recipe", "-r", help=RECIPE_HELP,
                         autocompletion=complete_recipe)
OverridesArg = typer.Argument(None, help=OVERRIDES_HELP, show_default=False,
                              autocompletion=complete_override)
DpOpt = typer.Option(None, "--dp", min=1, help=DP_HELP)
TargetOpt = typer.Option(None, "--target", help=TARGET_HELP, case_sensitive=False)
TeOpt = typer.Option(None, "--te-version", help=TE_HELP)
CudaOpt = typer.Option(None, "--cuda-version", help=CUDA_HELP)


def console(stderr: bool = False) -> Console:
    """A rich console: the terminal's width on a terminal, ``$COLUMNS`` (default 160) else."""
    from rich.console import Console

    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
    return Console(stderr=stderr, width=width, highlight=False)


def load_recipe(recipe: str, overrides: Optional[list[str]]) -> Composed:
    """The composed recipe; a :class:`~lptrain.config.errors.ConfigError` becomes
    ``error: ...`` and exit status 2 (:mod:`lptrain.cli.errors`)."""
    from lptrain.config.compose import load

    return load(recipe, overrides or [])


def detect_world(dp: Optional[int], target: Optional[Target], te_version: Optional[str],
                 cuda_version: Optional[str] = None, ranks: Optional[int] = None) -> World:
    """The world to check for: this machine unless ``--dp``/``--target``/``--te-version``/
    ``--cuda-version`` say (``ranks``: a launch's rank count, e.g. ``--nproc-per-node``).
    ``--dp`` is the data-parallel size: the world is the model-parallel sizes times it
    (:meth:`World.for_config`)."""
    from lptrain.config.world import World, check_version

    if cuda_version is not None:
        cuda_version = check_version(cuda_version, key="--cuda-version")
    if target is not None and target.value != "cpu" and te_version is None:
        te_version = te_python_release()
    return World.detect(dp=dp, target=target.value if target else None, te_version=te_version,
                        cuda_version=cuda_version, ranks=ranks)


def te_python_release() -> Optional[str]:
    """Checking for a GPU on a machine without one: the release of TE's own Python that the
    dry run's fake GPU step will run (``$LPTRAIN_TE_PYTHON``, else the newest folder ``make
    install`` made), so the rules judge the TE that runs; None when there is none or a real
    TE is installed (then that one's version is reported)."""
    try:
        from lptrain.testing import te_python
    except ImportError:  # a wheel without the testing package
        return None
    if te_python.version() is not None:  # imported in this process already: that one runs
        return te_python.version()
    from lptrain.config.world import installed_te_version

    if installed_te_version() is not None:
        return None
    return te_python.default_release()


def is_terminal(stream: str) -> bool:
    """Whether ``sys.stdout`` / ``sys.stderr`` (``stream``) is a terminal (tests replace this)."""
    f = getattr(sys, stream)
    return bool(getattr(f, "isatty", lambda: False)())


def violations_table(violations: list[Violation], title: str) -> Table:
    """One row per violation: rule id, severity, keys, message, fix (keys never cut)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), show_lines=True, title_justify="left")
    table.add_column("rule", style="bold", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("keys", no_wrap=True)
    for col in ("message", "fix"):
        table.add_column(col, overflow="fold")
    for v in violations:
        sev = "[red]error[/red]" if v.severity == "error" else "[yellow]warning[/yellow]"
        table.add_row(v.rule, sev, escape("\n".join(v.keys)), escape(v.message), escape(v.fix))
    return table


def violation_line(v: Violation) -> str:
    """One violation as one line, whole keys and the fix last (a log, a SLURM ``.err`` file)."""
    return f"{v.severity}: {v.rule}: {v.message}; keys: {', '.join(v.keys)}; fix: {v.fix}"


def report_violations(violations: list[Violation], name: str, world: World, as_json: bool) -> int:
    """Print the validate-config report (or JSON); returns the exit status it stands for: 1
    when any violation is an error, else 0.

    The table is for a terminal (stdout); everywhere else -- a log, a pipe, a SLURM ``.err``
    file -- each violation is one line (:func:`violation_line`), an error on stderr (so it
    reaches the error log, and a refused config is one line per error there), a warning on
    stdout; its keys and fix can be copied. The verdict line goes to stdout."""
    from rich.markup import escape

    from lptrain.config.check import has_errors

    errors = has_errors(violations)
    if as_json:
        payload = {"valid": not errors, "violations": [v.to_dict() for v in violations]}
        typer.echo(json.dumps(payload, indent=2))
        return 1 if errors else 0
    where = f"target {world.target}, {world.describe()}"
    n_err = sum(v.severity == "error" for v in violations)
    n_warn = len(violations) - n_err
    out = console()
    table = is_terminal("stdout")
    if violations and table:
        out.print(violations_table(violations, f"{name} ({where})"))
    if violations and not (table and is_terminal("stderr")):
        for v in violations:  # errors on stderr; warnings (no failure) with the verdict
            typer.echo(violation_line(v), err=v.severity == "error")
    name = escape(name)
    if errors:
        out.print(f"[red]{name}: invalid[/red] ({n_err} error(s), {n_warn} warning(s); {where})")
    else:
        out.print(f"[green]{name}: valid[/green] ({n_warn} warning(s); {where})")
    return 1 if errors else 0
