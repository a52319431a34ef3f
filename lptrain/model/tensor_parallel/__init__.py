"""The parallelize step: the parallelism-agnostic GPT made tensor (and sequence) parallel.

Model code never mentions tensor parallelism. :func:`build_parallel` builds the same
``GPTModel`` against a :class:`ShardingFactory` -- the run's layer factory, except that the
GEMM layers the plan names (:data:`TP_PLAN`, by canonical name, as torchtitan's plans) come
out as this rank's shard, initialized with the single-rank values of its slice -- and then
:func:`parallelize` swaps in the rest:

=====================  ===========================================  ==============================
module                 tensor parallel                              + sequence parallel
=====================  ===========================================  ==============================
QKV, fc1 (column)      output rows split (QKV by query groups,      input all-gathered along the
                       fc1 as ``[gate_t | up_t]``)                  sequence
proj, fc2 (row)        input columns split, outputs all-reduced     outputs reduce-scattered
attention              ``heads / TP`` heads, ``groups / TP`` kv     --
embedding              vocab rows split, partials all-reduced       partials reduce-scattered
output head, loss      vocab rows split, vocab-parallel CE          input all-gathered
norms                  q/k norms: gradient summed over TP           every norm: gradient summed
MoE router, experts    (refused: rule TP-MOE-NEEDS-SP)              router on the sequence shard,
                                                                    experts whole (expert TP 1)
=====================  ===========================================  ==============================

On the Transformer Engine backend the planned layers are TE's own ``Linear`` with its
``tp_group``, ``tp_size``, ``parallel_mode`` and ``sequence_parallel``: TE does their
collectives. The rank arithmetic (which ranks, which rows) is
:mod:`lptrain.catalog.parallel_dims`'; the groups come from whoever builds the model.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Optional

from torch import nn

from lptrain.catalog.parallel_dims import ShardLayout, padded_vocab_size
from lptrain.model.attention import SelfAttention
from lptrain.model.build_context import BuildContext
from lptrain.model.gpt import GPTModel
from lptrain.model.moe.router import TopKRouter
from lptrain.model.norm import RMSNorm
from lptrain.model.process_group import ProcessGroup
from lptrain.model.tensor_parallel.vocab import (
    TiedVocabParallelHead,
    TPRMSNorm,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelOutputHead,
)
from lptrain.precision.tensor_parallel import TPShard, sliced_init

__all__ = ["TP_PLAN", "ShardingFactory", "build_parallel", "parallelize", "plan_style",
           "whole_parameter_count"]

# canonical layer name -> (parallel mode, chunks of the split dimension)
TP_PLAN: tuple[tuple[re.Pattern[str], str, int], ...] = (
    (re.compile(r"^layers\.\d+\.self_attention\.linear_qkv$"), "column", 1),
    (re.compile(r"^layers\.\d+\.self_attention\.linear_proj$"), "row", 1),
    (re.compile(r"^layers\.\d+\.mlp\.linear_fc1$"), "column", 2),  # SwiGLU [gate | up]
    (re.compile(r"^layers\.\d+\.mlp\.linear_fc2$"), "row", 1),
)


def plan_style(name: str) -> Optional[tuple[str, int]]:
    """``(mode, chunks)`` of the layer named ``name`` in :data:`TP_PLAN`, or None (whole)."""
    for pattern, mode, chunks in TP_PLAN:
        if pattern.match(name):
            return mode, chunks
    return None


class ShardingFactory:
    """The run's layer factory, except that the GEMM layers :data:`TP_PLAN` names are built
    as this rank's tensor-parallel shard (through the factory's Transformer-Engine-style
    arguments); every other attribute is the run factory's."""

    def __init__(self, base: Any, group: ProcessGroup, sequence_parallel: bool) -> None:
        self.base = base
        self.group = group
        self.sequence_parallel = sequence_parallel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def linear(self, in_features: int, out_features: int, **kw: Any) -> nn.Module:
        style = plan_style(kw.get("name", ""))
        if style is None or not self.group.active:
            return self.base.linear(in_features, out_features, **kw)
        mode, chunks = style
        layout = ShardLayout(dim=0 if mode == "column" else 1, chunks=chunks)
        g = self.group
        kw["init_method"] = sliced_init(kw.get("init_method"), (out_features, in_features), layout,
                                        g.size, g.rank)
        module = self.base.linear(in_features, out_features, parallel_mode=mode, tp_group=g,
                                  tp_size=g.size, sequence_parallel=self.sequence_parallel, **kw)
        module.weight.tp_shard = TPShard(layout, g)
        module.weight.tensor_model_parallel = True
        return module


def build_parallel(ctx: BuildContext, group: ProcessGroup, sequence_parallel: bool, **kw: Any) -> GPTModel:
    """The tensor-parallel ``GPTModel`` of this rank: built against a :class:`ShardingFactory`,
    then :func:`parallelize`. ``kw`` goes to ``GPTModel``."""
    model = GPTModel(replace(ctx, factory=ShardingFactory(ctx.factory, group, sequence_parallel)), **kw)
    model.factory = ctx.factory  # the run's own factory from here on
    parallelize(model, group, sequence_parallel)
    return model


def parallelize(model: GPTModel, group: ProcessGroup, sequence_parallel: bool) -> None:
    """Swap the non-GEMM parts for their tensor-parallel versions (table in the module doc).
    The GEMM layers were built sharded by :class:`ShardingFactory`."""
    tp = group.size
    cfg = model.cfg
    padded = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
    model.padded_vocab_size = padded
    # the layer stack's activations stored sequence-first where the factory's sequence-parallel
    # layers take [s, b, h] (TE's Linear: lptrain.model.layout); batch-first otherwise
    sequence_first = sequence_parallel and bool(getattr(model.factory, "sequence_first_activations", False))
    if model.embedding is not None:  # (a pipeline stage without the table holds none)
        model.embedding = VocabParallelEmbedding(model.embedding, padded, group, sequence_parallel,
                                                 sequence_first)
    if model.output_layer is not None:
        model.output_layer = VocabParallelOutputHead(model.output_layer, padded, group, sequence_parallel)
    else:
        model.tied_head = TiedVocabParallelHead(group, sequence_parallel)
    model.lm_loss = VocabParallelCrossEntropy(cfg.vocab_size, padded, group)
    for module in list(model.modules()):
        if isinstance(module, SelfAttention):
            module.num_heads //= tp
            module.num_groups //= tp
            for attr in ("q_layernorm", "k_layernorm"):  # each rank normalizes its own heads
                norm = getattr(module, attr)
                if norm is not None:
                    setattr(module, attr, TPRMSNorm(norm, group))
        elif isinstance(module, TopKRouter) and sequence_parallel:
            module.sequence_parallel_group = group
    if sequence_parallel:
        for parent in list(model.modules()):
            for attr, child in list(parent.named_children()):
                if type(child) is RMSNorm:
                    setattr(parent, attr, TPRMSNorm(child, group))
    model.tensor_parallel_group = group
    model.sequence_parallel = sequence_parallel
    model.sequence_first = sequence_first


def whole_parameter_count(model: nn.Module) -> int:
    """The single-rank model's parameter count, from one tensor-parallel rank's model: each
    shard counted as its whole tensor (the vocab rows at their single-rank padding)."""
    total = 0
    for p in model.parameters():
        shard = getattr(p, "tp_shard", None)
        if shard is None:
            total += p.numel()
            continue
        shape = list(shard.whole_shape(p.shape))
        if shard.canonical_size is not None:
            shape[shard.layout.dim] = shard.canonical_size
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
