"""``lptrain export``: a run or checkpoint folder -> a Hugging Face model folder.

The weights are the checkpoint's fp32 masters (the ``model`` part of its DCP ``global``
state, read without the optimizer state), never a quantized copy, cast once to ``--dtype``.
Checkpoints hold every tensor whole under its canonical name (experts once each, under
their global index), so a run trained at any DP/EP size and with any expert layout exports
the same way. The folder holds what ``transformers`` writes itself: ``config.json``,
``generation_config.json``, ``model.safetensors`` (sharded with an index above
``--max-shard-size``) and, when the run used a ``tokenizers`` JSON file, ``tokenizer.json``
with its ``tokenizer_config.json``. The byte tokenizer has no ``transformers`` counterpart;
its token ids are written into the configs all the same.

An export of a run that is still saving and pruning reads the newest checkpoint under a reader
lease (the pruner leaves it until the export is done); one pruned before the lease was taken
is skipped for the next complete one, with a note.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lptrain.checkpoint.lease import reading
from lptrain.checkpoint.store import (
    CONFIG,
    CheckpointError,
    decode_keys,
    find_checkpoints,
    is_step_dir,
    read_train_state,
    step_dirs,
    validate,
)
from lptrain.config.schema import LPTrainConfig
from lptrain.errors import InputError
from lptrain.interop.export_folder import check_output, resolve_output, staged_output
from lptrain.interop.hf_arch import Architecture, architecture_for, hf_config
from lptrain.interop.hf_weights import to_hf
from lptrain.interop.safetensors_io import DEFAULT_MAX_SHARD, parse_size, write_safetensors

DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16"),
          "fp32": (torch.float32, "float32")}
_SOURCE_FIX = "pass a run folder (with resolved_config.yaml), a checkpoint.save folder or one iter_* folder"


@dataclass
class ExportReport:
    """What an export wrote, for the CLI's summary line."""

    output: Path
    checkpoint: Path
    iteration: int
    architecture: str
    dtype: str
    num_params: int
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _run_checkpoint_dirs(run: Path) -> list[Path]:
    """Where a run folder's checkpoints may be: its ``checkpoint.save`` (moved under ``run``
    when it lay under the run's ``run.output_dir``, so a copied run folder still works)."""
    from lptrain.config.compose import compose

    cfg = compose(str(run / CONFIG), [])
    out: list[Path] = []
    save = cfg.checkpoint.save
    if save:
        p, old = Path(save), Path(cfg.run.output_dir)
        if p.is_relative_to(old):
            out.append(run / p.relative_to(old))
        out.append(p)
    out.append(run / "checkpoints")
    return out


def export_candidates(source: str | Path) -> list[Path]:
    """The complete step folders ``source`` offers, newest first (one for an ``iter_*``
    folder); :class:`InputError` when there is none."""
    src = Path(source)
    if not src.exists():
        raise InputError(f"{src}: no such folder", fix=_SOURCE_FIX)
    if is_step_dir(src) and not os.path.lexists(src / "latest"):
        why = validate(src)
        if why is not None:
            raise InputError(f"checkpoint {src} is {why}", fix="export another iter_* folder")
        return [src]
    places = [src] if step_dirs(src) or os.path.lexists(src / "latest") else []
    if (src / CONFIG).is_file() and not places:
        places = _run_checkpoint_dirs(src)
    skipped: list[str] = []
    for place in places:
        found = find_checkpoints(place)
        if found.valid:
            return found.valid
        skipped += found.skipped
    if not places:
        raise InputError(f"{src} is neither a run folder nor a checkpoint folder", fix=_SOURCE_FIX)
    why = "; ".join(skipped) or "no iter_* checkpoint folders"
    raise InputError(f"{src} holds no valid checkpoint ({why})",
                     fix="train with checkpoint.save set, or pass the checkpoint folder itself")


def find_checkpoint(source: str | Path) -> Path:
    """The complete step folder to export from ``source`` (newest valid one of a save or run
    folder); :class:`InputError` when there is none."""
    return export_candidates(source)[0]


def read_masters(step: Path) -> dict[str, torch.Tensor]:
    """The fp32 masters (canonical names) of one complete checkpoint, without the optimizer."""
    from lptrain.checkpoint.restricted import read_global

    try:  # allow-listed unpickling only: a crafted checkpoint cannot run code here
        state = read_global(step / "global", keys={"model"})
    except CheckpointError as e:
        raise InputError(str(e)) from None
    model = decode_keys(state).get("model")
    if not isinstance(model, dict) or not model:
        raise InputError(f"checkpoint {step} holds no model weights", fix="export another checkpoint")
    return model


def token_ids(cfg: LPTrainConfig, tokenizer: str | None) -> tuple[dict[str, int | None], Any]:
    """``bos/eos/pad`` ids and the ``tokenizers`` JSON tokenizer (None for the byte one)."""
    from lptrain.data.tokenizer import ByteTokenizer, HFTokenizer

    spec = tokenizer or cfg.data.tokenizer
    if spec == "byte":
        t = ByteTokenizer()
        return {"bos": t.bos_id, "eos": t.eos_id, "pad": t.pad_id}, None
    if not Path(spec).is_file():
        raise InputError(
            f"the run's tokenizer {spec} (data.tokenizer) is not there", key="data.tokenizer",
            fix="pass --tokenizer PATH to the tokenizers JSON file the run used")
    hf = HFTokenizer(spec)
    return {"bos": hf.bos_id, "eos": hf.eos_id, "pad": hf.pad_id}, hf


def _write_tokenizer(out: Path, tok: Any, cfg: LPTrainConfig) -> list[str]:
    shutil.copyfile(tok.path, out / "tokenizer.json")
    names = {k: tok.id_to_token(i) for k, i in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id))
             if i is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.model.seq_length,
              "clean_up_tokenization_spaces": False, **{f"{k}_token": v for k, v in names.items()}}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


@dataclass
class _Pinned:
    """What an export reads from one checkpoint while it holds the reader lease on it."""

    step: Path
    cfg: LPTrainConfig
    iteration: int
    masters: dict[str, torch.Tensor]


def _read_pinned(candidates: list[Path], notes: list[str]) -> _Pinned:
    """Config, step and masters of the newest candidate, read under its reader lease (the
    trainer does not prune it meanwhile); a candidate pruned or changed before the lease was
    taken is skipped for the next one, with a note."""
    from lptrain.config.compose import compose

    for i, step in enumerate(candidates):
        with reading(step) as why:
            if why is None:
                cfg = compose(str(step / CONFIG), [])
                architecture_for(cfg.model)  # refuse before reading any tensor
                return _Pinned(step, cfg, int(read_train_state(step)["iteration"]), read_masters(step))
        nxt = candidates[i + 1] if i + 1 < len(candidates) else None
        notes.append(f"checkpoint {step} is {why} (the run is saving and pruning); "
                     + (f"exporting {nxt} instead" if nxt else "no older checkpoint is left"))
    raise InputError("no checkpoint could be read while the run pruned them: " + "; ".join(notes),
                     fix="export again, or pass one iter_* folder")


def export_hf(
    source: str | Path,
    output: str | Path,
    *,
    dtype: str = "bf16",
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    tokenizer: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> ExportReport:
    """Write the Hugging Face folder ``output`` from the newest checkpoint of ``source``
    (``progress``: a rich bar over the bytes written, shard by shard).

    The checkpoint is read under a reader lease (:mod:`lptrain.checkpoint.lease`), so a run
    that is still training does not prune it meanwhile; the folder is written whole or not
    at all (:mod:`lptrain.interop.export_folder`)."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}", fix="pass --dtype bf16")
    max_bytes = parse_size(max_shard_size)
    out = resolve_output(Path(output))  # through a symbolic link, into its target
    check_output(out, overwrite)
    notes: list[str] = []
    pinned = _read_pinned(export_candidates(source), notes)
    cfg = pinned.cfg
    arch: Architecture = architecture_for(cfg.model)
    ids, tok = token_ids(cfg, tokenizer)
    torch_dtype, dtype_name = DTYPES[dtype]
    tensors = to_hf(pinned.masters, cfg.model, arch, torch_dtype)
    from lptrain.data.prepare import transfer_progress

    with staged_output(out) as stage, transfer_progress(progress) as bar:
        task = bar.add_task(f"writing {out.name}", total=sum(t.numel() * t.element_size() for t in tensors.values()))
        files = write_safetensors(tensors, stage, max_bytes, on_shard=lambda n: bar.advance(task, n))
        config = hf_config(cfg.model, arch, dtype_name, ids)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"_from_model_config": True, **{f"{k}_token_id": v for k, v in ids.items() if v is not None}}
        (stage / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        files += ["config.json", "generation_config.json"]
        if tok is not None:
            files += _write_tokenizer(stage, tok, cfg)
        else:
            notes.append("the byte tokenizer has no transformers counterpart: no tokenizer files "
                         "(ids are UTF-8 bytes, BOS 256, EOS 257, PAD 258)")
    return ExportReport(out, pinned.step, pinned.iteration, arch.name, dtype,
                        sum(t.numel() for t in tensors.values()), files, notes)
