"""``prepare-data``: read inputs, tokenize in worker processes, write an indexed dataset.

Documents are read in order in the main process and grouped into chunks of about
``chunk_bytes`` of text; a process pool (``fork`` where available) tokenizes the chunks, whose
results are consumed in submission order (so the output does not depend on the worker count),
and the main process streams the tokens into the temp files of an
:class:`IndexedDatasetWriter`. ``workers=1`` tokenizes in-process, which is fastest for the byte
tokenizer (its encoding is cheaper than shipping text to a worker). A rich progress bar shows
source MB and MB/s.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lptrain.data.errors import DataError
from lptrain.data.indexed import IndexedDatasetWriter
from lptrain.data.sources import DEFAULT_GLOBS, ReadStats, discover_files, iter_documents
from lptrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from lptrain.errors import OutputDirError

_worker_tok: ByteTokenizer | HFTokenizer | None = None


@dataclass
class PrepareReport:
    """Outcome of one preparation: where it went, what it holds, what was wrong with the input."""

    prefix: str
    header: dict[str, Any]
    stats: ReadStats
    seconds: float = 0.0
    tokenizer_path: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.stats.bytes_read / 1e6 / max(self.seconds, 1e-9)


def _mp_context() -> Any:
    """``fork`` where available: workers start in milliseconds and do not re-import ``__main__``
    (a CLI or bench that imports torch); they only run numpy/tokenizers code. Else ``spawn``."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _start_pool(workers: int, spec: str) -> Any:
    """A worker pool; the workers run ``tokenizers`` single-threaded (the pool is the parallelism).

    ``TOKENIZERS_PARALLELISM`` is set only while the workers are forked, so they inherit it (and
    ``tokenizers`` does not warn about a fork after parallel use) while this process keeps its
    own setting.
    """
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return _mp_context().Pool(workers, initializer=_init_worker, initargs=(spec,))
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _init_worker(spec: str) -> None:
    global _worker_tok
    _worker_tok = load_tokenizer(spec)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    assert _worker_tok is not None
    dtype = np.uint16 if _worker_tok.vocab_size <= 1 << 16 else np.uint32  # 4x less IPC than int64
    return [a.astype(dtype, copy=False) for a in _worker_tok.encode_batch(texts)]


def _chunks(docs: Iterator[tuple[str, int]], chunk_bytes: int) -> Iterator[tuple[list[str], int]]:
    texts: list[str] = []
    size = 0
    src = 0
    for text, nbytes in docs:
        src += nbytes
        if text:
            texts.append(text)
            size += len(text)
        if size >= chunk_bytes:
            yield texts, src
            texts, size, src = [], 0, 0
    if texts or src:
        yield texts, src


def _progress(enabled: bool) -> Any:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )


def prepare_dataset(
    inputs: Sequence[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    tokenizer: str = "byte",
    *,
    train_tokenizer: str | None = None,
    vocab_size: int | None = None,
    workers: int = 1,
    text_key: str = "text",
    globs: Sequence[str] = DEFAULT_GLOBS,
    skip_bad_lines: bool = False,
    files: Sequence[Path] | None = None,
    extra: dict[str, Any] | None = None,
    progress: bool = False,
    chunk_bytes: int = 1 << 20,
) -> PrepareReport:
    """Tokenize ``inputs`` (or the explicit ``files``) into ``output_prefix``.{bin,idx}."""
    import time

    t0 = time.perf_counter()
    prefix = str(output_prefix)
    file_list = list(files) if files is not None else discover_files(inputs, globs)
    tok_path: str | None = None
    if train_tokenizer is not None:
        if train_tokenizer != "bpe":
            raise DataError(f"unknown --train-tokenizer {train_tokenizer!r} (supported: bpe)")
        if not vocab_size:
            raise DataError("--train-tokenizer bpe needs --vocab-size N")
        try:
            Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputDirError(
                f"cannot create the output folder of {prefix}: {e.strerror or e}",
                fix="choose a writable --output PREFIX",
            ) from None
        tok_path = f"{prefix}.tokenizer.json"
        train_stats = ReadStats()
        texts = (t for t, _ in iter_documents(file_list, text_key, skip_bad_lines, train_stats) if t)
        tok: ByteTokenizer | HFTokenizer = train_bpe(texts, vocab_size, tok_path)
    else:
        tok = load_tokenizer(tokenizer)
    spec = tok.spec()
    stats = ReadStats()
    total_bytes = sum(f.stat().st_size for f in file_list)
    writer = IndexedDatasetWriter(
        prefix=prefix,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer={"name": tok.name, "sha256": tok.sha256},
        extra=dict(extra or {}),
    )
    pool = None
    try:
        chunks = _chunks(iter_documents(file_list, text_key, skip_bad_lines, stats), chunk_bytes)
        if workers > 1:
            pool = _start_pool(workers, spec)
            results: Iterator[tuple[list[np.ndarray], int]] = _ordered(pool, chunks, workers * 2)
        else:
            results = ((tok.encode_batch(texts), src) for texts, src in chunks)
        with _progress(progress) as bar:
            task = bar.add_task(f"tokenizing -> {Path(prefix).name}", total=total_bytes)
            for encoded, src in results:
                writer.add_documents(encoded)
                bar.advance(task, src)
        header = writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    report = PrepareReport(prefix, header, stats, time.perf_counter() - t0, tok_path)
    if stats.invalid_utf8:
        names = ", ".join(f"{p} ({n})" for p, n in stats.invalid_utf8.items())
        report.warnings.append(
            f"replaced {stats.invalid_utf8_total} invalid UTF-8 sequences with U+FFFD in: {names}"
        )
    if stats.bad_lines:
        report.warnings.append(f"skipped {len(stats.bad_lines)} bad JSONL lines: " + "; ".join(stats.bad_lines))
    if stats.null_texts:
        names = ", ".join(f"{p} ({n})" for p, n in stats.null_texts.items())
        report.warnings.append(f"skipped {sum(stats.null_texts.values())} parquet rows whose text is null in: {names}")
    if stats.skipped_empty_files:
        report.warnings.append(f"skipped {len(stats.skipped_empty_files)} empty files")
    return report


def _ordered(pool: Any, chunks: Iterator[tuple[list[str], int]], depth: int) -> Iterator[tuple[list[np.ndarray], int]]:
    """``imap``-like ordered results with at most ``depth`` chunks in flight (bounded memory)."""
    inflight: list[tuple[Any, int]] = []
    for texts, src in chunks:
        inflight.append((pool.apply_async(_encode_chunk, (texts,)), src))
        if len(inflight) >= depth:
            res, s = inflight.pop(0)
            yield res.get(), s
    for res, s in inflight:
        yield res.get(), s


def print_report(report: PrepareReport, file: Any = None) -> None:
    """Summary lines of a finished preparation (warnings included)."""
    out = file or sys.stdout
    h = report.header
    print(
        f"wrote {report.prefix}.bin/.idx: {h['num_documents']} documents, {h['num_tokens']} tokens "
        f"({h['dtype']}, vocab {h['vocab_size']}, tokenizer {h['tokenizer']['name']}) from "
        f"{report.stats.files} files, {report.stats.bytes_read / 1e6:.2f} MB in {report.seconds:.2f} s "
        f"({report.mb_per_s:.1f} MB/s)",
        file=out,
    )
    if report.tokenizer_path:
        print(f"trained tokenizer saved to {report.tokenizer_path}", file=out)
    for w in report.warnings:
        print(f"warning: {w}", file=out)
