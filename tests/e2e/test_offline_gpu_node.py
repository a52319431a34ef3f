"""``make gpu-check WHEELHOUSE=...`` on a node that has torch and nothing else, and no network.

The node is simulated: a venv without pip and without the system's site-packages, that sees
torch (with the packages torch itself requires) and numpy through a ``.pth`` file -- what a
node's Python has -- and nothing else of this test's environment. The wheelhouse is made by
``scripts/wheelhouse.py download``, the code behind ``make wheelhouse``, resolving the real
requirement list with pip; only the source differs: instead of PyPI (network, minutes) an
index of wheels repacked from this environment's installed distributions (seconds). Then
``scripts/wheelhouse.py install`` (``make gpu-check``'s first step) runs with the node's
python, and lptrain's CLI and the gpu-check's pytest selection must work from the checkout
plus the installed folder alone. Every network route is closed (dead proxies, no index) and
pip variables that point elsewhere are set, so a pass cannot come from outside the wheelhouse.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "wheelhouse.py"
_spec = importlib.util.spec_from_file_location("wheelhouse_script", SCRIPT)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

# Not torch's requirements: these must come from the wheelhouse, never from the node or the
# test's environment (module name -> how lptrain or the gpu-check uses it).
FROM_WHEELHOUSE = {
    "omegaconf": "config composition", "typer": "the CLI", "rich": "console output",
    "yaml": "PyYAML, recipes", "xxhash": "checkpoint checksums", "matplotlib": "plots",
    "pytest": "the gpu-check's test run", "pytest_timeout": "the [tool.pytest] timeout",
    "hypothesis": "property tests collected by the gpu-check", "pyarrow": "input formats",
    "zstandard": "input formats",
}


def _closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``requirements`` need here, transitively (markers evaluated)."""
    out: dict[str, metadata.Distribution] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = W.canonical(req.name)
        if name in out:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency of torch that this environment lacks
        out[name] = dist
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            if sub_req.marker is None or sub_req.marker.evaluate({"extra": ""}):
                todo.append(sub_req)
    return out


def _top_level_entries(dist: metadata.Distribution) -> set[Path]:
    """The files and folders ``dist`` put directly into site-packages (dist-info included)."""
    return {Path(dist.locate_file(Path(str(f)).parts[0])) for f in dist.files or []
            if not str(f).startswith("..")}


def _repack(dist: metadata.Distribution, dest: Path) -> Path:
    """A wheel of an installed distribution: its files under site-packages, its own tags."""
    tags = [line.split(":", 1)[1].strip().split("-") for line in dist.read_text("WHEEL").splitlines()
            if line.startswith("Tag:")]
    tag = "-".join(".".join(sorted({t[i] for t in tags})) for i in range(3))
    name = W.canonical(dist.metadata["Name"]).replace("-", "_")
    path = dest / f"{name}-{dist.version}-{tag}.whl"
    record, rows = None, []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:  # stored: 400 MB in 2 s
        for f in dist.files or []:
            rel = str(f)
            if rel.startswith("..") or rel.endswith(".pyc"):
                continue  # console scripts (pip writes them again) and bytecode
            if rel.endswith(".dist-info/RECORD"):
                record = rel
                continue
            if Path(dist.locate_file(f)).is_file():
                zf.write(dist.locate_file(f), rel)
                rows.append(f"{rel},,")
        zf.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")
    return path


def _offline_env(**extra: str) -> dict[str, str]:
    """This environment minus what could leak packages in: no PYTHONPATH, no user site, no
    pip configuration, every proxy a closed port."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "NO_PROXY", "no_proxy")}
    dead = "http://127.0.0.1:9"
    env.update(PYTHONNOUSERSITE="1", http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead,
               HTTPS_PROXY=dead, ALL_PROXY=dead, PIP_CONFIG_FILE=os.devnull, **extra)
    return env


def _run(cmd: list, env: dict[str, str], timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


@dataclass
class Node:
    python: Path
    site: Path          # what the node's own site-packages holds: torch, its requirements, numpy
    index: Path         # the stand-in for PyPI
    wheelhouse: Path
    target: Path
    before: dict        # imports seen by the node's python before the install
    install: subprocess.CompletedProcess

    def env(self) -> dict[str, str]:
        return _offline_env(PYTHONPATH=f"{ROOT}{os.pathsep}{self.target}")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    base = tmp_path_factory.mktemp("offline_node")
    index = base / "index"
    index.mkdir()
    for dist in _closure([*W.requirements(), "pip"]).values():
        _repack(dist, index)
    wheelhouse = base / "wheelhouse"
    dl = _run([sys.executable, SCRIPT, "download", "--dest", wheelhouse, "--pip-arg=--no-index",
               f"--pip-arg=--find-links={index}"], _offline_env())
    assert dl.returncode == 0, dl.stdout[-3000:] + dl.stderr[-3000:]

    venv = base / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], _offline_env())
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   _offline_env()).stdout.strip()
    site = base / "node_site"
    site.mkdir()
    for dist in _closure(["torch", "numpy"]).values():
        for entry in _top_level_entries(dist):
            if not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    (Path(purelib) / "node_site.pth").write_text(f"{site}\n")
    probe = ("import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) is not None "
             f"for m in {[*FROM_WHEELHOUSE, 'torch']!r}}}))")
    seen = _run([python, "-c", probe], _offline_env())
    assert seen.returncode == 0, seen.stderr

    # PIP_FIND_LINKS names the full index: the install must ignore it (wheelhouse only).
    install = _run([python, SCRIPT, "install", "--wheelhouse", wheelhouse, "--target",
                    base / "deps"], _offline_env(PIP_FIND_LINKS=str(index)))
    yield Node(python, site, index, wheelhouse, base / "deps", json.loads(seen.stdout), install)
    shutil.rmtree(base, ignore_errors=True)  # 1.2 GB of wheels and installs: not kept for pytest's last 3 runs


def test_before_the_install_the_node_sees_torch_and_nothing_else(node: Node) -> None:
    assert node.before.pop("torch") is True
    assert not any(node.before.values()), node.before  # the test's own packages leak nowhere


def test_the_wheelhouse_holds_everything_but_torch(node: Node) -> None:
    manifest = json.loads((node.wheelhouse / W.MANIFEST).read_text())
    names = {W.wheel_name(w) for w in manifest["wheels"]}
    assert {"omegaconf", "typer", "xxhash", "pytest", "hypothesis", "pyarrow", "pip"} <= names
    assert not [n for n in names if W.node_provided(n)], names
    assert manifest["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_lptrain_cli_imports_with_every_dependency_from_the_wheelhouse(node: Node) -> None:
    assert node.install.returncode == 0, node.install.stdout[-3000:] + node.install.stderr[-3000:]
    assert W.installed_node_packages(node.target) == []
    code = ("import json, lptrain.cli, torch; import " + ", ".join(FROM_WHEELHOUSE) + "; "
            "print(json.dumps({m.__name__: m.__file__ for m in (lptrain.cli, torch, "
            + ", ".join(FROM_WHEELHOUSE) + ")}))")
    proc = _run([node.python, "-c", code], node.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = json.loads(proc.stdout)
    assert Path(where.pop("lptrain.cli")).is_relative_to(ROOT / "lptrain")
    assert Path(where.pop("torch")).is_relative_to(node.site)  # the node's torch, untouched
    outside = {m: f for m, f in where.items() if not Path(f).is_relative_to(node.target)}
    assert not outside, outside

    helped = _run([node.python, "-m", "lptrain", "--help"], node.env())
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "pretrain" in helped.stdout and "validate-config" in helped.stdout


def test_the_gpu_checks_pytest_selection_collects_on_the_node(node: Node) -> None:
    # scripts/gpu_check.py runs `pytest -m "gpu and not te" tests`: pytest imports every test
    # module before selecting, so each one's imports must resolve from the wheelhouse.
    proc = _run([node.python, "-m", "pytest", "--collect-only", "-q", "-m", "gpu and not te",
                 "-p", "no:cacheprovider", "tests"], node.env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " collected" in summary and "error" not in summary, summary
    assert int(summary.split("/")[0]) >= 1, summary  # tests/gpu is selected, not empty


def test_a_second_install_from_the_same_wheelhouse_changes_nothing(node: Node) -> None:
    before = sorted(p.name for p in node.target.iterdir())
    again = _run([node.python, SCRIPT, "install", "--wheelhouse", node.wheelhouse, "--target",
                  node.target], _offline_env())
    assert again.returncode == 0 and "already installed" in again.stdout, again.stdout + again.stderr
    assert sorted(p.name for p in node.target.iterdir()) == before


def test_a_wheel_missing_from_the_wheelhouse_is_not_fetched_from_elsewhere(
        node: Node, tmp_path: Path) -> None:
    # The same wheelhouse without omegaconf's wheel, while PIP_FIND_LINKS and PIP_INDEX_URL name
    # places that have it: the install must fail (exit 2, one line) rather than take it there.
    partial = tmp_path / "wheelhouse"
    partial.mkdir()
    for f in node.wheelhouse.iterdir():
        if W.wheel_name(f.name) != "omegaconf":
            os.link(f, partial / f.name)
    target = tmp_path / "deps"
    proc = _run([node.python, SCRIPT, "install", "--wheelhouse", partial, "--target", target],
                _offline_env(PIP_FIND_LINKS=str(node.index), PIP_INDEX_URL=node.index.as_uri()))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(error) == 1 and "could not install" in error[0], proc.stderr[-2000:]
    assert not target.exists() and not (tmp_path / "deps.partial").exists()
    shutil.rmtree(partial)
