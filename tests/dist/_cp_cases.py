"""Rank side of the context-parallel training tests (module-level: pickled).

One spawned world per size runs every case of that size (spawning and engine set-up cost
seconds, a tiny step a fraction of one): the comm types at CP 2, the regressions with a fix
monkeypatched away, the baselines of the 4-rank comparisons, FP8/FP4 param gather per CP
rank, and the checkpoint runs of the resumes across CP sizes (through
:func:`lptrain.train.pretrain`, what each rank of ``lptrain pretrain --nproc-per-node`` runs).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

STEPS = 6
# 2 sequences of 64 tokens per micro-batch, 4 per step (the same global batch at every size):
# at CP 2 each rank holds chunks of 16 tokens, at CP 4 of 8
SMALL = ["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false", "optimizer.warmup_iters=0",
         "model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=4"]
CP2 = ["model.context_parallel_size=2"]
COMM_TYPES = ["p2p", "a2a", "allgather"]
HIERARCHICAL = ["model.context_parallel_size=4", "model.cp_comm_type=a2a+p2p",
                "model.hierarchical_context_parallel_sizes=[2,2]"]
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
# MXFP8 at CP 2: 128-token sequences, chunks of one 32-token block (rule CP-BLOCK-BOUNDARY)
MX = ["model.seq_length=128"]
DISTOPT = ["ddp.use_distributed_optimizer=true"]
# quantized primary weights gathered over DP x CP (the distributed optimizer shards over both)
PARAM_GATHER = {
    "fp8_off": [*DISTOPT, "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"],
    "fp8_on": [*DISTOPT, "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise",
               "precision.fp8_param_gather=true"],
    "fp4_off": [*DISTOPT, "precision.fp4_format=e2m1"],
    "fp4_on": [*DISTOPT, "precision.fp4_format=e2m1", "precision.fp4_param_gather=true"],
}
# the data-parallel engine's sharding strategies over DP x CP, each against ZeRO-1
ZERO = {
    "optim": DISTOPT,
    "optim_grads": ["ddp.data_parallel_sharding_strategy=optim_grads"],
    "optim_grads_params": ["ddp.data_parallel_sharding_strategy=optim_grads_params", "ddp.overlap_grad_reduce=true",
                           "ddp.overlap_param_gather=true", "ddp.bucket_size=20000"],
}
# MoE at CP 2 with the experts split over the two CP ranks (EP 2: the expert-parallel group is
# the CP group, expert data parallelism 1): dense grads over DP x CP, expert grads over EDP
MOE = ["model.seq_length=128"]
MOE_CP2_EP2 = [*MOE, *CP2, "model.moe.expert_model_parallel_size=2"]
MOE_STEPS = 3
PP_STEPS = 3
CKPT_STEPS = 4  # the split runs stop after half (train.exit_interval) and resume


def run(recipe: str, extra: list[str], steps: int = STEPS) -> dict[str, Any]:
    """Losses, grad norms, fp32 masters and delayed-scaling state after ``steps`` steps."""
    from lptrain.testing.parity import train_steps

    r = train_steps(recipe, [*SMALL, *extra], steps=steps)
    return {"losses": r["losses"], "grad_norms": r["grad_norms"], "masters": r["masters"]}


def scaling_after(recipe: str, extra: list[str], steps: int) -> dict[str, Any]:
    """The delayed-scaling state (scales, amax histories) of every layer after ``steps``."""
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.data import build_train_valid_loaders
    from lptrain.precision.model_state import scaling_state
    from lptrain.train.engine import TrainEngine

    cfg = derive(load(recipe, [*SMALL, *extra]).cfg, World.detect())
    engine = TrainEngine(cfg)
    t = cfg.train
    it, _ = build_train_valid_loaders(cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
                                      global_batch_size=t.global_batch_size, dp_rank=engine.dp_rank,
                                      dp_size=engine.dp_size, vocab_size=cfg.model.vocab_size,
                                      context_parallel=engine.context_parallel)
    n = t.global_batch_size // (t.micro_batch_size * engine.dp_size)
    for step in range(1, steps + 1):
        engine.train_step([next(it) for _ in range(n)], step)
    return scaling_state(engine.model)


# a model whose attention is far from uniform (at the default init every query attends almost
# evenly, and positions hardly matter to a first step): the probe's logits show any position
PEAKY = ["model.init_method_std=0.5"]


def probe_logits(extra: list[str]) -> Any:
    """The logits of a fixed batch of two 64-token sequences (this rank's chunks of it under
    context parallelism), from the model as built (no step)."""
    import torch

    from lptrain.catalog.parallel_dims import cp_token_ranges
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("tiny_cpu.yaml", [*SMALL, *PEAKY, *extra]).cfg, World.detect())
    engine = TrainEngine(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    cp_rank, cp = engine.context_parallel
    cols = torch.cat([torch.arange(lo, hi) for lo, hi in cp_token_ranges(64, cp, cp_rank)])
    with torch.no_grad(), engine.model.autocast(engine.groups.amax_reduction.pg):
        return engine.model(tokens[:, cols]).detach(), cols


@contextlib.contextmanager
def without(fix: str) -> Any:
    """Monkeypatch one CP fix away: ``positions`` (RoPE at 0 .. s/CP - 1 on every rank),
    ``grad_reduction`` (gradients reduced over DP only, not DP x CP), ``amax`` (delayed-
    scaling amaxes reduced over TP x DP only, not the CP ranks)."""
    import torch

    from lptrain.catalog import parallel_dims
    from lptrain.distributed import groups
    from lptrain.model.context_parallel import ContextParallelRotary
    from lptrain.testing.parity import patched

    if fix == "positions":
        def local(self: Any, seq_len: int, device: Any) -> torch.Tensor:
            return torch.arange(seq_len, device=device)

        with patched(ContextParallelRotary, "positions", local):
            yield
    elif fix == "grad_reduction":
        with patched(groups, "GRAD_REDUCTION_DIMS", ("dp",)):
            yield
    elif fix == "amax":
        with patched(parallel_dims, "AMAX_REDUCTION_DIMS", ("tp", "dp")):
            yield
    else:
        raise ValueError(fix)


def pretrain_run(out: Path, *extra: str) -> dict[str, Any]:
    """Run (or resume) tiny_cpu.yaml into ``out``; its summary."""
    from lptrain.config import compose
    from lptrain.train import pretrain

    ov = [*SMALL, "logging.plots=false", "train.log_interval=null", f"train.train_iters={CKPT_STEPS}",
          f"checkpoint.save={out}/ckpt", *extra]
    return pretrain(compose("tiny_cpu.yaml", ov), out)


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def world2(rank: int, world: int, root: str) -> dict[str, Any]:
    """CP 2 in every comm type; the regressions; the DP 2 and TP 2 baselines of the 4-rank
    comparisons; FP8/FP4 param gather over the CP ranks; the CP 2 checkpoint runs."""
    base = Path(root)
    out: dict[str, Any] = {"cp2": {t: run("tiny_cpu.yaml", [*CP2, f"model.cp_comm_type={t}"]) for t in COMM_TYPES}}
    out["logits"] = probe_logits(CP2)
    with without("positions"):
        out["no_positions"] = probe_logits(CP2)
    with without("grad_reduction"):
        out["no_grad_reduction"] = run("tiny_cpu.yaml", CP2, steps=2)
    out["amax"] = scaling_after("fp8_delayed_cpu.yaml", CP2, 2)
    with without("amax"):
        out["no_amax"] = scaling_after("fp8_delayed_cpu.yaml", CP2, 2)
    out["dp2"] = run("fp8_delayed_cpu.yaml", [])
    out["tp2"] = run("mxfp8_muon_cpu.yaml", [*MX, *TP2])
    out["param_gather"] = {k: run("tiny_cpu.yaml", [*CP2, *v], steps=2) for k, v in PARAM_GATHER.items()}
    out["zero"] = {k: run("tiny_cpu.yaml", [*CP2, *v], steps=2) for k, v in ZERO.items()}
    out["moe"] = run("moe_mxfp8_cpu.yaml", MOE_CP2_EP2, steps=MOE_STEPS)
    pretrain_run(base / "cp2_straight", *CP2)
    out["half"] = pretrain_run(base / "cp2_half", *CP2, f"train.exit_interval={CKPT_STEPS // 2}")
    return out


def world4(rank: int, world: int, root: str) -> dict[str, Any]:
    """a2a+p2p at CP 4 (2 x 2) and DP 4 (CP 1 on 4 ranks); fp8_delayed at CP 2 x DP 2;
    mxfp8_muon at CP 2 x TP 2; CP 2 x PP 2; the CP 2 save resumed at CP 4."""
    out: dict[str, Any] = {
        "hierarchical": run("tiny_cpu.yaml", HIERARCHICAL),
        "dp4": run("tiny_cpu.yaml", ["train.micro_batch_size=1"]),  # (the same 4 sequences a step)
        "cp2dp2": run("fp8_delayed_cpu.yaml", CP2),
        "cp2tp2": run("mxfp8_muon_cpu.yaml", [*MX, *TP2, *CP2]),
        "cp2pp2": run("tiny_cpu.yaml", [*CP2, "model.pipeline_model_parallel_size=2"], steps=PP_STEPS),
    }
    pretrain_run(Path(root) / "cp4_from_cp2", "model.context_parallel_size=4")
    return out
