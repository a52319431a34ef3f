"""Write the tables of Transformer Engine's ``transformer_engine_torch`` extension, per release.

TE's PyTorch extension is C++ (pybind11). Its Python layer, which lptrain runs on a CPU
(:mod:`lptrain.testing.te_python`), reads enums and calls functions of that extension. This
script reads TE's published C++ sources -- the ``transformer-engine-torch`` source
distribution of a release, which ships ``csrc/`` and the core's headers -- and records, per
release, what the extension module exposes: each enum (its members and their integer values,
from the C++ enum definitions), and the names of its functions and classes. Nothing of TE's
code is kept: names and numbers only.

Usage (network to PyPI; each source distribution is ~0.5 MB)::

    python scripts/te_extension_tables.py 2.8.0 2.12.0 2.14.1 2.18.0 2.19.0 2.20.2

or ``--sdist-dir DIR`` with already unpacked ``transformer_engine_torch-X.Y.Z`` folders, or
``--git REPO`` with a clone of TE's repository (``VERSION=REF`` pairs: ``2.19.0=release_v2.19``).
Writes ``lptrain/testing/te_python/extension_tables.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "lptrain" / "testing" / "te_python" / "extension_tables.json"

_ENUM_BIND = re.compile(r'enum_<\s*([\w:]+)\s*>\s*\(\s*m\s*,\s*"(\w+)"')
_VALUE = re.compile(r'\.value\(\s*"(\w+)"\s*,\s*([\w:]+)\s*\)')
_DEF = re.compile(r'\bm\.def\(\s*"(\w+)"')
_CLASS = re.compile(r'class_<([^;]{0,400}?)>\s*\(\s*m\s*,\s*"(\w+)"')
_CPP_ENUM = re.compile(r"\benum\s+(?:class\s+)?(\w+)\s*(?::\s*[\w:]+\s*)?\{([^}]*)\}", re.S)
_C_TYPEDEF_ENUM = re.compile(r"\btypedef\s+enum\s*\w*\s*\{([^}]*)\}\s*(\w+)\s*;", re.S)


def _strip_comments(text: str) -> str:
    text = text.replace("\\\n", " ")  # macro line continuations
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _cpp_enums(root: Path) -> dict[str, dict[str, int]]:
    """Every C++ enum in the source tree: name -> {member: value}."""
    out: dict[str, dict[str, int]] = {}
    for path in [*root.rglob("*.h"), *root.rglob("*.cpp"), *root.rglob("*.cuh")]:
        text = _strip_comments(path.read_text(errors="replace"))
        found = _CPP_ENUM.findall(text) + [(n, b) for b, n in _C_TYPEDEF_ENUM.findall(text)]
        for name, body in found:
            members: dict[str, int] = {}
            nxt = 0
            for item in body.split(","):
                item = item.strip()
                if not item:
                    continue
                if "=" in item:
                    key, expr = (s.strip() for s in item.split("=", 1))
                    try:
                        nxt = int(expr, 0)
                    except ValueError:
                        if expr in members:
                            nxt = members[expr]
                        else:
                            continue
                else:
                    key = item
                if re.fullmatch(r"\w+", key):
                    members[key] = nxt
                    nxt += 1
            if members:
                out.setdefault(name, members)
    return out


def tables(src: Path) -> dict:
    """The extension's enums, functions and classes from one unpacked source distribution."""
    csrc = src / "csrc" if (src / "csrc").is_dir() else src / "transformer_engine" / "pytorch" / "csrc"
    enums_cpp = _cpp_enums(src)
    binding = ""
    for path in sorted([*csrc.rglob("*.cpp"), *csrc.rglob("*.h"), *src.rglob("pybind_helper.h")]):
        binding += _strip_comments(path.read_text(errors="replace")) + "\n"
    enums: dict[str, dict[str, int]] = {}
    for m in _ENUM_BIND.finditer(binding):
        cpp_name, py_name = m.group(1).split("::")[-1], m.group(2)
        end = binding.find(";", m.end())
        values = {}
        for key, ref in _VALUE.findall(binding[m.end():end]):
            member = ref.split("::")[-1]
            cpp = enums_cpp.get(cpp_name, {})
            if member not in cpp:
                raise SystemExit(f"{src.name}: no value for {cpp_name}::{member}")
            values[key] = cpp[member]
        enums[py_name] = values
    functions = sorted(set(_DEF.findall(binding)))
    classes = sorted({name for _, name in _CLASS.findall(binding)} - set(enums))
    return {"enums": enums, "functions": functions, "classes": classes}


def _download(version: str, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", "-d", str(dest), f"transformer-engine-torch=={version}"],
                   check=True)
    archive = next(dest.glob(f"transformer_engine_torch-{version}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / f"transformer_engine_torch-{version}"


def _from_git(repo: Path, ref: str, dest: Path) -> Path:
    out = dest / ref.replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "transformer_engine/pytorch/csrc",
                              "transformer_engine/common"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="+")
    ap.add_argument("--sdist-dir", type=Path, help="folder with unpacked transformer_engine_torch-X.Y.Z")
    ap.add_argument("--git", type=Path, help="a clone of TE's repository; versions given as VERSION=REF")
    args = ap.parse_args()
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.versions:
            v, _, ref = item.partition("=")
            if args.git:
                src = _from_git(args.git, ref or f"v{v}", Path(tmp))
            elif args.sdist_dir:
                src = args.sdist_dir / f"transformer_engine_torch-{v}"
            else:
                src = _download(v, Path(tmp))
            data[v] = tables(src)
            print(f"{v}: {len(data[v]['enums'])} enums, {len(data[v]['functions'])} functions, "
                  f"{len(data[v]['classes'])} classes")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dict(sorted(data.items(), key=lambda kv: tuple(map(int, kv[0].split("."))))),
                              indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main()
