"""Per-step MoE metrics: tokens per expert over the global batch and the balancing loss.

Each ``MoELayer`` accumulates, over the training forwards of one step, this rank's token
count per *global* expert (before the all-to-all, so every assignment is counted exactly
once in the whole world) and its load-balancing loss. :func:`moe_step_metrics` sums both
over the data-parallel group in one all-reduce (every rank must call it: it is a
collective) and resets the accumulators.

* ``moe_tokens_per_expert_{min,mean,max}``: over every (MoE layer, expert) pair, the number
  of token assignments the expert received in the step's global batch (``mean`` is
  ``global tokens x k / num_experts``; ``max / mean`` is the imbalance);
* ``load_balancing_loss``: the coefficient-weighted balancing loss summed over MoE layers,
  averaged over micro-batches and ranks (the value added to the LM loss).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lptrain.model.moe.layer import MoELayer
from lptrain.model.process_group import ProcessGroup


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def moe_step_metrics(model: nn.Module, group: ProcessGroup, sequence_shards: int = 1,
                     pipeline: Optional[ProcessGroup] = None) -> dict[str, float]:
    """The metrics in the module doc for the forwards since the last call (``{}`` for a
    dense model); resets the accumulators. Collective over ``group``. ``sequence_shards``:
    the ranks of ``group`` that split each sequence (sequence parallelism): their balancing
    losses add up to the sequence's, so the average counts each of their forwards once.
    ``pipeline``: the pipeline group of a model that holds one stage's layers: the stages'
    per-layer figures are gathered and taken in layer order, as the whole model's are."""
    layers = moe_layers(model)
    if pipeline is not None and pipeline.active:
        return _pipelined(model, layers, group, sequence_shards, pipeline)
    if not layers:
        return {}
    packed = _packed(model, layers, group)
    return _metrics([m.num_experts for m in layers], packed, sequence_shards)


def _pipelined(model: nn.Module, layers: list[MoELayer], group: ProcessGroup, sequence_shards: int,
               pipeline: ProcessGroup) -> dict[str, float]:
    """:func:`moe_step_metrics` over every stage's MoE layers (one small object gather)."""
    numbers = [layer.layer_number for layer in getattr(model, "layers", []) if getattr(layer, "is_moe", False)]
    packed = _packed(model, layers, group) if layers else torch.zeros(0, dtype=torch.float64)
    mine = (numbers, [m.num_experts for m in layers], packed)
    found: list[Any] = [None] * pipeline.size
    dist.all_gather_object(found, mine, group=pipeline.pg)
    rows = sorted((n, e, part) for nums, experts, part in found
                  for n, e, part in _split_rows(nums, experts, part))
    if not rows:
        return {}
    return _metrics([e for _, e, _ in rows], torch.cat([p for _, _, p in rows]), sequence_shards)


def _split_rows(numbers: list[int], experts: list[int], packed: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    out, off = [], 0
    for n, e in zip(numbers, experts, strict=True):
        out.append((n, e, packed[off : off + e + 2]))
        off += e + 2
    return out


def _packed(model: nn.Module, layers: list[MoELayer], group: ProcessGroup) -> torch.Tensor:
    """Per layer ``[counts (num_experts), lb sum, forwards]``, summed over ``group``, on the
    host; resets the layers' accumulators."""
    device = next(model.parameters()).device
    parts = []
    for m in layers:
        counts = m.metric_tokens_per_expert
        lb = m.metric_load_balancing_loss
        parts += [
            torch.zeros(m.num_experts, dtype=torch.float64, device=device) if counts is None else counts.to(device),
            torch.zeros(1, dtype=torch.float64, device=device) if lb is None else lb.reshape(1).to(device),
            torch.full((1,), float(m.metric_forwards), dtype=torch.float64, device=device),
        ]
        m.reset_metrics()
    packed = torch.cat(parts)
    if group.active:
        dist.all_reduce(packed, group=group.pg)
    return packed.cpu()


def _metrics(experts: list[int], packed: torch.Tensor, sequence_shards: int) -> dict[str, float]:
    counts_all, lb_total, off = [], 0.0, 0
    for e in experts:
        counts_all.append(packed[off : off + e])
        lb_sum, forwards = float(packed[off + e]), float(packed[off + e + 1])
        lb_total += lb_sum / max(forwards / sequence_shards, 1.0)
        off += e + 2
    counts = torch.cat(counts_all)
    return {
        "moe_tokens_per_expert_min": float(counts.min()),
        "moe_tokens_per_expert_mean": float(counts.mean()),
        "moe_tokens_per_expert_max": float(counts.max()),
        "load_balancing_loss": lb_total,
    }


def reduce_router_counts(model: nn.Module, group: ProcessGroup) -> None:
    """Sum the routers' live per-expert token counts (``expert_bias_counts``) over ``group``
    in one all-reduce, so the expert-bias update sees the global batch's counts (the data-
    parallel ranks', and the ranks holding other parts of the same sequences)."""
    counts = model.expert_bias_counts()  # type: ignore[operator]
    if not group.active or not counts:
        return
    flat = torch.cat([c.reshape(-1) for c in counts])
    dist.all_reduce(flat, group=group.pg)
    off = 0
    for c in counts:
        c.copy_(flat[off : off + c.numel()].view_as(c))
        off += c.numel()
