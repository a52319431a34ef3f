"""The recipe catalog (lptrain/catalog/recipes.py) is the one place a recipe is declared.

A fake entry added to the catalog -- before anything reads it, as an edit of that file would
be -- shows up in ``lptrain rules``, in ``validate-config``'s value set for
``precision.fp8_recipe`` (an override selecting it validates; an unknown name's error lists
it), in the per-recipe rules (alignment, minimum SM) and in the generated docs/rules.md,
with no other edit. The schema, the rules and the page read the catalog when they are
imported, so the entry is added in a fresh interpreter (one subprocess, about 2 s) rather
than patched into this one after the fact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from lptrain.catalog import recipes as catalog
from lptrain.config.render import rules_markdown

FAKE = "fake8"

CHILD = textwrap.dedent(f"""
    import dataclasses, json
    from lptrain.catalog import recipes as catalog

    # The test's monkeypatch: one more entry, before any reader imports the catalog.
    fake = dataclasses.replace(
        catalog.recipe("tensorwise"), name={FAKE!r}, formats=("e4m3",), alignment=16,
        grouped_alignment=64, min_sm=100, min_te="2.5", te_recipe_class="FakeScaling",
        emulated_recipe_class="FakeScaling")
    catalog.RECIPES = (*catalog.RECIPES, fake)

    from typer.testing import CliRunner
    from lptrain.cli import app
    from lptrain.config.render import rules_markdown

    def run(*args):
        res = CliRunner().invoke(app, list(args))
        return {{"code": res.exit_code, "out": res.output}}

    sel = ["precision.fp8_format=e4m3", "precision.fp8_recipe={FAKE}"]
    print(json.dumps({{
        "rules": run("rules"),
        "valid": run("validate-config", *sel, "--json"),
        "unknown": run("validate-config", "precision.fp8_format=e4m3",
                       "precision.fp8_recipe=fake9", "--json"),
        "misaligned": run("validate-config", *sel, "model.hidden_size=72", "--json"),
        "te_sm90": run("validate-config", *sel, "precision.backend=te", "--target", "sm90",
                       "--json"),
        "explain": run("show-config", "--explain"),
        "markdown": rules_markdown(),
    }}))
""")


def _with_fake_entry() -> dict:
    env = {**os.environ, "COLUMNS": "2000"}  # no wrapping inside the rules table
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    return json.loads(out.stdout)


def _rules(result: dict) -> list[str]:
    return [v["rule"] for v in json.loads(result["out"])["violations"]]


def test_a_catalog_entry_is_a_recipe_everywhere_config_reads_recipes() -> None:
    assert FAKE not in rules_markdown()  # the control: only the entry brings the name in
    got = _with_fake_entry()

    assert got["rules"]["code"] == 0
    assert "fp8_recipe in {delayed, tensorwise, blockwise, mxfp8, fake8}" in got["rules"]["out"]

    assert got["valid"]["code"] == 0, got["valid"]["out"]
    assert json.loads(got["valid"]["out"])["valid"]

    assert got["unknown"]["code"] == 1
    (bad,) = json.loads(got["unknown"]["out"])["violations"]
    assert bad["rule"] == "PREC-CHOICES"
    assert "expected one of delayed, tensorwise, blockwise, mxfp8, fake8" in bad["message"]

    # The rules keyed on a recipe's facts read the entry: its alignment and its minimum SM.
    assert got["misaligned"]["code"] == 1 and _rules(got["misaligned"]) == ["PREC-GEMM-ALIGN"]
    assert "fake8 quantizes in blocks" in got["misaligned"]["out"]
    assert got["te_sm90"]["code"] == 1 and "PREC-TARGET-SUPPORT" in _rules(got["te_sm90"])
    assert "the Transformer Engine fake8 recipe needs sm100" in got["te_sm90"]["out"]

    assert "fp8_recipe: delayed  # FP8 recipe: delayed, tensorwise, blockwise, mxfp8 or fake8." \
        in got["explain"]["out"]

    page = got["markdown"]
    assert "fp8_recipe in {delayed, tensorwise, blockwise, mxfp8, fake8}" in page
    assert "16 (delayed, tensorwise, blockwise, fake8), 32 (mxfp8, nvfp4)" in page
    assert "fake8 2.5" in page  # its minimum TE version, in PREC-TE-VERSION's row


def test_every_entry_names_the_classes_that_run_it() -> None:
    """Each entry's emulated recipe class exists and takes its alignments from the entry, and
    its TE recipe class is in ``transformer_engine.common.recipe`` at every TE release from the
    entry's ``min_te`` on (TE's source: tests/data/te_api.json; that ``min_te`` is its first
    release is tests/unit/precision/test_te_manifest.py's)."""
    from lptrain.precision.recipes import RECIPES
    from lptrain.testing import te_manifest as M

    assert list(RECIPES) == [s.name for s in catalog.RECIPES]
    for spec in catalog.RECIPES:
        cls = RECIPES[spec.name]
        assert cls.__name__ == spec.emulated_recipe_class
        assert (cls.alignment, cls.grouped_alignment) == (spec.alignment, spec.grouped_alignment)
        assert cls.has_delayed_state == spec.amax_history
        path = f"transformer_engine.common.recipe.{spec.te_recipe_class}"
        since = [v for v in M.versions() if M.version_tuple(v) >= M.version_tuple(spec.min_te)]
        assert since and all(M.class_present(path, v) for v in since), (spec.name, path)


def test_precision_fragments_state_the_catalogs_te_minimum() -> None:
    """A fragment's header ("sm100, TE >= 2.8") names its recipe's catalog ``min_te`` (the
    nvfp4 fragment said 2.7; NVFP4BlockScaling first appears in TE 2.8)."""
    import re
    from pathlib import Path

    import yaml

    from lptrain.catalog.recipes import recipe

    root = Path(__file__).parents[3] / "configs" / "precision"
    checked = 0
    for path in sorted(root.glob("*.yaml")):
        text = path.read_text()
        m = re.search(r"TE >= (\d+\.\d+)", text.splitlines()[0])
        if m is None:
            continue
        body = yaml.safe_load(text)
        name = body.get("fp8_recipe") or body.get("fp4_recipe")
        assert recipe(name).min_te == m.group(1), (path.name, name)
        checked += 1
    assert checked >= 3
