"""Lion, and the choice of optimizer for the params Muon does not take.

Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675), with
the two betas as Megatron-LM and Emerging-Optimizers name them. Per param ``p`` with gradient
``g`` and fp32 momentum ``m`` (state ``exp_avg``):

1. decoupled weight decay: ``p <- p * (1 - lr * wd)``;
2. ``p <- p - lr * sign(beta1 * m + (1 - beta1) * g)`` (every element moves by exactly ``lr``,
   or not at all where the interpolation is 0);
3. ``m <- beta2 * m + (1 - beta2) * g``.

One state tensor per param (AdamW keeps two), no step counter and no bias correction. Its
steps are ``lr`` per element whatever the gradient's scale, so it usually wants a smaller lr
than AdamW; lptrain runs it at ``optimizer.lr`` (the lr of the other non-Muon groups), as
Megatron runs ``--muon-scalar-optimizer lion`` at the global lr.

:func:`scalar_optimizer` builds the optimizer of a run's non-Muon params from the config:
AdamW unless ``optimizer.name=muon`` with ``optimizer.muon.scalar_optimizer=lion``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from lptrain.config.schema import OptimizerConfig


@torch.no_grad()
def lion_update_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion step on ``params`` in place (see the module docstring for the rule)."""
    for p, g, m in zip(params, grads, exp_avgs, strict=True):
        g = g.to(m.dtype)
        direction = m.lerp(g, 1.0 - beta1).sign_()
        if weight_decay != 0:
            p.mul_(1.0 - lr * weight_decay)
        p.add_(direction.to(p.dtype), alpha=-lr)
        m.lerp_(g, 1.0 - beta2)


def lion_group_step(group: dict[str, Any], state: Any) -> None:
    """Lion on one param group (``lr``, ``betas``, ``weight_decay``); state ``exp_avg`` (fp32,
    created on the first step)."""
    params, grads, moms = [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        st = state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32,
                                             memory_format=torch.contiguous_format)
        params.append(p)
        grads.append(p.grad)
        moms.append(st["exp_avg"])
    beta1, beta2 = group["betas"]
    lion_update_(params, grads, moms, lr=group["lr"], beta1=beta1, beta2=beta2,
                 weight_decay=group["weight_decay"])


def closure_loss(closure: Optional[Callable[[], float]]) -> Optional[float]:
    """torch's ``Optimizer.step(closure)`` contract: the loss the closure recomputes (with
    grad enabled, as the closure runs a backward), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Lion(torch.optim.Optimizer):
    """Lion as a ``torch.optim.Optimizer``: per-group ``lr``, ``betas`` and ``weight_decay``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.95, 0.98),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = closure_loss(closure)
        for group in self.param_groups:
            lion_group_step(group, self.state)
        return loss


def scalar_optimizer_name(cfg: OptimizerConfig) -> str:
    """``adamw`` or ``lion``: the optimizer of the params Muon does not take (and of every
    param when ``optimizer.name=adamw``)."""
    return cfg.muon.scalar_optimizer if cfg.name == "muon" else "adamw"


def _adamw(groups: list[dict[str, Any]], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, foreach=True)


def _lion(groups: list[dict[str, Any]], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return Lion(groups, lr=cfg.lr, betas=(cfg.lion_beta1, cfg.lion_beta2))


SCALAR_OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]], OptimizerConfig], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "lion": _lion,
}


def scalar_optimizer(
    decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """The optimizer of the non-Muon params: two groups named ``<name>_decay`` (matrices:
    embeddings, output head; ``optimizer.weight_decay``) and ``<name>_no_decay`` (1-D: norms,
    biases; no decay), where ``<name>`` is :func:`scalar_optimizer_name` (AdamW keeps its
    ``adamw_decay``/``adamw_no_decay`` groups)."""
    name = scalar_optimizer_name(cfg)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "name": f"{name}_decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": f"{name}_no_decay"},
    ]
    return SCALAR_OPTIMIZERS[name](groups, cfg)
