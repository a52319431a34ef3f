"""``ChainedOptimizer``: the dense and expert optimizers stepping as one.

One global grad norm (the children's squared norms summed), one clip coefficient, one
success decision (a non-finite norm skips every child), then every child stages its masters
and only after that are params gathered. Why the deferral matters (an upstream bug class):
with the grad buffer reused as the bf16 gather area, a param sync triggered right after the
first child's step would gather buckets that the second child has not staged yet -- their
staging slices still hold zeros or gradients, which would be copied into the expert weights.
Here ``stage`` of all children precedes any sync by construction, and a bucket that is not
staged refuses to be gathered (:class:`lptrain.distributed.bucket_group.IllegalTransition`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from lptrain.config.schema import OptimizerConfig
from lptrain.distributed.buffers import ParamAndGradBuffer
from lptrain.distributed.groups import SINGLE, Group
from lptrain.optim.child import OptimizerChild
from lptrain.optim.distributed import ExpertShardedMasterOptimizer, ShardedMasterOptimizer
from lptrain.optim.layerwise import build_layer_wise_children
from lptrain.optim.precision_aware import StatePrecision, state_precision

__all__ = ["ChainedOptimizer", "StepOutcome", "build_optimizer", "state_precision"]


@dataclass
class StepOutcome:
    grad_norm: float
    skipped: bool


class ChainedOptimizer:
    """The children (:class:`lptrain.optim.child.OptimizerChild`) stepping as one optimizer."""

    def __init__(self, children: Sequence[OptimizerChild], clip_grad: float) -> None:
        self.children: list[OptimizerChild] = list(children)
        self.clip_grad = clip_grad

    def prepare_grads(self) -> None:
        for c in self.children:
            c.prepare_grads()

    def grad_norm(self) -> float:
        """The global norm: the children's squared norms summed on their device, then one
        host read (the skip decision is a host branch)."""
        device = self.children[0].device if self.children else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        for c in self.children:
            total += c.grad_norm_sq()
        return math.sqrt(float(total))

    def step(self, lrs: Mapping[str, float]) -> StepOutcome:
        """Prepare, norm, clip and update every child (does not stage: see :meth:`stage`)."""
        self.prepare_grads()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            for c in self.children:
                c.discard_grads()
            return StepOutcome(norm, skipped=True)
        clip: Optional[float] = None
        if self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            clip = coef if coef < 1.0 else None
        for c in self.children:
            c.step(lrs, clip)
        return StepOutcome(norm, skipped=False)

    def stage(self) -> None:
        """Every child writes its masters back; the caller syncs params afterwards, once."""
        for c in self.children:
            c.stage()

    def lr_by_group(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.children:
            out.update(c.lr_by_group())
        return out

    def update_rms(self) -> Optional[float]:
        """RMS of the last Muon update over every Muon child (dense and expert), weighted by
        their element counts when a child reports one."""
        total, count = 0.0, 0
        for c in self.children:
            rms = c.update_rms()
            if rms is None:
                continue
            n = sum(pc.master.numel() for pc in c.pieces) or 1
            total += rms * rms * n
            count += n
        return (total / count) ** 0.5 if count else None

    def count_zeros(self) -> Optional[int]:
        """Zero gradient entries over the children that count them (reduced over the world
        by each child, every element once); None when none does."""
        counts = [n for n in (c.count_zeros() for c in self.children) if n is not None]
        return sum(counts) if counts else None


def build_optimizer(
    buffers: Sequence[ParamAndGradBuffer], cfg: OptimizerConfig, ep: Group = SINGLE,
    tp: Group = SINGLE, pp: Group = SINGLE, state: Optional[StatePrecision] = None,
) -> ChainedOptimizer:
    """The run's optimizer over the data-parallel engine's buffers: the layer-wise children
    (:func:`lptrain.optim.layerwise.build_layer_wise_children`) with
    ``optimizer.use_layer_wise_optimizer``, else a byte-sharded child over the dense buffers
    and, for MoE models, one over the expert buffers (adding the norm over ``ep``). The dense
    children add their norms over the tensor-parallel group ``tp`` (expert buffers already
    reduce over it: the experts are whole on every TP rank). Under pipeline parallelism each
    stage has its own children; their norms join over ``pp`` (one list of terms, summed as
    the unpipelined optimizer sums it). ``state``: the precision-aware optimizer's settings
    (:func:`lptrain.optim.precision_aware.state_precision`; None: off)."""
    children: list[OptimizerChild]
    if cfg.use_layer_wise_optimizer:
        children = build_layer_wise_children(buffers, cfg, ep=ep, tp=tp, pp=pp, state=state)
    else:
        dense = [b for b in buffers if not b.key.is_expert]
        expert = [b for b in buffers if b.key.is_expert]
        children = [ShardedMasterOptimizer(dense, cfg, label="dense", tp=tp, pp=pp, state=state)]
        if expert:
            children.append(ExpertShardedMasterOptimizer(expert, cfg, label="expert", ep=ep, pp=pp,
                                                         state=state))
    return ChainedOptimizer(children, cfg.clip_grad)
