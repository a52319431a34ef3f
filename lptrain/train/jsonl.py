"""The run folder's JSON-lines files (``metrics.jsonl``, ``anomalies.jsonl``), read back.

A kill can leave a torn last line; readers skip it (and any line that is not a step record)
rather than fail on a folder that is otherwise whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def step_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path`` that carry a ``step``, in file order; a line that does not
    parse (a torn last line) is skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out
