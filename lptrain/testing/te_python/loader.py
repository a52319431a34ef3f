"""Import Transformer Engine's own Python layer from a folder, with its extension emulated.

TE's ``transformer_engine.common`` loads the core CUDA library (``libtransformer_engine.so``)
and its dependencies (cuDNN, NVRTC, cuRAND, ...) at import, and
``transformer_engine.pytorch`` calls ``load_framework_extension("torch")`` to load the
compiled ``transformer_engine_torch`` extension. Neither exists on a CPU. This loader imports
TE's files unchanged from disk except for that one step: a :class:`sys.meta_path` finder
serves ``transformer_engine.common`` with its module-level library-loading block left out
(the top-level ``if`` that calls ``_load_core_library``, found in the parsed source, so no
file is edited and no line number is assumed) and with ``load_framework_extension`` replaced
by one that registers the emulated extension (:mod:`.extension`) as
``transformer_engine_torch``. Every other TE module is TE's own file, run as is.

One TE release per process: TE registers torch custom ops and global state at import, which
a second release cannot share. :func:`import_te` caches the first import; a different folder
afterwards raises (run other releases in a subprocess).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Optional

_COMMON = "transformer_engine.common"
_EXTENSION = "transformer_engine_torch"

_loaded: Optional[tuple[Path, str]] = None  # (folder, version) of the TE imported here


def release_of(folder: Path) -> str:
    """The TE release a ``pip install --target`` folder holds (its dist-info)."""
    infos = sorted(folder.glob("transformer_engine-*.dist-info"))
    if not infos or not (folder / "transformer_engine" / "pytorch").is_dir():
        raise FileNotFoundError(
            f"{folder} holds no Transformer Engine Python wheel (transformer_engine/pytorch and "
            "transformer_engine-X.Y.Z.dist-info); install one with `pip install --no-deps --target "
            f"{folder} transformer-engine==2.20.2 einops`")
    return infos[-1].name[len("transformer_engine-"):-len(".dist-info")]


def _without_library_loading(source: str, filename: str) -> types.CodeType:
    """``transformer_engine/common/__init__.py`` compiled without its top-level statements
    that load shared libraries (the block calling ``_load_core_library``)."""
    tree = ast.parse(source, filename)

    def loads_libraries(node: ast.stmt) -> bool:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                   and n.func.id in ("_load_core_library", "_load_cudnn", "_load_cuda_library")
                   for n in ast.walk(node))

    kept = [n for n in tree.body
            if not (isinstance(n, (ast.If, ast.Assign, ast.Expr)) and loads_libraries(n))]
    if len(kept) == len(tree.body):
        raise ImportError(f"{filename}: no library-loading block found; this TE release is not "
                          "supported by lptrain.testing.te_python")
    tree.body = kept
    return compile(tree, filename, "exec")


class _CommonLoader(importlib.abc.Loader):
    """Runs TE's ``transformer_engine.common`` without its library loading (module doc)."""

    def __init__(self, path: str, version: str) -> None:
        self.path, self.version = path, version

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        code = _without_library_loading(Path(self.path).read_text(), self.path)
        module.__builtins__ = _TE_BUILTINS  # type: ignore[attr-defined]
        exec(code, module.__dict__)
        version = self.version

        @functools.cache
        def load_framework_extension(framework: str) -> None:
            """lptrain: register the emulated ``transformer_engine_torch`` (no shared object)."""
            if framework != "torch":
                raise FileNotFoundError("Could not find shared object file for Transformer Engine "
                                        f"{framework} lib (only the torch extension is emulated)")
            from .extension import build

            sys.modules[_EXTENSION] = build(version)

        module.load_framework_extension = load_framework_extension


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, folder: Path, version: str) -> None:
        self.folder, self.version = folder, version

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == _COMMON:
            origin = str(self.folder / "transformer_engine" / "common" / "__init__.py")
            spec = importlib.util.spec_from_file_location(
                fullname, origin, loader=_CommonLoader(origin, self.version),
                submodule_search_locations=[str(Path(origin).parent)])
            return spec
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            spec = importlib.machinery.PathFinder.find_spec(
                fullname, [str(self.folder)] if path is None else path)
            if spec is not None and spec.loader is not None:
                spec.loader = _TELoader(spec.loader)
            return spec
        if fullname == _EXTENSION:
            raise ImportError(f"{_EXTENSION} is registered by transformer_engine.pytorch's import "
                              "(lptrain.testing.te_python emulates it)")
        return None


class _Absent(types.ModuleType):
    """A placeholder for a GPU-side dependency TE imports at module level but lptrain's paths
    never run: ``onnx`` / ``onnxscript`` (TE declares its ONNX export ops with them) and
    ``triton`` (TE's Triton kernels: padding, permutation, cross entropy, grouped dbias). Any
    attribute or call gives another placeholder, so the declarations import; a function
    decorated by it (``@triton.jit``, ``@triton.autotune(...)``) becomes a kernel whose launch
    raises :class:`~.extension.NotEmulatedError` naming it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and (isinstance(args[0], (types.FunctionType, _Kernel))):
            return _Kernel(args[0])
        return _Absent(f"{self.__name__}()")


class _Kernel:
    """A Triton kernel of TE's on a machine without Triton: launching it raises."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn.fn if isinstance(fn, _Kernel) else fn
        self.__name__ = getattr(self.fn, "__name__", "kernel")

    def __getitem__(self, grid: Any) -> Any:
        from .extension import NotEmulatedError

        def launch(*args: Any, **kwargs: Any) -> None:
            raise NotEmulatedError(f"TE's Triton kernel {self.fn.__module__}.{self.__name__} is not "
                                   "emulated by lptrain.testing.te_python")

        return launch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self[None](*args, **kwargs)


_ABSENT = ("onnx", "onnxscript", "triton")


@functools.cache
def _placeholder(name: str) -> Optional[_Absent]:
    """The placeholder for top-level package ``name`` where it is absent (else None)."""
    if name not in _ABSENT or importlib.util.find_spec(name) is not None:
        return None
    mod = _Absent(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__version__ = "0.0.0"  # (version gates on it take their oldest branch)
    return mod


def _te_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    """TE's modules' ``__import__``: the usual one, except that an absent GPU-side dependency
    (``_ABSENT``) resolves to its placeholder -- for TE's modules only, so torch and the rest
    of the process still see it absent."""
    if level == 0:
        stand_in = _placeholder(name.split(".")[0])
        if stand_in is not None:
            return stand_in
    return builtins.__import__(name, globals, locals, fromlist, level)


_TE_BUILTINS = {**vars(builtins), "__import__": _te_import}


class _TELoader(importlib.abc.Loader):
    """Runs one of TE's own modules from its file, with :func:`_te_import` as its import."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__builtins__ = _TE_BUILTINS  # type: ignore[attr-defined]
        self.inner.exec_module(module)

    def get_code(self, fullname: str) -> Any:
        return self.inner.get_code(fullname)

    def get_source(self, fullname: str) -> Any:
        return self.inner.get_source(fullname)


def _clear_foreign() -> None:
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")
                 or n == _EXTENSION]:
        del sys.modules[name]


def import_te(folder: Path) -> types.ModuleType:
    """Import ``transformer_engine.pytorch`` from ``folder`` (a ``pip install --target``
    folder of TE's Python wheel) with the extension emulated; cached for the process."""
    global _loaded
    folder = folder.resolve()
    version = release_of(folder)
    if _loaded is not None:
        if _loaded[0] != folder:
            raise RuntimeError(
                f"TE {_loaded[1]} from {_loaded[0]} is already imported in this process; one TE "
                f"release per process (run {version} in a subprocess)")
        return sys.modules["transformer_engine.pytorch"]
    _clear_foreign()
    sys.path.insert(0, str(folder))
    sys.meta_path.insert(0, _Finder(folder, version))
    os.environ.setdefault("NVTE_FRAMEWORK", "pytorch")  # TE then re-raises a broken import
    importlib.invalidate_caches()
    try:
        import transformer_engine.pytorch as te
    except BaseException:
        _clear_foreign()
        raise
    _loaded = (folder, version)
    return te


def loaded() -> Optional[tuple[Path, str]]:
    """(folder, release) of the TE imported in this process, or None."""
    return _loaded


def clear_caches() -> None:
    """Clear TE's ``functools`` caches (device capability, cuBLASLt version, recipe support...):
    TE computes them once per process on a GPU; a virtual GPU of another capability must not
    see the last one's answers."""
    for name, mod in list(sys.modules.items()):
        if not (name.startswith("transformer_engine.") and isinstance(mod, types.ModuleType)):
            continue
        for value in list(vars(mod).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and getattr(value, "__module__", "") == name:
                clear()


__all__ = ["clear_caches", "import_te", "loaded", "release_of"]

