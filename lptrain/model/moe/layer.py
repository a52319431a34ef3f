"""MoE layer: route -> dispatch -> experts -> combine (weighted sum).

The token movement is :mod:`lptrain.model.moe.dispatcher`: assignments ``(token, expert)``
are stably sorted by expert, sent to the expert-parallel rank owning the expert (an
all-to-all over the expert-parallel group the model was built with, ``build_model(...,
expert_parallel_group=...)``; nothing moves at ``EP = 1``), and laid out as one contiguous block per local expert (``m_splits``), padded
with zero rows to ``factory.grouped_alignment`` for quantized grouped GEMMs. Zero rows give
zero outputs and are dropped before the combine, so they never reach the result or the
gradients. Combine brings the rows back and scatter-adds each, times its routing
probability (fp32), onto its token.

Training forwards also accumulate, for the step metrics (``lptrain.model.moe.metrics``),
this rank's tokens per global expert and the load-balancing loss.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lptrain.model.build_context import BuildContext
from lptrain.model.layout import stored_like
from lptrain.model.mlp import ffn_hidden_size
from lptrain.model.moe.dispatcher import DispatchState, combine, dispatch
from lptrain.model.moe.experts import GroupedMLP, SequentialMLP
from lptrain.model.moe.router import TopKRouter
from lptrain.model.process_group import SINGLE_RANK, ProcessGroup

__all__ = ["DispatchState", "MoELayer", "combine", "dispatch"]


class MoELayer(nn.Module):
    """Router + local experts; returns ``(output, {"load_balancing_loss", "z_loss"})``."""

    def __init__(self, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        moe = ctx.cfg.moe
        ep, rank = ctx.expert_model_parallel_size, ctx.expert_model_parallel_rank
        if moe.num_experts % ep:
            raise ValueError(f"num_experts {moe.num_experts} not divisible by EP size {ep}")
        self.num_experts = moe.num_experts
        self.num_local_experts = moe.num_experts // ep
        self.expert_offset = rank * self.num_local_experts
        self.expert_model_parallel_size = ep
        self.expert_parallel_group = ctx.expert_parallel_group
        align_for = getattr(ctx.factory, "grouped_alignment_for", None)
        self.alignment = int(align_for(moe.single_grouped_weight) if align_for is not None
                             else getattr(ctx.factory, "grouped_alignment", 1) or 1)
        self.router = TopKRouter(
            ctx.cfg.hidden_size,
            moe,
            ctx.params_dtype,
            ctx.init(f"{prefix}router.weight", ctx.std),
        )
        ffn = ffn_hidden_size(ctx.cfg.hidden_size, moe.ffn_hidden_size or ctx.cfg.ffn_hidden_size)
        eprefix = f"{prefix}experts."
        self.experts: nn.Module
        if moe.grouped_gemm or moe.single_grouped_weight:
            self.experts = GroupedMLP(
                ctx, eprefix, self.num_local_experts, self.expert_offset, ffn, moe.single_grouped_weight
            )
        else:
            self.experts = SequentialMLP(ctx, eprefix, self.num_local_experts, self.expert_offset, ffn)
        self.reset_metrics()

    def _ep_group(self) -> ProcessGroup:
        ep = self.expert_model_parallel_size
        if ep == 1:
            return SINGLE_RANK
        group = self.expert_parallel_group
        if group.size != ep:
            raise RuntimeError(
                f"this MoE layer was built for expert_model_parallel_size={ep} but its "
                f"expert-parallel group has {group.size} rank(s); build the model with "
                "build_model(..., expert_parallel_group=groups.ep) (the ep group of "
                "lptrain.distributed.groups.build_groups(..., ep=EP)), as TrainEngine does"
            )
        return group

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        stored = x
        x = x.contiguous()  # tokens batch-major (a copy where x is stored sequence-first)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(x)
        group = self._ep_group()
        expert_in, state = dispatch(flat, routing.indices, self.num_experts, self.alignment, group)
        expert_out = self.experts(expert_in, state.m_splits)
        out = combine(expert_out, routing.probs, state, flat.shape[0])
        if self.training:
            with torch.no_grad():  # stays on the device: no host sync per forward
                counts = state.counts.to(torch.float64)
                lb = routing.aux_loss.detach().to(torch.float64)
                if self.metric_tokens_per_expert is None:
                    self.metric_tokens_per_expert, self.metric_load_balancing_loss = counts, lb
                else:
                    self.metric_tokens_per_expert = self.metric_tokens_per_expert + counts
                    self.metric_load_balancing_loss = self.metric_load_balancing_loss + lb
                self.metric_forwards += 1
        losses = {"load_balancing_loss": routing.aux_loss, "z_loss": routing.z_loss}
        return stored_like(out.to(x.dtype).view(shape), stored), losses

    def reset_metrics(self) -> None:
        """Clear the per-step accumulators: this rank's tokens per global expert ``[E]`` fp64,
        the summed load-balancing loss and the number of training forwards since the reset."""
        self.metric_tokens_per_expert: Optional[torch.Tensor] = None
        self.metric_load_balancing_loss: Optional[torch.Tensor] = None
        self.metric_forwards = 0
