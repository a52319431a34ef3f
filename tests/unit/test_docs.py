"""The user guide stays consistent with the repository: every page is reachable from
docs/index.md, every relative link and every test file a page names exists, and no file cites
a path outside the repository (users do not have the machine it was written on)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lptrain.config.compose import repo_root

ROOT = repo_root()
DOCS = ROOT / "docs"
_SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
              "runs", "outputs", "build", "dist", ".cache", "wandb",
              "wheelhouse", "wheelhouse.partial", ".gpu-deps", ".gpu-deps.partial"}
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Split so this file does not match itself.
_OUTSIDE = ("/" + "work/", "../" + "shared", "shared/" + "reference", "shared/" + "seeds")


def _repo_text_files() -> list[Path]:
    """Every file of the repository under 2 MB, skipping tool and run folders without
    walking into them (``.venv`` alone holds tens of thousands of files)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath) / name
            if name == ".git":  # a git worktree's pointer to its repository: not project content
                continue
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 2_000_000:
                out.append(path)
    return out


def test_no_file_cites_a_path_outside_the_repository() -> None:
    hits = []
    for path in _repo_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            if any(p in line for p in _OUTSIDE):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_index_links_every_page() -> None:
    index = (DOCS / "index.md").read_text()
    linked = set(_LINK.findall(index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"pages missing from docs/index.md: {sorted(pages - linked)}"


@pytest.mark.parametrize("page", [*sorted(p.name for p in DOCS.glob("*.md")), "../README.md"])
def test_relative_links_resolve(page: str) -> None:
    path = (DOCS / page).resolve()
    for target in _LINK.findall(path.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{page}: broken link {target}"


def test_named_test_files_exist() -> None:
    named = set()
    for page in DOCS.glob("*.md"):
        named |= set(re.findall(r"`(tests/[\w/]+\.py)`", page.read_text()))
    assert len(named) >= 10  # numerics.md backs its guarantees with tests
    missing = sorted(t for t in named if not (ROOT / t).is_file())
    assert not missing, f"docs name test files that do not exist: {missing}"


def test_readme_rule_count_is_current() -> None:
    from lptrain.config.rules import all_rules

    rules = all_rules()
    count = {s: sum(r.severity == s for r in rules) for s in ("error", "warning", "derived")}
    text = (ROOT / "README.md").read_text()
    want = (f"catalog of {len(rules)} rules\n({count['error']} errors, {count['warning']} "
            f"warnings, {count['derived']} derived value")
    assert want in text, f"README.md: update the rule count to: {want!r}"



def test_no_tracked_file_holds_merge_conflict_markers() -> None:
    """A merge that left ``<<<<<<<`` / ``>>>>>>>`` lines behind (it happened once, in README)."""
    import subprocess

    root = Path(__file__).parents[2]
    try:
        files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    bad = []
    for name in files:
        path = root / name
        if path.suffix in (".py", ".md", ".yaml", ".toml", ".sbatch", ".sh", ".txt", "") and path.is_file():
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if line.startswith(("<<<<<<< ", ">>>>>>> ")):
                    bad.append(f"{name}:{i}")
    assert bad == []
