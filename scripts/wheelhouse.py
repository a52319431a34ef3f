#!/usr/bin/env python3
"""Wheels for a CUDA node without network: built where the network is, installed on the node.

    make wheelhouse PYTHON_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64   # where the network is
    make gpu-check WHEELHOUSE=wheelhouse                                 # on the node, offline

``download`` fetches, as wheels only (the node has no compiler and no build backend to turn an
sdist into one), every dependency of lptrain and of ``make gpu-check`` for the node's Python
version and platform: ``project.dependencies`` and the ``gpu-check`` extra of pyproject.toml,
transitively, plus pip's own wheel (so the node needs no pip of its own). It never takes torch
or what a CUDA torch brings with it (``nvidia-*``, ``triton``): the node's CUDA build is the
one to test, and a wheel of another build installed next to it would shadow it. Nothing lptrain
needs depends on torch; should that change, the download stops with the wheel's name rather than
ship it. lptrain itself is not in the wheelhouse: ``make gpu-check`` runs this checkout (its
tests, recipes and scripts are needed anyway), ``PYTHONPATH=<checkout>:<target>``.

``install`` runs on the node: pip, from the wheelhouse's own wheel, installs with ``--no-index``
from the wheelhouse alone (pip's configuration files and ``PIP_*`` variables are ignored, so a
node's ``find-links`` or index cannot add anything) into a target folder, never into
site-packages; the node's torch and numpy stay where they are. The target is rebuilt next to the
old one and swapped in, and left as it is when it was built from the same wheelhouse.

Exit status: 0 done; 1 pip failed to download (network, a version that has no wheel for that
platform) or the result would hold torch; 2 the wheelhouse is missing, incomplete or built for
another Python version. Needs nothing but the standard library and pip.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (lptrain's oldest): the parser pip vendors
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "lptrain-wheelhouse.json"
# The extra that lists what `make gpu-check` needs on top of lptrain's own dependencies.
GPU_CHECK_EXTRA = "gpu-check"
# Distributions the node brings with its CUDA torch; a wheelhouse holding one would shadow it.
_NODE_NAMES = frozenset({"torch", "triton", "pytorch-triton"})
_NODE_PREFIXES = ("nvidia-",)
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


class WheelhouseError(Exception):
    """An expected failure: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def canonical(name: str) -> str:
    """PEP 503 name: ``PyYAML`` and ``pyyaml``, ``typing_extensions`` and ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def node_provided(name: str) -> bool:
    """True for torch and the distributions a CUDA torch installs with it."""
    name = canonical(name)
    return name in _NODE_NAMES or name.startswith(_NODE_PREFIXES)


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """lptrain's dependencies and the gpu-check extra, ``lptrain[...]`` expanded, torch left out."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = []
    seen_extras: set[str] = set()

    def add(reqs: list[str]) -> None:
        for req in reqs:
            m = _REQ_NAME.match(req)
            if m is None:
                raise WheelhouseError(f"{pyproject}: cannot read the requirement {req!r}", 2)
            if canonical(m.group(1)) == canonical(project["name"]):
                for extra in (e.strip() for e in (m.group(2) or "").split(",") if e.strip()):
                    if extra not in seen_extras:
                        seen_extras.add(extra)
                        add(extras[extra])
            elif not node_provided(m.group(1)) and req not in out:
                out.append(req)

    add(project["dependencies"])
    add([f"{project['name']}[{GPU_CHECK_EXTRA}]"])
    return out


def platform_tags(platform: str) -> list[str]:
    """Every wheel platform tag a node of ``platform`` runs, newest first.

    A glibc 2.X node runs manylinux wheels built for any glibc <= 2.X (PEP 600), and many
    projects tag theirs only for the oldest glibc they support (``manylinux_2_17``), but
    ``pip download --platform manylinux_2_28_x86_64`` accepts that one tag alone: the older
    ones (and their legacy names manylinux2014/2010/1) are listed here.
    """
    legacy = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)|(manylinux2014|manylinux2010|manylinux1)_(\w+)",
                     platform)
    if m is None:
        return [platform]
    glibc = int(m.group(1)) if m.group(1) else legacy[m.group(3)]
    arch = m.group(2) or m.group(4)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    return tags + [f"{name}_{arch}" for name, minor in legacy.items() if minor <= glibc]


def wheel_name(filename: str) -> str:
    """The distribution a wheel file installs (the part before the first dash)."""
    return canonical(filename.split("-", 1)[0])


def _check_replaceable(path: Path, what: str) -> None:
    """``path`` is replaced wholesale: only when it is absent, empty or one this script wrote
    (a mistyped ``GPU_DEPS=$HOME`` must not be emptied)."""
    if path.exists() and not (path / MANIFEST).is_file() and (
            not path.is_dir() or any(path.iterdir())):
        raise WheelhouseError(f"{path} exists and is not {what} this script wrote (no {MANIFEST}): "
                              "remove it or choose another folder", 2)


def download(dest: Path, python_version: str | None, platform: str | None,
             pip_args: list[str]) -> dict:
    """Fill ``dest`` with the wheels (into ``dest.partial``, swapped in once complete)."""
    if python_version is not None:
        m = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", python_version)
        if m is None:
            raise WheelhouseError(f"PYTHON_VERSION={python_version}: give the node's Python as "
                                  "X.Y, e.g. 3.12", 2)
        python_version = f"{m.group(1)}.{m.group(2)}"  # a docker image's PYTHON_VERSION is X.Y.Z
    _check_replaceable(dest, "a wheelhouse")
    reqs = requirements()
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    target: list[str] = []
    if python_version or platform:
        target = ["--implementation", "cp"]
        target += ["--python-version", python_version] if python_version else []
        for tag in platform_tags(platform) if platform else []:
            target += ["--platform", tag]
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(partial),
           *target, *pip_args, "pip", *reqs]
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise WheelhouseError("pip download failed (see its output above); the previous "
                              f"{dest} is unchanged", 1)
    wheels = sorted(p.name for p in partial.glob("*.whl"))
    shipped = [w for w in wheels if node_provided(wheel_name(w))]
    if shipped:
        shutil.rmtree(partial, ignore_errors=True)
        raise WheelhouseError(f"a requirement pulled in {', '.join(shipped)}, which would shadow "
                              "the node's CUDA torch: download that requirement with --no-deps",
                              1)
    pips = [w for w in wheels if wheel_name(w) == "pip"]
    manifest = {
        "python_version": python_version or f"{sys.version_info.major}.{sys.version_info.minor}",
        "platform": platform or sysconfig.get_platform(),
        "requirements": reqs,
        "pip_wheel": pips[-1],
        "wheels": wheels,
    }
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    size = sum((dest / w).stat().st_size for w in wheels)
    print(f"{dest}: {len(wheels)} wheels, {size / 2**20:.0f} MiB, for Python "
          f"{manifest['python_version']} on {manifest['platform']}")
    return manifest


def _read_manifest(wheelhouse: Path) -> dict:
    path = wheelhouse / MANIFEST
    if not path.is_file():
        raise WheelhouseError(f"{path} does not exist: build the wheelhouse with `make wheelhouse "
                              "PYTHON_VERSION=X.Y PLATFORM=...` where the network is, then copy it "
                              "here", 2)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WheelhouseError(f"{path} is unreadable ({e}): build the wheelhouse again", 2) from e


def _isolated_env() -> dict[str, str]:
    """No pip configuration file and no ``PIP_*`` variable: the wheelhouse is the only source."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def installed_node_packages(target: Path) -> list[str]:
    """What in ``target`` belongs to torch's side (must stay empty)."""
    names = [p.name.split("-", 1)[0] for p in target.glob("*.dist-info")]
    return sorted(n for n in names if node_provided(n)) + sorted(
        p.name for p in target.iterdir() if p.name in ("torch", "triton", "nvidia"))


def install(wheelhouse: Path, target: Path) -> Path:
    """Install the wheelhouse's requirements into ``target``, offline; return ``target``."""
    manifest = _read_manifest(wheelhouse)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != here:
        raise WheelhouseError(f"{wheelhouse} holds wheels for Python {manifest['python_version']} "
                              f"and this is Python {here} ({sys.executable}): build it with "
                              f"`make wheelhouse PYTHON_VERSION={here} PLATFORM=...`", 2)
    _check_replaceable(target, "an install")
    stamp = target / MANIFEST
    if stamp.is_file() and stamp.read_text() == (wheelhouse / MANIFEST).read_text():
        print(f"{target}: already installed from this wheelhouse")
        return target
    pip = wheelhouse / manifest["pip_wheel"]
    if not pip.is_file():
        raise WheelhouseError(f"{pip} is missing: copy the whole wheelhouse folder", 2)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # Running pip from its wheel is pip's own bootstrap path ("python pip.whl/pip install ...").
    cmd = [sys.executable, f"{pip}/pip", "install", "--isolated", "--no-index", "--find-links",
           str(wheelhouse), "--only-binary=:all:", "--target", str(partial),
           "--disable-pip-version-check", "--no-warn-script-location", "--no-compile", *manifest["requirements"]]
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, env=_isolated_env()).returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise WheelhouseError(f"pip could not install from {wheelhouse} alone (see its output "
                              f"above): it lacks a wheel for this machine; rebuild it with `make "
                              f"wheelhouse PYTHON_VERSION={here} PLATFORM=<this node's>`", 2)
    bad = installed_node_packages(partial)
    if bad:
        shutil.rmtree(partial, ignore_errors=True)
        raise WheelhouseError(f"{wheelhouse} installed {', '.join(bad)}, which would shadow the "
                              "node's torch: rebuild it with `make wheelhouse`", 2)
    (partial / MANIFEST).write_text((wheelhouse / MANIFEST).read_text())
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    print(f"{target}: installed from {wheelhouse}; run with PYTHONPATH={ROOT}:{target}")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="fetch the wheels (needs the network)")
    dl.add_argument("--dest", type=Path, default=ROOT / "wheelhouse")
    dl.add_argument("--python-version", default=None, help="the node's, e.g. 3.12 (default: this one)")
    dl.add_argument("--platform", default=None,
                    help="the node's wheel platform tag, e.g. manylinux_2_28_x86_64 (default: this one)")
    dl.add_argument("--pip-arg", action="append", default=[],
                    help="passed to pip download (an index, a proxy), repeatable")
    ins = sub.add_parser("install", help="install offline from a wheelhouse into a folder")
    ins.add_argument("--wheelhouse", type=Path, required=True)
    ins.add_argument("--target", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.command == "download":
            download(args.dest.resolve(), args.python_version, args.platform, args.pip_arg)
        else:
            install(args.wheelhouse.resolve(), args.target.resolve())
    except WheelhouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
