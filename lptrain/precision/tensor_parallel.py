"""Tensor-parallel GEMM layers of the emulated backend, and the collectives around them.

The factory builds these when model code (through the parallelize step,
:mod:`lptrain.model.tensor_parallel`) asks ``factory.linear(..., parallel_mode=...)`` with
Transformer Engine's arguments (``parallel_mode``, ``tp_group``, ``tp_size``,
``sequence_parallel``); on the TE backend the same call builds TE's own ``Linear``, which does
these collectives itself.

* ``ColumnParallelLinear`` (QKV, fc1): the weight's output rows are split; the input is the
  whole activation -- all-gathered along the sequence under sequence parallelism, else the
  replicated activation whose gradient is all-reduced -- and the output is this rank's
  columns.
* ``RowParallelLinear`` (proj, fc2): the weight's input columns are split; the input is this
  rank's columns of the activation and the partial outputs are summed -- reduce-scattered
  along the sequence under sequence parallelism, else all-reduced.

The collectives are autograd functions over ``torch.distributed`` (gloo on CPU, NCCL on GPU),
each the adjoint of the other in its backward (Megatron-LM's mappings); activations are
``[batch, sequence, hidden]`` and the sequence is dimension 1.

**Low precision across TP.** The quantizers of a sharded operand reduce their per-tensor amax
over the tensor-parallel group (``amax_reduction``), so a shard's scale is the whole tensor's
and its bytes equal the single-rank bytes of the same slice: the weight (both modes), the
input of a row-parallel layer (split by columns) and the gradient of a column-parallel layer's
output (split by columns). Replicated operands (a column-parallel input, a row-parallel output
gradient) are whole on every rank and need no reduction. Delayed scaling reduces every amax
over the autocast's amax-reduction group, which must contain the tensor-parallel group (the
engine passes tensor x data parallel, as Megatron-LM does). Block recipes need no reduction:
the rule TP-BLOCK-BOUNDARY makes every split fall on a block boundary.

Shard layouts (:class:`lptrain.catalog.parallel_dims.ShardLayout`) say which part of the whole
tensor a rank holds; :func:`take_shard` and :func:`join_shards` cut and reassemble (init,
checkpoints, Muon's whole-matrix Newton-Schulz).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lptrain.catalog.parallel_dims import ShardLayout
from lptrain.precision.collectives import all_gather_flat, reduce_scatter_flat
from lptrain.precision.layers import InitMethod, Linear
from lptrain.precision.scaling import AmaxOverGroups

SEQ_DIM = 1  # activations are [batch, sequence, hidden]

# Tensor roles a split cuts, per parallel mode: their per-tensor amaxes are reduced over TP.
SHARDED_ROLES = {"column": ("weight", "grad"), "row": ("weight", "input")}


# ---- traffic accounting (the communication test and bench/tp.py) ------------------------------


@dataclass
class TPTraffic:
    """Bytes of the tensor-parallel collectives since :func:`count_tp_traffic` started:
    per kind (``all_gather``, ``reduce_scatter``, ``all_reduce``) the element bytes of the
    whole tensor each collective assembles or reduces (``b x s x h`` for an activation), and
    the number of calls; ``activation`` counts only the layer-boundary collectives."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    activation_bytes: int = 0
    activation_calls: int = 0

    def add(self, kind: str, t: torch.Tensor, activation: bool) -> None:
        n = t.numel() * t.element_size()
        self.bytes[kind] = self.bytes.get(kind, 0) + n
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if activation:
            self.activation_bytes += n
            self.activation_calls += 1


_TRAFFIC: list[TPTraffic] = []


@contextlib.contextmanager
def count_tp_traffic() -> Iterator[TPTraffic]:
    """Record every tensor-parallel collective of this process inside the context."""
    t = TPTraffic()
    _TRAFFIC.append(t)
    try:
        yield t
    finally:
        _TRAFFIC.remove(t)


def tp_activation_traffic(*, tokens: int, hidden: int, itemsize: int, dense_layers: int,
                          moe_layers: int = 0, sequence_parallel: bool, backward: bool = True) -> tuple[int, int]:
    """``(collectives, bytes)`` of the layer-boundary tensor-parallel collectives of one
    forward (and backward) of ``tokens = b x s`` tokens, each moving one whole ``b x s x h``
    activation. Sequence parallel, per pass: 4 per dense layer (all-gather before QKV and fc1,
    reduce-scatter after proj and fc2), 2 per MoE layer (attention only: the experts run on the
    sequence shard) and 2 for the embedding and the head. Without it: forward all-reduces after
    proj and fc2 and of the embedding, backward all-reduces of the QKV, fc1 and head input
    grads: 2 per dense layer, 1 per MoE layer, 1 more per pass."""
    if sequence_parallel:
        per_pass = 4 * dense_layers + 2 * moe_layers + 2
    else:
        per_pass = 2 * dense_layers + moe_layers + 1
    calls = per_pass * (2 if backward else 1)
    return calls, calls * tokens * hidden * itemsize


def _record(kind: str, whole: torch.Tensor, activation: bool = True) -> None:
    for t in _TRAFFIC:
        t.add(kind, whole, activation)


def stored_outermost(x: torch.Tensor, dim: int) -> bool:
    """Whether ``x`` is stored with ``dim`` outermost: ``x.movedim(dim, 0)`` is contiguous
    (sequence-first activations ``[s, b, h]`` seen as ``[b, s, h]``, or a ``dim`` every
    earlier dimension of which has size 1). The rank-ordered blocks of a flat collective are
    then slices along ``dim`` as they are: no copy."""
    return x.movedim(dim, 0).is_contiguous()


def all_gather_dim(x: torch.Tensor, group: Any, dim: int = SEQ_DIM, outermost: Optional[bool] = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (no autograd). The result is
    stored with ``dim`` outermost when ``outermost`` (default: when ``x`` is stored so; then
    no copy is made), else contiguous (one copy: the rank-major gather reordered)."""
    outermost = stored_outermost(x, dim) if outermost is None else outermost
    if outermost:
        part = x.movedim(dim, 0).contiguous()
        out = part.new_empty((group.size * part.shape[0], *part.shape[1:]))
        _record("all_gather", out)
        all_gather_flat(out.view(-1), part.view(-1), group=group.pg)
        return out.movedim(0, dim)
    part = x.contiguous()
    out = part.new_empty((group.size, *part.shape))
    _record("all_gather", out)
    all_gather_flat(out.view(-1), part.view(-1), group=group.pg)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_dim(x: torch.Tensor, group: Any, dim: int = SEQ_DIM,
                       outermost: Optional[bool] = None) -> torch.Tensor:
    """This rank's equal slice along ``dim`` of the SUM of every rank's ``x`` (no autograd),
    stored with ``dim`` outermost when ``outermost`` (default: when ``x`` is stored so), else
    contiguous; one copy at most (none when ``x`` is stored as the result is). The same
    elements are summed in the same rank order either way."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over "
                         f"{group.size} tensor-parallel ranks")
    outermost = stored_outermost(x, dim) if outermost is None else outermost
    if outermost:
        whole = x.movedim(dim, 0).contiguous()
        out = whole.new_empty((whole.shape[0] // group.size, *whole.shape[1:]))
        _record("reduce_scatter", whole)
        reduce_scatter_flat(out.view(-1), whole.view(-1), group=group.pg)
        return out.movedim(0, dim)
    # rank-major blocks [TP, ..., s / TP, ...]: each rank's slice lands contiguous
    whole = x.unflatten(dim, (group.size, x.shape[dim] // group.size)).movedim(dim, 0).contiguous()
    out = whole.new_empty(whole.shape[1:])
    _record("reduce_scatter", whole)
    reduce_scatter_flat(out.view(-1), whole.view(-1), group=group.pg)
    return out


def all_reduce_sum(x: torch.Tensor, group: Any, activation: bool = True) -> torch.Tensor:
    """SUM over the group, in place on a contiguous copy (no autograd)."""
    out = x.contiguous().clone() if not x.is_contiguous() else x.clone()
    _record("all_reduce", out, activation)
    dist.all_reduce(out, group=group.pg)
    return out


def split_dim(x: torch.Tensor, group: Any, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (no communication)."""
    n = x.shape[dim]
    if n % group.size:
        raise ValueError(f"dimension {dim} of size {n} does not split over {group.size} ranks")
    per = n // group.size
    return x.narrow(dim, group.rank * per, per).contiguous()


class _CopyToTP(torch.autograd.Function):
    """Forward: identity (the activation is replicated); backward: SUM of the ranks' grads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return all_reduce_sum(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: SUM of the ranks' partial outputs; backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the sequence shards; backward: reduce-scatter the grads (each rank's
    grad of the whole sequence is partial: the sum is the shard's full grad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim, ctx.outermost = group, dim, stored_outermost(x, dim)
        return all_gather_dim(x, group, dim, ctx.outermost)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        # (the grad is stored as the forward's input was)
        return reduce_scatter_dim(g, ctx.group, ctx.dim, ctx.outermost), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter partial outputs into sequence shards; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim, ctx.outermost = group, dim, stored_outermost(x, dim)
        return reduce_scatter_dim(x, group, dim, ctx.outermost)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return all_gather_dim(g, ctx.group, ctx.dim, ctx.outermost), None, None


class _GatherLastDim(torch.autograd.Function):
    """Forward: all-gather along the last dim (whole logits); backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return all_gather_dim(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return split_dim(g, ctx.group, g.dim() - 1), None


class _ReduceGrad(torch.autograd.Function):
    """A replicated parameter whose uses on each rank see part of the data (a norm under
    sequence parallelism, a q/k norm over this rank's heads): forward identity, backward SUM
    of the ranks' partial grads, so every rank's param grad is the whole one."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return all_reduce_sum(g, ctx.group, activation=False), None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group.active else x


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group.active else x


def gather_sequence(x: torch.Tensor, group: Any, dim: int = SEQ_DIM) -> torch.Tensor:
    return _GatherSequence.apply(x, group, dim) if group.active else x


def reduce_scatter_sequence(x: torch.Tensor, group: Any, dim: int = SEQ_DIM) -> torch.Tensor:
    return _ReduceScatterSequence.apply(x, group, dim) if group.active else x


def gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherLastDim.apply(x, group) if group.active else x


def reduce_grad(w: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceGrad.apply(w, group) if group.active else w


# ---- shard layouts on tensors ------------------------------------------------------------------


def take_shard(whole: torch.Tensor, layout: ShardLayout, size: int, rank: int) -> torch.Tensor:
    """This rank's shard of the whole tensor (a copy, contiguous)."""
    parts = [whole.narrow(layout.dim, lo, hi - lo)
             for lo, hi in layout.segments(whole.shape[layout.dim], size, rank)]
    return torch.cat(parts, dim=layout.dim) if len(parts) > 1 else parts[0].contiguous()


def join_shards(shards: Sequence[torch.Tensor], layout: ShardLayout) -> torch.Tensor:
    """The whole tensor from every rank's shard, in rank order (inverse of :func:`take_shard`)."""
    if layout.chunks == 1:
        return torch.cat(list(shards), dim=layout.dim)
    pieces = [s.chunk(layout.chunks, dim=layout.dim) for s in shards]
    return torch.cat([p[c] for c in range(layout.chunks) for p in pieces], dim=layout.dim)


def sliced_init(init: Optional[InitMethod], whole_shape: Sequence[int], layout: ShardLayout,
                size: int, rank: int) -> Optional[InitMethod]:
    """An init method for this rank's shard that draws the whole tensor with ``init`` and
    keeps the shard: the shard's values are the single-rank values of its slice, whatever
    the tensor-parallel size (``init`` is model-independent: a per-name CPU generator)."""
    if init is None:
        return None

    @torch.no_grad()
    def shard_init(t: torch.Tensor) -> None:
        if t.is_meta:
            return
        whole = torch.empty(tuple(whole_shape), dtype=torch.float32, device="cpu")
        init(whole)
        t.copy_(take_shard(whole, layout, size, rank))

    return shard_init


# ---- the emulated tensor-parallel linears -------------------------------------------------------


@dataclass(frozen=True)
class TPShard:
    """What a tensor-parallel parameter carries (``param.tp_shard``): its layout in the whole
    tensor and the group holding the other shards. ``canonical_size``: the single-rank size of
    the split dimension when the tensor-parallel whole is padded beyond it (the vocab rows,
    padded to a multiple of TP with rows that stay zero); None when they are the same."""

    layout: ShardLayout
    group: Any
    canonical_size: Optional[int] = None

    @property
    def size(self) -> int:
        return int(self.group.size)

    @property
    def rank(self) -> int:
        return int(self.group.rank)

    def whole_shape(self, shard_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(shard_shape)
        shape[self.layout.dim] *= self.size
        return tuple(shape)

    def canonical(self, whole: torch.Tensor) -> torch.Tensor:
        """The single-rank form of the tensor-parallel whole (padding rows cut off)."""
        if self.canonical_size is None:
            return whole
        return whole.narrow(self.layout.dim, 0, self.canonical_size)

    def shard_of_canonical(self, canonical: torch.Tensor, shard_shape: Sequence[int]) -> torch.Tensor:
        """This rank's shard of a single-rank tensor (zero rows where the whole is padded).
        Also takes a canonical tensor padded for another TP size: its extra rows are dropped."""
        whole_shape = self.whole_shape(shard_shape)
        d = self.layout.dim
        n = min(canonical.shape[d], whole_shape[d], self.canonical_size or whole_shape[d])
        whole = canonical.new_zeros(whole_shape)
        whole.narrow(d, 0, n).copy_(canonical.narrow(d, 0, n))
        return take_shard(whole, self.layout, self.size, self.rank)


class _ParallelLinear(Linear):
    """A :class:`lptrain.precision.layers.Linear` holding one tensor-parallel shard."""

    mode: str = ""

    def __init__(self, in_features: int, out_features: int, *, tp_group: Any, tp_size: int,
                 sequence_parallel: bool = False, layout: Optional[ShardLayout] = None,
                 **kw: Any) -> None:
        if kw.get("bias"):
            raise ValueError(f"{kw.get('name') or type(self).__name__}: tensor-parallel linears "
                             "are bias-free (a row-parallel bias would be added once per rank)")
        if tp_group is None or int(tp_group.size) != tp_size:
            raise ValueError(f"{kw.get('name') or type(self).__name__}: tp_size={tp_size} but the "
                             f"tensor-parallel group has {getattr(tp_group, 'size', None)} rank(s)")
        dim = 0 if self.mode == "column" else 1
        self.layout = layout or ShardLayout(dim=dim)
        if self.layout.dim != dim:
            raise ValueError(f"a {self.mode}-parallel weight is split along dim {dim}")
        whole = (out_features, in_features)
        local = list(whole)
        local[dim] //= tp_size
        if whole[dim] % (tp_size * self.layout.chunks):
            raise ValueError(f"{kw.get('name')}: {whole[dim]} features do not split into "
                             f"{self.layout.chunks} x {tp_size} shards")
        super().__init__(local[1], local[0],
                         amax_reduction=_merged_amax(self.mode, tp_group, kw.pop("amax_reduction", None)),
                         **kw)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.weight.tp_shard = TPShard(self.layout, tp_group)
        self.weight.tensor_model_parallel = True


def _merged_amax(mode: str, tp_group: Any, other: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Per role, what its per-tensor amax is MAX-reduced over: the tensor-parallel group for
    the operands a ``mode`` split cuts, ``other``'s group for the operands split otherwise
    (the sequence, under context parallelism), both in turn for an operand split both ways."""
    tp_roles = SHARDED_ROLES[mode] if tp_group.active else ()
    other = dict(other or {})
    out: dict[str, Any] = {}
    for role in (*tp_roles, *(r for r in other if r not in tp_roles)):
        if role in tp_roles and role in other:
            out[role] = AmaxOverGroups(tp_group.pg, other[role])
        else:
            out[role] = tp_group.pg if role in tp_roles else other[role]
    return out


class ColumnParallelLinear(_ParallelLinear):
    """Output rows split (see the module doc): ``[b, s or s/TP, in] -> [b, s, out/TP]``."""

    mode = "column"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.tp_group
        x = gather_sequence(x, g) if self.sequence_parallel else copy_to_tp(x, g)
        return super().forward(x)


class RowParallelLinear(_ParallelLinear):
    """Input columns split (see the module doc): ``[b, s, in/TP] -> [b, s or s/TP, out]``."""

    mode = "row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        g = self.tp_group
        return reduce_scatter_sequence(y, g) if self.sequence_parallel else reduce_from_tp(y, g)


PARALLEL_LINEARS = {"column": ColumnParallelLinear, "row": RowParallelLinear}
