"""Checks ``pretrain`` runs before training starts, and ``pretrain --dry-run``.

Why here and not in the loop: a run folder that cannot be written, or data that does not fit
the model, should be reported in one line before minutes of start-up, and ``--dry-run`` lets a
user (and the fuzz test) exercise everything ``pretrain`` checks without training.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World
from lptrain.errors import OutputDirError
from lptrain.train.run_dir import OUTPUT_DIR_FIX, OUTPUT_DIR_KEY

CHECKPOINT_KEY = "checkpoint.save"
CHECKPOINT_FIX = "point checkpoint.save at a writable folder with room for the checkpoints"
# The longest names lptrain creates under each folder (a temp file, a rank's local state).
_LONGEST_IN_RUN = ".resolved_config.yaml.tmp4194304"
_LONGEST_IN_SAVE = "iter_0000000/local/.rank_00000.pt.tmp4194304"


def _existing_ancestor(path: Path) -> Path:
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    return probe


def _check_folder(path: Path, what: str, key: str, fix: str, longest: str) -> None:
    """``path`` is, or could be created as, a writable folder whose names fit the
    filesystem's limits, else :class:`OutputDirError`. Creates nothing."""
    absolute = Path(os.path.abspath(path))
    anchor = _existing_ancestor(absolute)
    try:
        name_max = os.pathconf(anchor if anchor.is_dir() else anchor.parent, "PC_NAME_MAX")
        path_max = os.pathconf(anchor if anchor.is_dir() else anchor.parent, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in absolute.parts:
        if len(part.encode()) > name_max:
            raise OutputDirError(
                f"{what} {path}: the path component {part[:40]}... has {len(part.encode())} "
                f"bytes, more than this filesystem's limit of {name_max}", key=key, fix=fix)
    if len(str(absolute / longest).encode()) >= path_max:
        raise OutputDirError(f"{what} {path}: the path is too long for the files lptrain writes "
                             f"in it (limit {path_max} bytes)", key=key, fix=fix)
    if absolute.exists() and not absolute.is_dir():
        raise OutputDirError(f"{what} {path} is a file, not a folder", key=key, fix=fix)
    if anchor.exists() and not anchor.is_dir():
        raise OutputDirError(f"cannot create {what} {path}: {anchor} is a file", key=key, fix=fix)
    if not os.access(anchor, os.W_OK | os.X_OK):
        why = "is on a read-only filesystem" if _read_only(anchor) else "is not writable"
        raise OutputDirError(f"cannot write {what} {path}: {anchor} {why}", key=key, fix=fix)


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_writable(out: Path) -> None:
    """Raise :class:`OutputDirError` unless ``out`` is, or could be created as, a writable
    folder. Creates nothing (used by ``--dry-run``)."""
    _check_folder(out, "run folder", OUTPUT_DIR_KEY, OUTPUT_DIR_FIX, _LONGEST_IN_RUN)


def checkpoint_bytes(cfg: LPTrainConfig) -> Optional[int]:
    """One checkpoint's size by the memory planner: every rank's fp32 masters and optimizer
    state, the whole model's (:func:`lptrain.memory.checkpoint_size.checkpoint_bytes`)."""
    from lptrain.memory.checkpoint_size import checkpoint_bytes as whole_checkpoint_bytes

    return whole_checkpoint_bytes(cfg)


def check_paths(cfg: LPTrainConfig, out: Path, room_is_error: bool = True) -> list[str]:
    """Before start (``pretrain`` and ``--dry-run``): the run folder and ``checkpoint.save``
    are writable, their paths fit the filesystem, and ``checkpoint.save`` has room for a
    checkpoint (the planner's size). Raises :class:`OutputDirError` (exit 2); returns
    warning lines (room for one checkpoint but not for ``keep_latest + 1`` of them).

    ``room_is_error=False`` (a dry run for another machine, ``--target``): too little room
    here is a warning, as the run's disk is the other machine's."""
    import shutil

    check_writable(out)
    save = cfg.checkpoint.save
    if not save:
        return []
    folder = Path(save)
    _check_folder(folder, "checkpoint folder", CHECKPOINT_KEY, CHECKPOINT_FIX, _LONGEST_IN_SAVE)
    size = checkpoint_bytes(cfg)
    if not size:
        return []
    anchor = _existing_ancestor(Path(os.path.abspath(folder)))
    usage = shutil.disk_usage(anchor)
    free = usage.free
    if free < size:
        virtual = usage.total == 0  # /proc, /sys: "0.0 MiB free" said nothing useful
        room = (f"{anchor} is on a filesystem without storage (a virtual one such as /proc or "
                "/sys)" if virtual else f"{free / 2**20:.1f} MiB free")
        err = OutputDirError(
            f"checkpoint folder {folder}: {room}, a checkpoint needs about "
            f"{size / 2**20:.1f} MiB (memory planner: the whole model's fp32 masters and optimizer state)",
            key=CHECKPOINT_KEY,
            fix="point checkpoint.save at a folder on a disk" if virtual
            else "free space there or point checkpoint.save at a larger filesystem")
        if room_is_error:
            raise err
        return [f"warning: {err} (on this machine; the run's machine may have room)"]
    peak = (cfg.checkpoint.keep_latest + 1) * size
    if free < peak:
        return [f"warning: checkpoint folder {folder}: {free / 2**20:.1f} MiB free; "
                f"checkpoint.keep_latest={cfg.checkpoint.keep_latest} needs about "
                f"{peak / 2**20:.1f} MiB at the peak of a save (a save that runs out fails with exit 3)"]
    return []


def prepare_output_dir(out: Path) -> None:
    """Create ``out`` and prove it is writable (a probe file), else :class:`OutputDirError`.

    A real write, not ``os.access``: read-only mounts and root's permissions fool the latter.
    """
    check_writable(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".lptrain-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputDirError(
            f"cannot write to run folder {out}: {e.strerror or e}", key=OUTPUT_DIR_KEY, fix=OUTPUT_DIR_FIX
        ) from None


@dataclass
class DryRunReport:
    """What ``--dry-run`` found: model size, the resolved data, and on a GPU target the fake
    GPU step's report lines."""

    params: int
    quantized_primary_weights_skipped: bool
    datasets: list[str]
    train_samples_per_epoch: int
    valid_samples_per_epoch: int
    init_from_hf: str | None = None  # the checked checkpoint.init_from_hf folder and its architecture
    fake_gpu_step: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        note = (
            " (FP8/FP4 primary weights sized as their high-precision shapes: quantizing needs "
            "real values)" if self.quantized_primary_weights_skipped else ""
        )
        valid = (
            f"{self.valid_samples_per_epoch} validation samples"
            if self.valid_samples_per_epoch else "no validation split"
        )
        hf = [f"checkpoint.init_from_hf: {self.init_from_hf} matches the recipe (read when the run "
              "starts fresh)"] if self.init_from_hf else []
        return [
            f"model: {self.params / 1e6:.2f}M parameters, built on the meta device{note}",
            f"data: {', '.join(self.datasets)}: {self.train_samples_per_epoch} training samples "
            f"per epoch, {valid}",
            *hf,
            *self.fake_gpu_step,
            "dry run ok: no run folder written, no training",
        ]


def dry_run(cfg: LPTrainConfig, world: Optional[World] = None) -> DryRunReport:
    """Build the model of a derived ``cfg`` on the meta device and open its data; for a GPU
    ``world`` on a machine without one, then run the fake GPU step.

    The meta device allocates no memory, so any recipe (an 8B model too) is checked in
    seconds. Quantized primary weights need real values to quantize, so with
    ``fp8_param_gather``/``fp4_param_gather`` the model is sized with high-precision weights of
    the same shapes (the report says so).

    The fake GPU step (:func:`lptrain.testing.fake_gpu.fake_gpu_steps`) trains two steps of
    the recipe at tiny shapes on a virtual GPU of the target that enforces CUDA's device rules
    -- through the emulated backend, or Transformer Engine's own Python with its kernels
    emulated (:mod:`lptrain.testing.te_python`) when the recipe uses TE and TE is not
    installed -- with the recipe's tensor and pipeline parallelism at 2 on 2
    or 4 gloo ranks, so a code path that would crash on a GPU fails here, before the job gets
    one; its report names the parallel paths it ran and the ones it did not.
    """
    import torch

    from lptrain.data.loader import build_streams
    from lptrain.distributed.launch_env import use_one_cuda_work_queue
    from lptrain.model.build import build_model
    from lptrain.model.process_group import SINGLE_RANK, ShapeOnlyGroup
    from lptrain.model.tensor_parallel import whole_parameter_count

    build_cfg = cfg
    skipped = bool(cfg.precision.fp8_param_gather or cfg.precision.fp4_param_gather)
    if skipped or cfg.model.context_parallel_size > 1:
        build_cfg = copy.deepcopy(cfg)
    if skipped:
        build_cfg.precision.fp8_param_gather = False
        build_cfg.precision.fp4_param_gather = False
    if cfg.model.context_parallel_size > 1:  # (CP shards no weight: the shapes are CP 1's)
        build_cfg.model.context_parallel_size = 1
        build_cfg.model.cp_comm_type = "p2p"
        build_cfg.model.hierarchical_context_parallel_sizes = None
    virtual = world is not None and world.cuda and not torch.cuda.is_available()
    with contextlib.ExitStack() as stack:
        if virtual:
            from lptrain.testing.fake_gpu import virtual_gpu

            stack.enter_context(virtual_gpu(world.target, te=cfg.precision.backend == "te",
                                            te_version=world.te_version))
        tp = build_cfg.model.tensor_model_parallel_size
        use_one_cuda_work_queue(tp)  # as the run's engine does (TE's TP layers warn without it)
        with torch.device("meta"):  # (tensor parallel: rank 0's shards, shapes only)
            model = build_model(build_cfg, tensor_parallel_group=ShapeOnlyGroup(tp) if tp > 1 else SINGLE_RANK)
        params = whole_parameter_count(model)
        del model
    train, valid = build_streams(cfg.data, cfg.model.seq_length, cfg.model.vocab_size)
    hf = None
    if cfg.checkpoint.init_from_hf:  # its config.json against the recipe (one line, exit 2)
        from lptrain.interop.hf_import import check_init_from_hf

        hf = f"{cfg.checkpoint.init_from_hf} ({check_init_from_hf(cfg).name})"
    report = DryRunReport(
        params=params,
        quantized_primary_weights_skipped=skipped,
        datasets=list(dict.fromkeys(d.indexed.prefix for d in train.datasets)),
        train_samples_per_epoch=sum(d.samples_per_epoch for d in train.datasets),
        valid_samples_per_epoch=sum(d.samples_per_epoch for d in valid.datasets) if valid else 0,
        init_from_hf=hf,
    )
    if virtual:
        from lptrain.testing.fake_gpu import fake_gpu_steps

        report.fake_gpu_step = fake_gpu_steps(cfg, world.target, te_version=world.te_version,
                                              cuda_version=world.cuda_version, dp=world.dp).lines()
    return report
