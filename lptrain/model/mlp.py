"""SwiGLU MLP: ``fc1`` produces ``[gate | up]``, ``fc2`` maps ``silu(gate) * up`` back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lptrain.model.build_context import BuildContext


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` along the last dim, in fp32, input dtype out.

    Row-wise, so it gives the same bits whether the rows come as one tensor or per expert.
    """
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(h.dtype)


def activation(recompute: bool, h: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu`, checkpointed when selective recompute covers ``mlp_act`` (its fp32
    copies are then recomputed in the backward instead of kept)."""
    from lptrain.model.layout import rowwise_in_storage_order
    from lptrain.model.recompute import run_checkpointed

    # in storage order: the halves' gradient is then assembled stored as h is (lptrain.model.layout)
    return run_checkpointed(recompute, None, rowwise_in_storage_order, swiglu, h)


def recomputes_activation(ctx: BuildContext) -> bool:
    from lptrain.model.recompute import RecomputePlan

    return RecomputePlan.of(ctx.cfg).selects("mlp_act")


def ffn_hidden_size(hidden: int, ffn: int | None) -> int:
    """The SwiGLU width: the configured value, else ``4 * hidden`` (as ``config.derive``)."""
    return ffn if ffn else 4 * hidden


def swiglu_linears(
    ctx: BuildContext, prefix: str, ffn: int, suffix: str = ""
) -> tuple[nn.Module, nn.Module]:
    """The factory linears of one SwiGLU MLP: ``fc1`` hidden -> 2*ffn, ``fc2`` ffn -> hidden.

    ``suffix`` (``".{expert}"``) gives a loop-layout expert its canonical per-expert names,
    which also seed its init, so every layout initialises the same weights.
    """
    hidden = ctx.cfg.hidden_size
    fc1 = ctx.factory.linear(
        hidden,
        2 * ffn,
        bias=False,
        init_method=ctx.init(f"{prefix}linear_fc1.weight{suffix}", ctx.std),
        name=f"{prefix}linear_fc1{suffix}",
    )
    fc2 = ctx.factory.linear(
        ffn,
        hidden,
        bias=False,
        init_method=ctx.init(f"{prefix}linear_fc2.weight{suffix}", ctx.output_std),
        name=f"{prefix}linear_fc2{suffix}",
    )
    return fc1, fc2


class MLP(nn.Module):
    """Dense SwiGLU MLP built from two factory linears."""

    def __init__(self, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        ffn = ffn_hidden_size(ctx.cfg.hidden_size, ctx.cfg.ffn_hidden_size)
        self.linear_fc1, self.linear_fc2 = swiglu_linears(ctx, prefix, ffn)
        self.recompute_act = recomputes_activation(ctx)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.linear_fc2(activation(self.recompute_act, self.linear_fc1(x))), {}
