"""The run folder's JSON-lines files (``metrics.jsonl``, ``anomalies.jsonl``), read back.

A kill can leave a torn last line; readers skip it (and any line that is not a step record)
rather than fail on a folder that is otherwise whole. What a kill cannot leave -- a byte that
is not UTF-8 (lptrain writes ASCII), a step that is not an integer, a statistic that is not a
number -- is damage or a hand edit: one :class:`~lptrain.errors.InputError` naming the file and
line (exit 2), never a traceback from the reader that tripped on it (``lptrain compare``,
``numerics``, ``plot``, ``replay``, a resume).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lptrain.errors import InputError

# the step fields readers compute with: a number or null
NUMBER_FIELDS = ("loss", "grad_norm", "lr", "val_loss", "consumed_samples")


def _fix(path: Path, line: int) -> str:
    return (f"restore {path.name} from a copy, or delete line {line} of {path} (that step's "
            "record is then missing)")


def read_lines(path: str | Path) -> list[str]:
    """The lines of ``path``, decoded strictly: a line that is not UTF-8 is an
    :class:`InputError` naming the file and the line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}", file=str(path)) from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        try:
            out.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{i}: byte {line[e.start]:#04x} at column {e.start + 1} is "
                             "not UTF-8 text (the file was damaged or edited)", file=str(path),
                             fix=_fix(path, i)) from None
    return out


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bad_value(rec: dict[str, Any]) -> str | None:
    """What in a step record no reader can use, or None."""
    step = rec["step"]
    if not is_number(step) or (isinstance(step, float) and not (math.isfinite(step) and step == int(step))):
        return f"\"step\" is {json.dumps(step)[:40]}, not an integer"
    for key in NUMBER_FIELDS:
        if rec.get(key) is not None and not is_number(rec[key]):
            return f"\"{key}\" is {json.dumps(rec[key])[:40]}, not a number"
    lrs = rec.get("lrs")
    if lrs is not None and not (isinstance(lrs, dict) and all(v is None or is_number(v) for v in lrs.values())):
        return f"\"lrs\" is {json.dumps(lrs)[:40]}, not a mapping of param groups to numbers"
    stats = rec.get("numerics")
    if stats is None:
        return None
    if not isinstance(stats, dict):
        return f"\"numerics\" is {json.dumps(stats)[:40]}, not a mapping of operands"
    for op, values in stats.items():
        if values is None:
            continue
        if not isinstance(values, dict):
            return f"\"numerics\" of {op[:60]!r} is {json.dumps(values)[:40]}, not a mapping of statistics"
        for stat, v in values.items():
            if v is not None and not is_number(v):
                return (f"\"numerics\" of {op[:60]!r}: {stat[:40]!r} is {json.dumps(v)[:40]}, "
                        "not a number")
    return None


def step_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path`` that carry a ``step``, in file order, with ``step`` as an
    int; a line that does not parse (a torn last line) is skipped, one that parses with values
    no reader can use is an :class:`InputError` naming the file and line."""
    path = Path(path)
    out = []
    for i, line in enumerate(read_lines(path), 1):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not (isinstance(rec, dict) and "step" in rec):
            continue
        bad = _bad_value(rec)
        if bad is not None:
            raise InputError(f"{path}:{i}: {bad}", file=str(path), fix=_fix(path, i))
        rec["step"] = int(rec["step"])
        out.append(rec)
    return out
