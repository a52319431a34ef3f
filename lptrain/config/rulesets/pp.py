"""Pipeline-parallel rules: what Megatron-LM's ``validate_args`` and its schedules refuse for
PP, and what ``torch.distributed.pipelining``'s schedules need.

The world is judged as ``TP x CP x PP x dp`` ranks (``--dp N``), or a launch's rank count is
split into pipeline stages of ``TP x CP x dp`` ranks each (pipeline ranks outermost:
:mod:`lptrain.catalog.parallel_dims`). The layers are cut into ``PP x VPP`` equal model chunks
(:mod:`lptrain.catalog.pipeline`).
"""

from __future__ import annotations

from typing import Any

from lptrain.catalog.pipeline import PipelineLayout
from lptrain.config.rules import Rule, is_moe
from lptrain.config.schema import LPTrainConfig
from lptrain.config.world import World

S = "Pipeline parallelism"


def pp_size(c: LPTrainConfig) -> int:
    return max(1, c.model.pipeline_model_parallel_size)


def vpp_size(c: LPTrainConfig) -> int:
    v = c.model.virtual_pipeline_model_parallel_size
    return max(1, v) if v is not None else 1


def layout(c: LPTrainConfig) -> PipelineLayout:
    return PipelineLayout(c.model.num_layers, pp_size(c), vpp_size(c))


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


def _layers_bad(c: LPTrainConfig, w: World) -> Any:
    lay = layout(c)
    if lay.chunks <= 1 or c.model.num_layers < 1 or lay.divides():
        return False
    what = (f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {lay.pp} x "
            f"{lay.vpp} = {lay.chunks} model chunks" if lay.vpp > 1 else
            f"pipeline_model_parallel_size={lay.pp} stages")
    return {"what": what, "chunks": lay.chunks}


def _fewer_micro_batches_than_stages(c: LPTrainConfig, w: World) -> Any:
    m = micro_batches(c, w)
    if pp_size(c) <= 1 or m < 1 or m >= pp_size(c):
        return False
    return {"m": m, "bubble": f"{100 * (pp_size(c) - 1) / (m + pp_size(c) - 1):.0f}%"}


def _too_few_for_interleaving(c: LPTrainConfig, w: World) -> Any:
    return _fewer_micro_batches_than_stages(c, w) if vpp_size(c) > 1 else False


def _too_few_for_1f1b(c: LPTrainConfig, w: World) -> Any:
    return _fewer_micro_batches_than_stages(c, w) if vpp_size(c) <= 1 else False


def _interleaved_not_divisible(c: LPTrainConfig, w: World) -> Any:
    m = micro_batches(c, w)
    if pp_size(c) <= 1 or c.model.pipeline_schedule != "interleaved_1f1b" or m < pp_size(c):
        return False  # (fewer than PP: PP-MICRO-BATCHES)
    return {"m": m} if m % pp_size(c) else False


def _stages_without_moe(c: LPTrainConfig, w: World) -> Any:
    lay = layout(c)
    if lay.pp <= 1 or not is_moe(c) or not lay.divides():
        return False
    moe = c.model.moe
    freq = max(1, moe.moe_layer_freq)
    dense = [r for r in range(lay.pp) if not any(i % freq == 0 for i in lay.rank_layers(r))]
    return {"stages": ", ".join(map(str, dense))} if dense else False


def _schedule_disagrees(c: LPTrainConfig, w: World) -> Any:
    """The interleaved schedule without virtual chunks, or virtual chunks under another
    schedule; the fix says which one to change to what (it said "set vpp >= 2" to a run
    whose vpp was 2 and schedule 1f1b)."""
    interleaved = c.model.pipeline_schedule == "interleaved_1f1b"
    if interleaved == (vpp_size(c) > 1):
        return False
    if interleaved:
        return {"make_them_agree": "model.virtual_pipeline_model_parallel_size=2 (or more chunks "
                                   "per rank) for interleaved_1f1b"}
    return {"make_them_agree": f"model.pipeline_schedule=interleaved_1f1b for "
                               f"virtual_pipeline_model_parallel_size={vpp_size(c)}"}


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
        id="PP-LAYERS-DIVIDE", severity="error",
        keys=("model.num_layers", "model.pipeline_model_parallel_size",
              "model.virtual_pipeline_model_parallel_size"),
        when=_layers_bad,
        message="num_layers={cfg.model.num_layers} must divide into {what}: every stage (and every "
                "virtual chunk) holds the same number of layers",
        fix="set model.num_layers to a multiple of {chunks}, or change the pipeline sizes",
        condition="num_layers % (pipeline_model_parallel_size x virtual_pipeline_model_parallel_size) == 0",
        why="Megatron-LM's validate_args refuses the same ('number of layers should be divisible "
            "by the pipeline parallel size', and per virtual stage); uneven first/last stages are "
            "not built",
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
        when=_schedule_disagrees,
        message="pipeline_schedule={cfg.model.pipeline_schedule} with "
                "virtual_pipeline_model_parallel_size={cfg.model.virtual_pipeline_model_parallel_size}: "
                "the interleaved schedule runs exactly when each rank holds several model chunks",
        fix="set {make_them_agree}, or model.pipeline_schedule=null (derived from the virtual size)",
        condition="pipeline_schedule == interleaved_1f1b <-> virtual_pipeline_model_parallel_size > 1",
        why="Megatron-LM selects the interleaved schedule by the virtual size alone; a 1f1b run "
            "with virtual chunks, or an interleaved one without, would not be what was asked",
        section=S,
    ),
    Rule(
        id="PP-MICRO-BATCHES", severity="error",
        keys=("train.global_batch_size", "train.micro_batch_size", "model.pipeline_model_parallel_size"),
        when=_too_few_for_interleaving,
        message="{m} micro-batch(es) per step (global_batch_size / (micro_batch_size x dp)) is fewer "
                "than the {cfg.model.pipeline_model_parallel_size} pipeline stages: the interleaved "
                "schedule needs at least one micro-batch in flight per stage",
        fix="raise train.global_batch_size to at least micro_batch_size x dp x "
            "{cfg.model.pipeline_model_parallel_size}, or lower train.micro_batch_size",
        condition="interleaved_1f1b -> global_batch_size / (micro_batch_size x dp) >= "
                  "pipeline_model_parallel_size",
        why="torch.distributed.pipelining's ScheduleInterleaved1F1B refuses fewer micro-batches "
            "than stages, and so does Megatron-LM's interleaved schedule (a multiple of PP)",
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
        condition="interleaved_1f1b -> micro-batches per step % pipeline_model_parallel_size == 0",
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
]
