"""``checkpoint.init_from_hf=DIR``: a fresh run starts from a Hugging Face model folder.

The folder's ``config.json`` is checked against the recipe before the engine is built (a
mismatch is one line naming both values, exit 2); its tensors become the fp32 masters of the
engine, which then pushes them into the parameters as it does after a resume -- quantized
primary weights are quantized from those masters. The optimizer, the delayed-scaling state
and the data position start fresh, as in a run from random weights.

When ``checkpoint.save`` already holds a checkpoint of this run, the run resumes from it
(its weights came from the folder at its start), as a requeued job must; the loop says so.
Combining the key with ``checkpoint.load`` is a rule violation (CKPT-INIT-FROM-HF-LOAD): two
sources of initial weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.errors import InputError
from lptrain.interop.hf_arch import Architecture, check_against_recipe
from lptrain.interop.hf_weights import canonical_shapes, from_hf
from lptrain.interop.safetensors_io import read_safetensors, safetensors_files

KEY = "checkpoint.init_from_hf"


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face folder, or a one-line :class:`InputError`."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise InputError(f"{KEY}={folder}: no such folder", key=KEY,
                         fix="point it at a Hugging Face model folder (config.json + model.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{KEY}={folder}: no config.json in it", key=KEY,
                         fix="point it at a Hugging Face model folder (config.json + model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{KEY}={folder}: unreadable config.json ({e})", key=KEY) from None
    if not isinstance(cfg, dict):
        raise InputError(f"{KEY}={folder}: config.json is not a JSON object", key=KEY)
    return cfg


def check_init_from_hf(cfg: LPTrainConfig) -> Architecture:
    """Check the folder of ``checkpoint.init_from_hf`` against the recipe (no tensor read)."""
    folder = cfg.checkpoint.init_from_hf
    assert folder, "check_init_from_hf needs checkpoint.init_from_hf"
    arch = check_against_recipe(read_hf_config(folder), cfg.model, f"{KEY}={folder}")
    safetensors_files(Path(folder))  # the weights are there (read later, after the engine)
    return arch


def hf_masters(cfg: LPTrainConfig, arch: Architecture | None = None) -> dict[str, torch.Tensor]:
    """The canonical fp32 masters of ``cfg``'s model read from ``checkpoint.init_from_hf``."""
    folder = Path(str(cfg.checkpoint.init_from_hf))
    arch = arch or check_init_from_hf(cfg)
    tensors = read_safetensors(folder)
    return from_hf(tensors, cfg.model, arch, canonical_shapes(cfg.model, arch), f"{KEY}={folder}")


def init_engine_from_hf(engine: Any, cfg: LPTrainConfig, arch: Architecture | None = None) -> str:
    """Load the folder's weights as the engine's masters (fresh optimizer); returns the log line."""
    arch = arch or check_init_from_hf(cfg)
    masters = hf_masters(cfg, arch)
    engine.load_checkpoint_state({"global": {"model": masters, "optimizer": {}, "scaling": {}}, "local": {}})
    n = sum(t.numel() for t in masters.values())
    return (f"initialised from {cfg.checkpoint.init_from_hf} ({n / 1e6:.2f}M weights, {arch.name}); "
            "optimizer state starts fresh")
