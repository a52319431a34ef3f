"""``prepare-data``: read inputs, tokenize on worker threads, write an indexed dataset.

Documents are read in order in the main thread and grouped into chunks of about
``chunk_bytes`` of text. ``workers`` threads each take a whole chunk: tokenize it (the
``tokenizers`` Rust code runs without the GIL, single-threaded per call, so ``N`` threads
are ``N`` cores and no more), then pack its ids with an EOS after each document into one
buffer of the storage dtype (numpy, also mostly without the GIL). The main thread consumes
the packed chunks in submission order -- so the dataset does not depend on the worker count
-- checksums them and writes them (both on the buffer in place, without the GIL), while the
workers tokenize the next chunks. ``workers=1`` does it all in this thread, one step after
the other. A rich progress bar shows source MB and MB/s.

Why threads: worker processes have to ship every document's text to the worker and its ids
back (pickled), which costs about what byte-level tokenization itself costs, and the
``tokenizers`` thread pool works one call at a time (reading and writing wait for it) at a
size fixed when it first starts; threads calling single-threaded encodes overlap all of it
and honour the exact worker count. ``bench/data.py`` measures the result against
``tokenizers``' own ``encode_batch``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lptrain.data.errors import DataError
from lptrain.data.indexed import IndexedDatasetWriter, PackedDocuments, pack_documents
from lptrain.data.sources import DEFAULT_GLOBS, ReadStats, discover_files, iter_documents
from lptrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from lptrain.errors import OutputDirError


@dataclass
class PrepareReport:
    """Outcome of one preparation: where it went, what it holds, what was wrong with the input."""

    prefix: str
    header: dict[str, Any]
    stats: ReadStats
    seconds: float = 0.0
    tokenizer_path: str | None = None
    warnings: list[str] = field(default_factory=list)
    workers: int = 1

    @property
    def mb_per_s(self) -> float:
        return self.stats.bytes_read / 1e6 / max(self.seconds, 1e-9)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int | None) -> int:
    """``None`` or 0 -> every available CPU; otherwise ``workers`` (at least 1)."""
    if workers is None or workers == 0:
        return available_cpus()
    if workers < 0:
        raise DataError(f"--workers {workers} must be >= 1 (or 0 for every CPU)")
    return workers


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` while preparing: ``tokenizers`` reads it per call, so
    each encode runs on its calling thread and the worker threads are the parallelism."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


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


class _NoProgress:
    """What ``transfer_progress`` gives when disabled: no rich import, no terminal work."""

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, task: int, amount: float) -> None:
        return None


def transfer_progress(enabled: bool) -> Any:
    """A rich bar of bytes done and MB/s (prepare-data, export), or a silent stand-in."""
    if not enabled:
        return _NoProgress()
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
        transient=False,
    )


def prepare_dataset(
    inputs: Sequence[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    tokenizer: str = "byte",
    *,
    train_tokenizer: str | None = None,
    vocab_size: int | None = None,
    workers: int | None = 1,
    text_key: str = "text",
    globs: Sequence[str] = DEFAULT_GLOBS,
    skip_bad_lines: bool = False,
    files: Sequence[Path] | None = None,
    extra: dict[str, Any] | None = None,
    progress: bool = False,
    chunk_bytes: int = 1 << 18,
) -> PrepareReport:
    """Tokenize ``inputs`` (or the explicit ``files``) into ``output_prefix``.{bin,idx} with
    ``workers`` threads (``None``/0: every available CPU)."""
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
    stats = ReadStats()
    total_bytes = sum(f.stat().st_size for f in file_list)
    writer = IndexedDatasetWriter(
        prefix=prefix,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer={"name": tok.name, "sha256": tok.sha256},
        extra=dict(extra or {}),
    )
    workers = resolve_workers(workers)

    def encode(texts: list[str]) -> PackedDocuments:
        return pack_documents(tok.encode_batch(texts), writer.eos_id, writer.dtype, writer.vocab_size)

    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_single_threaded_tokenizers())
            pool = stack.enter_context(ThreadPoolExecutor(workers)) if workers > 1 else None
            chunks = _chunks(iter_documents(file_list, text_key, skip_bad_lines, stats), chunk_bytes)
            if pool is not None:  # read ahead on a thread of its own (file reads drop the GIL)
                chunks = stack.enter_context(_read_ahead(chunks, 2 * workers))
            results = _in_order(pool, encode, chunks, 2 * workers)
            with transfer_progress(progress) as bar:
                task = bar.add_task(f"tokenizing -> {Path(prefix).name}", total=total_bytes)
                for packed, src in results:
                    writer.add_packed(packed)
                    bar.advance(task, src)
        header = writer.finalize()
    except BaseException:
        writer.abort()
        raise
    report = PrepareReport(prefix, header, stats, time.perf_counter() - t0, tok_path, workers=workers)
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


_DONE = object()


@contextlib.contextmanager
def _read_ahead(items: Iterator[Any], depth: int) -> Iterator[Iterator[Any]]:
    """``items`` produced on a background thread, at most ``depth`` ahead; an exception
    there is raised here, and leaving early stops the thread."""
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, which raises it
            put(e)

    def consume() -> Iterator[Any]:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    thread = threading.Thread(target=produce, name="prepare-data-reader", daemon=True)
    thread.start()
    try:
        yield consume()
    finally:
        stop.set()
        thread.join()


def _in_order(
    pool: ThreadPoolExecutor | None,
    encode: Callable[[list[str]], PackedDocuments],
    chunks: Iterator[tuple[list[str], int]],
    depth: int,
) -> Iterator[tuple[PackedDocuments, int]]:
    """``encode`` of every chunk in chunk order, at most ``depth`` chunks in flight (bounded
    memory); inline without a pool."""
    if pool is None:
        for texts, src in chunks:
            yield encode(texts), src
        return
    inflight: list[tuple[Future[PackedDocuments], int]] = []
    try:
        for texts, src in chunks:
            inflight.append((pool.submit(encode, texts), src))
            if len(inflight) >= depth:
                fut, s = inflight.pop(0)
                yield fut.result(), s
        for fut, s in inflight:
            yield fut.result(), s
    finally:
        for fut, _ in inflight:
            fut.cancel()


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
