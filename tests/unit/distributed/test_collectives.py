"""The flat collectives run on every torch lptrain supports: the names that torch 2.13 added
(``all_gather_single``/``reduce_scatter_single``) when they exist, the older ones otherwise,
and nowhere else in the package is either spelling called directly."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lptrain.precision import collectives

NAMES = {"all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"}


@pytest.mark.parametrize(("wrapper", "new", "old"), [
    ("all_gather_flat", "all_gather_single", "all_gather_into_tensor"),
    ("reduce_scatter_flat", "reduce_scatter_single", "reduce_scatter_tensor"),
])
def test_the_new_name_when_present_else_the_old_one(monkeypatch: pytest.MonkeyPatch, wrapper: str,
                                                    new: str, old: str) -> None:
    calls = []
    out, inp = torch.zeros(4), torch.ones(2)

    def spy(tag: str):
        return lambda o, i, group=None, async_op=False: calls.append((tag, o, i, group, async_op))

    monkeypatch.setattr(dist, old, spy("old"))
    monkeypatch.setattr(dist, new, spy("new"), raising=False)
    getattr(collectives, wrapper)(out, inp, group="g", async_op=True)
    monkeypatch.delattr(dist, new)  # an older torch
    getattr(collectives, wrapper)(out, inp)
    assert [c[0] for c in calls] == ["new", "old"]
    assert calls[0][1:] == (out, inp, "g", True) and calls[1][1:] == (out, inp, None, False)


def test_no_module_calls_a_flat_collective_directly() -> None:
    root = Path(collectives.__file__).parents[1]
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in NAMES:
                offenders.append(f"{path.relative_to(root)}:{node.lineno} {node.attr}")
    assert offenders == []
