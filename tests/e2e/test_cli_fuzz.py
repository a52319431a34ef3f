"""Fuzzing the front door: no input makes ``validate-config`` or ``pretrain --dry-run`` crash.

Hypothesis draws override sets (valid keys with wrong, boundary and extreme values; unknown
keys; malformed ``key=value``) and recipe files (truncated real recipes, random bytes). Every
run must exit 0, 1 or 2 and never print a traceback; an exit 2 is exactly one ``error:`` line.
Examples: 60 override sets (each through both commands) + 40 recipes, derandomized so the
suite is deterministic; about 15-25 s on 2 cores. Runs in-process (typer's CliRunner).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config.compose import repo_root
from lptrain.config.schema import iter_fields
from lptrain.data.prepare import prepare_dataset

KEYS = [k for k, _, _ in iter_fields()]
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in KEYS})
# Boundary and extreme values, as the command line would carry them.
NUMBERS = ["0", "-1", "1", "2", "3", "4", "7", "8", "16", "64", "0.5", "1.0", "1.5", "-0.0",
           "1e-30", "1e308", "1e400", "inf", "-inf", ".nan", "nan", str(2**24), str(2**24 + 1),
           str(2**31), str(2**63), str(-(2**63)), "9" * 30, "1" * 5000]
WRONG = ["", "abc", "true", "false", "null", "~", "[1, 2]", "{a: 1}", "[", "{", "'", '"x',
         "${model.hidden_size}", "${nope.nothing}", "${", "2020-01-01", "0x10", "1_000",
         "e4m3", "mxfp8", "muon", "cuda", "- a", ": b", "!!python/object:os.system x"]
VALUES = st.one_of(st.sampled_from(NUMBERS + WRONG), st.text(max_size=12))
IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)

GOOD_OVERRIDE = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), VALUES)
UNKNOWN_OVERRIDE = st.builds(
    lambda parts, v: ".".join(parts) + f"={v}", st.lists(IDENT, min_size=1, max_size=4), VALUES
)
MALFORMED = st.one_of(
    st.sampled_from(["model", "=3", "model.=3", "model..hidden_size=3", ".model=1", "model=3",
                     "model.hidden_size.x=1", "meta.target=sm1", "meta.nope=1", " = ", "==",
                     "model.moe=1", "data.paths=[a, b]", "data.weights=[1, -1]"]),
    st.builds(lambda s: s.replace("=", ""), st.text(max_size=15)),
    st.builds(lambda sec, v: f"{sec}={v}", st.sampled_from(SECTIONS), VALUES),
)
NUMERIC_KEYS = [k for k, tp, _ in iter_fields() if any(t in str(tp) for t in ("int", "float"))]
NUMERIC_OVERRIDE = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(NUMERIC_KEYS),
                             st.sampled_from(NUMBERS))
# Mostly well-formed numeric overrides (they reach the rules and the dry run), some mixed sets
# with wrong types, unknown keys and malformed items (they exercise the front door).
OVERRIDES = st.one_of(
    st.lists(NUMERIC_OVERRIDE, max_size=3),
    st.lists(NUMERIC_OVERRIDE, max_size=3),
    st.lists(st.one_of(GOOD_OVERRIDE, UNKNOWN_OVERRIDE, MALFORMED), max_size=4),
)

RECIPES = [p.read_bytes() for p in sorted((repo_root() / "recipes").glob("*.yaml"))]
RECIPE_BYTES = st.one_of(
    st.builds(lambda r, f: r[: int(len(r) * f)], st.sampled_from(RECIPES), st.floats(0, 1)),
    st.binary(max_size=200),
    st.builds(lambda r, b, f: r[: int(len(r) * f)] + b + r[int(len(r) * f):],
              st.sampled_from(RECIPES), st.binary(min_size=1, max_size=8), st.floats(0, 1)),
)

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny prepared dataset (so --dry-run never prepares the built-in corpus) and a folder."""
    root = tmp_path_factory.mktemp("fuzz")
    for i in range(8):
        (root / f"d{i}.txt").write_text(f"document {i} " * 150)
    prepare_dataset([root], root / "ds")
    return {"root": root, "ds": root / "ds"}


def check(args: list[str], env: dict[str, Path]) -> None:
    r = runner.invoke(app, args, env={"LPTRAIN_CACHE_DIR": str(env["root"] / "cache")})
    assert r.exit_code in (0, 1, 2), (args, r.exit_code, r.output)
    assert "Traceback" not in r.output, (args, r.output)
    if r.exit_code == 2:
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (args, r.stderr)


def _dry_run(overrides: list[str], env: dict[str, Path], recipe: list[str]) -> list[str]:
    # The dataset first, so a drawn data.source still wins; nothing is written under out/.
    return ["pretrain", "--dry-run", *recipe, "-o", str(env["root"] / "out"),
            f"data.source={env['ds']}", f"data.cache_dir={env['root'] / 'cache'}", *overrides]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(overrides=OVERRIDES)
def test_fuzz_overrides(overrides: list[str], env: dict[str, Path]) -> None:
    check(["validate-config", *overrides], env)
    check(_dry_run(overrides, env, []), env)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(content=RECIPE_BYTES)
def test_fuzz_recipes(content: bytes, env: dict[str, Path]) -> None:
    path = env["root"] / "fuzzed.yaml"
    path.write_bytes(content)
    check(["validate-config", "--recipe", str(path)], env)
    check(_dry_run([], env, ["--recipe", str(path)]), env)


@pytest.mark.parametrize("overrides", [
    ["model.virtual_pipeline_model_parallel_size=16777216", "model.pipeline_model_parallel_size=2"],
    ["model.pipeline_model_parallel_size=2147483648"],
    ["model.pipeline_model_parallel_size=2", "model.pipeline_model_parallel_layout=E|(t)*9999999999"],
])
def test_huge_pipeline_sizes_are_refused_without_listing_them(overrides: list[str], env: dict[str, Path]) -> None:
    """Regression (found by test_fuzz_overrides): the pipeline layout listed one entry per model
    chunk, or unrolled a layout's repeat count, before any rule judged the sizes: 2**24 chunks
    took minutes and gigabytes. Refused at once now (exit 1)."""
    r = runner.invoke(app, ["validate-config", *overrides], env={"LPTRAIN_CACHE_DIR": str(env["root"] / "cache")})
    assert r.exit_code == 1 and "PP-" in r.output, r.output
