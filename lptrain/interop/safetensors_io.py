"""``model.safetensors`` as ``transformers`` writes and reads it: one file up to a size
threshold, above it numbered shards (``model-00001-of-00003.safetensors``) plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map":
{tensor: file}}``). Shards are filled in the given tensor order and a new one starts when the
next tensor would cross the threshold (a tensor larger than it gets a shard of its own), as
``transformers``' own sharding does. Every file carries ``{"format": "pt"}`` metadata, which
``transformers`` checks on load. Writes go to temporary names renamed at the end, so a crash
never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lptrain.errors import InputError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "5GB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_INSTALL = "install it with `pip install 'lptrain[hf]'` (or `pip install safetensors`)"


def safetensors_torch() -> Any:
    """``safetensors.torch``, or a one-line :class:`InputError` naming the extra."""
    try:
        import safetensors.torch
    except ImportError:
        raise InputError(f"Hugging Face folders are read and written with the safetensors package; {_INSTALL}") from None
    return safetensors.torch


def parse_size(text: str | int) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``1000`` -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m or float(m[1]) <= 0:
        raise InputError(f"--max-shard-size {text!r} is not a size", fix="write e.g. 5GB, 500MB or 2GiB")
    return int(float(m[1]) * _UNITS[(m[2] or "").upper()])


def plan_shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], folder: Path, max_bytes: int,
    on_shard: Callable[[int], None] | None = None,
) -> list[str]:
    """Write ``tensors`` into ``folder`` (sharded above ``max_bytes``); returns the file
    names. ``on_shard(bytes)`` is called after each shard (a progress bar)."""
    st = safetensors_torch()
    shards = plan_shards(tensors, max_bytes)
    names = ([SINGLE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, keys in zip(names, shards, strict=True):
        tmp = folder / f".{name}.tmp"
        st.save_file({k: tensors[k] for k in keys}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / name)
        if on_shard is not None:
            on_shard(sum(tensors[k].numel() * tensors[k].element_size() for k in keys))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in sorted(keys)},
        }
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [*names, INDEX]
    (folder / INDEX).unlink(missing_ok=True)
    return names


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder (index first, then the single file)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{index}: unreadable index ({e})", fix="re-export or re-download the folder") from None
        return [folder / f for f in sorted(set(weight_map.values()))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    others = sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
    hint = f" (it has {', '.join(others)}: only safetensors weights are read)" if others else ""
    raise InputError(f"{folder}: no {SINGLE} or {INDEX}{hint}",
                     fix="point at a Hugging Face model folder saved with safetensors")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder (CPU, stored dtype)."""
    st = safetensors_torch()
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        if not path.is_file():
            raise InputError(f"{path}: listed in {INDEX} but missing", fix="re-export or re-download the folder")
        try:
            out.update(st.load_file(str(path)))
        except Exception as e:  # safetensors raises its own error type for a corrupt file
            raise InputError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})",
                             fix="re-export or re-download the folder") from None
    return out
