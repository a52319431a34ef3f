"""Routed experts: SwiGLU MLPs over consecutive per-expert token splits (``m_splits``).

Three storage layouts with one canonical checkpoint form (``<prefix>linear_fc1.weight.<e>``,
``e`` the global expert index; see ``state_dict_adapter``):

* ``GroupedMLP(single_grouped_weight=True)``: one factory ``grouped_linear`` parameter
  ``linear_fc1.weight [E_local, 2F, H]`` (and ``linear_fc2.weight [E_local, H, F]``);
* ``GroupedMLP(single_grouped_weight=False)``: discrete members ``linear_fc1.weight<i>``;
* ``SequentialMLP``: a loop over per-expert factory linears ``local_experts.<i>.linear_fc1``.

All run the same per-expert GEMMs on the same rows, so with the same weights they give
bitwise identical outputs and gradients (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lptrain.model.build_context import BuildContext
from lptrain.model.mlp import activation, recomputes_activation, swiglu_linears


class GroupedMLP(nn.Module):
    """All local experts as two grouped GEMMs (fc1, fc2)."""

    def __init__(
        self,
        ctx: BuildContext,
        prefix: str,
        num_local_experts: int,
        expert_offset: int,
        ffn: int,
        single_grouped_weight: bool,
    ) -> None:
        super().__init__()
        hidden = ctx.cfg.hidden_size
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        self.recompute_act = recomputes_activation(ctx)
        self.linear_fc1 = ctx.factory.grouped_linear(
            num_local_experts,
            hidden,
            2 * ffn,
            single_grouped_weight=single_grouped_weight,
            init_method=ctx.grouped_init(f"{prefix}linear_fc1.weight", ctx.std, expert_offset),
            name=f"{prefix}linear_fc1",
        )
        self.linear_fc2 = ctx.factory.grouped_linear(
            num_local_experts,
            ffn,
            hidden,
            single_grouped_weight=single_grouped_weight,
            init_method=ctx.grouped_init(f"{prefix}linear_fc2.weight", ctx.output_std, expert_offset),
            name=f"{prefix}linear_fc2",
        )
        # the members' operands are named by global expert index in the numerics statistics
        self.linear_fc1.member_offset = self.linear_fc2.member_offset = expert_offset

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        return self.linear_fc2(activation(self.recompute_act, self.linear_fc1(x, m_splits)), m_splits)


class ExpertMLP(nn.Module):
    """One expert of ``SequentialMLP``; its weights keep their per-expert canonical names."""

    def __init__(self, ctx: BuildContext, prefix: str, expert: int, ffn: int) -> None:
        super().__init__()
        self.recompute_act = recomputes_activation(ctx)
        self.linear_fc1, self.linear_fc2 = swiglu_linears(ctx, prefix, ffn, f".{expert}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.recompute_act, self.linear_fc1(x)))


class SequentialMLP(nn.Module):
    """Loop over discrete per-expert MLPs (the fallback without grouped GEMM)."""

    def __init__(
        self, ctx: BuildContext, prefix: str, num_local_experts: int, expert_offset: int, ffn: int
    ) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        self.local_experts = nn.ModuleList(
            ExpertMLP(ctx, prefix, expert_offset + i, ffn) for i in range(num_local_experts)
        )

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        outs = []
        for expert, xi in zip(self.local_experts, torch.split(x, list(m_splits), dim=0), strict=True):
            # Empty splits run too, so a zero-token expert gets a zero wgrad (not None), the
            # same as a zero-token member of a grouped GEMM.
            outs.append(expert(xi))
        return torch.cat(outs, dim=0)
