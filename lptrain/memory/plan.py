"""The memory planner: per-rank bytes of a recipe at a data-parallel size, before any GPU.

Why it can be trusted: it runs the engine's own planning code on a model built on the meta
device (no memory, any size) -- :func:`lptrain.distributed.layout.param_specs` /
``plan_layout`` (or the layer-wise Muon layout and ownership of
:mod:`lptrain.optim.layerwise`), the same bucket padding, the same shard ranges -- and sizes
quantized primary weights through the :class:`~lptrain.precision.tensors.QuantizedTensor`
interface (``nbytes()`` of a tensor the run's own weight quantizer produced), so
``tests/unit/memory/test_estimate_memory.py`` can hold every persistent category to 1% of a
real CPU engine. The per-rank accounting itself is :func:`lptrain.memory.accounting.rank_memory`,
the one the analytic model and the engine's report share.

Categories (bytes on one rank; ``ranks`` holds every rank, ``worst`` the largest):

* ``weights``: high-precision (bf16/fp32) parameters, inside or outside the param buffers;
* ``quantized_weights``: FP8/FP4 primary weights, both orientations with their scales
  (``precision.fp8_param_gather`` / ``fp4_param_gather``);
* ``grads``: the grad buffers' parameter elements (``main_grad`` views);
* ``masters``: fp32 master copies this rank updates (its shard; whole matrices it owns); with
  the precision-aware optimizer as stored (fp16 with scales, or an int16 remainder of the bf16
  param, when TE holds them: :mod:`lptrain.memory.optimizer`);
* ``optimizer_states``: AdamW ``exp_avg``/``exp_avg_sq``/``step`` (Lion: ``exp_avg``), Muon
  ``momentum_buffer``; with the precision-aware optimizer in their stored dtypes and scales;
* ``padding``: alignment and bucket padding of the grad and param buffers;
* ``param_gather_staging``: the high-precision staging area of quantized buffers for the
  param all-gather (zero when ``ddp.reuse_grad_buf_for_mxfp8_param_ag`` reuses the grad
  buffer, or when bytes are gathered directly);
* ``weight_copies``: transient per-step copies -- quantized GEMM weight copies saved for
  backward when primary weights are high precision, the fp32 upcast of the LM head on an
  fp32-activation run;
* ``sharded_buckets``: with ``ddp.data_parallel_sharding_strategy=optim_grads`` /
  ``optim_grads_params``, the full grad and param buckets alive at the activation peak;
* ``activations``: tensors one micro-batch keeps for backward under the run's recompute
  settings, plus the region being recomputed (see :mod:`lptrain.memory.activations`);
  ``activations_recompute`` is the figure with full per-layer recompute, for comparison.
  Under pipeline parallelism: the stage's layers, times the micro-batches it holds in flight;
* ``pipeline_buffers`` (pipeline parallelism only): the schedule's receive buffers, one
  hidden-state tensor per micro-batch for each chunk's input and output gradient.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lptrain.config.schema import LPTrainConfig
from lptrain.distributed.layout import BufferLayout, ParamSpec
from lptrain.memory.accounting import Sharding, StoredParam, rank_memory
from lptrain.memory.breakdown import PERSISTENT as PERSISTENT  # the categories listed above
from lptrain.memory.context_parallel import context_parallel_note, cp_buffer_bytes
from lptrain.memory.optimizer import optimizer_layout, optimizer_state_dtypes

_WEIGHT_NAME = re.compile(r"weight\d*")
_EXACT_NUMEL = 1 << 22  # quantize shapes up to 4M elements whole; larger ones by row slabs
_SLAB_ROWS = (256, 512)
_MAX_RANKS = 64  # ranks evaluated one by one (more: evenly spaced samples)


@dataclass
class RankMemory:
    """Bytes per category on one rank."""

    rank: int
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class MemoryEstimate:
    """The planner's answer for one (recipe, dp) pair."""

    dp: int
    ranks: list[RankMemory]
    activations_recompute: int
    params: int
    layout_report: str
    notes: list[str] = field(default_factory=list)
    tp: int = 1  # tensor-parallel size (the world is tp x cp x pp x dp ranks)
    pp: int = 1  # pipeline-parallel size (ranks of every stage are in ``ranks``)
    cp: int = 1  # context-parallel size
    # micro-batches whose activations the worst rank's stage holds at once (1 without PP);
    # ``layout_report`` is that stage's too: every figure printed is the worst rank's
    in_flight: float = 1.0
    # the stored dtypes of the optimizer tensors ({}: fp32 throughout, no precision-aware
    # optimizer): main_grads, masters (who holds them), exp_avg, exp_avg_sq
    optimizer_state: dict[str, str] = field(default_factory=dict)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    def to_dict(self) -> dict[str, Any]:
        w = self.worst
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "params": self.params,
            "worst_rank": w.rank,
            "bytes": dict(w.bytes),
            "total_bytes": w.total,
            "activations_recompute_bytes": self.activations_recompute,
            "per_rank_total_bytes": [r.total for r in self.ranks],
            "activations_in_flight": self.in_flight,
            "optimizer_state_dtypes": dict(self.optimizer_state) or optimizer_state_dtypes(None),
            "notes": list(self.notes),
        }


# ---- the model on the meta device, quantized weights sized through the interface -------------


def _planning_cfg(cfg: LPTrainConfig) -> LPTrainConfig:
    """``cfg`` as the meta build needs it: emulated backend (TE layers need CUDA), and no
    quantized primary weights (quantizing needs values; they are sized separately)."""
    out = copy.deepcopy(cfg)
    out.model.context_parallel_size = 1  # (CP shards no weight: the shapes are CP 1's)
    out.model.cp_comm_type = "p2p"
    out.model.hierarchical_context_parallel_sizes = None
    out.precision.backend = "emulated"
    out.precision.fp8_param_gather = False
    out.precision.fp4_param_gather = False
    return out


def _quantized_primary(cfg: LPTrainConfig) -> bool:
    from lptrain.precision.factory import recipe_from_config

    p = cfg.precision
    return bool(p.fp8_param_gather or p.fp4_param_gather) and recipe_from_config(p) is not None


class _Quantizers:
    """The run's weight/input quantizers, taken from a small CPU layer of the run's factory
    (so every recipe option applies), with a cache of sizes by shape."""

    def __init__(self, cfg: LPTrainConfig) -> None:
        from lptrain.precision.factory import build_factory

        factory = build_factory(_planning_cfg(cfg).precision, num_layers=cfg.model.num_layers)
        self.recipe = factory.recipe
        align = max(16, factory.alignment)
        with torch.device("cpu"):
            layer = factory.linear(align, align, name="memory_planner_probe")
        self.members = layer.quant_state(self.recipe).members[0]
        self._cache: dict[tuple[Any, ...], tuple[Any, int]] = {}

    def weight(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, int]:
        """``(proxy, nbytes)``: a quantized tensor of the same kind (for its staging dtype)
        and the bytes a quantized primary weight of ``shape`` holds (both orientations)."""
        key = ("w", shape, dtype)
        if key not in self._cache:
            self._cache[key] = self._sized(self.members.weight, shape, dtype)
        return self._cache[key]

    def input_bytes_per_row(self, width: int, dtype: torch.dtype) -> float:
        """Bytes per token of a GEMM input of ``width`` kept for backward (column-wise)."""
        key = ("x", width, dtype)
        if key not in self._cache:
            q = self.members.input.with_usage(False, True)
            rows = 128
            qt = q.quantize(torch.zeros(rows, width, dtype=dtype))
            self._cache[key] = (None, qt.nbytes())
        return self._cache[key][1] / 128

    def weight_copy_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """A GEMM weight's column-wise copy kept for backward (high-precision primaries)."""
        key = ("wc", shape, dtype)
        if key not in self._cache:
            self._cache[key] = self._sized(self.members.weight.with_usage(False, True), shape, dtype)
        return self._cache[key][1]

    @staticmethod
    def _sized(quantizer: Any, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, int]:
        def make(s: tuple[int, ...]) -> Any:
            z = torch.zeros(s, dtype=dtype)
            if len(s) == 3:
                return quantizer.quantize_grouped(z)
            return quantizer.quantize(z)

        if math.prod(shape) <= _EXACT_NUMEL or shape[-2] <= _SLAB_ROWS[1]:
            q = make(shape)
            return q, q.nbytes()
        # Bytes are affine in the row count (per-row data and block scales, plus per-tensor
        # constants): two slabs whose row counts are multiples of every block height fix it.
        r1, r2 = _SLAB_ROWS
        q1, q2 = make((*shape[:-2], r1, shape[-1])), make((*shape[:-2], r2, shape[-1]))
        per_row = (q2.nbytes() - q1.nbytes()) / (r2 - r1)
        return q1, round(q1.nbytes() + per_row * (shape[-2] - r1))


@dataclass
class _Param:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    quantized_bytes: int  # 0 for a high-precision param
    gemm_weight: bool


def meta_model(cfg: LPTrainConfig, ep_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> torch.nn.Module:
    """The run's model on the meta device (shapes and tags, no memory): tensor-parallel rank
    ``tp_rank``'s shards under ``model.tensor_model_parallel_size`` (every TP rank has the
    same shapes), pipeline rank ``pp_rank``'s stage under ``model.pipeline_model_parallel_size``."""
    from lptrain.model.build import build_model
    from lptrain.model.pipeline import model_part
    from lptrain.model.process_group import SINGLE_RANK, ShapeOnlyGroup

    tp = max(1, cfg.model.tensor_model_parallel_size)
    group = ShapeOnlyGroup(tp, tp_rank) if tp > 1 else SINGLE_RANK
    with torch.device("meta"):
        return build_model(_planning_cfg(cfg), expert_model_parallel_rank=ep_rank,
                           tensor_parallel_group=group, part=model_part(cfg.model, pp_rank))


def _gemm_weights(model: torch.nn.Module) -> set[int]:
    """Parameters of the factory's GEMM layers (the ones that become quantized primaries)."""
    out: set[int] = set()
    for m in model.modules():
        if callable(getattr(m, "quant_state", None)):
            for n, p in m.named_parameters(recurse=False):
                if _WEIGHT_NAME.fullmatch(n):
                    out.add(id(p))
    return out


def _specs(
    cfg: LPTrainConfig, model: torch.nn.Module, quantizers: Optional[_Quantizers]
) -> tuple[list[ParamSpec], list[_Param]]:
    """Layout specs through the engine's own functions; a param the run keeps as a quantized
    primary weight gets the buffer key its quantized tensor would get (``staging_dtype`` /
    ``is_quantized`` of a proxy the run's weight quantizer made)."""
    from dataclasses import replace

    from lptrain.distributed.layerwise_layout import muon_buffer_key
    from lptrain.distributed.layout import param_specs
    from lptrain.precision.param_storage import is_quantized, staging_dtype

    gemm = _gemm_weights(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layer_wise = bool(cfg.optimizer.use_layer_wise_optimizer)
    specs = param_specs(named, grad_reduce_in_fp32=bool(cfg.ddp.grad_reduce_in_fp32),
                        separate_muon=layer_wise or cfg.optimizer.name == "muon")
    out: list[ParamSpec] = []
    info: list[_Param] = []
    for spec, (n, p) in zip(specs, named, strict=True):
        qbytes = 0
        if quantizers is not None and id(p) in gemm:
            proxy, qbytes = quantizers.weight(tuple(p.shape), p.dtype)
            key = replace(spec.key, param_dtype=staging_dtype(proxy), quantized=is_quantized(proxy))
            spec = replace(spec, key=key)
        if layer_wise and spec.key.is_muon:  # as layer_wise_param_specs: keyed by logical dtype
            spec = replace(spec, key=muon_buffer_key(spec.key, p.dtype))
        out.append(spec)
        info.append(_Param(n, tuple(p.shape), p.dtype, p.numel(), qbytes, id(p) in gemm))
    return out, info


def engine_layout(cfg: LPTrainConfig, specs: Sequence[ParamSpec], intra: int,
                  expert_intra: Optional[int] = None) -> BufferLayout:
    """The layout ``TrainEngine`` plans for these specs (the same function)."""
    from lptrain.distributed.layout import plan_run_layout

    return plan_run_layout(cfg, specs, intra, expert_dp=expert_intra)


# ---- per-rank accounting ------------------------------------------------------------------------


def parallel_dims(cfg: LPTrainConfig, dp: int) -> Any:
    """The run's :class:`~lptrain.catalog.parallel_dims.ParallelDims` at data-parallel size
    ``dp`` (the world is tensor x context x pipeline parallel x ``dp`` ranks)."""
    from lptrain.catalog.parallel_dims import ParallelDims

    moe = cfg.model.moe
    return ParallelDims(tp=max(1, cfg.model.tensor_model_parallel_size), dp=dp,
                        cp=max(1, cfg.model.context_parallel_size),
                        pp=max(1, cfg.model.pipeline_model_parallel_size),
                        ep=moe.expert_model_parallel_size if moe.num_experts else 1,
                        sequence_parallel=cfg.model.sequence_parallel)


def _group_sizes(cfg: LPTrainConfig, dp: int) -> tuple[int, int]:
    """(dense intra size, expert intra size): the shard groups of dense and expert buffers
    (one optimizer instance's data x context parallel ranks; expert-data-parallel spans the
    TP and CP ranks)."""
    inst = max(1, cfg.ddp.num_distributed_optimizer_instances)
    dims = parallel_dims(cfg, dp)
    return dp * dims.cp // inst, max(1, dims.edp // inst)


def _sharding(cfg: LPTrainConfig, dp: int, rank: int) -> Sharding:
    """Rank ``rank`` of the data x context parallel group (at tensor-parallel rank 0, on the
    first pipeline stage: every stage's shards lie alike): its index in the dense and the
    expert shard groups, from the rank arithmetic of :mod:`lptrain.catalog.parallel_dims`."""
    from lptrain.catalog.parallel_dims import EXPERT_ORDER

    dense_n, expert_n = _group_sizes(cfg, dp)
    dims = parallel_dims(cfg, dp)
    world_rank = dims.rank_of(cp=rank % dims.cp, dp=rank // dims.cp)
    return Sharding(dense_n, rank % dense_n, expert_n,
                    dims.coords(world_rank, EXPERT_ORDER)["edp"] % expert_n)


def _stored(info: Sequence[_Param]) -> dict[str, StoredParam]:
    return {p.name: StoredParam(p.numel, p.quantized_bytes or p.numel * p.dtype.itemsize,
                                bool(p.quantized_bytes)) for p in info}


def _transient_weight_copies(
    cfg: LPTrainConfig, model: torch.nn.Module, info: Sequence[_Param], quantizers: Optional[_Quantizers],
    act_bytes: int, in_flight: float = 1.0,
) -> int:
    """Quantized weight copies a forward keeps for its backward: once per micro-batch in
    flight (a pipeline stage's), except on Transformer Engine with full recompute, whose
    forward keeps none (the recompute quantizes again, one layer at a time)."""
    total = 0
    te_recompute = cfg.precision.backend == "te" and cfg.model.recompute_granularity == "full"
    per_micro_batch = 1.0 if te_recompute else in_flight
    if quantizers is not None and not _quantized_primary(cfg):
        # Every quantized GEMM keeps its weight's column-wise copy until its backward;
        # layers kept in bf16 (precision.first_last_layers_bf16) keep none.
        factory = getattr(model, "factory", None)
        for p in info:
            if not p.gemm_weight:
                continue
            m = re.match(r"layers\.(\d+)\.", p.name)
            if m and factory is not None and factory.is_bf16_layer(int(m.group(1)) + 1):
                continue
            total += int(per_micro_batch * quantizers.weight_copy_bytes(p.shape, p.dtype))
    if getattr(model, "final_norm", None) is None:
        return total  # a pipeline stage without the head
    head = model.output_weight
    if act_bytes == 4 and head.dtype != torch.float32:
        total += head.numel() * 4  # head_logits upcasts the weight for an fp32 GEMM
    return total


def _sharded_bucket_bytes(layout: BufferLayout) -> int:
    """Full buckets alive at the activation peak (end of forward, start of backward) with
    sharded grads / params: the first grad bucket the backward fills (the largest, to be
    safe) and, with sharded params, the bucket in use plus the one prefetched (and a tied
    embedding's bucket, kept from the forward to the backward)."""
    total = 0
    for b in layout.buffers:
        if not b.buckets:
            continue
        largest = max(k.numel for k in b.buckets)
        if b.shards_grads:
            total += largest * b.key.grad_dtype.itemsize
        if b.shards_params:
            total += 2 * largest * b.key.param_dtype.itemsize
    return total


def _sampled_ranks(dp: int) -> list[int]:
    if dp <= _MAX_RANKS:
        return list(range(dp))
    return sorted({round(i * (dp - 1) / (_MAX_RANKS - 1)) for i in range(_MAX_RANKS)})


def activation_dtype_bytes(cfg: LPTrainConfig, target: str) -> int:
    """Bytes of the activations flowing between layers: fp32 on CPU, the 16-bit params dtype
    on a GPU (``lptrain.model.build.compute_dtype_for``)."""
    from lptrain.model.build import compute_dtype_for, params_dtype_of

    device = torch.device("cpu" if target == "cpu" else "cuda")
    return compute_dtype_for(device, params_dtype_of(cfg.precision.params_dtype)).itemsize


def estimate_memory(cfg: LPTrainConfig, dp: int, target: str = "cpu") -> MemoryEstimate:
    """Per-rank bytes of a derived ``cfg`` at data-parallel size ``dp`` on ``target``. Under
    pipeline parallelism every stage is planned from its own model part (its layers, the
    embedding on the first, the head on the last) with its in-flight micro-batches
    (:meth:`lptrain.catalog.pipeline.PipelineLayout.in_flight`) and the schedule's receive
    buffers; the ranks of every stage are reported, the worst is the most loaded stage's."""
    from lptrain.memory.pipeline_plan import (
        pipeline_buffer_bytes,
        sampled_stages,
        stage_in_flight,
        stage_params,
    )
    from lptrain.model.pipeline import pipeline_layout
    from lptrain.precision.factory import recipe_from_config

    quantizers = _Quantizers(cfg) if recipe_from_config(cfg.precision) is not None else None
    act_bytes = activation_dtype_bytes(cfg, target)
    lay = pipeline_layout(cfg.model)
    dims = parallel_dims(cfg, dp)
    micro = max(1, cfg.train.global_batch_size // max(1, cfg.train.micro_batch_size * dp))
    ranks: list[RankMemory] = []
    params = 0
    # per stage: its layout report, full-recompute activations and micro-batches in flight
    reports: dict[int, str] = {}
    recompute: dict[int, int] = {}
    in_flight = stage_in_flight(cfg, lay, micro) if lay.pp > 1 else {0: 1.0}
    for stage in sampled_stages(lay.pp):
        model = meta_model(cfg, pp_rank=stage)
        stage_ranks, recompute[stage], reports[stage] = _stage_memory(
            cfg, dp, model, quantizers, act_bytes, in_flight[stage],
            pipeline_buffer_bytes(cfg, lay, stage, micro, act_bytes))
        for r in stage_ranks:
            r.rank = dims.rank_of(cp=r.rank % dims.cp, dp=r.rank // dims.cp, pp=stage)
        ranks += stage_ranks
        params += stage_params(model, stage, lay.pp)
    # every figure reported is the most loaded rank's, from its own stage (its layout, its
    # micro-batches in flight), never another stage's
    worst_stage = dims.coords(max(ranks, key=lambda r: (r.total, -r.rank)).rank)["pp"]
    notes = []
    if dp * dims.cp > _MAX_RANKS:
        notes.append(f"{len(ranks) // len(sampled_stages(lay.pp))} of {dp * dims.cp} data"
                     f"{' x context' if dims.cp > 1 else ''}-parallel ranks evaluated (evenly "
                     "spaced, first and last included)")
    if dims.cp > 1:
        notes.append(context_parallel_note(cfg))
    if cfg.model.moe.num_experts:
        notes.append("MoE activations are estimated for perfectly balanced routing")
    tp = max(1, cfg.model.tensor_model_parallel_size)
    if tp > 1:
        notes.append(f"tensor parallel {tp}{' + sequence parallel' if cfg.model.sequence_parallel else ''}: "
                     f"{tp * dims.cp * dp * lay.pp} ranks; the figures are one rank's (its shards), params "
                     "the whole model's")
    if lay.pp > 1:
        notes.append(
            f"pipeline parallel {lay.pp}{f' x {lay.vpp} virtual chunks' if lay.vpp > 1 else ''} "
            f"({cfg.model.pipeline_schedule}, {micro} micro-batches per step): stage "
            f"{worst_stage} is the most loaded; it holds {micro_batches(in_flight[worst_stage])} "
            f"of activations at most (stage 0: {in_flight[0]:g}), as Megatron-LM counts them (the "
            "zero-bubble schedules: read off their order, each held until its W step), and the "
            "schedule's receive buffers of every micro-batch; the layout is stage "
            f"{worst_stage}'s")
        if lay.uneven or lay.v_shape:  # the split each stage was planned from
            notes.append("split: " + "; ".join(lay.describe().splitlines()))
    state = optimizer_state_dtypes(cfg) if cfg.optimizer.use_precision_aware_optimizer else {}
    if state:
        notes.append("precision-aware optimizer: " + ", ".join(f"{k} {v}" for k, v in state.items()))
    return MemoryEstimate(
        dp=dp, ranks=ranks, activations_recompute=recompute[worst_stage], params=params,
        layout_report=reports[worst_stage], notes=notes, tp=tp, pp=lay.pp, cp=dims.cp,
        in_flight=in_flight[worst_stage], optimizer_state=state,
    )


def micro_batches(n: float) -> str:
    """``1 micro-batch``, ``7 micro-batches``, ``5.25 micro-batches``."""
    return f"{n:g} micro-batch{'' if n == 1 else 'es'}"


def _stage_memory(cfg: LPTrainConfig, dp: int, model: torch.nn.Module, quantizers: Optional[_Quantizers],
                  act_bytes: int, in_flight: float, buffers: int) -> tuple[list[RankMemory], int, str]:
    """The data-parallel ranks of one stage (``model``: its part), its full-recompute
    activations and its layout report."""
    from lptrain.memory.activations import activation_bytes, configured_activation_bytes

    specs, info = _specs(cfg, model, quantizers if _quantized_primary(cfg) else None)
    dense_n, expert_n = _group_sizes(cfg, dp)
    layout = engine_layout(cfg, specs, dense_n, expert_n)
    _, acts_rc = activation_bytes(cfg, model, act_bytes, quantizers, in_flight)
    acts = configured_activation_bytes(cfg, model, act_bytes, quantizers, in_flight)
    buckets = _sharded_bucket_bytes(layout)
    copies = _transient_weight_copies(cfg, model, info, quantizers, act_bytes, in_flight)
    optimizer = optimizer_layout(cfg, layout, *_group_sizes(cfg, dp))
    stored = _stored(info)
    reuse = bool(cfg.ddp.reuse_grad_buf_for_mxfp8_param_ag)
    ranks = []
    cp_buffers = cp_buffer_bytes(cfg, act_bytes)
    for r in _sampled_ranks(dp * max(1, cfg.model.context_parallel_size)):
        b = rank_memory(layout, stored, _sharding(cfg, dp, r), optimizer,
                        reuse_grad_buffer=reuse).categories()
        b["weight_copies"] = copies
        b["sharded_buckets"] = buckets
        b["activations"] = acts
        if buffers:
            b["pipeline_buffers"] = buffers
        if cp_buffers:
            b["cp_buffers"] = cp_buffers
        ranks.append(RankMemory(r, b))
    return ranks, acts_rc, layout.report()
