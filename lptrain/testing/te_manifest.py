"""Queries on the Transformer Engine API manifest (``tests/data/te_api.json``, written by
``scripts/te_manifest.py`` from TE's tagged sources).

The manifest stores, per class and function lptrain reaches, each member with the TE releases
it exists in, as ranges (``"2.8-2.13,2.15"``). These helpers answer "does TE's ``X`` have
``y`` at release ``v``?" and "from which release on does it?", which the TE-call and
version-gate tests ask.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import functools
import json
from pathlib import Path
from typing import Any, Optional

import torch

MANIFEST_PATH = Path(__file__).resolve().parents[2] / "tests" / "data" / "te_api.json"

# The non-TE bases TE's classes end in, and what Python finds on them.
EXTERNAL_BASES: dict[str, Any] = {
    "torch.Tensor": torch.Tensor,
    "torch.nn.Module": torch.nn.Module,
    "torch.autograd.Function": torch.autograd.Function,
    "abc.ABC": abc.ABC,
    "enum.Enum": enum.Enum,
    "contextlib.AbstractContextManager": contextlib.AbstractContextManager,
    "contextlib.ContextDecorator": contextlib.ContextDecorator,
    "object": object,
}


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2])


@functools.cache
def manifest() -> dict[str, Any]:
    return json.loads(MANIFEST_PATH.read_text())


def versions() -> list[str]:
    return list(manifest()["versions"])


def holds(ranges: str, version: str) -> bool:
    """Whether ``version`` ("2.14") is inside ``ranges`` ("2.8-2.13,2.15")."""
    v = version_tuple(version)
    for part in filter(None, ranges.split(",")):
        lo, _, hi = part.partition("-")
        if version_tuple(lo) <= v <= version_tuple(hi or lo):
            return True
    return False


def first(ranges: str) -> Optional[str]:
    """The first release of ``ranges`` (None when empty)."""
    part = next(iter(filter(None, ranges.split(","))), None)
    return part.split("-")[0] if part else None


def class_entry(path: str) -> dict[str, Any]:
    return manifest()["classes"][path]


def class_present(path: str, version: str) -> bool:
    entry = manifest()["classes"].get(path)
    return entry is not None and holds(entry["present"], version)


def members(path: str, version: str) -> set[str]:
    """Every member name Python finds on TE's class ``path`` at ``version``: its own and its
    TE bases' methods, properties and attributes, plus those of its non-TE bases."""
    entry = class_entry(path)
    names = {n for kind in ("methods", "properties", "attributes")
             for n, r in entry[kind].items() if holds(r, version)}
    for base, r in entry["external_bases"].items():
        if holds(r, version) and base in EXTERNAL_BASES:
            names |= set(dir(EXTERNAL_BASES[base]))
    return names | set(dir(object))


def init_kwargs(path: str, version: str) -> tuple[set[str], bool]:
    """TE's constructor keywords of ``path`` at ``version`` and whether it takes ``**kwargs``."""
    entry = class_entry(path)
    return ({n for n, r in entry["init_kwargs"].items() if holds(r, version)},
            holds(entry["init_varkw"], version))


def parameter_attributes(version: str) -> set[str]:
    """Attributes TE's modules attach to their (quantized) parameters at ``version``."""
    return {n for n, r in manifest()["parameter_attributes"].items() if holds(r, version)}


def function_params(path: str, version: str) -> Optional[tuple[set[str], bool]]:
    entry = manifest()["functions"].get(path)
    if entry is None or not holds(entry["present"], version):
        return None
    return {n for n, r in entry["params"].items() if holds(r, version)}, holds(entry["varkw"], version)


def module_exports(module: str, version: str) -> Optional[set[str]]:
    entry = manifest()["modules"].get(module)
    if entry is None or not holds(entry["present"], version):
        return None
    return {n for n, r in entry["exports"].items() if holds(r, version)}


def feature(name: str, version: str) -> bool:
    return holds(manifest()["features"][name], version)


def feature_first(name: str) -> Optional[str]:
    return first(manifest()["features"][name])


def member_first(path: str, member: str) -> Optional[str]:
    """The first release whose class ``path`` has ``member`` (own or inherited from a TE base)."""
    entry = class_entry(path)
    spans = [entry[k][member] for k in ("methods", "properties", "attributes", "init_kwargs")
             if member in entry[k]]
    firsts = [first(s) for s in spans if first(s)]
    return min(firsts, key=version_tuple) if firsts else None


def function_first(path: str) -> Optional[str]:
    entry = manifest()["functions"].get(path)
    return first(entry["present"]) if entry else None
