"""Reading a checkpoint without running code from it: every pickle goes through an allow-list.

Why: a pickle is a program. ``torch.load(..., weights_only=False)`` of a rank's local file, the
plain ``pickle.load`` with which DCP's ``FileSystemReader`` reads ``global/.metadata``, and the
``torch.load(..., weights_only=False)`` with which DCP's default planner reads non-tensor
values each run whatever callable the file names. The completion marker's checksums catch a
flipped bit, not a file crafted with its size and checksum updated: such a file ran a shell
command on resume and on ``lptrain export``.

What lptrain reads, and how (the trust model is in docs/checkpoints.md):

* ``local/rank_NNNNN.pt``: ``torch.load(weights_only=True)`` -- tensors, numbers, strings and
  containers only (the RNG states and sizes lptrain writes there);
* ``global/.metadata``: :class:`RestrictedUnpickler` with DCP's own metadata types
  (:data:`METADATA_TYPES`), nothing else;
* DCP's tensor data: ``torch.load(weights_only=True)`` (DCP's own reader) and its byte items
  (the checkpoint's numbers and strings) the same way (a planner whose ``load_bytes`` reads
  weights-only: :func:`read_global`);
* a Transformer Engine module's extra state (a byte tensor TE itself unpickles in
  ``set_extra_state``): checked first by :func:`check_te_extra_state`, which unpickles it
  here with TE's recipe classes and torch's tensor rebuilders only; a file whose pickle names
  anything else is refused before TE sees it.

A refusal is a :class:`~lptrain.checkpoint.folders.CheckpointError` naming the file and the
global it asked for: the resume treats it as a corrupt checkpoint (falls back to an older one,
saying why), ``lptrain export`` as an unreadable one (one line, exit 2).
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from lptrain.checkpoint.folders import CheckpointError

REFUSED = "refused: it names {what}, which no checkpoint lptrain writes holds (crafted, or written by another program)"
FIX = "resume from or export another checkpoint; only load checkpoints from sources you trust"


def _is_class(obj: Any) -> bool:
    return isinstance(obj, type)


def _is_dtype(obj: Any) -> bool:
    return isinstance(obj, torch.dtype)


# module -> (names allowed, or None for any name whose object passes the check, the check)
Rule = tuple[Optional[frozenset[str]], Callable[[Any], bool]]

METADATA_TYPES: dict[str, Rule] = {
    # DCP's plain data classes (and one enum); a new one in a later torch shows up as a
    # refused lptrain checkpoint in tests/unit/checkpoint's round trips, never silently
    "torch.distributed.checkpoint.metadata": (frozenset({
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}), _is_class),
    "torch.distributed.checkpoint.filesystem": (frozenset({"_StorageInfo"}), _is_class),
    "torch": (None, lambda obj: _is_dtype(obj) or obj is torch.Size),
    "torch.serialization": (frozenset({"_get_layout"}), callable),  # a layout by its name
    "pathlib": (frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
                _is_class),
    "collections": (frozenset({"OrderedDict"}), _is_class),
    "builtins": (frozenset({"set", "frozenset", "slice", "complex", "bytearray"}), _is_class),
}

# What TE pickles into a module's extra state: its recipe (data classes and enums of
# transformer_engine.common.recipe), tensors (rebuilt from their storage bytes: see below),
# dicts. Any other global is refused.
TE_EXTRA_STATE_TYPES: dict[str, Rule] = {
    "transformer_engine.common.recipe": (None, _is_class),
    "torch._utils": (frozenset({"_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_parameter"}),
                     callable),
    "torch": (None, lambda obj: _is_dtype(obj) or obj is torch.Size),
    "collections": (frozenset({"OrderedDict"}), _is_class),
    "builtins": (frozenset({"set", "frozenset", "slice", "complex", "bytearray"}), _is_class),
}


class Refused(pickle.UnpicklingError):
    """A pickle named a global the allow-list does not hold (the message is its name)."""


class RestrictedUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only the globals ``rules`` allow (Python's "restricting
    globals" recipe); any other global raises :class:`Refused` naming it."""

    def __init__(self, file: Any, rules: dict[str, Rule],
                 substitutes: Optional[dict[tuple[str, str], Any]] = None) -> None:
        super().__init__(file)
        self.rules = rules
        self.substitutes = substitutes or {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.substitutes:
            return self.substitutes[(module, name)]
        rule = self.rules.get(module)
        if rule is not None and "." not in name and not name.startswith("__"):
            names, check = rule
            if names is None or name in names:
                obj = getattr(__import__(module, fromlist=[name]), name, None)
                if obj is not None and check(obj):
                    return obj
        raise Refused(f"{module}.{name}"[:120])

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(f"a persistent id ({str(pid)[:40]})")


def restricted_loads(data: bytes, rules: dict[str, Rule],
                     substitutes: Optional[dict[tuple[str, str], Any]] = None) -> Any:
    return RestrictedUnpickler(io.BytesIO(data), rules, substitutes).load()


_TORCH_GLOBAL = re.compile(r"GLOBAL (\S+)")


def _error(where: str, e: BaseException) -> CheckpointError:
    """:class:`CheckpointError` for a pickle that could not be read: a refused global (ours,
    or torch's weights-only reader's "unsupported GLOBAL x.y") is named as such."""
    text = " ".join(str(e).split())
    torch_global = _TORCH_GLOBAL.search(text) if isinstance(e, pickle.UnpicklingError) else None
    if isinstance(e, Refused) or torch_global:
        what = torch_global.group(1) if torch_global and not isinstance(e, Refused) else text
        return CheckpointError(f"{where}: {REFUSED.format(what=what)}", fix=FIX)
    if isinstance(e, OSError):
        return CheckpointError(f"{where} could not be read ({e.strerror or e})")
    return CheckpointError(f"{where} could not be read ({type(e).__name__}: {text[:160]})")


def read_metadata(path: Path) -> Any:
    """DCP's ``.metadata`` through :data:`METADATA_TYPES`; :class:`CheckpointError` for a file
    that names anything else, is not a pickle, or is not DCP's ``Metadata``."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = restricted_loads(path.read_bytes(), METADATA_TYPES)
    except Exception as e:  # Refused, a torn or scrambled stream, a type's own complaint
        raise _error(str(path), e) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})",
                              fix=FIX)
    return metadata


def load_weights_only(path: Path | io.BytesIO, where: str) -> Any:
    """``torch.load`` of what lptrain wrote with ``torch.save``: tensors, numbers, strings and
    containers only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise _error(where, e) from None


def _storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (how a pickled tensor carries its storage) without
    its ``weights_only=False``: the bytes are a ``torch.save`` file, read weights-only."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def check_te_extra_state(value: Any, where: str) -> None:
    """A TE module's extra state (a byte tensor of pickled data that TE's ``set_extra_state``
    will unpickle without restriction): unpickle it here first through
    :data:`TE_EXTRA_STATE_TYPES`; :class:`CheckpointError` if it names anything else."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        what = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(f"{where}: a module's extra state is {what}, not the byte tensor "
                              "Transformer Engine writes", fix=FIX)
    if value.numel() == 0:
        return
    data = value.detach().cpu().contiguous().numpy().tobytes()
    try:
        restricted_loads(data, TE_EXTRA_STATE_TYPES,
                         {("torch.storage", "_load_from_bytes"): _storage_from_bytes})
    except Exception as e:
        raise _error(f"{where} (Transformer Engine extra state)", e) from None


def load_local(path: Path) -> dict[str, Any]:
    """A rank's ``local/rank_NNNNN.pt``: weights-only, a dict, and any TE extra state in it
    checked (:func:`check_te_extra_state`)."""
    local = load_weights_only(path, str(path))
    if not isinstance(local, dict):
        raise CheckpointError(f"{path} holds a {type(local).__name__}, not the dict lptrain writes",
                              fix=FIX)
    extra = local.get("module_extra_state") or {}
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path}: module_extra_state is not a dict", fix=FIX)
    for name, value in extra.items():
        check_te_extra_state(value, f"{path} ({name})")
    return local


def read_global(folder: Path, keys: Optional[set[str]] = None) -> dict[str, Any]:
    """The DCP state under ``folder`` (every key, or the top-level ``keys``), unsharded, with
    no template (what makes it reshardable), read restricted: ``.metadata`` through
    :func:`read_metadata`, tensors and byte items weights-only. Runs without a process group
    (every rank reads the whole replicated state on its own). :class:`CheckpointError` on any
    failure, naming the file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lptrain.checkpoint.save_errors import describe

    # Read (restricted) before DCP starts: DCP would otherwise unpickle it itself, and a
    # failure there logs two tracebacks on stderr as it tries a per-rank metadata file.
    metadata = read_metadata(folder / ".metadata")

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            where = f"{folder} ({read_item.dest_index.fqn})"
            loaded = load_weights_only(value, where)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=Reader(str(folder)),
                         planner=Planner(keys=keys), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        inner = e
        if isinstance(e, CheckpointException) and e.failures:
            inner = next(iter(e.failures.values()))
            inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"checkpoint {folder} could not be read ({describe(e)})") from None
    return state
