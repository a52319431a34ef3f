"""Weight gradients: where a GEMM's weight gradient goes, for every emulated GEMM.

With gradient-accumulation fusion (``train.gradient_accumulation_fusion``, Megatron-LM's
contract) a backward adds its fp32 weight gradient straight into ``weight.main_grad``
(:func:`add_wgrad`), sets ``weight.grad_added_to_main_grad`` and hands autograd only a
placeholder (:func:`fused_wgrad_placeholder`); without it the gradient goes to autograd.
The quantized grouped op (:mod:`lptrain.precision.linear_ops`) forms its members' gradients
with :func:`_weight_grads`; the unquantized linear is :class:`_HighPrecisionLinearFn`. Both
can hand the whole weight-gradient step to a later W step
(:mod:`lptrain.precision.deferred_wgrad`: the zero-bubble pipeline schedules).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lptrain.precision import deferred_wgrad as _deferred
from lptrain.precision import gemm as _gemm


def add_wgrad(weight: torch.Tensor, dw: torch.Tensor, main_grad: Optional[torch.Tensor]) -> None:
    """Accumulate ``dw`` into ``main_grad`` (fp32 add) and flag the weight (fusion contract)."""
    assert main_grad is not None
    # reshaped and cast only when needed: each is an op per linear per backward, and the
    # add is the same either way
    if dw.shape != main_grad.shape:
        dw = dw.view_as(main_grad)
    main_grad.add_(dw if dw.dtype == main_grad.dtype else dw.to(main_grad.dtype))
    weight.grad_added_to_main_grad = True


def fused_wgrad_placeholder(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """What a fused-wgrad backward hands autograd for ``weight`` once its grad is in
    ``main_grad``.

    Under a data-parallel engine (``weight.main_grad_hooked``: its post-accumulate hook adds
    ``.grad`` into ``main_grad`` when there is one, resets the fusion flag and marks the grad
    ready) this is ``None``, so autograd accumulates nothing into ``.grad``: the zero tensor,
    its accumulation and the hook's drop of it, per weight per backward, are not paid (host
    cost that caps small models). Autograd still runs the weight's AccumulateGrad and so the
    hook, with ``.grad`` None; :func:`_hooks_fire_without_grad` checks that this torch does,
    else the zero is returned as before. Without an engine, a fresh zero of the weight's
    shape, the way TE does (never a cached one: ``p.grad`` would alias it, and autograd's
    in-place sum of a later grad would write into the cache). A weight the engine keeps no
    hook on (``weight.main_grad_unhooked``: no overlapped reduction needs its readiness)
    gets ``None`` on any torch.
    """
    if getattr(weight, "main_grad_unhooked", False):  # the engine expects no grad at all
        return None
    if getattr(weight, "main_grad_hooked", False) and _hooks_fire_without_grad():
        return None
    return torch.zeros(tuple(weight.shape), dtype=weight.dtype, device=weight.device)


class _NoWeightGrad(torch.autograd.Function):
    """y = x * w whose backward gives ``w`` no grad (the probe of :func:`_hooks_fire_without_grad`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * w

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        return dy, None


@functools.cache
def _hooks_fire_without_grad() -> bool:
    """Whether autograd runs a leaf's post-accumulate-grad hooks when a backward hands it no
    grad (None), as torch 2.13 does. Probed once on two 1-element tensors."""
    w = torch.ones(1, requires_grad=True)
    fired: list[Optional[torch.Tensor]] = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad))
    with torch.enable_grad():
        _NoWeightGrad.apply(torch.ones(1, requires_grad=True), w).sum().backward()
    return fired == [None]


@dataclass(frozen=True)
class _WgradContext:
    """What :func:`_weight_grads` reads of an op's autograd context (kept past its backward
    by a deferred W step, without the context's saved tensors)."""

    op: Any
    wdtypes: list[torch.dtype]
    weights: Optional[Sequence[torch.Tensor]]

    @staticmethod
    def of(ctx: Any) -> _WgradContext:
        return _WgradContext(ctx.op, ctx.wdtypes, ctx.weights)


def _weight_grads(ctx: Any, op: Any, pairs: list[Any], in_features: int,
                  device: torch.device) -> list[Optional[torch.Tensor]]:
    """The wgrad GEMMs ``dW_i = dy_i^T x_i`` of every member (an exact zero for a member without
    tokens: ``pairs[i]`` its output width), then :func:`_accumulate_weight_grads`."""
    dws = [torch.zeros(p, in_features, dtype=torch.float32, device=device) if isinstance(p, int)
           else _member_wgrad(op, *p) for p in pairs]
    return _accumulate_weight_grads(ctx, dws)


def _member_wgrad(op: Any, qdy: Any, qx: Any) -> torch.Tensor:
    """One member's ``dW = dy^T x`` in fp32: torch's scaled GEMM on the stored operands
    (``precision.quantized_gemm=scaled_mm``), else the GEMM of the dequantized ones."""
    if op.scaled:
        from lptrain.precision import scaled_gemm

        return scaled_gemm.wgrad(qdy, qx)
    return op.col_t(qdy) @ op.col_t(qx).t()


def _accumulate_weight_grads(ctx: Any, dws: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """Per-weight autograd grads; with fusion, accumulate into ``main_grad`` and return
    :func:`fused_wgrad_placeholder` (None under a data-parallel engine, else zeros)."""
    op = ctx.op
    out: list[Optional[torch.Tensor]] = []
    if op.single:
        dtype = ctx.wdtypes[0]
        w = ctx.weights[0] if ctx.weights is not None else None
        main_grad = getattr(w, "main_grad", None) if w is not None else None
        if op.fuse_wgrad and main_grad is not None:
            for i, dw in enumerate(dws):
                main_grad[i].add_(dw.to(main_grad.dtype))
            w.grad_added_to_main_grad = True
            out.append(fused_wgrad_placeholder(w))
        else:
            out.append(torch.stack(dws).to(dtype))
        return out
    for i, dw in enumerate(dws):
        dtype = ctx.wdtypes[i]
        w = ctx.weights[i] if ctx.weights is not None else None
        main_grad = getattr(w, "main_grad", None) if w is not None else None
        if op.fuse_wgrad and main_grad is not None:
            add_wgrad(w, dw, main_grad)
            out.append(fused_wgrad_placeholder(w))
        else:
            out.append(dw.to(dtype))
    return out


class _HighPrecisionLinearFn(torch.autograd.Function):
    """y = x W^T unquantized; wgrad optionally accumulated straight into ``weight.main_grad``.

    fprop and dgrad run natively in bf16 on CUDA (``gemm.native_16bit_gemm``), else in
    fp32; the weight gradient is always formed in fp32 (``gemm.wgrad_fp32``). When the
    weight carries a ``main_grad`` buffer and fusion is on, it is added into it and
    ``weight.grad_added_to_main_grad`` is set, so the data-parallel hook does not add it a
    second time (the Megatron gradient-accumulation-fusion contract).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fuse_wgrad: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.fuse_wgrad = fuse_wgrad
        if _gemm.native_16bit_gemm(x, weight):
            return x @ weight.t()
        out = x.float() @ weight.float().t()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        if _gemm.native_16bit_gemm(x, weight) and dy.dtype == x.dtype:
            dx = (dy2 @ weight).reshape(*dy.shape[:-1], weight.shape[1])
        else:
            dx = (dy2.float() @ weight.float()).reshape(*dy.shape[:-1], weight.shape[1]).to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        deferred = _deferred.queue() if weight.requires_grad else None
        if deferred is not None:  # the W step of a zero-bubble schedule computes it
            fuse = ctx.fuse_wgrad
            deferred.defer([weight], lambda: [accumulate_wgrad(weight, _gemm.wgrad_fp32(dy2, x2), fuse)])
            return dx, None, None
        return dx, accumulate_wgrad(weight, _gemm.wgrad_fp32(dy2, x2), ctx.fuse_wgrad), None


def accumulate_wgrad(weight: torch.Tensor, dw: torch.Tensor, fuse: bool) -> Optional[torch.Tensor]:
    """Return ``dw`` as the autograd grad, or add it into ``weight.main_grad`` (fusion).

    With fusion, autograd still needs a gradient of the weight's shape; a zero tensor is
    returned the way TE does (``grad_added_to_main_grad`` tells the DDP hook to skip it). A
    fresh one each time, never a cached zero: without the DDP hook to drop it, ``p.grad``
    would alias the cache, and autograd's in-place sum of a later grad would write into it.
    """
    main_grad = getattr(weight, "main_grad", None)
    if fuse and main_grad is not None:
        add_wgrad(weight, dw, main_grad)
        return fused_wgrad_placeholder(weight)
    return dw.to(weight.dtype)
