"""Checksums of checkpoint files: what the completion marker records and loading verifies.

Why a checksum and not only the size: a flipped bit or a same-size overwrite (a bad disk, a
stray ``dd``, a copy that went wrong) keeps every size and loads silently, and a run that
resumes from it trains on garbage. xxHash's XXH3 (64 bit) reads at several GB/s on one core,
so hashing costs a small part of a save that writes and ``fsync``s the same bytes
(``bench/checkpoint.py`` measures the ratio).

Files the saving code holds in memory (a rank's local state, ``train_state.json``,
``resolved_config.yaml``) are hashed from those bytes as they are written; DCP's files are
hashed by the rank that wrote them right after DCP returns, while they are still in the page
cache. A marker written before checksums existed (format 1: sizes only) still loads: the
folder cannot be verified, and loading says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import xxhash

ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20


def digest_bytes(data: bytes | memoryview) -> str:
    """Hex digest of bytes held in memory."""
    return xxhash.xxh3_64_hexdigest(data)


def digest_file(path: str | Path) -> str:
    """Hex digest of a file, read in 8 MiB chunks into one reused buffer."""
    h = xxhash.xxh3_64()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def write_bytes_hashed(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path`` (flushed to disk) and return its marker entry."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return entry(len(data), digest_bytes(data))


def entry(size: int, digest: str) -> dict[str, Any]:
    return {"bytes": size, ALGORITHM: digest}


def file_entry(path: Path) -> dict[str, Any]:
    """Marker entry of a file on disk (size and digest read back)."""
    return entry(path.stat().st_size, digest_file(path))


@dataclass
class Listed:
    """One file as the marker lists it: size, and digest when the marker has checksums."""

    size: int
    digest: Optional[str]


def listed_files(marker: dict[str, Any]) -> dict[str, Listed]:
    """The marker's files; format 1 markers (``{name: size}``) have no digests.

    Raises ``TypeError``/``KeyError``/``ValueError`` on a marker of another shape."""
    out: dict[str, Listed] = {}
    for rel, info in marker["files"].items():
        if isinstance(info, bool):
            raise TypeError(rel)
        if isinstance(info, int):
            out[rel] = Listed(info, None)
        else:
            out[rel] = Listed(int(info["bytes"]), str(info[ALGORITHM]))
    return out


def mismatch(folder: Path, rel: str, listed: Listed) -> Optional[str]:
    """Why ``folder/rel`` is not the file the marker lists (None when it is)."""
    p = folder / rel
    if not p.is_file():
        return f"{rel} is missing"
    size = p.stat().st_size
    if size != listed.size:
        return f"{rel} has {size} bytes, expected {listed.size}"
    if listed.digest is not None:
        got = digest_file(p)
        if got != listed.digest:
            return (f"{rel} fails its checksum ({ALGORITHM} {got}, recorded {listed.digest}): "
                    "the file changed after it was written")
    return None
