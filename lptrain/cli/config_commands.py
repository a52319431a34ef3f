"""``validate-config``, ``show-config`` and ``rules``: the config commands.

They import only the config package, OmegaConf, YAML and rich (inside the commands), never
torch: validating a recipe for a GPU cluster works on a laptop in well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lptrain.cli.common import (
    CudaOpt,
    DpOpt,
    OverridesArg,
    RecipeOpt,
    Target,
    TargetOpt,
    TeOpt,
    console,
    detect_world,
    load_recipe,
    report_violations,
)


def validate_config(
    overrides: Optional[list[str]] = OverridesArg,
    recipe: str = RecipeOpt,
    dp: Optional[int] = DpOpt,
    target: Optional[Target] = TargetOpt,
    te_version: Optional[str] = TeOpt,
    cuda_version: Optional[str] = CudaOpt,
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable JSON report."),
) -> None:
    """Check a recipe (plus overrides) against every rule and report all violations.

    Exit status: 0 valid (warnings allowed), 1 errors, 2 unreadable input.
    """
    from lptrain.config.layers import check_composed

    composed = load_recipe(recipe, overrides)
    world = detect_world(dp, target, te_version, cuda_version).for_config(composed.cfg)
    violations = check_composed(composed, world)
    raise typer.Exit(report_violations(violations, Path(recipe).name, world, as_json))


def show_config(
    overrides: Optional[list[str]] = OverridesArg,
    recipe: str = RecipeOpt,
    diff: bool = typer.Option(False, "--diff", help="Only values that differ from the schema defaults."),
    explain: bool = typer.Option(False, "--explain", help="Append each key's help text as a comment."),
    dp: Optional[int] = DpOpt,
    target: Optional[Target] = TargetOpt,
    te_version: Optional[str] = TeOpt,
    cuda_version: Optional[str] = CudaOpt,
) -> None:
    """Print the resolved config as YAML, after derived values are filled in."""
    from lptrain.config.derive import derive
    from lptrain.config.render import config_yaml

    composed = load_recipe(recipe, overrides)
    cfg = derive(composed.cfg, detect_world(dp, target, te_version, cuda_version))
    typer.echo(config_yaml(cfg, only_diff=diff, explain=explain), nl=False)


def rules(
    markdown: bool = typer.Option(
        False, "--markdown", help="Print the docs/rules.md page generated from the rule list."
    ),
) -> None:
    """List the configuration rule catalog (ids, severities, keys, conditions)."""
    from lptrain.config.render import rules_markdown
    from lptrain.config.rules import all_rules

    if markdown:
        typer.echo(rules_markdown(), nl=False)
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="lptrain configuration rules", show_lines=True, title_justify="left")
    table.add_column("rule", no_wrap=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("keys", overflow="fold")
    table.add_column("condition -> requirement", overflow="fold")
    for r in all_rules():
        table.add_row(r.id, r.severity, escape("\n".join(r.keys)), escape(r.condition))
    console().print(table)
