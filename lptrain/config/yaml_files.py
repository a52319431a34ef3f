"""Reading one recipe or fragment YAML file, refusing what would be silently misread.

Split out of :mod:`lptrain.config.compose`: besides YAML syntax errors (with the line), a
file is refused when its bytes are not UTF-8, when it is empty (it would silently mean "all
defaults"), when a mapping holds the same key twice (PyYAML keeps the last one silently) and
when its aliases expand past :data:`MAX_EXPANDED_NODES` values (an alias bomb kept validation
busy for minutes). Every refusal is a :class:`ConfigError` naming the file and line.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

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


# Values a YAML document may expand to through its aliases (``*name`` repeats the node
# ``&name`` anchors). A recipe is a few hundred; nine levels of aliased lists in 501 bytes are
# 10^9, which the composer shares but every later walk (duplicate check, OmegaConf) expands.
MAX_EXPANDED_NODES = 10_000


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def expanded_size(root: yaml.Node, limit: int = MAX_EXPANDED_NODES) -> int:
    """The number of nodes ``root`` holds with every alias expanded, counted over the shared
    nodes once each (linear in the file), capped at ``limit + 1``; a node that contains itself
    (``&a [*a]``) is infinite, so also ``limit + 1``."""
    size: dict[int, int] = {}
    open_: set[int] = set()  # started, not finished: the current path of the walk
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            size[key] = min(limit + 1, 1 + sum(size[id(c)] for c in _children(node)))
            open_.discard(key)
            continue
        if key in size:
            continue
        open_.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_:
                return limit + 1
            if id(child) not in size:
                stack.append((child, False))
    return size[id(root)]


def load_bounded(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``, refusing (:class:`ConfigError` naming ``where``) a document
    whose aliases expand past :data:`MAX_EXPANDED_NODES` values, before anything expands it."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    check_expansion(node, where)
    return yaml.safe_load(text)


def check_expansion(node: Any, where: str) -> None:
    if node is not None and expanded_size(node) > MAX_EXPANDED_NODES:
        raise ConfigError(
            f"{where}: YAML aliases (*name) expand to more than {MAX_EXPANDED_NODES} values "
            "(an alias bomb, or a node that contains itself); refused before expanding them",
            fix="write the values out, or alias less deeply")


# The longest text any key takes: names, paths (Linux's PATH_MAX), module lists. A 10 MB
# run.name was accepted and echoed into every console line and resolved_config.yaml.
MAX_STRING_CHARS = 4096
# The longest recipe file or override lptrain parses (PyYAML reads about a megabyte a second;
# a recipe is a few kilobytes, a long data.paths list a few hundred).
MAX_YAML_CHARS = 1 << 20


def _too_long(value: Any) -> Optional[int]:
    """The length of the first string in ``value`` (a string or a list of them) longer than
    :data:`MAX_STRING_CHARS`, else None."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str) and len(v) > MAX_STRING_CHARS:
            return len(v)
    return None


def check_length(value: Any, key: str, where: str) -> None:
    """:class:`ConfigError` when a string of ``value`` is longer than :data:`MAX_STRING_CHARS`."""
    n = _too_long(value)
    if n is not None:
        raise ConfigError(f"{where}: {key} is {n} characters long; the limit is {MAX_STRING_CHARS}",
                          fix=f"give {key} a value of at most {MAX_STRING_CHARS} characters")


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to 120 characters for an error line."""
    text = repr(value)
    return text if len(text) <= 120 else text[:100] + f"... ({len(text)} characters)"


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})",
            fix="save the file as UTF-8",
        ) from None


# Parsed files by (path, bytes): a process composing many configs (the planner, the rule
# battery, a test suite) reads the same recipes and fragments again and again; YAML parsing
# and the duplicate-key walk were most of a compose. Keyed by content, so an edited file is
# parsed again; only files that parsed cleanly are kept.
_PARSED: dict[tuple[str, bytes], tuple[dict[str, Any], dict[str, int]]] = {}
_PARSED_MAX = 512


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse one YAML file into (mapping, dotted key -> line); syntax errors name the line.

    Also refused, each naming the file and line: bytes that are not UTF-8, an empty file
    (it would silently mean "all defaults") and a key given twice in one mapping.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) > MAX_YAML_CHARS:
        raise ConfigError(f"{path}: {len(raw)} bytes; a recipe or fragment is read up to "
                          f"{MAX_YAML_CHARS} bytes", fix="split it into fragments, or shorten its values")
    hit = _PARSED.get((str(path), raw))
    if hit is not None:  # the same bytes parse the same: a copy, callers may mutate it
        return copy.deepcopy(hit[0]), dict(hit[1])
    text = _decode(raw, path)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        check_expansion(node, str(path))  # before anything walks the expanded tree
        data = yaml.safe_load(text)
    except ConfigError:
        raise
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
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[(str(path), raw)] = (copy.deepcopy(data), dict(lines))
    return data, lines
