"""The emulated ``transformer_engine_torch``: TE's compiled extension, as a Python module.

What the module exposes follows TE's pybind registration of that release
(``extension_tables.json``, written by ``scripts/te_extension_tables.py`` from TE's csrc):

* every enum with TE's members and integer values (an :class:`enum.IntEnum`, which compares
  and hashes as its integer, as TE's ``DType`` does);
* every function name. The ones lptrain's paths reach are computed by lptrain's bit-exact
  emulation with the C++ semantics (:mod:`.kernels`); calling any other raises
  :class:`NotEmulatedError` naming it -- a TE path lptrain does not emulate fails loudly
  instead of computing something else;
* every class name (``FP8TensorMeta``, the comm-overlap classes): constructing one raises the
  same error, except ``FP8TensorMeta``, a plain holder of ``scale`` / ``scale_inv`` /
  ``amax_history``.

A name TE's extension lacks at the release raises ``AttributeError``, as the real module would.
"""

from __future__ import annotations

import enum
import functools
import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

TABLES = Path(__file__).with_name("extension_tables.json")


class NotEmulatedError(NotImplementedError):
    """A ``transformer_engine_torch`` function lptrain's emulation does not provide."""


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3])


@functools.cache
def _all_tables() -> dict[str, Any]:
    return json.loads(TABLES.read_text())


def tables_for(version: str) -> tuple[str, dict[str, Any]]:
    """The tables of ``version``, or of the newest recorded release before it (the extension's
    surface changes between minor releases only; the returned release says which was used)."""
    data = _all_tables()
    known = sorted(data, key=_v)
    older = [k for k in known if _v(k) <= _v(version)]
    if not older:
        raise ImportError(f"TE {version} is older than every release lptrain.testing.te_python has "
                          f"tables for ({known[0]}..{known[-1]})")
    return older[-1], data[older[-1]]


def _not_emulated(name: str, version: str) -> Callable[..., Any]:
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise NotEmulatedError(
            f"transformer_engine_torch.{name} (TE {version}) is not emulated by "
            "lptrain.testing.te_python: lptrain's TE paths do not call it, so this TE code path "
            "is not covered on a CPU")

    fn.__name__ = fn.__qualname__ = name
    return fn


class FP8TensorMeta:
    """TE's ``FP8TensorMeta``: the delayed-scaling buffers of one module direction."""

    def __init__(self) -> None:
        self.scale: Any = None
        self.scale_inv: Any = None
        self.amax_history: Any = None


def _stub_class(name: str, version: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _not_emulated(name, version)()

    return type(name, (), {"__init__": __init__, "__module__": "transformer_engine_torch"})


def build(version: str) -> types.ModuleType:
    """The ``transformer_engine_torch`` module of TE ``version``."""
    from . import kernels

    _, t = tables_for(version)
    mod = types.ModuleType("transformer_engine_torch", f"lptrain's emulation of TE {version}'s extension")
    mod.__file__ = __file__
    mod._lptrain_version = _v(version)  # type: ignore[attr-defined]
    for name, members in t["enums"].items():
        cls = enum.IntEnum(name, members, module="transformer_engine_torch")
        cls.__str__ = lambda self: f"{type(self).__name__}.{self.name}"  # type: ignore[method-assign]
        setattr(mod, name, cls)
    for name in t["classes"]:
        setattr(mod, name, FP8TensorMeta if name == "FP8TensorMeta" else _stub_class(name, version))
    emulated = kernels.functions(mod, _v(version))
    for name in t["functions"]:
        setattr(mod, name, emulated.get(name) or _not_emulated(name, version))
    mod._lptrain_emulated = sorted(n for n in t["functions"] if n in emulated)  # type: ignore[attr-defined]
    return mod


def emulated_functions(version: str) -> list[str]:
    """The extension functions of ``version`` computed by the emulation (the rest raise)."""
    import transformer_engine_torch as tex

    del version
    return list(tex._lptrain_emulated)
