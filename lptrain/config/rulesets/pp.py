"""Pipeline-parallel rules: what Megatron-LM's ``validate_args`` and its schedules refuse for
PP, and what ``torch.distributed.pipelining``'s schedules need.

The world is judged as ``TP x CP x PP x dp`` ranks (``--dp N``), or a launch's rank count is
split into pipeline stages of ``TP x CP x dp`` ranks each (pipeline ranks outermost:
:mod:`lptrain.catalog.parallel_dims`). The layers are cut into ``PP x VPP`` equal model chunks
(:mod:`lptrain.catalog.pipeline`).
"""

from __future__ import annotations

from typing import Any

from lptrain.catalog.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
    PipelineLayout,
    layout_for,
)
from lptrain.catalog.pipeline_split import SplitError
from lptrain.config.rules import Rule, is_moe
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Pipeline parallelism"
# schedules that run the micro-batches in rounds of one per stage (Megatron's interleaved check)
ROUNDS_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")


def pp_size(c: LPTrainConfig) -> int:
    return max(1, c.model.pipeline_model_parallel_size)


def vpp_size(c: LPTrainConfig) -> int:
    v = c.model.virtual_pipeline_model_parallel_size
    return max(1, v) if v is not None else 1


def layout(c: LPTrainConfig) -> PipelineLayout | None:
    """The run's split (None when the rules on the split refuse it: rulesets.pp_split)."""
    try:
        return layout_for(c.model)
    except SplitError:
        return None


def micro_batches(c: LPTrainConfig, w: World) -> int:
    """Micro-batches per step on each data-parallel rank (what the schedule pipelines)."""
    per = c.train.micro_batch_size * max(1, w.dp)
    return c.train.global_batch_size // per if per > 0 else 0


def _world_not_divisible(c: LPTrainConfig, w: World) -> Any:
    tp = max(1, c.model.tensor_model_parallel_size)
    mp = tp * pp_size(c)
    if pp_size(c) <= 1 or w.ranks is None or w.ranks % mp == 0:
        return False
    # the largest smaller pipeline size this world, the layers and the batch take (at this TP)
    mbs, gbs = c.train.micro_batch_size, c.train.global_batch_size
    fits = [p for p in range(pp_size(c) - 1, 0, -1) if w.ranks % (tp * p) == 0
            and PipelineLayout(c.model.num_layers, p, vpp_size(c) if p > 1 else 1).divides()
            and mbs > 0 and gbs % (mbs * (w.ranks // (tp * p))) == 0]
    other = f", or set model.pipeline_model_parallel_size={fits[0]}" if fits else ""
    return {"mp": mp, "or_other_sizes": other}


def _fewer_micro_batches_than_stages(c: LPTrainConfig, w: World) -> Any:
    m = micro_batches(c, w)
    if pp_size(c) <= 1 or m < 1 or m >= pp_size(c):
        return False
    return {"m": m, "bubble": f"{100 * (pp_size(c) - 1) / (m + pp_size(c) - 1):.0f}%"}


def _too_few_for_interleaving(c: LPTrainConfig, w: World) -> Any:
    if c.model.pipeline_schedule == "1f1b":
        return False
    return _fewer_micro_batches_than_stages(c, w)


def _too_few_for_1f1b(c: LPTrainConfig, w: World) -> Any:
    return _fewer_micro_batches_than_stages(c, w) if c.model.pipeline_schedule == "1f1b" else False


def _interleaved_not_divisible(c: LPTrainConfig, w: World) -> Any:
    m = micro_batches(c, w)
    if pp_size(c) <= 1 or c.model.pipeline_schedule not in ROUNDS_SCHEDULES or m < pp_size(c):
        return False  # (fewer than PP: PP-MICRO-BATCHES)
    return {"m": m} if m % pp_size(c) else False


def _schedule_chunks_mismatch(c: LPTrainConfig, w: World) -> Any:
    """The chunks per rank the schedule runs against the virtual size."""
    s, v = c.model.pipeline_schedule, vpp_size(c)
    if s == "interleaved_1f1b" and v < 2:
        return {"need": "several model chunks per rank (virtual size >= 2)",
                "make_them_agree": "model.virtual_pipeline_model_parallel_size=2 (or more chunks per "
                                   "rank) for interleaved_1f1b"}
    if s == "1f1b" and v > 1:
        return {"need": "one model chunk per rank (virtual size null or 1)",
                "make_them_agree": f"model.pipeline_schedule=interleaved_1f1b for "
                                   f"virtual_pipeline_model_parallel_size={v}"}
    if s in V_SCHEDULES and v != 2:
        return {"need": "exactly two model chunks per rank, placed in a V (virtual size 2)",
                "make_them_agree": f"model.virtual_pipeline_model_parallel_size=2 for {s}"}
    return False


def _dualpipev_too_few(c: LPTrainConfig, w: World) -> Any:
    m = micro_batches(c, w)
    if pp_size(c) <= 1 or c.model.pipeline_schedule != "dualpipev" or m < 1:
        return False
    return {"m": m, "need": 2 * pp_size(c)} if m < 2 * pp_size(c) else False


def _stages_without_moe(c: LPTrainConfig, w: World) -> Any:
    lay = layout(c)
    if lay is None or lay.pp <= 1 or not is_moe(c) or not lay.divides():
        return False
    moe = c.model.moe
    freq = max(1, moe.moe_layer_freq)
    dense = [r for r in range(lay.pp) if not any(i % freq == 0 for i in lay.rank_layers(r))]
    return {"stages": ", ".join(map(str, dense))} if dense else False


def _stages_without_layers_for_muon(c: LPTrainConfig, w: World) -> Any:
    lay = layout(c)
    if lay is None or lay.pp <= 1 or c.optimizer.name != "muon":
        return False
    empty = [r for r in range(lay.pp) if not lay.rank_layers(r)]
    return {"stages": ", ".join(map(str, empty))} if empty else False


RULES = [
    Rule(
        id="LAUNCH-PP-DIVIDES-WORLD", severity="error",
        keys=("model.pipeline_model_parallel_size", "model.tensor_model_parallel_size"),
        when=_world_not_divisible,
        message="tensor x pipeline parallel = {cfg.model.tensor_model_parallel_size} x "
                "{cfg.model.pipeline_model_parallel_size} = {mp} ranks hold one model copy and must "
                "divide the world of {world.ranks} ranks (the data-parallel size is world / {mp})",
        fix="launch a multiple of {mp} ranks ({world.launcher}){or_other_sizes}",
        condition="world % (tensor_model_parallel_size x pipeline_model_parallel_size) == 0",
        why="Megatron-LM's initialize_model_parallel refuses the same: every rank is in exactly "
            "one pipeline of PP stages",
        section=S,
    ),
    Rule(
        id="PP-VIRTUAL-NEEDS-PP", severity="error",
        keys=("model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_size"),
        when=lambda c, w: vpp_size(c) > 1 and pp_size(c) <= 1,
        message="virtual_pipeline_model_parallel_size={cfg.model.virtual_pipeline_model_parallel_size} "
                "interleaves model chunks over pipeline ranks, but pipeline_model_parallel_size=1: it "
                "would have no effect",
        fix="set model.pipeline_model_parallel_size > 1, or model.virtual_pipeline_model_parallel_size=null",
        condition="virtual_pipeline_model_parallel_size > 1 -> pipeline_model_parallel_size > 1",
        why="Megatron-LM refuses the interleaved schedule without pipeline parallelism; a setting "
            "that is accepted must be honoured",
        section=S,
    ),
    Rule(
        id="PP-SCHEDULE-VIRTUAL", severity="error",
        keys=("model.pipeline_schedule", "model.virtual_pipeline_model_parallel_size"),
        when=_schedule_chunks_mismatch,
        message="pipeline_schedule={cfg.model.pipeline_schedule} runs {need}, but "
                "virtual_pipeline_model_parallel_size={cfg.model.virtual_pipeline_model_parallel_size}",
        fix="set {make_them_agree}, or model.pipeline_schedule=null (derived from the virtual size)",
        condition="1f1b <-> one chunk per rank; interleaved_1f1b <-> virtual_pipeline_model_parallel_size "
                  "> 1; zbv_zero_bubble, dualpipev -> virtual_pipeline_model_parallel_size == 2 "
                  "(interleaved_zero_bubble: any)",
        why="Megatron-LM selects the interleaved schedule by the virtual size alone, and torch's V "
            "schedules (ScheduleZBVZeroBubble, ScheduleDualPipeV) refuse any other count than two "
            "stages per rank; a run with other chunks than its schedule runs would not be what was asked",
        section=S,
    ),
    Rule(
        id="PP-SCHEDULE-NEEDS-PP", severity="error",
        keys=("model.pipeline_schedule", "model.pipeline_model_parallel_size"),
        when=lambda c, w: pp_size(c) <= 1 and c.model.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES,
        message="pipeline_schedule={cfg.model.pipeline_schedule} is a pipeline schedule, but "
                "pipeline_model_parallel_size=1: it would have no effect",
        fix="set model.pipeline_model_parallel_size > 1, or model.pipeline_schedule=null",
        condition="pipeline_schedule in (interleaved_zero_bubble, zbv_zero_bubble, dualpipev) -> "
                  "pipeline_model_parallel_size > 1",
        why="a setting that is accepted must be honoured", section=S,
        supersedes=("PP-VIRTUAL-NEEDS-PP",),
    ),
    Rule(
        id="PP-SPLIT-BACKWARD-TE", severity="error",
        keys=("model.pipeline_schedule", "precision.backend"),
        when=lambda c, w: (pp_size(c) > 1 and c.model.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
                           and c.precision.backend == "te"),
        message="pipeline_schedule={cfg.model.pipeline_schedule} splits every backward into its "
                "input-gradient and weight-gradient parts, but Transformer Engine's modules compute "
                "the weight gradient inside their own backward (lptrain does not drive TE's "
                "delay_wgrad_compute): precision.backend=te cannot be split",
        fix="use model.pipeline_schedule=1f1b or interleaved_1f1b with the te backend, or "
            "precision.backend=emulated",
        condition="pipeline_schedule in (interleaved_zero_bubble, zbv_zero_bubble, dualpipev) -> "
                  "precision.backend != te",
        why="the zero-bubble schedules run a weight-gradient (W) step apart from the input-gradient "
            "(I) step; lptrain's emulated GEMMs defer their wgrad (with the micro-batch's quantized "
            "operands) to the W step, TE's modules would run it in the I step and leave W empty -- "
            "correct, but not the schedule that was asked for",
        section=S,
    ),
    Rule(
        id="PP-DUALPIPEV-MICRO-BATCHES", severity="error",
        keys=("train.global_batch_size", "train.micro_batch_size", "model.pipeline_schedule"),
        when=_dualpipev_too_few,
        message="{m} micro-batch(es) per step is fewer than DualPipeV's {need} (two per model chunk "
                "of the pipeline's {cfg.model.pipeline_model_parallel_size} x 2)",
        fix="raise train.global_batch_size to at least micro_batch_size x dp x {need}, or lower "
            "train.micro_batch_size",
        condition="dualpipev -> micro-batches per step >= 2 x pipeline_model_parallel_size",
        why="torch.distributed.pipelining's ScheduleDualPipeV refuses fewer micro-batches than stages",
        section=S,
    ),
    Rule(
        id="PP-MICRO-BATCHES", severity="error",
        keys=("train.global_batch_size", "train.micro_batch_size", "model.pipeline_model_parallel_size"),
        when=_too_few_for_interleaving,
        message="{m} micro-batch(es) per step (global_batch_size / (micro_batch_size x dp)) is fewer "
                "than the {cfg.model.pipeline_model_parallel_size} pipeline stages: "
                "pipeline_schedule={cfg.model.pipeline_schedule} needs at least one micro-batch in "
                "flight per stage",
        fix="raise train.global_batch_size to at least micro_batch_size x dp x "
            "{cfg.model.pipeline_model_parallel_size}, or lower train.micro_batch_size",
        condition="pipeline_schedule != 1f1b -> global_batch_size / (micro_batch_size x dp) >= "
                  "pipeline_model_parallel_size",
        why="torch.distributed.pipelining's ScheduleInterleaved1F1B refuses fewer micro-batches "
            "than stages, and so does Megatron-LM's interleaved schedule (a multiple of PP); the "
            "zero-bubble schedules are built on the same warm-up",
        section=S,
    ),
    Rule(
        id="PP-FEW-MICRO-BATCHES", severity="warning",
        keys=("train.global_batch_size", "train.micro_batch_size", "model.pipeline_model_parallel_size"),
        when=_too_few_for_1f1b,
        message="{m} micro-batch(es) per step is fewer than the "
                "{cfg.model.pipeline_model_parallel_size} pipeline stages: 1F1B's warm-up holds them "
                "all, so each stage runs every forward, then every backward (torch's ScheduleGPipe, "
                "the same order); {bubble} of the step is bubble",
        fix="raise train.global_batch_size to at least micro_batch_size x dp x "
            "{cfg.model.pipeline_model_parallel_size} (or lower train.micro_batch_size) for a "
            "pipeline that overlaps its stages",
        condition="global_batch_size / (micro_batch_size x dp) >= pipeline_model_parallel_size",
        why="the results are the same (the micro-batches run in the same order); the time is not: "
            "the bubble is (p - 1) / (m + p - 1)",
        section=S,
    ),
    Rule(
        id="PP-INTERLEAVED-MICRO-BATCHES", severity="error",
        keys=("train.global_batch_size", "train.micro_batch_size", "model.pipeline_model_parallel_size"),
        when=_interleaved_not_divisible,
        message="{m} micro-batches per step is not a multiple of "
                "pipeline_model_parallel_size={cfg.model.pipeline_model_parallel_size}: the "
                "interleaved schedule runs the micro-batches in rounds of one per stage",
        fix="make global_batch_size / (micro_batch_size x dp) a multiple of "
            "{cfg.model.pipeline_model_parallel_size}",
        condition="interleaved_1f1b, interleaved_zero_bubble -> micro-batches per step % "
                  "pipeline_model_parallel_size == 0",
        why="Megatron-LM's interleaved schedule refuses the same ('number of microbatches is not "
            "divisible by pipeline-model-parallel-size when using interleaved schedule')",
        section=S,
    ),
    Rule(
        id="PP-MOE-EVERY-STAGE", severity="error",
        keys=("model.moe.moe_layer_freq", "model.pipeline_model_parallel_size"),
        when=_stages_without_moe,
        message="pipeline stage(s) {stages} hold no MoE layer (moe_layer_freq="
                "{cfg.model.moe.moe_layer_freq} over {cfg.model.num_layers} layers cut into "
                "{cfg.model.pipeline_model_parallel_size} stages): stages with and without experts "
                "would run different optimizer parts, which is not built",
        fix="choose model.moe.moe_layer_freq (or the pipeline size) so that every stage holds an "
            "MoE layer",
        condition="pipeline_model_parallel_size > 1 and num_experts > 0 -> every stage holds a "
                  "layer with i % moe_layer_freq == 0",
        why="each stage's optimizer joins the others' in the gradient norm child by child "
            "(dense, expert): every stage must have the same children",
        section=S,
    ),
    Rule(
        id="PP-MUON-EVERY-STAGE", severity="error",
        keys=("optimizer.name", "model.pipeline_model_parallel_layout",
              "model.account_for_embedding_in_pipeline_split", "model.account_for_loss_in_pipeline_split"),
        when=_stages_without_layers_for_muon,
        message="pipeline stage(s) {stages} hold no transformer layer (only the embedding and/or the "
                "loss), so no Muon matrix: stages with and without a Muon optimizer part would join the "
                "gradient norm differently, which is not built",
        fix="give every pipeline rank a transformer layer (the layout, or fewer layers counted for "
            "the embedding / loss), or use optimizer.name=adamw",
        condition="pipeline_model_parallel_size > 1 and optimizer.name = muon -> every pipeline rank "
                  "holds a transformer layer",
        why="Muon optimizes the layers' matrices (the embedding and the head take the scalar "
            "optimizer); each stage's optimizer joins the others' child by child",
        section=S,
    ),
]
