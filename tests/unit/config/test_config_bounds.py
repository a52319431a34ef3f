"""Input bounds (issue 52, items 19 and 21): a YAML alias bomb is refused before anything
expands it, and no string key takes more than ``MAX_STRING_CHARS`` characters.

A 501-byte recipe of lists aliased 9 levels deep (9^9 = 387M values) kept ``validate-config``
busy for 145 s; a 10 MB ``run.name`` became a 10 MB console line and resolved_config.yaml.
"""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli.app import app
from lptrain.config import yaml_files
from lptrain.config.compose import load
from lptrain.config.errors import ConfigError

FIX = "; fix: write the values out, or alias less deeply"


def _sequence_bomb(levels: int) -> str:
    names = "abcdefghijklmnop"
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]"]
    for prev, name in itertools.pairwise(names[:levels]):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines) + "\n"


def _mapping_bomb(levels: int) -> str:
    lines = ["k0: &k0 {a: x, b: x, c: x, d: x, e: x, f: x, g: x, h: x}"]
    for i in range(1, levels):
        lines.append(f"k{i}: &k{i} {{{', '.join(f'{c}: *k{i - 1}' for c in 'abcdefgh')}}}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text", [_sequence_bomb(9), _mapping_bomb(10), "a: &a [x, *a]\n"],
                         ids=["sequences", "mappings", "self-reference"])
def test_an_alias_bomb_is_refused_naming_the_file(text: str, tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, ["validate-config", "--recipe", str(path)])
    took = time.perf_counter() - t0
    assert r.exit_code == 2, r.output
    assert r.stderr == (f"error: {path}: YAML aliases (*name) expand to more than 10000 values (an "
                        "alias bomb, or a node that contains itself); refused before expanding them"
                        f"{FIX}\n")
    assert took < 10, took  # a hang guard only: the bomb took 145 s (9 levels) before the fix


def test_an_override_alias_bomb_is_refused() -> None:
    bomb = "[" + ", ".join(["&a [" + ", ".join(["x"] * 200) + "]"] + ["*a"] * 99) + "]"  # 20k values
    with pytest.raises(ConfigError, match=re.escape("command-line override 'run.name': YAML aliases")):
        load("tiny_cpu.yaml", [f"run.name={bomb}"])


def test_the_bound_counts_expanded_values_and_its_removal_lets_a_bomb_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml

    # root, key a, [x, x] (3), key b, [*a, *a] (1 + 3 + 3): 13 nodes with the aliases expanded
    assert yaml_files.expanded_size(yaml.compose("a: &a [x, x]\nb: [*a, *a]\n")) == 13
    assert yaml_files.expanded_size(yaml.compose(_sequence_bomb(4))) <= yaml_files.MAX_EXPANDED_NODES
    assert yaml_files.expanded_size(yaml.compose(_sequence_bomb(5))) > yaml_files.MAX_EXPANDED_NODES
    path = tmp_path / "bomb.yaml"
    path.write_text(_sequence_bomb(5))
    monkeypatch.setattr(yaml_files, "check_expansion", lambda node, where: None)  # the fix, removed
    with pytest.raises(ConfigError, match="unknown key"):  # every later walk expanded all 59k values
        load(str(path))


def test_string_keys_are_bounded() -> None:
    r = CliRunner().invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", "run.name=" + "x" * 10_000_000])
    assert r.exit_code == 2
    assert r.stderr == ("error: command-line override: run.name is 10000000 characters long; the "
                        "limit is 4096; fix: give run.name a value of at most 4096 characters\n")
    load("tiny_cpu.yaml", ["run.name=" + "x" * 4096, "run.output_dir=runs/x"])  # at the limit
    with pytest.raises(ConfigError, match=re.escape("run.name is 4097 characters long; the limit is 4096")):
        load("tiny_cpu.yaml", ["run.name=" + "x" * 4097])
    r = CliRunner().invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", "train.train_iters=" + "9x" * 500])
    assert r.exit_code == 2 and len(r.stderr) < 400, r.stderr  # a wrong type's value is cut short
