"""Token dispatcher: routed tokens -> the rank and local expert that own them -> back.

One code path for every expert-parallel size ``EP`` (the local dispatch is ``EP = 1``):

1. **permute**: assignments ``(token, slot)`` are stably sorted by global expert id. Experts of
   EP rank ``r`` are ``[r * L, (r + 1) * L)`` (``L = num_experts / EP``), so the sorted rows
   are already grouped by destination rank, and inside a rank by local expert.
2. **all-to-all** (``EP > 1``): the per-expert counts ``[EP, L]`` are exchanged first
   (``all_to_all_single`` on int64), then the rows with uneven splits. Rows arrive ordered
   by (source rank, local expert) and are reordered to (local expert, source rank): each
   local expert gets one contiguous block, sources in rank order, tokens in their order.
3. **pad** each local expert's block with zero rows to ``alignment`` (the quantized grouped
   GEMM's token multiple; 1 when unquantized). Padding happens after the all-to-all, so
   the wire carries only real rows: ``tokens x k x hidden`` elements each way.
4. **combine** undoes 3, 2 and 1 (the return all-to-all swaps the splits) and scatter-adds
   each row times its routing probability (fp32) onto its token with ``index_add``.

Every step is a gather/scatter with an explicit index (``index_select`` / ``index_add``,
deterministic on CPU) or a collective whose backward is the reverse all-to-all, so forward
and backward are deterministic, and ``EP = 1`` is bitwise the former local dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lptrain.model.process_group import SINGLE_RANK, ProcessGroup


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], pg: Any) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.pg = pg
        return all_to_all_rows(x, out_splits, in_splits, pg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        out_splits, in_splits = ctx.splits
        return all_to_all_rows(grad, in_splits, out_splits, ctx.pg), None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], pg: Any) -> torch.Tensor:
    """Rows ``x [sum(in_splits), ...]`` exchanged: ``in_splits[r]`` rows go to rank ``r``,
    ``out_splits[r]`` rows come from it (no autograd)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=pg)
    return out


@dataclass
class DispatchState:
    """Bookkeeping to undo a dispatch."""

    token_index: torch.Tensor  # [T*k] source token of each sorted assignment
    order: torch.Tensor  # [T*k] permutation: sorted position -> flat (token, slot) index
    dest: Optional[torch.Tensor]  # padded row of each received row in expert order (None: no pad)
    m_splits: list[int]  # rows per local expert, padded
    tokens_per_expert: list[int]  # real rows per local expert (summed over source ranks)
    counts: Optional[torch.Tensor] = None  # [E] int64: this rank's tokens per global expert
    send_splits: Optional[list[int]] = None  # rows sent to each EP rank (None: EP = 1)
    recv_splits: Optional[list[int]] = None  # rows received from each EP rank
    regroup: Optional[torch.Tensor] = None  # received row (source-major) of each expert-major row
    pg: Any = None


def _pad_index(counts: torch.Tensor, alignment: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Padded row of each row of expert-contiguous blocks with ``counts`` rows each."""
    padded = (counts + alignment - 1) // alignment * alignment
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    dest = pstart[expert] + (torch.arange(expert.numel(), device=device) - start[expert])
    return dest, padded.tolist()


def dispatch(
    x: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    alignment: int = 1,
    group: ProcessGroup = SINGLE_RANK,
) -> tuple[torch.Tensor, DispatchState]:
    """Token rows ``x [T, H]`` routed by ``indices [T, k]`` (global expert ids) -> the rows
    of this rank's ``num_experts / group.size`` local experts, one padded block each."""
    k = indices.shape[1]
    ep = group.size if group.active else 1
    local = num_experts // ep
    flat_e = indices.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    token_index = torch.div(order, k, rounding_mode="floor")
    counts = torch.bincount(flat_e, minlength=num_experts)
    rows = x.index_select(0, token_index)
    state = DispatchState(token_index, order, None, [], [], counts=counts)
    if ep > 1:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group.pg)  # [EP * L]: (source, local expert)
        recv = received.view(ep, local)
        state.send_splits = counts.view(ep, local).sum(1).tolist()
        state.recv_splits = recv.sum(1).tolist()
        state.pg = group.pg
        rows = _AllToAll.apply(rows, state.recv_splits, state.send_splits, group.pg)
        # (source, expert)-major -> (expert, source)-major: stable sort on the expert id.
        block = torch.arange(ep * local, device=x.device).view(ep, local) % local
        expert_of_row = torch.repeat_interleave(block.reshape(-1), recv.reshape(-1))
        state.regroup = torch.argsort(expert_of_row, stable=True)
        rows = rows.index_select(0, state.regroup)
        per_expert = recv.sum(0)
    else:
        per_expert = counts
    state.tokens_per_expert = per_expert.tolist()
    if alignment <= 1:
        state.m_splits = list(state.tokens_per_expert)
        return rows, state
    dest, state.m_splits = _pad_index(per_expert, alignment, x.device)
    state.dest = dest
    out = rows.new_zeros(sum(state.m_splits), x.shape[1]).index_copy(0, dest, rows)
    return out, state


def combine(
    expert_out: torch.Tensor, probs: torch.Tensor, state: DispatchState, num_tokens: int
) -> torch.Tensor:
    """Weighted scatter-add of expert rows back onto their tokens; fp32 result ``[T, H]``."""
    rows = expert_out if state.dest is None else expert_out.index_select(0, state.dest)
    if state.regroup is not None:
        back = torch.empty_like(state.regroup)
        back[state.regroup] = torch.arange(state.regroup.numel(), device=back.device)
        rows = rows.index_select(0, back)  # expert-major -> source-major
        rows = _AllToAll.apply(rows, state.send_splits, state.recv_splits, state.pg)
    weights = probs.reshape(-1).index_select(0, state.order).unsqueeze(1)
    weighted = rows.float() * weights
    out = weighted.new_zeros(num_tokens, expert_out.shape[1])
    return out.index_add(0, state.token_index, weighted)
