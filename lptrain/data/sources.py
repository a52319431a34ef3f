"""Input discovery and document reading: text files, JSONL (plain, ``.gz``, ``.zst``), parquet,
directories and glob patterns mixing them.

A plain text file is one document; each JSONL line is one document (its ``text_key`` value),
as is each parquet row (its ``text_key`` column; see :mod:`lptrain.data.formats` for the
compressed and columnar readers). Reading happens in the main process in a deterministic
order (inputs in the given order, directory contents and glob matches sorted), so a dataset
is reproducible. Invalid UTF-8 is replaced with U+FFFD
and counted per file (as are lone surrogates that a JSON ``\\ud800`` escape can produce, which
UTF-8 cannot encode); bad JSONL lines raise with file and line number unless skipped.
"""

from __future__ import annotations

import fnmatch
import glob as globbing
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lptrain.data.errors import DataError
from lptrain.data.formats import compressed_lines, parquet_texts

DEFAULT_GLOBS = ("*.txt", "*.md", "*.rst", "*.py", "*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.parquet")
_REPLACEMENT_UTF8 = "\ufffd".encode()
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SNIFF_BYTES = 1 << 16
_MAX_INVALID_UTF8_SHARE = 0.1  # above this share of bad bytes, a file is not text with typos
_BINARY_FIX = ("pass text, Markdown, code, JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or .parquet files "
               "(in a directory, pick them with --glob)")
_GLOB_CHARS = set("*?[")


@dataclass
class ReadStats:
    """What reading found besides documents; reported at the end of ``prepare-data``."""

    files: int = 0
    documents: int = 0
    bytes_read: int = 0
    invalid_utf8: dict[str, int] = field(default_factory=dict)
    bad_lines: list[str] = field(default_factory=list)
    skipped_empty_files: list[str] = field(default_factory=list)
    null_texts: dict[str, int] = field(default_factory=dict)  # parquet rows whose text is null

    @property
    def invalid_utf8_total(self) -> int:
        return sum(self.invalid_utf8.values())


def discover_files(inputs: Sequence[str | os.PathLike[str]], globs: Sequence[str] = DEFAULT_GLOBS) -> list[Path]:
    """Files named directly (must exist and be non-empty), matching files under directories,
    and the files a glob pattern (``data/*.parquet``, ``shards/**/*.jsonl.zst``) matches."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if not p.exists() and _GLOB_CHARS & set(str(item)):
            matched = sorted(Path(m) for m in globbing.glob(str(item), recursive=True) if Path(m).is_file())
            if not matched:
                raise DataError(f"no input files match the pattern {item}")
            out.extend(matched)
        elif p.is_dir():
            found = sorted(
                q
                for q in p.rglob("*")
                if q.is_file() and any(fnmatch.fnmatch(q.name, g) for g in globs)
            )
            if not found:
                raise DataError(f"no input files matching {', '.join(globs)} under directory {p}")
            out.extend(found)
        elif p.is_file():
            if p.stat().st_size == 0:
                raise DataError(f"input file is empty: {p}")
            out.append(p)
        else:
            raise DataError(f"input path not found: {p}")
    if not out:
        raise DataError("no input files given")
    return out


def decode_utf8(raw: bytes, path: str, stats: ReadStats) -> str:
    """UTF-8 text; invalid sequences become U+FFFD and are counted under ``path``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        # Each replacement character not present as valid EF BF BD bytes was an invalid sequence.
        n = text.count("\ufffd") - raw.count(_REPLACEMENT_UTF8)
        stats.invalid_utf8[path] = stats.invalid_utf8.get(path, 0) + n
        return text


def _jsonl_docs(
    path: Path, lines: Iterable[tuple[bytes, int]], text_key: str, skip_bad_lines: bool, stats: ReadStats
) -> Iterator[tuple[str, int]]:
    """``(text, source bytes consumed since the previous yield)`` per good line of
    ``lines`` (``(line bytes, source bytes)`` pairs, streamed)."""
    pending = 0
    for lineno, (line, nbytes) in enumerate(lines, start=1):
        pending += nbytes
        stats.bytes_read += nbytes
        if not line.strip():
            continue
        text = decode_utf8(line, str(path), stats)
        problem: str | None = None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            problem = f"invalid JSON ({exc.msg})"
        else:
            if not isinstance(obj, dict) or text_key not in obj:
                problem = f"no {text_key!r} key"
            elif not isinstance(obj[text_key], str):
                problem = f"{text_key!r} is not a string"
        if problem is not None:
            msg = f"{path}:{lineno}: {problem}"
            if not skip_bad_lines:
                raise DataError(f"bad JSONL line {msg} (use --skip-bad-lines to skip such lines)")
            stats.bad_lines.append(msg)
            continue
        value: str = obj[text_key]
        if "\\u" in text:  # only a JSON escape can produce a lone surrogate (not encodable)
            value, n = _LONE_SURROGATE.subn("\ufffd", value)
            if n:
                stats.invalid_utf8[str(path)] = stats.invalid_utf8.get(str(path), 0) + n
        yield value, pending
        pending = 0
    if pending:
        yield "", pending


def _file_lines(path: Path) -> Iterator[tuple[bytes, int]]:
    with open(path, "rb") as f:
        for line in f:
            yield line, len(line)


def check_not_binary(path: Path, head: bytes) -> None:
    """Refuse a file whose first bytes are not text: a NUL byte (no text format has one) or
    more than 10% invalid UTF-8. Without this a binary file became a dataset of U+FFFD with
    only a warning."""
    head = head[:_SNIFF_BYTES]
    if b"\0" in head:
        raise DataError(f"{path} looks like a binary file (it holds NUL bytes), not text", fix=_BINARY_FIX)
    if not head:
        return
    # "+ 3": a multi-byte character cut at the sniff boundary is not the file's fault.
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - head.count(_REPLACEMENT_UTF8)
    if bad > _MAX_INVALID_UTF8_SHARE * len(head) + 3:
        raise DataError(
            f"{path} looks like a binary file ({bad} invalid UTF-8 sequences in its first "
            f"{len(head)} bytes), not text",
            fix=_BINARY_FIX,
        )


def _read_head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(_SNIFF_BYTES)
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror or e}") from None


Reader = Callable[[Path, str, bool, ReadStats], Iterator[tuple[str, int]]]


def _read_text(path: Path, text_key: str, skip_bad_lines: bool, stats: ReadStats) -> Iterator[tuple[str, int]]:
    """A text file is one document, read whole (once: the binary sniff looks at its head)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror or e}") from None
    check_not_binary(path, raw[:_SNIFF_BYTES])
    stats.bytes_read += len(raw)
    if not raw:
        stats.skipped_empty_files.append(str(path))
        return
    yield decode_utf8(raw, str(path), stats), len(raw)


def _read_jsonl(path: Path, text_key: str, skip_bad_lines: bool, stats: ReadStats) -> Iterator[tuple[str, int]]:
    check_not_binary(path, _read_head(path))
    return _jsonl_docs(path, _file_lines(path), text_key, skip_bad_lines, stats)


def _compressed_jsonl(kind: str) -> Reader:
    def read(path: Path, text_key: str, skip_bad_lines: bool, stats: ReadStats) -> Iterator[tuple[str, int]]:
        return _jsonl_docs(path, compressed_lines(path, kind), text_key, skip_bad_lines, stats)

    return read


def _read_parquet(path: Path, text_key: str, skip_bad_lines: bool, stats: ReadStats) -> Iterator[tuple[str, int]]:
    for texts, nbytes in parquet_texts(path, text_key):
        for text in texts:
            if text is None:
                stats.null_texts[str(path)] = stats.null_texts.get(str(path), 0) + 1
                continue
            yield text, 0
        if nbytes:
            stats.bytes_read += nbytes
            yield "", nbytes


# Longest suffix first: a name ending in .jsonl.gz is compressed JSONL, not text.
READERS: tuple[tuple[str, Reader], ...] = (
    (".jsonl.gz", _compressed_jsonl("gzip")),
    (".jsonl.zst", _compressed_jsonl("zstd")),
    (".jsonl", _read_jsonl),
    (".parquet", _read_parquet),
)


def reader_for(path: Path) -> Reader:
    """The document reader of ``path`` by its name (plain text when no suffix matches)."""
    return next((r for suffix, r in READERS if path.name.endswith(suffix)), _read_text)


def iter_documents(
    files: Sequence[Path],
    text_key: str = "text",
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, int]]:
    """Yield ``(document_text, source_bytes_consumed)``; the byte count drives the progress bar.

    A text file is read whole (it is one document); JSONL and parquet are streamed.
    """
    stats = stats if stats is not None else ReadStats()
    for path in files:
        if not path.is_file():
            raise DataError(f"input path not found: {path}")
        stats.files += 1
        for doc, nbytes in reader_for(path)(path, text_key, skip_bad_lines, stats):
            if doc:
                stats.documents += 1
            yield doc, nbytes
