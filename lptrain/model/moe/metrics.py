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

import torch
import torch.distributed as dist
from torch import nn

from lptrain.model.moe.layer import MoELayer
from lptrain.model.process_group import ProcessGroup


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def moe_step_metrics(model: nn.Module, group: ProcessGroup, sequence_shards: int = 1) -> dict[str, float]:
    """The metrics in the module doc for the forwards since the last call (``{}`` for a
    dense model); resets the accumulators. Collective over ``group``. ``sequence_shards``:
    the ranks of ``group`` that split each sequence (sequence parallelism): their balancing
    losses add up to the sequence's, so the average counts each of their forwards once."""
    layers = moe_layers(model)
    if not layers:
        return {}
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
    packed = packed.cpu()
    counts_all, lb_total, off = [], 0.0, 0
    for m in layers:
        counts_all.append(packed[off : off + m.num_experts])
        lb_sum, forwards = float(packed[off + m.num_experts]), float(packed[off + m.num_experts + 1])
        lb_total += lb_sum / max(forwards / sequence_shards, 1.0)
        off += m.num_experts + 2
    counts = torch.cat(counts_all)
    return {
        "moe_tokens_per_expert_min": float(counts.min()),
        "moe_tokens_per_expert_mean": float(counts.mean()),
        "moe_tokens_per_expert_max": float(counts.max()),
        "load_balancing_loss": lb_total,
    }
