"""The one exception type of the data pipeline.

Every bad input (missing file, invalid JSONL, corrupt index, token ids beyond the model's
vocabulary, ...) raises :class:`DataError` with a message that names the offending path,
line or dataset, so a wrong dataset is never used silently.
"""

from __future__ import annotations


class DataError(Exception):
    """Invalid data input, dataset or index; the message says what and where."""
