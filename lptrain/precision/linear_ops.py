"""Quantized linear / grouped-linear autograd ops for the emulated backend.

Operand orientation per GEMM (docs/numerics.md section 4, ``module/linear.py``), for
y = x W^T with x [M, K], W [N, K], dy [M, N]:

=======  ================  ==================================  ==============
GEMM     op                operands                            reduction dim
=======  ================  ==================================  ==============
fprop    y  = x W^T        x rowwise,  W rowwise               K
dgrad    dx = dy W         dy rowwise, W columnwise            N
wgrad    dW = dy^T x       dy columnwise, x columnwise         M (tokens)
=======  ================  ==================================  ==============

Each operand is quantized by the recipe's quantizer for its role (``input`` for x,
``weight`` for W, ``grad`` for dy); the GEMMs run in fp32 on the dequantized operands
(GEMM outputs cannot be bit-exact with cuBLAS anyway; operands are). What is quantized once
is reused: x is quantized in forward for both orientations and its quantized tensor saved
for wgrad; W is quantized once per forward for both orientations (a quantized primary
weight is used as stored, never requantized); dy is quantized once in backward for both.

Everything is one grouped op: a plain linear is the grouped op with one member. Members are
quantized separately (own amax / blocks / global scale, own delayed-scaling slots), so a
grouped op over N members is bitwise equal to N separate quantized linears. A member with
zero tokens skips its GEMMs and gets an exact zero weight gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lptrain.precision import autocast as _ac
from lptrain.precision import deferred_wgrad as _deferred
from lptrain.precision import operand_stats as _stats
from lptrain.precision import scaled_gemm as _sg
from lptrain.precision.wgrad import (  # noqa: F401 (add_wgrad, the probe: this module's API)
    _hooks_fire_without_grad,
    _weight_grads,
    _WgradContext,
    add_wgrad,
    fused_wgrad_placeholder,
)

ROLES = ("input", "weight", "grad")


def _is_quantized(t: Any) -> bool:
    from lptrain.precision.tensors.base import QuantizedTensor

    return isinstance(t, QuantizedTensor)


@dataclass
class MemberQuantizers:
    """One member's quantizers (and delayed-scaling states) for the three roles."""

    input: Any
    weight: Any
    grad: Any
    states: dict[str, Any] = field(default_factory=dict)


class QuantState:
    """Per-module quantizer cache for one recipe: quantizers per member and role.

    Delayed scaling keeps its per-module recipe state here (a ``DelayedScalingState`` per
    role and member, created by the recipe, persisting across steps); stateless recipes
    only cache quantizer objects (an NVFP4 grad quantizer also carries its SR generator,
    which must advance from call to call).

    ``amax_reduction`` maps a role to the group its per-tensor amax is MAX-reduced over (the
    operands a tensor-parallel split cuts); it reaches the recipes whose quantizers take one
    (``amax_reduction`` in ``QUANTIZER_OPTIONS``: current per-tensor scales). Delayed scaling
    reduces at the autocast region's update instead, block recipes have no per-tensor amax.
    """

    # Whose operands these are, for the quantization statistics (set by the owning module):
    # its state-dict name, and for a grouped GEMM the global index of member 0.
    label: Optional[str] = None
    member_offset: Optional[int] = None

    def __init__(self, recipe: Any, num_members: int, amax_reduction: Optional[Mapping[str, Any]] = None) -> None:
        self.recipe = recipe
        self.members: list[MemberQuantizers] = []
        reduce = amax_reduction if "amax_reduction" in getattr(recipe, "QUANTIZER_OPTIONS", ()) else None
        for _ in range(num_members):
            qs: dict[str, Any] = {}
            states: dict[str, Any] = {}
            for role in ROLES:
                if recipe.has_delayed_state:
                    states[role] = recipe.make_state(role)
                    qs[role] = recipe.make_quantizer(role, True, True, state=states[role])
                elif reduce and role in reduce:
                    qs[role] = recipe.make_quantizer(role, True, True, amax_reduction=reduce[role])
                else:
                    qs[role] = recipe.make_quantizer(role, True, True)
            self.members.append(MemberQuantizers(states=states, **qs))

    def slots(self, roles: Sequence[str]) -> list[tuple[Any, Any]]:
        """``(recipe, state)`` pairs of the given roles (empty for stateless recipes)."""
        return [(self.recipe, m.states[r]) for m in self.members for r in roles if r in m.states]


class _PlainOperand:
    """A high-precision operand behind the quantized-tensor ``dequantize`` interface."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def dequantize(self, orientation: str = "rowwise") -> torch.Tensor:
        return self.t.float()


class HighPrecisionQuantizer:
    """Identity "quantizer": lets the unquantized grouped path share the grouped op.

    fp32 GEMMs on the operands as given, i.e. exactly what the high-precision linear does
    (same fp32 ops in the same order), plus the grouped op's fusion and zero-token handling.
    """

    rowwise = True
    columnwise = True

    def with_usage(self, rowwise: bool, columnwise: bool) -> HighPrecisionQuantizer:
        return self

    def quantize(self, x: torch.Tensor) -> _PlainOperand:
        return _PlainOperand(x)


def high_precision_state(num_members: int) -> QuantState:
    """A ``QuantState`` whose quantizers are identities (no recipe, no delayed slots)."""
    st = QuantState.__new__(QuantState)
    st.recipe = None
    q = HighPrecisionQuantizer()
    st.members = [MemberQuantizers(input=q, weight=q, grad=q) for _ in range(num_members)]
    return st


def _quantize(quantizer: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Any:
    if quantizer.rowwise != rowwise or quantizer.columnwise != columnwise:
        quantizer = quantizer.with_usage(rowwise, columnwise)
    return quantizer.quantize(x)


def _only_columnwise(q: Any) -> Any:
    """Drop the rowwise buffers of an operand kept for backward (only wgrad/dgrad need it
    columnwise), the way TE's ``update_usage(rowwise_usage=False)`` frees them. Operands
    without that method (older core API, high-precision operands) are kept whole."""
    update = getattr(q, "update_usage", None)
    if update is not None and q.has_orientation("columnwise"):
        update(rowwise=False, columnwise=True)
    return q


def col_operand_t(q: Any) -> torch.Tensor:
    """The wgrad operand of ``q``'s columnwise data as a ``[cols, rows]`` fp32 matrix.

    Columnwise data is what the wgrad GEMM consumes with the token dimension as its
    reduction dimension. For operands quantized after a random Hadamard transform (NVFP4
    input/grad) this is the *rotated* operand as stored; since the transform is
    orthogonal and applied to both wgrad operands along the tokens it cancels in dy^T x.
    """
    rot = getattr(q, "columnwise_rht_operand", None)
    if rot is not None and getattr(q, "with_rht", False):
        return rot()
    return q.dequantize("columnwise").t()


class _QuantizedGroupedFn(torch.autograd.Function):
    """y_i = x_i W_i^T for consecutive token splits x_i, each member quantized on its own.

    Inputs: ``x`` [T, K] (2-D), ``m_splits``, the op context, then the weights: either one
    grouped weight ``[N, out, in]`` (``ctx.single``) or N weights ``[out, in]``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, m_splits: list[int], op: _OpContext, *weights: torch.Tensor):  # type: ignore[override]
        n = len(m_splits)
        if op.single:
            w0 = weights[0]
            members = list(w0.members()) if _is_quantized(w0) else [w0[i] for i in range(n)]
        else:
            members = list(weights)
        # Function.forward runs with grad mode off; the caller's mode says whether a backward
        # can follow (eval / no_grad forwards need no columnwise operands).
        need_dgrad = op.grad_enabled and x.requires_grad
        need_wgrad = op.grad_enabled and any(w.requires_grad for w in weights)
        # one member (every plain linear): no split / cat, whose copies and dispatcher calls
        # a small model's GEMMs would pay for nothing
        xs = (x,) if n == 1 and m_splits[0] == x.shape[0] else torch.split(x, list(m_splits), dim=0)
        outs: list[Optional[torch.Tensor]] = []
        saved_x: list[Any] = []
        saved_w: list[Any] = []
        scaled_x: dict[int, Any] = {}  # member -> its quantized input, for the scaled GEMMs
        qws: list[Any] = []
        trim_w: list[Any] = []  # quantized weights kept for dgrad column-wise only
        for i, (xi, wi) in enumerate(zip(xs, members, strict=False)):
            mq = op.qstate.members[i]
            if _is_quantized(wi):
                qw = wi  # quantized primary weight: use the stored bytes as they are
            elif op.reuse_weights is not None:  # a recompute: the forward's quantized weight
                qw = op.reuse_weights[i]
            else:
                qw = _quantize(mq.weight, wi.detach(), True, need_dgrad)
                if op.keep_weights is not None:  # kept whole for the recompute's fprop
                    op.keep_weights.append(qw)
            qws.append(qw)
            if xi.shape[0] == 0:
                outs.append(x.new_zeros(0, wi.shape[0], dtype=torch.float32))
                saved_x.append(None)
                saved_w.append(qw if need_dgrad else None)
                continue
            qx = _quantize(mq.input, xi.detach(), True, need_wgrad)
            if op.scaled:  # torch's scaled GEMM on the stored operands: after the loop
                x_row = w_row = None
                scaled_x[i] = qx
                outs.append(None)
            else:
                w_row = op.deq(qw, "rowwise")
                x_row = op.deq(qx, "rowwise")
                outs.append(x_row @ w_row.t())
            if op.record:  # the statistics reuse the GEMM's dequantized operands
                op.record_operand("input", i, xi, qx, x_row)
                op.record_operand("weight", i, None if _is_quantized(wi) else wi, qw, w_row)
            saved_x.append(qx if need_wgrad else None)
            whole = _is_quantized(wi) or op.keep_weights is not None
            saved_w.append(qw if need_dgrad else None)
            if need_dgrad and not whole:
                trim_w.append(qw)
        if scaled_x:
            outs = _scaled_member_gemms("fprop", scaled_x, outs, qws, x.dtype)
        # only now (the scaled GEMMs above read the row-wise bytes): drop what backward never reads
        for q in [*saved_x, *trim_w]:
            if q is not None:
                _only_columnwise(q)
        ctx.op = op
        ctx.m_splits = list(m_splits)
        # through save_for_backward, so activation checkpointing can drop and recompute them
        ctx.kinds = _save_operands(ctx, saved_x + saved_w)
        ctx.need_dgrad = need_dgrad
        ctx.wdtypes = [w.dtype for w in weights]
        ctx.in_features = x.shape[-1]
        ctx.x_dtype = x.dtype
        ctx.weights = weights if op.fuse_wgrad else None
        ctx.all_weights = weights  # (a deferred W step hands them their grads)
        y = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)) if outs else x.new_zeros(0, op.out_features)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        op: _OpContext = ctx.op
        need_dgrad = ctx.need_dgrad
        need_wgrad = any(ctx.needs_input_grad[3:])
        n = len(ctx.m_splits)
        dys = (dy,) if n == 1 and ctx.m_splits[0] == dy.shape[0] else torch.split(dy, ctx.m_splits, dim=0)
        dxs: list[Optional[torch.Tensor]] = []
        # per member: the wgrad operands (dy, x), or the member's output width (no tokens)
        pairs: list[Any] = []
        operands = _saved_operands(ctx, ctx.kinds)
        deferred = _deferred.queue() if need_wgrad else None
        scaled_dy: dict[int, Any] = {}  # member -> its quantized gradient, for the scaled dgrad
        for i, dyi in enumerate(dys):
            mq = op.qstate.members[i]
            qx, qw = operands[i], operands[n + i]
            if dyi.shape[0] == 0:
                if need_dgrad:
                    dxs.append(dy.new_zeros(0, ctx.in_features, dtype=torch.float32))
                pairs.append(dyi.shape[1])
                continue
            qdy = _quantize(mq.grad, dyi.detach(), need_dgrad, need_wgrad)
            dy_row = op.deq(qdy, "rowwise") if need_dgrad and not op.scaled else None
            if need_dgrad and op.scaled:  # torch's scaled GEMM: after the loop
                scaled_dy[i] = qdy
                dxs.append(None)
            elif need_dgrad:
                dxs.append(dy_row @ op.deq(qw, "columnwise"))
            if op.record:
                op.record_operand("grad", i, dyi, qdy, dy_row)
            if need_wgrad:
                pairs.append((qdy, qx))
        if scaled_dy:
            dxs = _scaled_member_gemms("dgrad", scaled_dy, dxs, operands[n:], ctx.x_dtype)
        if deferred is not None:  # kept for a deferred W step: only the orientation it reads
            for p in pairs:
                if not isinstance(p, int):
                    _only_columnwise(p[0])
        del operands
        dx = (dxs[0] if len(dxs) == 1 else torch.cat(dxs, dim=0)).to(ctx.x_dtype) if need_dgrad else None
        if not need_wgrad:
            wgrads: list[Optional[torch.Tensor]] = [None] * len(ctx.wdtypes)
        elif deferred is not None:  # the W step of a zero-bubble schedule computes them
            grads_of = functools.partial(_weight_grads, _WgradContext.of(ctx), op, pairs, ctx.in_features,
                                         dy.device)
            deferred.defer(ctx.all_weights, grads_of)
            wgrads = [None] * len(ctx.wdtypes)
        else:
            wgrads = _weight_grads(ctx, op, pairs, ctx.in_features, dy.device)
        # Delayed scaling: the first module of the autocast region updates grad-role scales
        # after its backward, i.e. after every module's backward (numerics.md 2.1).
        if op.bwd_slots is not None:
            _ac.finish_backward(op.bwd_slots, op.group)
        return (dx, None, None, *wgrads)


def _scaled_member_gemms(gemm: str, qas: dict[int, Any], outs: list[Optional[torch.Tensor]],
                         qws: Sequence[Any], out_dtype: torch.dtype) -> list[Optional[torch.Tensor]]:
    """The members' ``gemm`` (``fprop`` / ``dgrad``) on torch's scaled GEMMs: one grouped GEMM
    for all members where torch has that kernel here (``scaled_gemm.grouped``), else one per
    member with tokens (``qas``: member -> quantized input / gradient; ``outs``: None where a
    member's GEMM is still to run, its empty result otherwise)."""
    if len(qws) > 1:
        y = _sg.grouped(gemm, [qas.get(i) for i in range(len(qws))], qws, out_dtype)
        if y is not None:
            return [y]
    one = _sg.fprop if gemm == "fprop" else _sg.dgrad
    return [one(qas[i], qws[i], out_dtype) if o is None else o for i, o in enumerate(outs)]


def _save_operands(ctx: Any, operands: list[Any]) -> list[bool]:
    """``ctx.save_for_backward`` of quantized / high-precision operands (None kept as None);
    returns which ones were high-precision (to be wrapped again on the way out)."""
    plain = [isinstance(o, _PlainOperand) for o in operands]
    ctx.save_for_backward(*(o.t if p else o for o, p in zip(operands, plain, strict=True)))
    return plain


def _saved_operands(ctx: Any, plain: list[bool]) -> list[Any]:
    return [_PlainOperand(t) if p else t for t, p in zip(ctx.saved_tensors, plain, strict=True)]


@dataclass
class _OpContext:
    """Non-tensor arguments of one op call."""

    qstate: QuantState
    single: bool
    fuse_wgrad: bool
    out_features: int
    bwd_slots: Optional[list] = None
    group: Any = None
    grad_enabled: bool = True
    # activation recompute (lptrain.precision.autocast.RecomputeTape): the forward keeps its
    # quantized weights here, the recompute reuses them
    keep_weights: Optional[list] = None
    reuse_weights: Optional[list] = None
    record: bool = False  # collect the operands' statistics (lptrain.precision.operand_stats)
    # the GEMMs run on torch's scaled GEMM with the operands as stored (quantized_gemm=
    # scaled_mm, lptrain.precision.scaled_gemm), not as fp32 GEMMs of dequantized operands
    scaled: bool = False

    def record_operand(self, role: str, i: int, x: Optional[torch.Tensor], q: Any,
                       rowwise: Optional[torch.Tensor] = None) -> None:
        """Add member ``i``'s ``role`` operand to the statistics (``rowwise``: its row-wise
        dequantized values, already computed for the GEMM)."""
        st = self.qstate
        member = None if st.member_offset is None else st.member_offset + i
        quantized = None if isinstance(q, _PlainOperand) else q
        _stats.record(st.label, role, member, x, quantized, rowwise)

    @staticmethod
    def deq(q: Any, orientation: str) -> torch.Tensor:
        """fp32 dequantized operand in its logical orientation (one seam for tests to spy on)."""
        return q.dequantize(orientation)

    @staticmethod
    def col_t(q: Any) -> torch.Tensor:
        return col_operand_t(q)


def _scaled(qstate: QuantState) -> bool:
    """Whether this call's quantized GEMMs run on torch's scaled GEMM (the autocast region's
    ``gemm``); an unquantized grouped state never does."""
    return qstate.recipe is not None and _ac.active_gemm() == "scaled_mm"


def quantized_grouped_linear(
    x: torch.Tensor,
    m_splits: Sequence[int],
    weights: Sequence[torch.Tensor],
    qstate: QuantState,
    *,
    single: bool,
    out_features: int,
    fuse_wgrad: bool = False,
) -> torch.Tensor:
    """Run the quantized grouped GEMM; registers delayed-scaling slots with the autocast region.

    A forward without grad (eval) neither records amaxes nor takes part in the scale update,
    as in TE (which reduces and updates only when grad is enabled): evaluating between steps
    must leave training bitwise unchanged.
    """
    if not torch.is_grad_enabled():
        fwd = qstate.slots(("input", "weight"))
        saved = [(st, st.amax_history[0].clone()) for _, st in fwd]
        op = _OpContext(
            qstate=qstate, single=single, fuse_wgrad=fuse_wgrad, out_features=out_features,
            group=_ac.current_group(), grad_enabled=False, scaled=_scaled(qstate),
        )
        try:
            return _QuantizedGroupedFn.apply(x, list(m_splits), op, *weights)
        finally:
            for st, first in saved:
                st.amax_history[0] = first
    tape = _ac.recompute_tape()
    if tape is not None and tape.replaying:
        return _recompute(x, m_splits, weights, qstate, tape.replay(), single, out_features, fuse_wgrad)
    fwd = qstate.slots(("input", "weight"))
    bwd_slots = _ac.register_forward(fwd, qstate.slots(("grad",)))
    entry = tape.record() if tape is not None else None
    if entry is not None:
        entry.scales = [st.scale.clone() for _, st in fwd]
    op = _OpContext(
        qstate=qstate,
        single=single,
        fuse_wgrad=fuse_wgrad,
        out_features=out_features,
        bwd_slots=bwd_slots,
        group=_ac.current_group(),
        grad_enabled=torch.is_grad_enabled(),
        keep_weights=entry.weights if entry is not None else None,
        record=qstate.label is not None and _stats.active() is not None,
        scaled=_scaled(qstate),
    )
    return _QuantizedGroupedFn.apply(x, list(m_splits), op, *weights)


def _recompute(x: torch.Tensor, m_splits: Sequence[int], weights: Sequence[torch.Tensor],
               qstate: QuantState, entry: Any, single: bool, out_features: int,
               fuse_wgrad: bool) -> torch.Tensor:
    """The op inside a recompute (activation checkpointing): the forward's quantized weights
    and delayed-scaling scales, no amax recorded, no slot registered for the scale update --
    so the recomputed operands are the forward's bit for bit and the step's scaling state
    is what it would be without recompute."""
    fwd = qstate.slots(("input", "weight"))
    op = _OpContext(
        qstate=qstate, single=single, fuse_wgrad=fuse_wgrad, out_features=out_features,
        group=_ac.current_group(), grad_enabled=True, reuse_weights=entry.weights or None,
        scaled=_scaled(qstate),
    )
    with _ac.amax_untouched(fwd), _ac.forward_scales(fwd, entry.scales):
        return _QuantizedGroupedFn.apply(x, list(m_splits), op, *weights)


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    qstate: QuantState,
    *,
    fuse_wgrad: bool = False,
) -> torch.Tensor:
    """y = x W^T with quantized operands; ``x`` may have any leading dims."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = quantized_grouped_linear(
        x2, [x2.shape[0]], [weight], qstate, single=False, out_features=weight.shape[0],
        fuse_wgrad=fuse_wgrad,
    )
    return y.reshape(*lead, weight.shape[0])
