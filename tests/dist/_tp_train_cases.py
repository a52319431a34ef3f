"""Rank side of the tensor-parallel training tests (module-level: pickled).

One spawned world per size runs every case of that size (spawning costs seconds, a tiny step
a fraction of one): losses of every CPU recipe over :data:`STEPS` steps, the bitwise checks at
a fixed TP size, the Muon modes, and the checkpoint runs of the cross-size resumes (through
:func:`lptrain.train.pretrain`, what each rank of ``lptrain pretrain --nproc-per-node`` runs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

RECIPES = ["tiny_cpu.yaml", "bf16_adamw_cpu.yaml", "fp8_blockwise_cpu.yaml", "fp8_delayed_cpu.yaml",
           "fp8_tensorwise_cpu.yaml", "moe_mxfp8_cpu.yaml", "mxfp8_adamw_cpu.yaml", "mxfp8_muon_cpu.yaml",
           "nvfp4_adamw_cpu.yaml"]
# TP 2 x DP 2 against DP 2: every recipe (ZeRO-2/3 and the FP8/FP4 param gathers per TP rank
# are ENGINE_VARIANTS besides: bitwise against their off switches)
DP_RECIPES = RECIPES
STEPS = 10  # issue 44: the TP losses over 10 steps
# 2 sequences of 64 tokens per micro-batch, 4 per step: one micro-batch per data-parallel rank
# at DP 2, two at DP 1 (the same global batch, the same samples, at every size)
SMALL = ["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false", "optimizer.warmup_iters=0",
         "model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=4"]
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
BITWISE = ["fp8_delayed_cpu.yaml"]  # train-eval-train at a fixed TP size (delayed: a no-grad
# forward must leave the amax histories as they were)
MUON = "mxfp8_muon_cpu.yaml"
CKPT = "tiny_cpu.yaml"
CKPT_STEPS = 4  # the split runs stop after half (train.exit_interval) and resume


def losses(recipe: str, extra: list[str], steps: int = STEPS) -> dict[str, list[float]]:
    from lptrain.testing.parity import train_steps

    r = train_steps(recipe, [*SMALL, *extra], steps=steps)
    return {"losses": r["losses"], "grad_norms": r["grad_norms"]}


def pretrain_run(out: Path, *extra: str) -> dict[str, Any]:
    """Run (or resume) :data:`CKPT` into ``out``; its summary."""
    from lptrain.config import compose
    from lptrain.train import pretrain

    ov = [*SMALL, "logging.plots=false", "train.log_interval=null", f"train.train_iters={CKPT_STEPS}",
          f"checkpoint.save={out}/ckpt", *extra]
    return pretrain(compose(CKPT, ov), out)


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _copy_on_rank0(rank: int, src: Path, dst: Path) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.copytree(src, dst)
    dist.barrier()


def world2(rank: int, world: int, root: str) -> dict[str, Any]:
    """DP 2 and TP 2 losses of every recipe, the fixed-TP bitwise cases, the Muon modes, and
    the TP 2 checkpoint runs (straight, split, and the resume of the TP 1 save)."""
    from lptrain.testing.parity import first_difference, train_steps

    base = Path(root)
    out: dict[str, Any] = {"dp2": {r: losses(r, []) for r in DP_RECIPES},
                           "tp2": {r: losses(r, TP2) for r in RECIPES}}
    # train-eval-train and forced syncs are bitwise train at TP 2
    out["eval_bitwise"] = {}
    for recipe in BITWISE:
        plain = train_steps(recipe, [*SMALL, *TP2], steps=3)
        evald = train_steps(recipe, [*SMALL, *TP2], steps=3, eval_every=1, sync_after=[2])
        out["eval_bitwise"][recipe] = first_difference(plain, evald)
    # Muon: the two TP modes give the same update
    modes = {m: train_steps(MUON, [*SMALL, *TP2, f"optimizer.muon.tp_mode={m}"], steps=3)
             for m in ("duplicated", "distributed")}
    out["muon_modes"] = first_difference(modes["duplicated"]["masters"], modes["distributed"]["masters"])
    out["muon_losses"] = [modes[m]["losses"] for m in ("duplicated", "distributed")]
    # checkpoints at TP 2: straight, split (bitwise), a copy of the split's first half for the
    # TP 1 and TP 2 x DP 2 resumes, and the resume of the parent's TP 1 save
    half = f"train.exit_interval={CKPT_STEPS // 2}"
    pretrain_run(base / "tp2_straight", *TP2)
    first = pretrain_run(base / "tp2_split", *TP2, half)
    _copy_on_rank0(rank, base / "tp2_split", base / "tp2_half")
    second = pretrain_run(base / "tp2_split", *TP2, half)
    out["split_status"] = (first["status"], second["status"], second.get("resumed_from_step"))
    pretrain_run(base / "from_tp1", *TP2)  # a copy of the TP 1 half run, resumed at TP 2
    return out


DISTOPT = ["ddp.use_distributed_optimizer=true"]
# the data-parallel engine's options, each against its own off switch, at TP 2 x DP 2 (3 steps)
ENGINE_VARIANTS = {
    "optim": DISTOPT,
    "optim_grads": ["ddp.data_parallel_sharding_strategy=optim_grads"],
    "optim_grads_params": ["ddp.data_parallel_sharding_strategy=optim_grads_params", "ddp.overlap_grad_reduce=true",
                           "ddp.overlap_param_gather=true", "ddp.bucket_size=20000"],
    "fp8_pg_off": [*DISTOPT, "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"],
    "fp8_pg_on": [*DISTOPT, "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise",
                  "precision.fp8_param_gather=true"],
    "fp4_pg_off": [*DISTOPT, "precision.fp4_format=e2m1"],
    "fp4_pg_on": [*DISTOPT, "precision.fp4_format=e2m1", "precision.fp4_param_gather=true"],
}


def world4(rank: int, world: int, root: str) -> dict[str, Any]:
    """TP 2 x DP 2 losses of every recipe, the data-parallel engine's options per TP rank, the
    straight TP 2 x DP 2 run, the resume of the TP 2 save at TP 2 x DP 2, and a TP 2 x DP 2
    save for the parent's TP 1 resume."""
    from lptrain.testing.parity import train_steps

    base = Path(root)
    out: dict[str, Any] = {"tp2dp2": {r: losses(r, TP2) for r in DP_RECIPES}}
    out["engine"] = {}
    for name, ov in ENGINE_VARIANTS.items():
        r = train_steps("tiny_cpu.yaml", [*SMALL, *TP2, *ov], steps=3)
        out["engine"][name] = {"losses": r["losses"], "grad_norms": r["grad_norms"], "masters": r["masters"]}
    half = f"train.exit_interval={CKPT_STEPS // 2}"
    pretrain_run(base / "tp2dp2_straight", *TP2)
    pretrain_run(base / "from_tp2", *TP2)  # a copy of the TP 2 half run, resumed at TP 2 x DP 2
    pretrain_run(base / "tp2dp2_half", *TP2, half)
    return out


def world2_after(rank: int, world: int, root: str) -> dict[str, Any]:
    """After the 4-rank world: its TP 2 x DP 2 save, resumed at TP 2."""
    return pretrain_run(Path(root) / "tp2_from_tp2dp2", *TP2)
