"""Recipe composition: defaults fragments -> recipe values -> ``key=value`` overrides.

A recipe (``recipes/<name>.yaml``) is a YAML mapping with up to three kinds of content:

* ``defaults:`` an ordered list of one-key mappings. ``- model: tiny`` merges
  ``configs/model/tiny.yaml`` into the ``model`` section (``- model/moe: small`` into
  ``model.moe``); ``- recipe: mxfp8_muon`` merges a whole other recipe (its own defaults,
  values and ``meta``) at the root, which is how ``*_cpu`` siblings reuse a cluster recipe.
* ``meta:`` facts about the recipe that are not run settings: ``target`` (the hardware it is
  written for: cpu, sm89, sm90, sm100) and ``description``. It is kept out of the schema on
  purpose; ``validate-config`` uses ``meta.target`` when ``--target`` is not given.
* every other top-level key is a schema section (``model``, ``precision``, ...).

Later layers win: fragments in list order, then the recipe's own values, then the
command-line overrides. Each layer is checked against the schema *before* it is merged, so
an unknown key or a wrong type is reported with the file, the line and the dotted key
(and for unknown keys the closest valid key). Merging is done by OmegaConf on
``OmegaConf.structured(LPTrainConfig)`` in struct mode, which also gives ``${a.b}``
interpolation. Every unreadable input raises :class:`ConfigError`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lptrain.config.errors import ConfigError
from lptrain.config.schema import LPTrainConfig
from lptrain.config.yaml_files import MAX_YAML_CHARS, check_length, load_bounded, short_repr
from lptrain.config.yaml_files import first_line as _first_line
from lptrain.config.yaml_files import read_yaml as _read_yaml

KNOWN_TARGETS: tuple[str, ...] = ("cpu", "sm89", "sm90", "sm100")
DEFAULT_RECIPE = "tiny_cpu.yaml"
_META_KEYS = ("target", "description")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|\.inf)|nan")


def repo_root() -> Path:
    """The checkout that holds the package (``recipes/`` and ``configs/`` live next to it)."""
    import lptrain

    return Path(lptrain.__file__).resolve().parents[1]


def package_dir() -> Path:
    """The installed package folder (holds ``_recipes``/``_configs`` in a built wheel)."""
    import lptrain

    return Path(lptrain.__file__).resolve().parent


@dataclass(frozen=True)
class RecipeMeta:
    """Non-schema facts about a recipe (the ``meta:`` section)."""

    target: Optional[str] = None
    description: str = ""


@dataclass
class Composed:
    """The result of composing one recipe: the typed config plus where it came from."""

    cfg: LPTrainConfig
    meta: RecipeMeta
    recipe_path: Optional[Path]
    sources: list[str] = field(default_factory=list)
    # The layers in merge order (fragments, recipe values, overrides): which one set a key
    # (lptrain.config.layers).
    layers: list[_Layer] = field(default_factory=list, repr=False)


@dataclass
class _Layer:
    """One mapping to merge, with its origin for error messages."""

    data: dict[str, Any]
    source: str
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> 1-based line


# --------------------------------------------------------------------------- schema view


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type (a dataclass type for nested sections)."""
    hints = _hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@lru_cache(maxsize=1)
def all_keys() -> tuple[str, ...]:
    """Every valid dotted key: sections and leaves, in declaration order."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _section_fields(cls).items():
            key = prefix + name
            out.append(key)
            if dataclasses.is_dataclass(tp):
                walk(tp, key + ".")

    walk(LPTrainConfig, "")
    return tuple(out)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(inner)}"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return getattr(tp, "__name__", str(tp))


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _type_ok(value: Any, tp: Any) -> bool:
    """Strict scalar typing: no ``"yes"`` for a bool, no ``1.5`` or ``true`` for an int."""
    if _is_interpolation(value):
        return True  # checked by OmegaConf once resolved
    origin = typing.get_origin(tp)
    if origin is Union:
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if tp is Any:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        # PyYAML reads 1e-3 (no dot) as a string; accept it like any YAML 1.2 parser would.
        if isinstance(value, str):
            return _FLOAT_RE.fullmatch(value.strip()) is not None
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return isinstance(value, tp)


def _where(source: str, lines: dict[str, int], key: str) -> str:
    line = lines.get(key)
    return f"{source}:{line}" if line else source


def suggest_key(key: str) -> Optional[str]:
    """The closest valid dotted key to ``key`` (difflib), or None."""
    # An exact leaf name in another section first, then the closest full dotted key (catches
    # typos in the section name too), then the closest leaf name anywhere.
    from lptrain.config.aliases import key_for

    leaf = key.rsplit(".", 1)[-1]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in all_keys()}
    alias = key_for(leaf, all_keys())  # an abbreviation (model.tp) or Megatron-LM's name
    if alias is not None and alias != key:
        return alias
    if leaf in by_leaf:  # the right name in the wrong section
        return by_leaf[leaf]
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    if close:
        return close[0]
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None


def _not_a_key(key: str) -> Optional[str]:
    """For a name that stands for no key at all (``dp``), what stands for it."""
    from lptrain.config.aliases import NOT_KEYS

    note = NOT_KEYS.get(key.rsplit(".", 1)[-1])
    return f"; {note}" if note else None


def _validate(data: Any, cls: type, prefix: str, layer: _Layer) -> None:
    """Raise ConfigError at the first unknown key or wrongly typed value of one layer."""
    if not isinstance(data, dict):
        where = _where(layer.source, layer.lines, prefix.rstrip("."))
        section = prefix.rstrip(".") or "the top level"
        raise ConfigError(
            f"{where}: {section} must be a mapping of keys to values, got {data!r}"
        )
    known = _section_fields(cls)
    for name, value in data.items():
        key = prefix + str(name)
        if name not in known:
            line_key = key
            while isinstance(value, dict) and len(value) >= 1:  # name the full leaf path
                sub, value = next(iter(value.items()))
                key = f"{key}.{sub}"
            hint = suggest_key(key)
            tail = f"; did you mean '{hint}'?" if hint else f"; valid keys here: {', '.join(known)}"
            tail = _not_a_key(key) or tail
            raise ConfigError(
                f"{_where(layer.source, layer.lines, line_key)}: unknown key '{key}'{tail}"
            )
        tp = known[name]
        if dataclasses.is_dataclass(tp):
            _validate(value, tp, key + ".", layer)
        elif not _type_ok(value, tp):
            raise ConfigError(
                f"{_where(layer.source, layer.lines, key)}: {key} expects {_type_name(tp)}, "
                f"got {short_repr(value)} ({type(value).__name__})"
            )
        else:
            check_length(value, key, _where(layer.source, layer.lines, key))


# --------------------------------------------------------------------------- lookup


def recipe_dirs() -> list[Path]:
    """Where bare recipe names are looked up, in order: ./recipes, the repo's recipes/, then
    the copy shipped inside an installed (non-editable) package as ``lptrain/_recipes``."""
    dirs = [Path.cwd() / "recipes", repo_root() / "recipes", package_dir() / "_recipes"]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def available_recipes() -> list[str]:
    names: set[str] = set()
    for d in recipe_dirs():
        if d.is_dir():
            names.update(p.name for p in d.glob("*.yaml"))
    return sorted(names)


def resolve_recipe(name: Union[str, Path], relative_to: Optional[Path] = None) -> Path:
    """A bare name (``mxfp8_muon`` or ``mxfp8_muon.yaml``) is looked up in ``relative_to``
    (for ``- recipe:`` includes), ./recipes and the repo's recipes/; anything with a
    directory part is a path."""
    text = str(name)
    if "/" in text or "\\" in text:
        path = Path(text).expanduser()
        if path.is_file():
            return path
        raise ConfigError(f"recipe file '{text}' not found")
    fname = text if text.endswith((".yaml", ".yml")) else text + ".yaml"
    dirs = ([relative_to] if relative_to is not None else []) + recipe_dirs()
    for d in dirs:
        if (d / fname).is_file():
            return d / fname
    looked = ", ".join(str(d) for d in dict.fromkeys(dirs))
    avail = ", ".join(available_recipes()) or "none"
    raise ConfigError(f"recipe '{text}' not found (looked in {looked}); available: {avail}")


def _fragment_path(group: str, name: str, recipe_dir: Path) -> Path:
    fname = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    roots = [
        recipe_dir.parent / "configs",
        recipe_dir.parent / "_configs",
        Path.cwd() / "configs",
        repo_root() / "configs",
        package_dir() / "_configs",
    ]
    roots = list(dict.fromkeys(r.resolve() for r in roots))
    for root in roots:
        path = root / group / fname
        if path.is_file():
            return path
    looked = ", ".join(str(r / group) for r in roots)
    raise ConfigError(f"config fragment '{group}: {name}' not found (looked in {looked})")


# --------------------------------------------------------------------------- composition


def _meta_from(raw: Any, source: str, lines: dict[str, int]) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{_where(source, lines, 'meta')}: meta must be a mapping")
    for k, v in raw.items():
        if k not in _META_KEYS:
            close = difflib.get_close_matches(str(k), _META_KEYS, n=1)
            hint = f"; did you mean 'meta.{close[0]}'?" if close else ""
            raise ConfigError(f"{_where(source, lines, f'meta.{k}')}: unknown key 'meta.{k}'{hint}")
        if k == "target" and v is not None and v not in KNOWN_TARGETS:
            raise ConfigError(
                f"{_where(source, lines, 'meta.target')}: meta.target must be one of "
                f"{', '.join(KNOWN_TARGETS)}, got {v!r}"
            )
        if k == "description" and not isinstance(v, str):
            raise ConfigError(f"{_where(source, lines, 'meta.description')}: must be a string")
    return dict(raw)


def _expand(path: Path, stack: tuple[Path, ...]) -> tuple[list[_Layer], dict[str, Any]]:
    """All layers of one recipe file (includes first, own values last) and its merged meta."""
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(p.name for p in (*stack, path))
        raise ConfigError(f"{path}: recipe includes itself ({chain})")
    data, lines = _read_yaml(path)
    source = str(path)
    defaults = data.pop("defaults", None) or []
    meta: dict[str, Any] = {}
    layers: list[_Layer] = []
    if not isinstance(defaults, list):
        raise ConfigError(f"{_where(source, lines, 'defaults')}: defaults must be a list")
    for entry in defaults:
        if not (isinstance(entry, dict) and len(entry) == 1):
            raise ConfigError(
                f"{_where(source, lines, 'defaults')}: each defaults entry must be one "
                f"'group: name' pair (e.g. '- model: tiny'), got {entry!r}"
            )
        ((group, name),) = entry.items()
        group, name = str(group), str(name)
        if group == "recipe":
            sub_layers, sub_meta = _expand(resolve_recipe(name, path.parent), (*stack, path))
            layers.extend(sub_layers)
            meta.update(sub_meta)
            continue
        frag = _fragment_path(group, name, path.parent)
        frag_data, frag_lines = _read_yaml(frag)
        keys = [k for k in group.replace("/", ".").split(".") if k]
        prefix = ".".join(keys) + "."
        wrapped: dict[str, Any] = frag_data
        for k in reversed(keys):
            wrapped = {k: wrapped}
        layers.append(
            _Layer(wrapped, str(frag), {prefix + k: v for k, v in frag_lines.items()})
        )
    meta.update(_meta_from(data.pop("meta", None), source, lines))
    layers.append(_Layer(data, source, lines))
    return layers, meta


def parse_overrides(overrides: Iterable[str]) -> tuple[_Layer, dict[str, Any]]:
    """``key=value`` strings -> one layer (values parsed as YAML scalars) and meta overrides.

    For string-typed fields the raw text is kept (``run.name=123`` is the string "123").
    """
    data: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    source = "command-line override"
    for item in overrides:
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{source} {item!a}: not valid UTF-8 text") from None
        if "=" not in item:
            raise ConfigError(f"{source} {short_repr(item)}: expected key=value (e.g. model.num_layers=4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"{source} {short_repr(item)}: empty key")
        if len(raw) > MAX_YAML_CHARS:  # refused before YAML parses it
            check_length(raw, key, source)
        try:
            value = load_bounded(raw, f"{source} '{key}'") if raw.strip() else None
        except (yaml.YAMLError, ValueError, RecursionError, OverflowError):
            value = raw  # not YAML: kept as text (a type error names it if text is wrong)
        if key.startswith("meta."):
            meta[key[5:]] = value
            continue
        tp = _leaf_type(key)
        if tp is not None and _accepts_str(tp) and isinstance(value, (bool, int, float)):
            value = raw
        parts = key.split(".")
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{source} '{item}': '{p}' is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return _Layer(data, source), _meta_from(meta, source, {}) if meta else {}


def _leaf_type(key: str) -> Any:
    cls: Any = LPTrainConfig
    tp: Any = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        tp = _section_fields(cls).get(part)
        if tp is None:
            return None
        cls = tp
    return tp


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    return typing.get_origin(tp) is Union and str in typing.get_args(tp)


@lru_cache(maxsize=1)
def _base() -> DictConfig:
    """The schema as a struct-mode OmegaConf tree (built once; ~20 ms), copied per load."""
    base = OmegaConf.structured(LPTrainConfig)
    OmegaConf.set_struct(base, True)
    return base


def load(
    recipe: Union[str, Path, None] = DEFAULT_RECIPE, overrides: Sequence[str] = ()
) -> Composed:
    """Compose ``recipe`` (None = schema defaults only) with ``overrides`` into a typed config."""
    layers: list[_Layer] = []
    meta: dict[str, Any] = {}
    recipe_path: Optional[Path] = None
    if recipe is not None:
        recipe_path = resolve_recipe(recipe)
        layers, meta = _expand(recipe_path, ())
    cli_layer, cli_meta = parse_overrides(overrides)
    layers.append(cli_layer)
    meta.update(cli_meta)

    cfg = merge_layers(layers)
    return Composed(cfg, RecipeMeta(**meta), recipe_path, [layer.source for layer in layers], layers)


def merge_layers(layers: Sequence[_Layer]) -> LPTrainConfig:
    """The typed config of ``layers`` merged in order over the schema defaults (each layer
    checked against the schema first); :class:`ConfigError` on any unreadable value."""
    for layer in layers:
        _validate(layer.data, LPTrainConfig, "", layer)
    try:  # the common case: the layers folded into one mapping, one merge into the schema
        merged = OmegaConf.unsafe_merge(copy.deepcopy(_base()), _folded([layer.data for layer in layers]))
    except OmegaConfBaseException:  # merged again layer by layer, to name the layer at fault
        merged = _merge_each(layers)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        raise ConfigError(
            f"cannot resolve {key or 'config'}: {_first_line(str(e))}"
        ) from None
    assert isinstance(cfg, LPTrainConfig)
    _check_resolved_types(cfg)
    return cfg


def _merge_each(layers: Sequence[_Layer]) -> DictConfig:
    """``layers`` merged one at a time over the schema defaults; :class:`ConfigError` naming
    the first layer (file and line) whose values OmegaConf refuses."""
    merged = copy.deepcopy(_base())
    for layer in layers:
        try:
            # in place: ``merged`` is this call's own copy, and a layer's plain mapping is
            # turned into fresh nodes first (``merge`` deep-copied the whole tree per layer)
            merged = OmegaConf.unsafe_merge(merged, layer.data)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or ""
            where = _where(layer.source, layer.lines, key)
            raise ConfigError(f"{where}: {key + ': ' if key else ''}{_first_line(str(e))}") from None
    return merged


def _folded(mappings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mappings merged in order as OmegaConf merges them: a mapping into a mapping key
    by key, anything else (a value, a list, ``None``) replacing what was there."""
    out: dict[str, Any] = {}
    for m in mappings:
        _fold_into(out, m)
    return out


def _fold_into(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _fold_into(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v) if isinstance(v, (dict, list)) else v


def _check_resolved_types(cfg: Any, prefix: str = "") -> None:
    """Interpolated values are only type-checked once resolved; OmegaConf is lax there."""
    for name, tp in _section_fields(type(cfg)).items():
        value = getattr(cfg, name)
        key = prefix + name
        if dataclasses.is_dataclass(tp):
            _check_resolved_types(value, key + ".")
        elif not _type_ok(value, tp) and not (tp is str or _accepts_str(tp)):
            raise ConfigError(f"{key} expects {_type_name(tp)}, got {short_repr(value)} after interpolation")
        else:
            check_length(value, key, "after interpolation")


def compose(
    recipe: Union[str, Path, None] = DEFAULT_RECIPE, overrides: Sequence[str] = ()
) -> LPTrainConfig:
    """The typed :class:`LPTrainConfig` of ``recipe`` + ``overrides`` (see :func:`load`)."""
    return load(recipe, overrides).cfg


def to_yaml(cfg: LPTrainConfig) -> str:
    """Serialize a (typically derived) config to YAML in schema order."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
