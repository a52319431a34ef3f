"""The emulated extension functions (see :mod:`lptrain.testing.te_python.extension`)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def functions(tex: types.ModuleType, version: tuple[int, ...]) -> dict[str, Callable[..., Any]]:
    """Name -> emulated function for TE ``version``'s extension module ``tex``."""
    from . import adam, cast, device, gemm, grouped, misc, recipe

    out: dict[str, Callable[..., Any]] = dict(device.functions(tex, version))
    for mod in (cast, gemm, grouped, misc, recipe):
        out.update(mod.functions())
    out.update(adam.functions(version))
    return out
