"""Reading one recipe or fragment YAML file, refusing what would be silently misread.

Split out of :mod:`lptrain.config.compose`: besides YAML syntax errors (with the line), a
file is refused when its bytes are not UTF-8, when it is empty (it would silently mean "all
defaults") and when a mapping holds the same key twice (PyYAML keeps the last one silently).
Every refusal is a :class:`ConfigError` naming the file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lptrain.config.errors import ConfigError


def first_line(msg: str) -> str:
    return msg.strip().splitlines()[0] if msg.strip() else "invalid value"


def _line_map(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{prefix}{k.value}"
            out[key] = k.start_mark.line + 1
            _line_map(v, key + ".", out)


def _check_duplicates(node: yaml.Node, prefix: str, path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently; a recipe with both is an error."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(item, prefix, path)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for k, v in node.value:
        name = str(k.value) if isinstance(k, yaml.ScalarNode) else None
        line = k.start_mark.line + 1
        if name is not None:
            if name in seen:
                raise ConfigError(
                    f"{path}:{line}: duplicated key '{prefix}{name}' (first at line {seen[name]}): "
                    "only the last value would be used",
                    fix="keep one of the two",
                )
            seen[name] = line
        _check_duplicates(v, f"{prefix}{name}." if name is not None else prefix, path)


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})",
            fix="save the file as UTF-8",
        ) from None


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse one YAML file into (mapping, dotted key -> line); syntax errors name the line.

    Also refused, each naming the file and line: bytes that are not UTF-8, an empty file
    (it would silently mean "all defaults") and a key given twice in one mapping.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    text = _decode(raw, path)
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
    except (ValueError, RecursionError, OverflowError) as e:  # e.g. a 5000-digit integer
        raise ConfigError(f"{path}: cannot parse a value: {first_line(str(e))}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = e.problem or e.context or "invalid YAML"
        ctx = e.context_mark
        if e.problem and e.context and ctx is not None and mark is not None and ctx.line != mark.line:
            problem += f" ({e.context} started at line {ctx.line + 1})"
        raise ConfigError(f"{path}{line}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML syntax error: {e}") from None
    if data is None:
        raise ConfigError(
            f"{path}:1: the file is empty (no settings; it would silently mean all defaults)",
            fix="add settings, or include a recipe with 'defaults: [{recipe: tiny_cpu}]'",
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of sections, got {type(data).__name__}")
    lines: dict[str, int] = {}
    if node is not None:
        _check_duplicates(node, "", path)
        _line_map(node, "", lines)
    return data, lines
