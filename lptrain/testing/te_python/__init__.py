"""Transformer Engine's own Python layer on a CPU, with only its kernels emulated.

TE publishes its Python layer as a pure-Python wheel (``transformer-engine``, about 1 MB:
``transformer_engine/pytorch/...``); the CUDA code lives in the ``transformer_engine_torch``
extension and the core library. This package imports TE's own modules -- ``Linear``,
``GroupedLinear``, the quantizers and the storage classes they return, ``autocast`` and the
global FP8 state manager with its amax reduction, the recompute contexts, ``fp8_meta``,
extra state, ``is_first_microbatch`` caching -- from a folder holding that wheel
(:mod:`.loader`), with the extension replaced by lptrain's bit-exact emulation
(:mod:`.extension`, :mod:`.kernels`). The TE backend's tests then prove that lptrain works
with TE's code, not with a picture of it; and ``lptrain pretrain --dry-run`` on a GPU target
runs its fake GPU step through it.

Folders: ``make install`` puts the releases of :data:`MATRIX` under ``.te-python/<release>/``
in the checkout (``pip install --no-deps --target``, never into site-packages, so a real TE
on a GPU machine is never shadowed); ``LPTRAIN_TE_PYTHON=DIR`` points at any one folder made
the same way. One TE release per process (TE registers global state at import): the newest
folder serves unless the variable or a requested release says otherwise.

Used by the tests and by the dry run; never imported by ``import lptrain``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from lptrain.errors import DeviceError

from .loader import clear_caches, import_te, loaded, release_of

ENV = "LPTRAIN_TE_PYTHON"
# The releases `make install` puts under .te-python/ (TE's tags; the newest serves by default).
MATRIX = ("2.8.0", "2.12.0", "2.14.1", "2.18.0", "2.19.0", "2.20.2")
ROOT = Path(__file__).resolve().parents[3] / ".te-python"
# TE's own pure-Python runtime dependency that lptrain's venv lacks (installed beside TE)
DEPENDENCIES = ("einops",)
HOW_TO_GET = (f"run `make install` (TE's Python wheels {', '.join(MATRIX)} into .te-python/) or set "
              f"{ENV}=DIR after `pip install --no-deps --target DIR transformer-engine==X.Y.Z einops`")


class TEPythonMissing(DeviceError):
    """No folder with TE's Python wheel to run the TE backend on a CPU."""


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3] if x.isdigit())


def installed_folders(root: Path = ROOT) -> dict[str, Path]:
    """release -> folder of every TE Python folder under ``root`` (oldest first)."""
    found: dict[str, Path] = {}
    if root.is_dir():
        for d in root.iterdir():
            try:
                found[release_of(d)] = d
            except (FileNotFoundError, ValueError):
                continue
    return dict(sorted(found.items(), key=lambda kv: _v(kv[0])))


def folder(version: Optional[str] = None) -> Path:
    """The TE Python folder to use: ``$LPTRAIN_TE_PYTHON``; else the installed folder of
    release ``version`` (``"2.14"`` matches ``2.14.1``); else the newest installed one.
    :class:`TEPythonMissing` (one line saying how to get one) when there is none."""
    env = os.environ.get(ENV)
    if env:
        path = Path(env).expanduser()
        try:
            release_of(path)
        except FileNotFoundError as e:
            raise TEPythonMissing(f"{ENV}={env}: {e}") from None
        return path
    folders = installed_folders()
    if version is not None:
        want = _v(version)
        matches = [p for r, p in folders.items() if _v(r)[: len(want)] == want]
        if matches:
            return matches[-1]
        if folders:
            raise TEPythonMissing(f"Transformer Engine {version}'s Python is not installed under {ROOT} "
                                  f"(have {', '.join(folders)}); {HOW_TO_GET}")
    if not folders:
        raise TEPythonMissing(f"no Transformer Engine Python to run the TE backend on a CPU; {HOW_TO_GET}")
    return list(folders.values())[-1]


def load(version: Optional[str] = None) -> Any:
    """``transformer_engine.pytorch`` of :func:`folder` (``version``), imported once per
    process; a later call for another release raises (use a subprocess)."""
    done = loaded()
    if done is not None and (version is None or _v(done[1])[: len(_v(version))] == _v(version)):
        return sys.modules["transformer_engine.pytorch"]
    return import_te(folder(version))


def version() -> Optional[str]:
    """The release of the TE imported in this process (None: none yet)."""
    done = loaded()
    return done[1] if done else None


def _fp8_state_manager() -> Any:
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def default_release() -> Optional[str]:
    """The release :func:`folder` would serve without a requested one (None: no folder)."""
    try:
        return release_of(folder())
    except (TEPythonMissing, FileNotFoundError):
        return None


_CLASS_HOMES = ("tensor", "tensor.float8_tensor", "tensor.mxfp8_tensor", "tensor.float8_blockwise_tensor",
                "tensor.nvfp4_tensor", "tensor.grouped_tensor", "quantized_tensor", "tensor.quantized_tensor")


def te_class(name: str) -> Optional[type]:
    """A class of the imported TE by name (``QuantizedTensor``, ``Float8Tensor``,
    ``GroupedTensor``...), wherever its release keeps it; None when the release has none."""
    import importlib

    for home in _CLASS_HOMES:
        try:
            mod = importlib.import_module(f"transformer_engine.pytorch.{home}")
        except ImportError:
            continue
        cls = getattr(mod, name, None)
        if isinstance(cls, type):
            return cls
    return None


def serves_importable_te() -> bool:
    """Whether the ``transformer_engine`` that ``import`` would find is one of these folders
    (not a real TE): this process's parent imported TE's Python from it, and a spawned rank
    inherits the parent's ``sys.path`` but not the finder that emulates the extension."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    home = Path(next(iter(spec.submodule_search_locations))).resolve().parent
    env = os.environ.get(ENV)
    ours = {p.resolve() for p in installed_folders().values()} | ({Path(env).expanduser().resolve()} if env else set())
    return home in ours


def describe() -> str:
    """What serves the TE backend: ``TE 2.20.2, TE's own Python, kernels emulated``."""
    return f"TE {version()}, TE's own Python, kernels emulated"


@contextlib.contextmanager
def installed(version: Optional[str] = None) -> Iterator[Any]:
    """TE's own Python (``version`` or the default folder) for the block: imported (once per
    process), TE's per-process caches cleared (device capability, recipe support) and the
    classes lptrain builds on TE's forgotten, so they are made on this import."""
    from lptrain.precision import te_adapter

    te = load(version)
    clear_caches()
    te_adapter.forget_te_classes()
    _fp8_state_manager().reset()  # TE's global FP8 state: nothing left over from another run
    try:
        yield te
    finally:
        clear_caches()
        te_adapter.forget_te_classes()


__all__ = [
    "ENV",
    "HOW_TO_GET",
    "MATRIX",
    "ROOT",
    "TEPythonMissing",
    "default_release",
    "describe",
    "folder",
    "installed",
    "installed_folders",
    "load",
    "serves_importable_te",
    "te_class",
    "version",
]
