"""The ranks of ``--nproc-per-node`` import this lptrain whatever the current folder holds
(issue: a folder named ``lptrain`` in the current folder -- an empty one, or the clone seen
from its parent folder -- became a namespace package in every rank of an editable install,
which crashed in ``repo_root()`` with exit 70)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lptrain
from lptrain.launch.local import REPORTED_ENV, rank_environment

ROOT = Path(lptrain.__file__).resolve().parents[1]

# A rank of an editable install: lptrain reachable only through a finder that runs after the
# path scan (setuptools' editable finder), the current folder first on sys.path as under -m.
RANK = f"""
import importlib.util, os, sys
root = {str(ROOT)!r}
sys.path[:] = [p for p in sys.path if os.path.realpath(p or '.') != root]
class EditableFinder:
    def find_spec(self, name, path=None, target=None):
        if name != "lptrain":
            return None
        init = os.path.join(root, "lptrain", "__init__.py")
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
from importlib.machinery import PathFinder
sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, EditableFinder())
import lptrain
print(lptrain.__file__)
"""


def _rank_imports(cwd: Path, env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-c", RANK], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11+")
def test_ranks_import_lptrain_whatever_the_cwd(tmp_path: Path) -> None:
    (tmp_path / "lptrain").mkdir()  # the empty folder of the issue
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    assert _rank_imports(tmp_path, base) == "None"  # the bug: a namespace package
    fixed = _rank_imports(tmp_path, {**base, **rank_environment()})
    assert Path(fixed).resolve() == ROOT / "lptrain" / "__init__.py"


def test_a_checkout_off_the_path_goes_first_on_pythonpath(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A launcher that found lptrain in the current folder (a checkout, no install) or through
    an editable finder gives the ranks its folder first on PYTHONPATH (Python 3.10 too); the
    launcher's rule report is not printed again by the ranks."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and Path(p).resolve() != ROOT])
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = rank_environment()
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/elsewhere"
    assert env["PYTHONSAFEPATH"] == "1" and env[REPORTED_ENV] == "1"
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    assert "PYTHONPATH" not in rank_environment()  # a regular package on the path: left alone
