"""Rank-side functions for the virtual-CUDA engine tests (module-level: they are pickled).

Each rank enters one virtual CUDA device and runs several configurations in the same world:
the process group is requested as NCCL by the engine (``run.device=cuda``), becomes gloo with
NCCL's rule that every collective's tensors be device tensors, and stays up for all cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BASE = ["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false",
        "logging.plots=false", "run.device=cuda", "optimizer.warmup_iters=0",
        "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64"]


def run_cases(rank: int, world: int, cases: dict[str, tuple[str, Sequence[str]]], cache: str,
              run_dir: str) -> dict[str, Any]:
    """``{case: (losses, grad norms)}`` of two steps with an eval after each, then one run of
    the real loop with a checkpoint save (``"loop"``), all on one virtual device."""
    from lptrain.config.compose import load
    from lptrain.testing.parity import train_steps
    from lptrain.testing.virtual_cuda import VirtualCuda
    from lptrain.train import pretrain

    out: dict[str, Any] = {}
    with VirtualCuda() as vc:
        for name, (recipe, overrides) in cases.items():
            r = train_steps(recipe, [*BASE, f"data.cache_dir={cache}", *overrides], steps=2, eval_every=1)
            out[name] = (r["losses"], r["grad_norms"])
        cfg = load("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", "train.train_iters=2",
                                     "ddp.use_distributed_optimizer=true",
                                     f"checkpoint.save={run_dir}/ckpt", "checkpoint.save_interval=2"]).cfg
        out["loop"] = pretrain(cfg, f"{run_dir}/run", overwrite=True)["status"]
        out["violations"] = list(vc.violations)
        out["collectives"] = dict(vc.stats.collectives)
    return out


def te_param_gather_cases(rank: int, world: int, cases: dict[str, tuple[str, Sequence[str]]],
                          cache: str) -> dict[str, Any]:
    """On TE's own Python (kernels emulated): ``{case: losses}`` of three steps, the CUDA generator's seed of
    this rank, and the byte-gathered params' aliasing. Cases run on the target in their name's
    recipe (mxfp8: sm100, else sm90)."""
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.testing.parity import train_steps

    out: dict[str, Any] = {}
    for name, (target, overrides) in cases.items():
        with virtual_gpu(target, te=True) as vc:
            r = train_steps("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", "precision.backend=te",
                                              "ddp.use_distributed_optimizer=true", *overrides], steps=3)
            out[name] = r["losses"]
            out[f"{name}/seed"] = vc.generator.initial_seed()
            out[f"{name}/violations"] = list(vc.violations)
    return out
