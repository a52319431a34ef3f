"""Input discovery and document reading: text files, directories and JSONL.

A plain text file is one document; each JSONL line is one document (its ``text_key`` value).
Reading happens in the main process in a deterministic order (inputs in the given order,
directory contents sorted), so a dataset is reproducible. Invalid UTF-8 is replaced with U+FFFD
and counted per file (as are lone surrogates that a JSON ``\\ud800`` escape can produce, which
UTF-8 cannot encode); bad JSONL lines raise with file and line number unless skipped.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lptrain.data.errors import DataError

DEFAULT_GLOBS = ("*.txt", "*.md", "*.rst", "*.py", "*.jsonl")
_REPLACEMENT_UTF8 = "\ufffd".encode()
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SNIFF_BYTES = 1 << 16
_MAX_INVALID_UTF8_SHARE = 0.1  # above this share of bad bytes, a file is not text with typos
_BINARY_FIX = "pass text, Markdown, code or JSONL files (in a directory, pick them with --glob)"


@dataclass
class ReadStats:
    """What reading found besides documents; reported at the end of ``prepare-data``."""

    files: int = 0
    documents: int = 0
    bytes_read: int = 0
    invalid_utf8: dict[str, int] = field(default_factory=dict)
    bad_lines: list[str] = field(default_factory=list)
    skipped_empty_files: list[str] = field(default_factory=list)

    @property
    def invalid_utf8_total(self) -> int:
        return sum(self.invalid_utf8.values())


def discover_files(inputs: Sequence[str | os.PathLike[str]], globs: Sequence[str] = DEFAULT_GLOBS) -> list[Path]:
    """Files named directly (must exist and be non-empty) plus matching files under directories."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
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
    path: Path, text_key: str, skip_bad_lines: bool, stats: ReadStats
) -> Iterator[tuple[str, int]]:
    """``(text, bytes consumed since the previous yield)`` per good line, streamed line by line."""
    pending = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            pending += len(line)
            stats.bytes_read += len(line)
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


def iter_documents(
    files: Sequence[Path],
    text_key: str = "text",
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, int]]:
    """Yield ``(document_text, source_bytes_consumed)``; the byte count drives the progress bar.

    A text file is read whole (it is one document); JSONL is streamed line by line.
    """
    stats = stats if stats is not None else ReadStats()
    for path in files:
        if not path.is_file():
            raise DataError(f"input path not found: {path}")
        stats.files += 1
        check_not_binary(path, _read_head(path))
        if path.suffix == ".jsonl":
            for doc, nbytes in _jsonl_docs(path, text_key, skip_bad_lines, stats):
                if doc:
                    stats.documents += 1
                yield doc, nbytes
            continue
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read input {path}: {e.strerror or e}") from None
        stats.bytes_read += len(raw)
        if not raw:
            stats.skipped_empty_files.append(str(path))
            continue
        stats.documents += 1
        yield decode_utf8(raw, str(path), stats), len(raw)
