"""Rank side of the pipeline-parallel tests (module-level: pickled).

One spawned world per size runs every case of that size (spawning and engine set-up cost
seconds; a tiny step a fraction of one): every CPU recipe at PP 2 for :data:`STEPS` steps
under 1F1B and each zero-bubble schedule (the V ones on uneven splits), interleaving, the
delayed-scaling, stochastic-rounding and W-step readiness regressions, train-eval-train, tied
embeddings, and the checkpoint runs of the resumes across pipeline sizes and splits (through
:func:`lptrain.train.pretrain`, what each rank of ``lptrain pretrain --nproc-per-node`` runs).
Each rank returns its own stage's fp32 masters; the tests join them into one model.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

RECIPES = ["tiny_cpu.yaml", "bf16_adamw_cpu.yaml", "fp8_blockwise_cpu.yaml", "fp8_delayed_cpu.yaml",
           "fp8_tensorwise_cpu.yaml", "moe_mxfp8_cpu.yaml", "mxfp8_adamw_cpu.yaml", "mxfp8_muon_cpu.yaml",
           "nvfp4_adamw_cpu.yaml"]
STEPS = 6
# 1 sequence of 64 tokens per micro-batch, 4 per step: 4 micro-batches per step at DP 1 (DualPipeV
# needs 2 PP), 2 at DP 2 -- one batching for every schedule, so one PP 1 run per recipe serves
# 1F1B, the zero-bubble schedules, DualPipeV and the uneven split
SMALL = ["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false", "optimizer.warmup_iters=0",
         "model.seq_length=64", "train.micro_batch_size=1", "train.global_batch_size=4"]
# 2 sequences per micro-batch (2 per step at DP 1, 1 at DP 2): the TP runs, and the runs with
# fewer micro-batches than stages
TWO_SEQ = ["train.micro_batch_size=2"]
PP2 = ["model.pipeline_model_parallel_size=2"]
# interleaving: 4 layers in 2 x 2 chunks (rank 0 holds layers 0 and 2, rank 1 layers 1 and 3)
FOUR_LAYERS = ["model.num_layers=4"]
VPP2 = [*PP2, "model.virtual_pipeline_model_parallel_size=2"]
INTERLEAVED = ["tiny_cpu.yaml", "fp8_delayed_cpu.yaml", "moe_mxfp8_cpu.yaml", "mxfp8_muon_cpu.yaml",
               "nvfp4_adamw_cpu.yaml"]
# PP 2 x DP 2 against DP 2 (2 micro-batches per step and rank); MoE at EP 2
DP_CASES = {
    "tiny_cpu.yaml": [],
    "mxfp8_adamw_cpu.yaml": [],  # MXFP8 param gather through the reused grad buffer, ZeRO-1
    "mxfp8_muon_cpu.yaml": [],  # layer-wise Muon
    "moe_mxfp8_cpu.yaml": ["model.moe.expert_model_parallel_size=2"],  # dense + expert optimizers
    "zero3": ["ddp.data_parallel_sharding_strategy=optim_grads_params", "ddp.overlap_grad_reduce=true",
              "ddp.overlap_param_gather=true", "ddp.bucket_size=20000"],
}
# PP 2 x TP 2 (+ SP) against TP 2: the hidden states between stages are sequence shards
TP_CASES = {"tiny_cpu.yaml": [], "moe_mxfp8_cpu.yaml": []}
TP2 = [*TWO_SEQ, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
# One micro-batch per step at DP 2 (as the CPU recipes' own 8 / (4 x 2) at 4 ranks): fewer
# than the stages, so the pipeline runs GPipe's order; every recipe, PP 2 x DP 2 against DP 2
FEW = RECIPES
# The zero-bubble schedules, each backward split into its I and W steps (DualPipeV: some of
# them, the others whole, overlapped with a forward), at PP 2 against PP 1, every recipe. ZBV
# runs an uneven split of the 2 layers: chunk 0 the embedding alone, chunks 1 and 2 a layer each,
# chunk 3 the loss alone (rank 0 runs the embedding and the loss, rank 1 both layers); DualPipeV
# the same split asked as Megatron's embedding and loss counted as layers. A MoE model needs an
# MoE layer on every rank, Muon a matrix: their V runs split 4 layers evenly (against the
# 4-layer PP 1 run).
ZERO_BUBBLE = {
    "interleaved_zero_bubble": [*PP2, "model.pipeline_schedule=interleaved_zero_bubble"],
    "zbv_zero_bubble": [*PP2, "model.pipeline_schedule=zbv_zero_bubble",
                        "model.pipeline_model_parallel_layout=E|t|t|L"],
    "dualpipev": [*PP2, "model.pipeline_schedule=dualpipev", "model.account_for_embedding_in_pipeline_split=true",
                  "model.account_for_loss_in_pipeline_split=true"],
}
MOE = "moe_mxfp8_cpu.yaml"
EVERY_STAGE_A_LAYER = (MOE, "mxfp8_muon_cpu.yaml")
NUMERICS = "mxfp8_adamw_cpu.yaml"  # its zero-bubble runs also record the quantization statistics
# 1F1B on an uneven split: both layers on the first stage, the loss alone on the second
UNEVEN_1F1B = [*PP2, "model.pipeline_model_parallel_layout=Ett|L"]
UNEVEN_1F1B_RECIPES = ["fp8_delayed_cpu.yaml"]
# PP 2 x DP 2 and PP 2 x TP 2 with a zero-bubble schedule (against DP 2 / TP 2): overlapped,
# sharded grad reductions ready only after the W steps (ZeRO-3, on the uneven V split), an
# overlapped all-reduce (the readiness regression's run without the fault); sequence shards
# between stages
DP_ZB_CASES = {"zero3": ZERO_BUBBLE["zbv_zero_bubble"], "overlap": ZERO_BUBBLE["interleaved_zero_bubble"]}
TP_ZB_CASES = {"tiny_cpu.yaml": ZERO_BUBBLE["zbv_zero_bubble"]}
# overlapped all-reduce of unsharded buckets (against the DP 2 run without overlap: one
# bucket either way, the same sums); the readiness regression runs it with the fault
OVERLAP = ["ddp.overlap_grad_reduce=true"]
TIED = ["model.tie_embeddings=true"]
# NVFP4 on both layers (the recipe keeps the last one in BF16): stage 1 rounds stochastically
NVFP4_ALL = ["precision.num_layers_at_end_in_bf16=0"]
CKPT = "tiny_cpu.yaml"
# the regressions' runs with their fix removed: they part from the fixed run within 2 steps
FAULT_STEPS = 2
CKPT_STEPS = 4  # the split runs stop after half (train.exit_interval) and resume


def recipe_of(case: str) -> str:
    return case if case.endswith(".yaml") else "tiny_cpu.yaml"


def four_layers(recipe: str, schedule: str) -> bool:
    """Whether ``schedule``'s PP 2 run of ``recipe`` splits 4 layers (and so compares with the
    4-layer PP 1 run): the MoE and Muon V runs (rules PP-MOE-EVERY-STAGE, PP-MUON-EVERY-STAGE)."""
    return recipe in EVERY_STAGE_A_LAYER and schedule != "interleaved_zero_bubble"


def zero_bubble_case(recipe: str, schedule: str) -> list[str]:
    """The overrides of ``schedule``'s PP 2 run of ``recipe`` (the MoE and Muon V runs at 4
    layers, evenly split: :func:`four_layers`)."""
    ov = ZERO_BUBBLE[schedule]
    if four_layers(recipe, schedule):
        return [*ov[:2], *FOUR_LAYERS]
    return ov


def run(recipe: str, extra: list[str], steps: int = STEPS, numerics: bool = False, **kw: Any) -> dict[str, Any]:
    """Losses, grad norms and this rank's fp32 masters after ``steps`` steps (``numerics``:
    and the quantization statistics of every step, :mod:`lptrain.train.numerics`)."""
    from lptrain.testing.parity import train_steps
    from lptrain.train.engine import TrainEngine

    records: list[Any] = []
    unpatched = TrainEngine.train_step

    def armed(self: TrainEngine, batches: Any, step: int, **kwargs: Any) -> Any:
        res = unpatched(self, batches, step, **{**kwargs, "numerics": True})
        records.append(res.numerics)
        return res

    if numerics:
        TrainEngine.train_step = armed  # type: ignore[method-assign]
    try:
        r = train_steps(recipe, [*SMALL, *extra], steps=steps, **kw)
    finally:
        TrainEngine.train_step = unpatched  # type: ignore[method-assign]
    return {"losses": r["losses"], "grad_norms": r["grad_norms"], "masters": r["masters"], "numerics": records}


def pretrain_run(out: Path, *extra: str) -> dict[str, Any]:
    """Run (or resume) :data:`CKPT` into ``out``; its summary."""
    from lptrain.config import compose
    from lptrain.train import pretrain

    ov = [*SMALL, "logging.plots=false", "train.log_interval=null", f"train.train_iters={CKPT_STEPS}",
          f"checkpoint.save={out}/ckpt", *extra]
    return pretrain(compose(CKPT, ov), out)


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def copy_on_rank0(rank: int, src: Path, dst: Path) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.copytree(src, dst)
    dist.barrier()


@contextlib.contextmanager
def one_region_per_step() -> Any:
    """The fault the delayed-scaling regression test injects: the whole schedule step runs
    inside one autocast region of the stage, so each layer's history advances once per step
    (at the region's exit) instead of once per micro-batch as without pipelining."""
    from lptrain.distributed.pipeline import PipelineRunner

    unpatched = PipelineRunner.forward_backward

    def per_step(self: PipelineRunner, micro_batches: Any) -> Any:
        with self.model.autocast(self.groups.everyone.pg):
            return unpatched(self, micro_batches)

    PipelineRunner.forward_backward = per_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        PipelineRunner.forward_backward = unpatched  # type: ignore[method-assign]


@contextlib.contextmanager
def streams_seeded_by_global_rank() -> Any:
    """The fault the stochastic-rounding regression test injects: each stage seeds its
    quantizers' streams with its global rank (rank 1 draws other bits than rank 0, which
    holds all layers without pipelining)."""
    from lptrain.train.engine import TrainEngine

    unpatched = TrainEngine.stream_rank
    TrainEngine.stream_rank = lambda self: self.rank  # type: ignore[method-assign]
    try:
        yield
    finally:
        TrainEngine.stream_rank = unpatched  # type: ignore[method-assign]


@contextlib.contextmanager
def readiness_at_the_input_step() -> Any:
    """The fault the zero-bubble readiness regression test injects: a GEMM weight whose
    gradient is deferred to the W step is not marked pending (nor reported by its W step), so
    the data-parallel hook autograd fires in the I step reports it ready there -- its bucket's
    overlapped reduction starts before the W step adds the last micro-batch's gradient."""
    from lptrain.precision.deferred_wgrad import DeferredWgrads

    unpatched = DeferredWgrads.defer

    def unmarked(self: DeferredWgrads, weights: Any, grads_of: Any) -> None:
        def job() -> None:
            for w, g in zip(weights, grads_of(), strict=True):
                if w.requires_grad and g is not None:
                    w.grad = g if w.grad is None else w.grad + g

        self.jobs.append(job)

    DeferredWgrads.defer = unmarked  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeferredWgrads.defer = unpatched  # type: ignore[method-assign]


def dualpipev_pairs_split() -> bool:
    """Whether the DualPipeV schedule the runner built runs each paired forward and backward
    as two actions, each with its sends right after it (``send_after_each_half``, wired in
    ``PipelineRunner.schedule``): torch's own plan keeps the pairs (actions with sub-actions)
    and posts the forward's output only after the paired backward. One step."""
    from lptrain.testing.parity import train_steps

    engines: list[Any] = []
    train_steps("fp8_delayed_cpu.yaml", [*SMALL, *ZERO_BUBBLE["dualpipev"]], steps=1,
                before_step=lambda engine, step: engines.append(engine))
    orders = [s.pipeline_order_with_comms for s in engines[0].pipeline._schedules.values()]
    return bool(orders) and all(not getattr(a, "sub_actions", None)
                                for order in orders for acts in order.values() for a in acts if a is not None)


def nonfinite_note(rank: int) -> str:
    """The error of a run whose second stage's final-norm gradient turns NaN at step 2 (a hook
    on rank 1 only): every rank stops with the same line, naming the rank, stage and tensor."""
    import torch

    from lptrain.testing.parity import train_steps
    from lptrain.train.engine import TrainingDivergedError

    def poison(engine: Any, step: int) -> None:
        if step == 2 and rank == 1:
            w = engine.model.final_norm.weight
            w.register_hook(lambda g: torch.full_like(g, float("nan")))

    try:
        train_steps("tiny_cpu.yaml", [*SMALL, *PP2], steps=2, before_step=poison)
    except TrainingDivergedError as e:
        return str(e)
    return "no error"


def world2(rank: int, world: int, root: str) -> dict[str, Any]:
    """PP 2: every recipe, interleaving, the zero-bubble schedules and uneven splits, the
    regressions, train-eval-train, tied embeddings, the DP 2 and TP 2 baselines of the 4-rank
    world, and the checkpoint runs (a resume onto another split among them)."""
    from lptrain.testing.parity import first_difference, train_steps

    base = Path(root)
    out: dict[str, Any] = {
        "pp2": {r: run(r, PP2) for r in RECIPES},
        "interleaved": {r: run(r, [*FOUR_LAYERS, *VPP2]) for r in INTERLEAVED},
        "dp2": {c: run(recipe_of(c), ov) for c, ov in DP_CASES.items()},
        "tp2": {c: run(c, [*TP2, *ov]) for c, ov in TP_CASES.items()},
        "dp2_few": {r: run(r, TWO_SEQ) for r in FEW},
        "tied": run("tiny_cpu.yaml", [*TIED, *PP2]),
        "zero_bubble": {(r, s): run(r, zero_bubble_case(r, s), numerics=r == NUMERICS)
                        for r in RECIPES for s in ZERO_BUBBLE},
        "uneven_1f1b": {r: run(r, UNEVEN_1F1B) for r in UNEVEN_1F1B_RECIPES},
    }
    with one_region_per_step():
        out["delayed_per_step"] = run("fp8_delayed_cpu.yaml", PP2, steps=FAULT_STEPS)
    out["sr"] = run("nvfp4_adamw_cpu.yaml", [*NVFP4_ALL, *PP2])
    with streams_seeded_by_global_rank():
        out["sr_global_rank"] = run("nvfp4_adamw_cpu.yaml", [*NVFP4_ALL, *PP2], steps=FAULT_STEPS)
    # train-eval-train (an evaluation through the schedule, a forced param sync) is bitwise
    plain = train_steps("fp8_delayed_cpu.yaml", [*SMALL, *PP2], steps=3)
    evald = train_steps("fp8_delayed_cpu.yaml", [*SMALL, *PP2], steps=3, eval_every=1, sync_after=[2])
    out["eval_bitwise"] = first_difference(plain, evald)
    # and through ZBV's forwards on the uneven V split (torch's own V eval fails: forward_only)
    evald_v = train_steps("fp8_delayed_cpu.yaml", [*SMALL, *ZERO_BUBBLE["zbv_zero_bubble"]], steps=3, eval_every=1,
                          sync_after=[2])
    out["eval_v"] = (evald_v["losses"], evald_v["grad_norms"])
    out["nonfinite"] = nonfinite_note(rank)
    out["dualpipev_pairs_split"] = dualpipev_pairs_split()
    # checkpoints at PP 2: straight, split (bitwise), a copy of the first half for the PP 1
    # and PP 2 x DP 2 resumes, and the resume of the parent's PP 1 save
    half = f"train.exit_interval={CKPT_STEPS // 2}"
    pretrain_run(base / "pp2_straight", *PP2)
    first = pretrain_run(base / "pp2_split", *PP2, half)
    copy_on_rank0(rank, base / "pp2_split", base / "pp2_half")
    second = pretrain_run(base / "pp2_split", *PP2, half)
    out["split_status"] = (first["status"], second["status"], second.get("resumed_from_step"))
    pretrain_run(base / "from_pp1", *PP2)  # a copy of the PP 1 half run, resumed at PP 2
    out["parallel"] = second.get("parallel")  # summary.json's layout
    # `lptrain replay --nproc-per-node 2` of a PP 2 run: every rank replays, rank 0 says it
    from lptrain.train.replay import replay_step

    out["replay"] = replay_step(base / "pp2_split", CKPT_STEPS).lines()
    out["nan_module"] = nan_on_the_last_stage(base / "pp2_nan")
    # the PP 2 (1F1B, even split) half run resumed on the uneven V split under ZBV
    copy_on_rank0(rank, base / "pp2_half", base / "from_pp2_uneven")
    pretrain_run(base / "from_pp2_uneven", *ZERO_BUBBLE["zbv_zero_bubble"])
    return out


def nan_on_the_last_stage(out: Path) -> str:
    """``debug.nan_module`` naming a layer of the second stage (refused on the first one
    before: each stage checked the name against its own layers)."""
    from lptrain.train.engine import TrainingDivergedError

    try:
        pretrain_run(out, *PP2, "debug.nan_sample=1", "debug.nan_module=layers.1.mlp.linear_fc2")
    except TrainingDivergedError as e:
        return str(e)
    return "no error"


def world4(rank: int, world: int, root: str) -> dict[str, Any]:
    """PP 2 x DP 2 and PP 2 x TP 2 against the DP 2 and TP 2 baselines (1F1B and zero-bubble
    schedules), the zero-bubble readiness regression, and the resumes across DP at PP 2."""
    base = Path(root)
    out: dict[str, Any] = {"pp2dp2": {c: run(recipe_of(c), [*ov, *PP2]) for c, ov in DP_CASES.items()},
                           "pp2tp2": {c: run(c, [*TP2, *ov, *PP2]) for c, ov in TP_CASES.items()},
                           "pp2dp2_few": {r: run(r, [*TWO_SEQ, *PP2]) for r in FEW},
                           "pp2dp2_zb": {c: run(recipe_of(c), [*DP_CASES.get(c, OVERLAP), *ov])
                                         for c, ov in DP_ZB_CASES.items()},
                           "pp2tp2_zb": {c: run(c, [*TP2, *TP_CASES[c], *ov]) for c, ov in TP_ZB_CASES.items()}}
    with readiness_at_the_input_step():
        out["ready_at_i"] = run("tiny_cpu.yaml", [*OVERLAP, *DP_ZB_CASES["overlap"]], steps=FAULT_STEPS)
    half = f"train.exit_interval={CKPT_STEPS // 2}"
    pretrain_run(base / "pp2dp2_straight", *PP2)
    pretrain_run(base / "from_pp2", *PP2)  # the PP 2 half run, resumed at PP 2 x DP 2
    pretrain_run(base / "pp2dp2_half", *PP2, half)  # resumed at PP 1 by the parent
    return out
