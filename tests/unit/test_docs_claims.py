"""What the guide claims about lptrain's commands, keys and recipes holds today (issue 52 item
14: a 70B example that failed as shown, a key the docs called "already a field" that is refused,
recipes and targets missing from their lists).

* every ``lptrain validate-config`` command a page shows in a code block exits as the page
  shows it: ``invalid`` in the shown output means 1, anything else 0;
* every config key a page names (a dotted ``section.key`` in backticks) is a key lptrain
  accepts, unless the line says it is refused as an unknown key;
* docs/parallelism.md says context parallelism is not a key exactly while it is not one;
* docs/recipes.md lists every shipped recipe, docs/getting-started.md every ``--target``.
"""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.cli.common import Target
from lptrain.config.compose import repo_root
from lptrain.config.schema import iter_fields

ROOT = repo_root()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEYS = {k for k, _, _ in iter_fields()}
_FILE_SUFFIXES = (".safetensors", ".json", ".yaml", ".png", ".py", ".md")


def _shown_commands(command: str) -> list[tuple[str, list[str], str]]:
    """(page, argv after ``lptrain``, the output shown under it) for every ``lptrain
    <command>`` line in a ``bash`` or ``console`` block (continuation lines joined, comments
    dropped)."""
    out = []
    for page in PAGES:
        in_block, lines = False, page.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                in_block = not in_block and line[3:].strip() in ("bash", "console")
                i += 1
                continue
            text = line.strip().removeprefix("$ ")
            if in_block and text.startswith(f"lptrain {command}"):
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                shown = []
                while i + 1 < len(lines) and lines[i + 1].strip() and not lines[i + 1].startswith(("$", "```", "lptrain")):
                    i += 1
                    shown.append(lines[i])
                argv = shlex.split(text, comments=True)[1:]
                if all(argv != a for _, a, _ in out):  # (the same command shown twice runs once)
                    out.append((page.name, argv, "\n".join(shown)))
            i += 1
    return out


VALIDATE = _shown_commands("validate-config")


def test_pages_show_validate_config_commands() -> None:
    assert len(VALIDATE) >= 5  # README, getting-started, parallelism (the 70B and 405B examples)


@pytest.mark.parametrize(("page", "argv", "shown"), VALIDATE, ids=[" ".join(a) for _, a, _ in VALIDATE])
def test_shown_validate_config_commands_exit_as_shown(page: str, argv: list[str], shown: str) -> None:
    r = CliRunner().invoke(app, argv)
    want = 1 if "invalid" in shown else 0
    assert r.exit_code == want, f"{page}: lptrain {' '.join(argv)} exits {r.exit_code}: {r.output[-600:]}"


def test_pages_name_only_keys_that_exist() -> None:
    sections = {k.split(".")[0] for k in KEYS}
    prefixes = {".".join(k.split(".")[:i]) for k in KEYS for i in range(1, k.count(".") + 1)}
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "unknown key" in line or "did you mean" in line:  # a wrong key shown on purpose
                continue
            for key in re.findall(r"`([a-z_]+(?:\.[a-z0-9_]+)+)(?:=[^`]*)?`", line):
                if key.split(".")[0] in sections and key not in KEYS and key not in prefixes \
                        and not key.endswith(_FILE_SUFFIXES):
                    bad.append(f"{page.name}:{n}: {key}")
    assert bad == []


def test_the_parallelism_page_says_whether_context_parallelism_is_a_key() -> None:
    page = (ROOT / "docs" / "parallelism.md").read_text()
    is_key = any(k.startswith("model.context_parallel") for k in KEYS)
    assert ("Context parallelism is not built" in page) is (not is_key)
    assert "already" not in page.split("Context parallelism")[0][-200:]


def test_recipe_and_target_lists_are_complete() -> None:
    recipes = (ROOT / "docs" / "recipes.md").read_text()
    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.endswith("_cpu"))
    assert [r for r in shipped if f"| `{r}` |" not in recipes] == []
    start = (ROOT / "docs" / "getting-started.md").read_text()
    assert [t.value for t in Target if t.value != "cpu" and f"`{t.value}`" not in start] == []
