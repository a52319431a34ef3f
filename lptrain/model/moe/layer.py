"""MoE layer: route -> dispatch (sort by expert, pad) -> experts -> combine (weighted sum).

Dispatch and combine here are the local (single expert-parallel rank) token movement:
assignments ``(token, expert)`` are stably sorted by expert, giving each expert one
contiguous block of rows (``m_splits``). For quantized grouped GEMMs each block is padded
with zero rows to ``factory.grouped_alignment`` (1 when unquantized); zero rows give zero
outputs and are dropped again before the combine, so they never reach the result or the
gradients. Combine multiplies each expert output row by its routing probability (fp32) and
scatter-adds it onto its token (``index_add``, deterministic on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lptrain.model.build_context import BuildContext
from lptrain.model.mlp import ffn_hidden_size
from lptrain.model.moe.experts import GroupedMLP, SequentialMLP
from lptrain.model.moe.router import TopKRouter


@dataclass
class DispatchState:
    """Bookkeeping to undo a dispatch."""

    token_index: torch.Tensor  # [T*k] source token of each sorted assignment
    order: torch.Tensor  # [T*k] permutation: sorted position -> flat (token, slot) index
    dest: Optional[torch.Tensor]  # [T*k] padded row of each sorted assignment (None: no pad)
    m_splits: list[int]  # rows per local expert, padded
    tokens_per_expert: list[int]  # real rows per local expert


def dispatch(
    x: torch.Tensor, indices: torch.Tensor, num_experts: int, alignment: int = 1
) -> tuple[torch.Tensor, DispatchState]:
    """Permute token rows ``x [T, H]`` into per-expert blocks for ``indices [T, k]``."""
    k = indices.shape[1]
    flat_e = indices.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    token_index = torch.div(order, k, rounding_mode="floor")
    counts = torch.bincount(flat_e, minlength=num_experts)
    rows = x.index_select(0, token_index)
    if alignment <= 1:
        state = DispatchState(token_index, order, None, counts.tolist(), counts.tolist())
        return rows, state
    padded = (counts + alignment - 1) // alignment * alignment
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    e_sorted = flat_e.index_select(0, order)
    dest = pstart[e_sorted] + (torch.arange(order.numel(), device=x.device) - start[e_sorted])
    out = x.new_zeros(int(padded.sum()), x.shape[1]).index_copy(0, dest, rows)
    return out, DispatchState(token_index, order, dest, padded.tolist(), counts.tolist())


def combine(
    expert_out: torch.Tensor, probs: torch.Tensor, state: DispatchState, num_tokens: int
) -> torch.Tensor:
    """Weighted scatter-add of expert rows back onto their tokens; fp32 result ``[T, H]``."""
    rows = expert_out if state.dest is None else expert_out.index_select(0, state.dest)
    weights = probs.reshape(-1).index_select(0, state.order).unsqueeze(1)
    weighted = rows.float() * weights
    out = weighted.new_zeros(num_tokens, expert_out.shape[1])
    return out.index_add(0, state.token_index, weighted)


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
        self.alignment = int(getattr(ctx.factory, "grouped_alignment", 1) or 1)
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.expert_model_parallel_size > 1:
            raise NotImplementedError(
                "expert-parallel forward needs an all-to-all token dispatcher (lptrain.distributed)"
            )
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(x)
        expert_in, state = dispatch(flat, routing.indices, self.num_experts, self.alignment)
        expert_out = self.experts(expert_in, state.m_splits)
        out = combine(expert_out, routing.probs, state, flat.shape[0])
        losses = {"load_balancing_loss": routing.aux_loss, "z_loss": routing.z_loss}
        return out.to(x.dtype).view(shape), losses
