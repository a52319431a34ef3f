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


def check_writable(out: Path) -> None:
    """Raise :class:`OutputDirError` unless ``out`` is, or could be created as, a writable
    folder. Creates nothing (used by ``--dry-run``)."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"run folder {out} is a file, not a folder", key=OUTPUT_DIR_KEY, fix=OUTPUT_DIR_FIX)
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OutputDirError(
            f"cannot create run folder {out}: {probe} is a file", key=OUTPUT_DIR_KEY, fix=OUTPUT_DIR_FIX
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputDirError(
            f"cannot create run folder {out}: {probe} is not writable", key=OUTPUT_DIR_KEY, fix=OUTPUT_DIR_FIX
        )


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
    -- through the emulated backend, or the stand-in Transformer Engine when the recipe uses
    TE and TE is not installed -- so a code path that would crash on a GPU fails here, before
    the job gets one.
    """
    import torch

    from lptrain.data.loader import build_streams
    from lptrain.model.build import build_model

    build_cfg = cfg
    skipped = bool(cfg.precision.fp8_param_gather or cfg.precision.fp4_param_gather)
    if skipped:
        build_cfg = copy.deepcopy(cfg)
        build_cfg.precision.fp8_param_gather = False
        build_cfg.precision.fp4_param_gather = False
    virtual = world is not None and world.cuda and not torch.cuda.is_available()
    with contextlib.ExitStack() as stack:
        if virtual:
            from lptrain.testing.fake_gpu import virtual_gpu

            stack.enter_context(virtual_gpu(world.target, te=cfg.precision.backend == "te",
                                            te_version=world.te_version))
        with torch.device("meta"):
            model = build_model(build_cfg)
        params = sum(p.numel() for p in model.parameters())
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

        report.fake_gpu_step = fake_gpu_steps(cfg, world.target, te_version=world.te_version).lines()
    return report
