"""The package layering: every import points down the declared order, no cycles, no private names.

The order is declared once, in ``lptrain.LAYERS`` (and stated in a sentence in the package
docstring): each layer imports only layers to its right. This test parses every module's
imports with ``ast`` (function-level imports and ``TYPE_CHECKING`` blocks included: a lazy
import is still a dependency) and fails on an import against the order, a cycle between
packages, or a private name (``_x``) imported from another package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lptrain

ROOT = Path(lptrain.__file__).parent


def _unit(module: str) -> str:
    """The layer unit of ``lptrain.a.b``: the package ``a`` or the top-level module ``a``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lptrain"


def _layer_of() -> dict[str, int]:
    return {unit: i for i, layer in enumerate(lptrain.LAYERS) for unit in layer}


def _imports() -> list[tuple[str, int, str, str, str]]:
    """(file, line, importing unit, imported module, imported name) for every lptrain import."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = _unit(module) if path.parent != ROOT else rel.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    if path.name != "__init__.py":
                        base = base[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                if target.split(".")[0] == "lptrain":
                    for alias in node.names:
                        out.append((str(path.relative_to(ROOT)), node.lineno, src, target, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "lptrain":
                        out.append((str(path.relative_to(ROOT)), node.lineno, src, alias.name, ""))
    return out


def _target_unit(target: str, name: str) -> str:
    unit = _unit(target)
    if unit == "lptrain" and name:  # ``from lptrain import errors``
        return name
    return unit


def test_every_unit_is_in_the_declared_order() -> None:
    declared = {u for layer in lptrain.LAYERS for u in layer}
    present = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert present <= declared, sorted(present - declared)


def test_imports_point_down_the_declared_order() -> None:
    layer = _layer_of()
    bad = []
    for file, line, src, target, name in _imports():
        dst = _target_unit(target, name)
        if dst == src or dst == "lptrain":
            continue
        if layer[dst] < layer[src]:
            bad.append(f"{file}:{line}: {src} (layer {layer[src]}) imports {target}.{name} (layer {layer[dst]})")
    assert bad == [], "\n".join(bad)


def test_no_cycles_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for _file, _line, src, target, name in _imports():
        dst = _target_unit(target, name)
        if dst not in (src, "lptrain"):
            edges.setdefault(src, set()).add(dst)

    def reach(a: str, seen: set[str]) -> set[str]:
        for b in edges.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    cycles = sorted(a for a in edges if a in reach(a, set()))
    assert cycles == [], cycles


def test_no_private_name_is_imported_from_another_package() -> None:
    bad = [f"{file}:{line}: {target}.{name}" for file, line, src, target, name in _imports()
           if name.startswith("_") and not name.startswith("__") and _target_unit(target, name) != src]
    assert bad == [], "\n".join(bad)
