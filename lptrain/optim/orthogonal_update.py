"""The per-matrix Muon update: EMA momentum, scaled Newton-Schulz orthogonalization (with the
QKV split), and one step over a param group's matrices.

The math of :mod:`lptrain.optim.muon` (its module doc states the update and the parameter
contract), apart from the optimizer classes: every Muon path -- the single-process
optimizers and the distributed children (byte-sharded and layer-wise) -- steps through
:func:`muon_group_step`, so they share one sequence of kernels and agree bitwise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from lptrain.catalog.muon_scaling import muon_scale
from lptrain.optim.newton_schulz import NS_EPS, CoefficientsArg, newton_schulz
from lptrain.optim.tp_muon import TPOrthogonalizer
from lptrain.precision.optimizer_states import make_state, store_scaled, unscale

__all__ = ["muon_group_step", "muon_momentum_", "muon_update", "orthogonalize"]


def muon_momentum_(
    grad: torch.Tensor, momentum_buf: torch.Tensor, *, beta: float, nesterov: bool
) -> torch.Tensor:
    """EMA momentum: update ``momentum_buf`` in place and return the vector to orthogonalize.

    ``M <- M + (1-beta)*(G - M)``; returns ``G + beta*(M - G)`` with Nesterov, else a copy of
    ``M``. (The sum form M <- beta*M + G differs by the factor (1-beta), which NS's
    normalization removes.)
    """
    momentum_buf.lerp_(grad, 1.0 - beta)
    if nesterov:
        return grad.lerp(momentum_buf, beta)
    return momentum_buf.clone()


def _scaled_ns(
    u: torch.Tensor, steps: int, coefficients: CoefficientsArg, scale_mode: str,
    extra_scale_factor: float, eps: float,
) -> torch.Tensor:
    """``s * extra * NS(u)``; the scale multiplies NS's fresh fp32 result in place (the same
    kernel and rounding as ``* scale``, one matrix-sized allocation less per update)."""
    scale = muon_scale(u.shape[0], u.shape[1], scale_mode) * extra_scale_factor
    return newton_schulz(u, steps, coefficients, eps).mul_(scale)


def orthogonalize(
    u: torch.Tensor,
    *,
    ns_steps: int,
    coefficients: CoefficientsArg,
    scale_mode: str,
    extra_scale_factor: float = 1.0,
    qkv_split_shapes: Optional[Sequence[int]] = None,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Scaled orthogonalized update of one 2-D matrix ``u`` (fp32 result, shape of ``u``).

    With ``qkv_split_shapes=[q, k, v]`` the rows are viewed as ``[groups, q+k+v, in]``,
    split into Q ``[groups*q, in]``, K and V pieces, each orthogonalized and scaled by its own
    shape, and reassembled in the original per-group layout (Megatron ``split_qkv``).
    """
    if u.dim() != 2:
        raise ValueError(f"orthogonalize needs a 2-D matrix, got shape {tuple(u.shape)}")
    args = (ns_steps, coefficients, scale_mode, extra_scale_factor, eps)
    if qkv_split_shapes is None:
        return _scaled_ns(u, *args)
    shapes = [int(s) for s in qkv_split_shapes]
    rows, cols = u.shape
    total = sum(shapes)
    if total <= 0 or rows % total:
        raise ValueError(
            f"qkv_split_shapes={shapes} do not divide the QKV weight's {rows} rows"
        )
    groups = rows // total
    pieces = u.reshape(groups, total, cols).split(shapes, dim=1)
    outs = [_scaled_ns(pc.reshape(-1, cols), *args).reshape(groups, -1, cols) for pc in pieces]
    return torch.cat(outs, dim=1).reshape(rows, cols)


def muon_update(
    grad: torch.Tensor, momentum_buf: torch.Tensor, *, beta: float, nesterov: bool, **ortho: Any
) -> torch.Tensor:
    """Momentum + scaled orthogonalization for one 2-D matrix: the update to subtract times lr.

    Mutates ``momentum_buf`` (fp32). ``ortho`` are :func:`orthogonalize`'s keyword arguments
    (``ns_steps``, ``coefficients``, ``scale_mode``, ``extra_scale_factor``, ``eps``, and
    ``qkv_split_shapes`` only when the QKV split is wanted). Returns
    ``s * extra_scale_factor * NS(U)`` in fp32.
    """
    u = muon_momentum_(grad.float(), momentum_buf, beta=beta, nesterov=nesterov)
    return orthogonalize(u, **ortho)


def muon_group_step(
    group: dict[str, Any], state: Any
) -> tuple[Optional[torch.Tensor], int]:
    """One Muon step on every param of ``group`` that has a grad.

    The elementwise parts common to every matrix run batched (``torch._foreach_*``: the same
    per-tensor kernels, so bitwise what the per-matrix path computes, with one Python call
    instead of one per matrix): the momentum update over all matrices, and the decoupled
    decay of the fp32 ones (the masters of every distributed path; bf16 params are decayed
    one by one: there ``_foreach_mul_`` with a Python scalar rounds differently from
    ``mul_``). The Nesterov vector, Newton-Schulz and the step then go matrix by matrix, so
    only one matrix's temporaries are alive at a time. Matrices are independent, and a
    matrix's decay still precedes its step, so this order gives bitwise the updates of the
    matrix-at-a-time order.

    Returns the sum of squared update entries (``s * extra_scale_factor * O``, before lr) and
    their count, for :attr:`Muon.last_update_rms`; ``(None, 0)`` when no param had a grad.
    """
    mats: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[Sequence[int]]]] = []
    # the precision-aware optimizer stores the momentum as Adam's exp_avg (exp_avg_dtype):
    # read into fp32 here, stored back after the step (lptrain.precision.optimizer_states)
    stored: list[tuple[dict[str, Any], torch.Tensor]] = []
    momentum_dtype = group.get("momentum_dtype", torch.float32)
    for p in group["params"]:
        if p.grad is None:
            continue
        st = state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = make_state(momentum_dtype, p)
            if momentum_dtype != torch.float32:
                st["momentum_scale"] = torch.ones(1, dtype=torch.float32, device=p.device)
        buf = unscale(st["momentum_buffer"], st.get("momentum_scale"))
        if buf is not st["momentum_buffer"]:
            stored.append((st, buf))
        if p.dim() == 3:
            # Per member on views: bitwise identical to discrete expert weights.
            mats += [(p[i], p.grad[i], buf[i], None) for i in range(p.shape[0])]
        else:
            shapes = getattr(p, "qkv_split_shapes", None)
            split = group["split_qkv"] and getattr(p, "is_qkv", False)
            mats.append((p, p.grad, buf, shapes if split else None))
    if not mats:
        return None, 0
    lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
    grads = [g.float() for _, g, _, _ in mats]
    bufs = [b for _, _, b, _ in mats]
    torch._foreach_lerp_(bufs, grads, 1.0 - beta)  # muon_momentum_'s EMA, all matrices
    decay_one_by_one = False
    if wd != 0:
        fp32 = [m[0] for m in mats if m[0].dtype == torch.float32]
        if fp32:
            torch._foreach_mul_(fp32, 1.0 - lr * wd)
        decay_one_by_one = len(fp32) != len(mats)
    sq: list[torch.Tensor] = []
    count = 0
    tp_ortho = TPOrthogonalizer(group.get("tp_mode", "duplicated"))
    for (p, _, buf, shapes), grad in zip(mats, grads, strict=True):
        u = grad.lerp(buf, beta) if group["nesterov"] else buf.clone()
        ortho = functools.partial(
            orthogonalize, ns_steps=group["ns_steps"], coefficients=group["coefficients"],
            scale_mode=group["scale_mode"], extra_scale_factor=group["extra_scale_factor"],
            qkv_split_shapes=shapes, eps=group["eps"],
        )
        # a tensor-parallel shard: Newton-Schulz on the whole matrix (lptrain.optim.tp_muon)
        shard = getattr(p, "tp_shard", None)
        update = tp_ortho(u, shard, ortho) if shard is not None else ortho(u)
        if decay_one_by_one and p.dtype != torch.float32:
            p.mul_(1.0 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)
        sq.append(update.square().sum())
        count += update.numel()
    for st, buf in stored:
        store_scaled(st["momentum_buffer"], buf, st.get("momentum_scale"))
    return torch.stack(sq).sum(), count
