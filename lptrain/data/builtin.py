"""Offline built-in corpora, prepared on first use into a cache and reused afterwards.

``python-stdlib``: the ``*.py`` sources of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), without ``site-packages``/``dist-packages``, test suites
(``test``, ``tests``, ``idle_test``), ``__pycache__`` and empty files, in sorted relative-path
order. The corpus is capped at the first ``max_bytes`` (default 32 MB) in that order; CPython
3.11's non-test stdlib is about 14 MB, so the cap normally keeps everything. The cached dataset
carries an identity (corpus name, interpreter version, stdlib path, a fingerprint of the names,
sizes and mtimes of the files the cap keeps, and the tokenizer hash); a changed identity is
another dataset, and one whose index fails verification is prepared again. A file lock serialises concurrent first uses (several ranks).

Cached datasets are content-addressed: the file name carries a hash of the identity
(``python-stdlib-byte-3f9c0a1b2d4e5f60.bin``/``.idx``), so two runs with different caps or
tokenizers on one cache -- ``tiny_cpu`` (2 MB) next to a cluster recipe's ``--dry-run``
(32 MB), or two runs started a second apart -- use two files and never touch each other's.
A name is prepared once, into temp files renamed into place (the index last), and never
replaced while valid: a reader holding it open keeps reading the file it verified. (Before,
the cache was ``{name}-{tokenizer}`` with no cap in the name, and the second run re-prepared
it under the first, which died at its next epoch with "dataset token file ... changed under
the running job".)

The cache folder is ``data.cache_dir`` when set, else ``$LPTRAIN_CACHE_DIR``, else
``$XDG_CACHE_HOME/lptrain``, else ``~/.cache/lptrain``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lptrain.data.errors import DataError
from lptrain.data.indexed import IndexedDataset

BUILTIN_NAMES = ("python-stdlib",)
DEFAULT_MAX_BYTES = 32 * 1000 * 1000
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_cache_dir() -> Path:
    """``$LPTRAIN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/lptrain`` (an absolute
    ``XDG_CACHE_HOME``, as the XDG spec requires), else ``~/.cache/lptrain``."""
    explicit = os.environ.get("LPTRAIN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "lptrain"
    return Path("~/.cache/lptrain").expanduser()


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The capped, sorted list of standard-library sources of this interpreter (walked once
    per process and cap: every run and evaluation of a process asks again)."""
    return list(_stdlib_files(str(Path(sysconfig.get_paths()["stdlib"])), max_bytes))


@functools.lru_cache(maxsize=8)
def _stdlib_files(stdlib: str, max_bytes: int) -> tuple[Path, ...]:
    root = Path(stdlib)
    found: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                p = Path(dirpath) / fn
                size = p.stat().st_size
                if size:
                    found.append((p.relative_to(root).as_posix(), p, size))
    found.sort()
    out: list[Path] = []
    total = 0
    for _, p, size in found:
        if total + size > max_bytes:
            break
        out.append(p)
        total += size
    if not out:
        raise DataError(f"no Python sources found under the standard library at {root}")
    return tuple(out)


def _identity(name: str, files: list[Path], tokenizer_sha: str) -> dict[str, Any]:
    """What the cached dataset is made of (the cap only through the files it keeps: two caps
    that keep the same files share one dataset)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return {
        "builtin": name,
        "python": sys.version,
        "stdlib": str(root),
        "files": len(files),
        "files_fingerprint": h.hexdigest(),
        "tokenizer_sha256": tokenizer_sha,
    }


def cache_name(name: str, tag: str, identity: dict[str, Any]) -> str:
    """``{name}-{tag}-{16 hex digits of the identity's sha256}``: one name per content."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return f"{name}-{tag}-{digest}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def builtin_files(name: str, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    if name == "python-stdlib":
        return stdlib_files(max_bytes)
    raise DataError(f"unknown built-in dataset {name!r} (available: {', '.join(BUILTIN_NAMES)})")


def ensure_builtin_dataset(
    name: str = "python-stdlib",
    cache_dir: str | os.PathLike[str] | None = None,
    tokenizer: str = "byte",
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = False,
    workers: int = 1,
) -> str:
    """Index prefix of built-in corpus ``name``, prepared into ``cache_dir`` on first use."""
    from lptrain.data.prepare import prepare_dataset
    from lptrain.data.tokenizer import load_tokenizer

    files = builtin_files(name, max_bytes)
    tok = load_tokenizer(tokenizer)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    tag = "byte" if tok.name == "byte" else tok.sha256[:12]
    identity = _identity(name, files, tok.sha256)
    stem = cache_name(name, tag, identity)
    prefix = str(cache / stem)
    with _file_lock(cache / f".{stem}.lock"):
        try:
            ds = IndexedDataset(prefix, verify=True)
            if ds.header.get("extra", {}).get("identity") == identity:
                return prefix
        except DataError:
            pass
        prepare_dataset(
            [],
            prefix,
            tokenizer,
            files=files,
            extra={"identity": identity},
            progress=progress,
            workers=workers,
        )
    return prefix
