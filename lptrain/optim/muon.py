"""Muon for hidden matrices, and ``MuonWithAdamW`` pairing it with AdamW for everything else.

The math follows /work/shared/reference/muon.md section 1 and megatron-behaviors.md 2.3.
Per matrix parameter ``W`` (out x in) with gradient ``G`` and fp32 momentum buffer ``M``:

1. decoupled weight decay, base lr: ``W <- W * (1 - lr * wd)``;
2. EMA momentum: ``M <- beta*M + (1-beta)*G``; the vector to orthogonalize is
   ``U = G + beta*(M - G)`` with Nesterov (= ``(1-beta)*G + beta*M``, muon.md 1.1), else ``M``;
3. ``O = NS(U)`` (``newton_schulz``); with ``split_qkv`` a fused QKV weight is orthogonalized
   as separate Q, K and V pieces; a grouped expert weight ``[E, out, in]`` per member;
4. ``W <- W - lr * s(out, in) * extra_scale_factor * O`` with ``s = muon_scale`` of the
   orthogonalized piece's shape (as upstream, a Q piece is scaled by its own shape).

Parameter contract (read from the tensors handed to the optimizer, never from names):

* ``is_qkv`` (bool) + ``qkv_split_shapes`` ([q, k, v] rows per query group): the weight is
  ``[groups * (q+k+v), in]`` laid out per group;
* ``num_grouped_members`` (int, == shape[0]) on a 3-D ``[E, out, in]`` weight: E matrices.

A caller that optimizes fp32 master copies must copy these attributes (and ``use_muon`` /
``is_embedding_or_output`` for routing) from the model params onto the masters:
:func:`lptrain.optim.param_groups.copy_param_attributes` does that.

Grouped weights are updated member by member on views (decay, momentum, NS, step), so a single
grouped weight and the equivalent discrete weights get bitwise identical updates regardless of
how elementwise kernels vectorize tensors of different sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from lptrain.config.schema import OptimizerConfig
from lptrain.optim.newton_schulz import NS_EPS, CoefficientsArg, newton_schulz, resolve_coefficients

SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")


def muon_scale(out_features: int, in_features: int, mode: str) -> float:
    """Update scale s(A, B) for an A x B (fan_out x fan_in) matrix (muon.md 1.3).

    * ``spectral``: sqrt(max(A, B)) -- update RMS ~ 1, Megatron's default (times
      ``extra_scale_factor=0.2`` it is Moonlight's "match AdamW RMS");
    * ``shape_scaling``: sqrt(max(1, A/B)) -- Keller's original;
    * ``unit_rms_norm``: sqrt(A/B) -- RMS->RMS operator norm 1 (Scion / Dion's default).
    """
    a, b = out_features, in_features
    if mode == "spectral":
        return math.sqrt(max(a, b))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, a / b))
    if mode == "unit_rms_norm":
        return math.sqrt(a / b)
    raise ValueError(
        f"optimizer.muon.scale_mode={mode!r} is not one of {', '.join(SCALE_MODES)}"
    )


def muon_momentum_(
    grad: torch.Tensor, momentum_buf: torch.Tensor, *, beta: float, nesterov: bool
) -> torch.Tensor:
    """EMA momentum: update ``momentum_buf`` in place and return the vector to orthogonalize.

    ``M <- M + (1-beta)*(G - M)``; returns ``G + beta*(M - G)`` with Nesterov, else a copy of
    ``M``. (The sum form M <- beta*M + G differs by the factor (1-beta), which NS's
    normalization removes; muon.md 1.1.)
    """
    momentum_buf.lerp_(grad, 1.0 - beta)
    if nesterov:
        return grad.lerp(momentum_buf, beta)
    return momentum_buf.clone()


def _scaled_ns(
    u: torch.Tensor, steps: int, coefficients: CoefficientsArg, scale_mode: str,
    extra_scale_factor: float, eps: float,
) -> torch.Tensor:
    scale = muon_scale(u.shape[0], u.shape[1], scale_mode) * extra_scale_factor
    return newton_schulz(u, steps, coefficients, eps) * scale


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
    grad: torch.Tensor,
    momentum_buf: torch.Tensor,
    *,
    beta: float,
    nesterov: bool,
    ns_steps: int,
    coefficients: CoefficientsArg,
    scale_mode: str,
    extra_scale_factor: float = 1.0,
    qkv_split_shapes: Optional[Sequence[int]] = None,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Momentum + scaled orthogonalization for one 2-D matrix: the update to subtract times lr.

    Mutates ``momentum_buf`` (fp32). Returns ``s * extra_scale_factor * NS(U)`` in fp32;
    pass ``qkv_split_shapes`` only when the QKV split is wanted.
    """
    u = muon_momentum_(grad.float(), momentum_buf, beta=beta, nesterov=nesterov)
    return orthogonalize(
        u, ns_steps=ns_steps, coefficients=coefficients, scale_mode=scale_mode,
        extra_scale_factor=extra_scale_factor, qkv_split_shapes=qkv_split_shapes, eps=eps,
    )


def _validate_hparams(group: dict[str, Any]) -> None:
    """Reject invalid hyperparameters with ValueErrors naming the config key."""
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"optimizer.muon.momentum={group['momentum']} not in [0, 1)")
    if int(group["ns_steps"]) < 1:
        raise ValueError(f"optimizer.muon.ns_steps={group['ns_steps']} must be >= 1")
    resolve_coefficients(group["coefficients"])
    muon_scale(1, 1, group["scale_mode"])
    if group["lr"] < 0:
        raise ValueError(f"optimizer.lr={group['lr']} must be >= 0")
    if group["weight_decay"] < 0:
        raise ValueError(f"optimizer.weight_decay={group['weight_decay']} must be >= 0")


def _validate_param(p: torch.Tensor) -> None:
    """A Muon param is a 2-D matrix, or a 3-D grouped weight tagged ``num_grouped_members``."""
    if p.dim() == 3:
        members = getattr(p, "num_grouped_members", None)
        if members != p.shape[0]:
            raise ValueError(
                f"Muon got a 3-D param of shape {tuple(p.shape)} with num_grouped_members="
                f"{members}; only grouped expert weights [E, out, in] tagged with "
                "num_grouped_members == E are accepted"
            )
    elif p.dim() != 2:
        raise ValueError(f"Muon handles 2-D matrices (or grouped 3-D), got {tuple(p.shape)}")
    if getattr(p, "is_qkv", False):
        shapes = getattr(p, "qkv_split_shapes", None)
        if p.dim() != 2 or not shapes or p.shape[0] % sum(shapes):
            raise ValueError(
                f"is_qkv param of shape {tuple(p.shape)} needs qkv_split_shapes dividing its "
                f"rows, got {shapes}"
            )


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton-Schulz orthogonalization) for matrix params, single process.

    Per-group hyperparameters: ``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_steps``, ``coefficients``, ``scale_mode``, ``extra_scale_factor``, ``split_qkv``,
    ``eps``. State per param: ``momentum_buffer`` (fp32, shape of the param). Params must be
    2-D, or 3-D with ``num_grouped_members`` (see the module docstring for the contract).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        coefficients: CoefficientsArg = "quintic",
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        split_qkv: bool = True,
        eps: float = NS_EPS,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, coefficients=coefficients, scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor, split_qkv=split_qkv, eps=eps,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_hparams(group)
        for p in group["params"]:
            _validate_param(p)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, dtype=torch.float32, memory_format=torch.contiguous_format
                    )
                buf = state["momentum_buffer"]
                if p.dim() == 3:
                    # Per member on views: bitwise identical to discrete expert weights.
                    for i in range(p.shape[0]):
                        self._update_matrix(p[i], p.grad[i], buf[i], group, None)
                else:
                    shapes = getattr(p, "qkv_split_shapes", None)
                    split = group["split_qkv"] and getattr(p, "is_qkv", False)
                    self._update_matrix(p, p.grad, buf, group, shapes if split else None)
        return loss

    @staticmethod
    def _update_matrix(
        p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict[str, Any],
        qkv_split_shapes: Optional[Sequence[int]],
    ) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        update = muon_update(
            grad, buf, beta=group["momentum"], nesterov=group["nesterov"],
            ns_steps=group["ns_steps"], coefficients=group["coefficients"],
            scale_mode=group["scale_mode"], extra_scale_factor=group["extra_scale_factor"],
            qkv_split_shapes=qkv_split_shapes, eps=group["eps"],
        )
        if wd != 0:
            p.mul_(1.0 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)


class MuonWithAdamW:
    """Muon for ``muon_params`` and AdamW for ``adamw_params``, behind one optimizer interface.

    Both children hold exactly the tensor objects passed in (e.g. fp32 masters whose ``.grad``
    the caller sets). ``param_groups`` lists every group of both children (same dict objects),
    each tagged ``group["optimizer"]`` = ``"muon"`` or ``"adamw"``, so
    ``for g in opt.param_groups: g["lr"] = lr`` drives both. AdamW decays params with
    ``ndim >= 2`` (embeddings, head) and not 1-D ones (norms, biases), like the AdamW trainer.
    Both use ``optimizer_cfg.lr`` / ``weight_decay``; Muon's settings come from
    ``optimizer_cfg.muon``.
    """

    def __init__(
        self,
        muon_params: Iterable[torch.Tensor],
        adamw_params: Iterable[torch.Tensor],
        optimizer_cfg: OptimizerConfig,
    ) -> None:
        o, m = optimizer_cfg, optimizer_cfg.muon
        if m.scalar_optimizer != "adamw":
            raise ValueError(
                f"optimizer.muon.scalar_optimizer={m.scalar_optimizer!r} is not supported "
                "(only adamw)"
            )
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        seen: set[int] = set()
        for p in muon_params + adamw_params:
            if id(p) in seen:
                raise ValueError("MuonWithAdamW: a tensor was passed twice (or to both lists)")
            seen.add(id(p))
        self.muon: Optional[Muon] = None
        self.adamw: Optional[torch.optim.AdamW] = None
        if muon_params:
            self.muon = Muon(
                [{"params": muon_params, "optimizer": "muon"}],
                lr=o.lr, weight_decay=o.weight_decay, momentum=m.momentum,
                nesterov=m.nesterov, ns_steps=m.ns_steps, coefficients=m.coefficients,
                scale_mode=m.scale_mode, extra_scale_factor=m.extra_scale_factor,
                split_qkv=m.split_qkv,
            )
        decay = [p for p in adamw_params if p.dim() >= 2]
        no_decay = [p for p in adamw_params if p.dim() < 2]
        groups = [
            {"params": ps, "weight_decay": wd, "optimizer": "adamw"}
            for ps, wd in ((decay, o.weight_decay), (no_decay, 0.0))
            if ps
        ]
        if groups:
            self.adamw = torch.optim.AdamW(
                groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps
            )

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"muon": ..., "adamw": ...}`` (a child absent because it has no params is None)."""
        return {
            "muon": None if self.muon is None else self.muon.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            sd = state_dict.get(key)
            if (opt is None) != (sd is None):
                raise ValueError(
                    f"MuonWithAdamW.load_state_dict: {key} state is "
                    f"{'missing' if sd is None else 'present'} but this optimizer "
                    f"{'has' if opt is not None else 'has no'} {key} params"
                )
            if opt is not None:
                opt.load_state_dict(sd)
