"""scripts/wheelhouse.py without pip or network: the requirement list, the platform tags given
to ``pip download``, the guard against shipping torch, and the install step's refusals (one
``error:`` line, exit 2). The real download and install run in tests/e2e/test_offline_gpu_node.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("wheelhouse_script", ROOT / "scripts" / "wheelhouse.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def _names(reqs: list[str]) -> set[str]:
    return {W.canonical(W._REQ_NAME.match(r).group(1)) for r in reqs}


def test_the_requirements_are_lptrains_and_the_gpu_checks_without_torch() -> None:
    names = _names(W.requirements())
    # lptrain's own dependencies (the node lacks omegaconf), then what the gpu-check's pytest
    # run imports: the runner, its timeout plugin, and the libraries test modules import.
    assert {"omegaconf", "typer", "rich", "xxhash", "numpy", "matplotlib", "wandb"} <= names
    assert {"pytest", "pytest-timeout", "hypothesis", "pyarrow", "zstandard"} <= names
    assert "torch" not in names and "lptrain" not in names


def test_self_extras_expand_once_and_node_packages_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "lp_train"\ndependencies = ["torch>=2.3", "a>=1"]\n'
        '[project.optional-dependencies]\n'
        '"gpu-check" = ["LP-Train[x, y]", "nvidia-cudnn-cu12", "b"]\n'
        'x = ["c", "lp.train[y]", "Triton"]\ny = ["d", "a>=1"]\nunused = ["e"]\n')
    assert W.requirements(tmp_path / "pyproject.toml") == ["a>=1", "c", "d", "b"]


def test_a_manylinux_platform_takes_every_older_glibcs_wheels() -> None:
    tags = W.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64"
    # matplotlib and friends publish manylinux_2_17 / manylinux2014 wheels only
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags and not any("aarch64" in t for t in tags)
    assert "manylinux_2_28_x86_64" not in W.platform_tags("manylinux2014_aarch64")
    assert W.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def _fake_pip(wheels: list[str], calls: list[list[str]]):
    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for w in wheels:
            (dest / w).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0)
    return run


def test_download_asks_pip_for_binary_wheels_of_the_nodes_python_and_records_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(W.subprocess, "run", _fake_pip(
        ["pip-26.0-py3-none-any.whl", "omegaconf-2.4.0-py3-none-any.whl"], calls))
    assert W.main(["download", "--dest", str(tmp_path / "wh"), "--python-version", "3.12.4",
                   "--platform", "manylinux_2_28_x86_64"]) == 0
    cmd = calls[0]
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert cmd[cmd.index("--implementation") + 1] == "cp"
    assert {cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"} == set(
        W.platform_tags("manylinux_2_28_x86_64"))
    assert "pip" in cmd and not any(a.startswith("torch") for a in cmd)
    manifest = json.loads((tmp_path / "wh" / W.MANIFEST).read_text())
    assert manifest["python_version"] == "3.12"  # the install compares X.Y with the node's
    assert manifest["pip_wheel"] == "pip-26.0-py3-none-any.whl"
    assert manifest["requirements"] == W.requirements()
    assert not (tmp_path / "wh.partial").exists()


@pytest.mark.parametrize("wheel", ["torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                                   "nvidia_nccl_cu12-2.27.3-py3-none-manylinux_2_18_x86_64.whl",
                                   "triton-3.5.0-cp312-cp312-manylinux_2_27_x86_64.whl"])
def test_download_refuses_a_wheelhouse_that_would_shadow_the_nodes_torch(
        wheel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "wh"
    dest.mkdir()
    (dest / "previous.whl").write_bytes(b"")
    (dest / W.MANIFEST).write_text("{}")
    monkeypatch.setattr(W.subprocess, "run", _fake_pip(["pip-26.0-py3-none-any.whl", wheel], []))
    assert W.main(["download", "--dest", str(dest)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and wheel in err[0] and "shadow" in err[0], err
    assert sorted(p.name for p in dest.iterdir()) == [W.MANIFEST, "previous.whl"]  # kept
    assert not (tmp_path / "wh.partial").exists()


def test_a_python_version_that_is_not_x_y_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert W.main(["download", "--python-version", "cp312"]) == 2
    assert "give the node's Python as X.Y" in capsys.readouterr().err


def test_install_refuses_a_missing_wheelhouse_and_one_for_another_python(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "deps"
    assert W.main(["install", "--wheelhouse", str(tmp_path / "nowhere"), "--target", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make wheelhouse" in err[0], err

    other = f"3.{sys.version_info.minor + 1}"
    (tmp_path / W.MANIFEST).write_text(json.dumps({"python_version": other, "requirements": [],
                                                   "pip_wheel": "pip.whl", "wheels": []}))
    assert W.main(["install", "--wheelhouse", str(tmp_path), "--target", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"for Python {other}" in err[0], err
    assert f"PYTHON_VERSION={sys.version_info.major}.{sys.version_info.minor}" in err[0]
    assert not target.exists()


def test_gpu_check_without_torch_says_which_python_in_one_line() -> None:
    # -S: no site-packages, so this interpreter has no torch (the wrong PY on a node)
    proc = subprocess.run([sys.executable, "-S", str(ROOT / "scripts" / "gpu_check.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "cannot import torch" in proc.stderr


def test_a_folder_this_script_did_not_write_is_never_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # `GPU_DEPS=$HOME` or `--dest .` by mistake: refused before pip runs, nothing deleted.
    mine = tmp_path / "home"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    calls: list[list[str]] = []
    monkeypatch.setattr(W.subprocess, "run", _fake_pip(["pip-26.0-py3-none-any.whl"], calls))
    assert W.main(["download", "--dest", str(mine)]) == 2
    wheelhouse = tmp_path / "wh"
    assert W.main(["download", "--dest", str(wheelhouse)]) == 0  # its own output: replaceable
    assert W.main(["download", "--dest", str(wheelhouse)]) == 0
    assert W.main(["install", "--wheelhouse", str(wheelhouse), "--target", str(mine)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(err) == 2 and all(f"{mine} exists and is not" in ln for ln in err), err
    assert len(calls) == 2 and [p.name for p in mine.iterdir()] == ["notes.txt"]
