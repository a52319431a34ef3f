"""Input formats beyond plain text and JSONL: ``.jsonl.gz``, ``.jsonl.zst`` and ``.parquet``.

The open pretraining corpora (FineWeb, DCLM, The Stack v2, SlimPajama, ...) ship in these.
Everything is streamed, never a whole file in memory:

* compressed JSONL is decompressed in 1 MiB blocks (``zlib`` for gzip, ``zstandard`` for
  zstd; concatenated members/frames are read through) and split into lines, each line then
  parsed as plain JSONL is. A corrupt stream is reported with the file and the compressed
  byte offset at which the decoder failed (found by re-feeding the failing block byte by
  byte), a truncated one with the offset where it ends;
* parquet is read one row group at a time, only the ``--text-key`` column, in record
  batches; a missing column or one that is not a string column is one line naming the file,
  the column and the columns it does have.

``pyarrow`` and ``zstandard`` are optional (the ``data`` extra); a missing one is one line
naming the extra. Byte counts given back are bytes of the file on disk, so the progress bar
(whose total is the sum of file sizes) ends at 100%.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lptrain.data.errors import DataError

BLOCK = 1 << 20
_EXTRA = "install it with `pip install 'lptrain[data]'`"


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:
        raise DataError(f"reading .zst files needs the zstandard package; {_EXTRA}") from None
    return zstandard


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading .parquet files needs the pyarrow package; {_EXTRA}") from None
    return pq


class _Decoder:
    """One decompression stream that reads across concatenated gzip members / zstd frames."""

    def __init__(self, new: Callable[[], Any], errors: tuple[type[BaseException], ...]) -> None:
        self._new = new
        self.errors = errors
        self.d = new()

    def feed(self, data: bytes) -> bytes:
        out = self.d.decompress(data)
        while self.d.eof and self.d.unused_data:
            rest = self.d.unused_data
            self.d = self._new()
            out += self.d.decompress(rest)
        return out

    @property
    def finished(self) -> bool:
        return bool(self.d.eof)


def _gzip_decoder() -> _Decoder:
    return _Decoder(lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), (zlib.error,))


def _zstd_decoder() -> _Decoder:
    zstd = _zstandard()
    return _Decoder(lambda: zstd.ZstdDecompressor().decompressobj(), (zstd.ZstdError,))


DECODERS: dict[str, Callable[[], _Decoder]] = {"gzip": _gzip_decoder, "zstd": _zstd_decoder}


def _failing_offset(path: Path, kind: str, block_start: int, block: bytes) -> int:
    """The exact compressed offset where decoding fails: a fresh decoder gets every byte
    before the failing block (known good), then the block one byte at a time."""
    dec = DECODERS[kind]()
    with open(path, "rb") as f:
        left = block_start
        while left > 0:
            dec.feed(f.read(min(BLOCK, left)))
            left -= min(BLOCK, left)
    for i in range(len(block)):
        try:
            dec.feed(block[i : i + 1])
        except dec.errors:
            return block_start + i
    return block_start + len(block)


def compressed_lines(path: Path, kind: str) -> Iterator[tuple[bytes, int]]:
    """``(line without its newline, compressed bytes consumed since the previous yield)``."""
    dec = DECODERS[kind]()
    offset, pending, tail = 0, 0, b""
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            try:
                data = dec.feed(block)
            except dec.errors as e:
                at = _failing_offset(path, kind, offset, block)
                raise DataError(f"{path}: corrupt {kind} stream at compressed byte offset {at} ({e})",
                                fix="re-download or re-compress the file") from None
            offset += len(block)
            pending += len(block)
            lines = (tail + data).split(b"\n")
            tail = lines.pop()
            for line in lines:
                yield line, pending
                pending = 0
    if not dec.finished:
        raise DataError(f"{path}: the {kind} stream ends at byte {offset} before its end (truncated file?)",
                        fix="re-download or re-compress the file")
    if tail or pending:
        yield tail, pending


def parquet_texts(path: Path, text_key: str, batch_rows: int = 1024) -> Iterator[tuple[list[str | None], int]]:
    """``(texts of one record batch, file bytes consumed)``, one row group at a time, reading
    only the ``text_key`` column; ``None`` for null values."""
    pq = _pyarrow_parquet()
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a non-parquet file
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})",
                        fix="pass parquet, JSONL or text files") from None
    schema = pf.schema_arrow
    if text_key not in schema.names:
        raise DataError(f"{path}: no column {text_key!r} (columns: {', '.join(schema.names)})",
                        fix="name the text column with --text-key")
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda t: False)(kind)):
        raise DataError(f"{path}: column {text_key!r} is {kind}, not a text (string) column",
                        fix="name the text column with --text-key")
    meta = pf.metadata
    col = schema.get_field_index(text_key)
    total, used = path.stat().st_size, 0
    for rg in range(meta.num_row_groups):
        size = meta.row_group(rg).column(col).total_compressed_size
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=[text_key]):
                yield batch.column(0).to_pylist(), 0
        except Exception as e:
            raise DataError(f"{path}: row group {rg} could not be read ({type(e).__name__}: {e})",
                            fix="re-download the file") from None
        yield [], size
        used += size
    yield [], max(0, total - used)
