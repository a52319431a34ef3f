"""The one exception type of the data pipeline (an ``InputError``: exit status 2).

Every bad input (missing file, invalid JSONL, corrupt index, token ids beyond the model's
vocabulary, ...) raises :class:`DataError` with a message that names the offending path,
line or dataset, and where there is one the fix, so a wrong dataset is never used silently.
"""

from __future__ import annotations

from lptrain.errors import InputError


class DataError(InputError):
    """Invalid data input, dataset or index; the message says what and where, ``fix`` how."""
