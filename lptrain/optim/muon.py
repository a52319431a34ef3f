"""Muon for hidden matrices, and ``MuonWithAdamW`` pairing it with AdamW for everything else.

Per matrix parameter ``W`` (out x in) with gradient ``G`` and fp32 momentum buffer ``M``:

1. decoupled weight decay, base lr: ``W <- W * (1 - lr * wd)`` (Keller, Moonlight, torch);
2. EMA momentum: ``M <- beta*M + (1-beta)*G``; the vector to orthogonalize is
   ``U = G + beta*(M - G)`` with Nesterov (= ``(1-beta)*G + beta*M``), else ``M``. The sum
   form ``M <- beta*M + G`` differs by the factor (1-beta), which NS's normalization removes;
3. ``O = NS(U)`` (``newton_schulz``: ``O ~ U (U^T U)^(-1/2)``, the polar factor); with
   ``split_qkv`` a fused QKV weight is orthogonalized as separate Q, K and V pieces; a grouped
   expert weight ``[E, out, in]`` per member;
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

The update math and the per-group step live in :mod:`lptrain.optim.orthogonal_update`
(re-exported here); this module holds the optimizers and their hyperparameter checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch

from lptrain.catalog.muon_scaling import SCALE_MODES, muon_scale
from lptrain.catalog.ns_coefficients import ns_steps_problem
from lptrain.config.schema import OptimizerConfig
from lptrain.optim.lion import closure_loss, lion_group_step
from lptrain.optim.named_state import NamedStateMixin
from lptrain.optim.newton_schulz import NS_EPS, CoefficientsArg, resolve_coefficients
from lptrain.optim.orthogonal_update import (
    muon_group_step,
    muon_momentum_,
    muon_update,
    orthogonalize,
)

__all__ = [
    "GROUP_NAMES",
    "SCALE_MODES",
    "Muon",
    "MuonWithAdamW",
    "build_muon",
    "muon_hparams",
    "muon_momentum_",
    "muon_scale",
    "muon_update",
    "orthogonalize",
]


def _validate_hparams(group: dict[str, Any]) -> None:
    """Reject invalid hyperparameters with ValueErrors naming the config key."""
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"optimizer.muon.momentum={group['momentum']} not in [0, 1)")
    if int(group["ns_steps"]) < 1:
        raise ValueError(f"optimizer.muon.ns_steps={group['ns_steps']} must be >= 1")
    resolve_coefficients(group["coefficients"])
    if isinstance(group["coefficients"], str):
        problem = ns_steps_problem(group["coefficients"], int(group["ns_steps"]))
        if problem:
            raise ValueError(f"optimizer.muon.ns_steps: {problem}")
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


class _UpdateRMS:
    """Keeps the Muon update statistics of the last step (tensors until read: no device sync)
    and runs the Muon groups of a step."""

    _rms_sumsq: Optional[torch.Tensor] = None
    _rms_count: int = 0
    param_groups: list[dict[str, Any]]
    state: Any

    def _step_groups(self, is_muon: Callable[[dict[str, Any]], bool]) -> None:
        """One step of every param group: Muon where ``is_muon(group)``, else the group's
        scalar optimizer (``group["optimizer"]``); records the Muon update statistics."""
        sq: list[torch.Tensor] = []
        count = 0
        for group in self.param_groups:
            if is_muon(group):
                s, n = muon_group_step(group, self.state)
                if s is not None:
                    sq.append(s)
                    count += n
            else:
                _SCALAR_KINDS[group["optimizer"]](group, self.state)
        self._rms_sumsq = torch.stack(sq).sum() if sq else None
        self._rms_count = count

    @property
    def last_update_stats(self) -> tuple[Optional[torch.Tensor], int]:
        """``(sum of squared entries, number of entries)`` of the last step's Muon update
        ``s * extra * O`` (before lr), the sum still on the device (``None`` before the first
        step or when no Muon param had a grad): what a distributed caller sums over ranks."""
        return self._rms_sumsq, self._rms_count

    @property
    def last_update_rms(self) -> Optional[float]:
        """RMS over all Muon matrix entries of the last step's update ``s * extra * O``
        (before lr): ~1 for ``spectral``, ~0.2 with ``extra_scale_factor=0.2``; None before the
        first step or when no Muon param had a grad."""
        if self._rms_sumsq is None or self._rms_count == 0:
            return None
        return math.sqrt(float(self._rms_sumsq) / self._rms_count)


def muon_hparams(cfg: OptimizerConfig) -> dict[str, Any]:
    """The Muon hyperparameters of a config (``optimizer.lr``, ``optimizer.weight_decay`` and
    ``optimizer.muon.*``), as :class:`Muon`'s keyword arguments and group defaults."""
    m = cfg.muon
    return dict(
        lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
        ns_steps=m.ns_steps, coefficients=m.coefficients, scale_mode=m.scale_mode,
        extra_scale_factor=m.extra_scale_factor, split_qkv=m.split_qkv, eps=NS_EPS,
        tp_mode=m.tp_mode,
    )


class Muon(_UpdateRMS, NamedStateMixin, torch.optim.Optimizer):
    """Muon (momentum + Newton-Schulz orthogonalization) for matrix params, single process.

    Per-group hyperparameters: ``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_steps``, ``coefficients``, ``scale_mode``, ``extra_scale_factor``, ``split_qkv``,
    ``eps``, ``tp_mode`` (tensor-parallel shards: :mod:`lptrain.optim.tp_muon`). State per param: ``momentum_buffer`` (fp32, shape of the param). Params must be
    2-D, or 3-D with ``num_grouped_members`` (see the module docstring for the contract);
    ``(name, param)`` pairs name them, and state then loads by name.
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
        tp_mode: str = "duplicated",
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, coefficients=coefficients, scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor, split_qkv=split_qkv, eps=eps, tp_mode=tp_mode,
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
        loss = closure_loss(closure)
        self._step_groups(lambda group: True)
        return loss


def build_muon(masters: Sequence[torch.Tensor], cfg: OptimizerConfig,
               momentum_dtype: torch.dtype = torch.float32) -> Muon:
    """Muon over ``masters`` (one group named ``muon``) with the config's settings: the
    optimizer of every distributed Muon path (byte-sharded and layer-wise). ``momentum_dtype``:
    the momentum's stored dtype (the precision-aware optimizer's exp_avg_dtype)."""
    group: dict[str, Any] = {"params": list(masters), "name": "muon"}
    if momentum_dtype != torch.float32:
        group["momentum_dtype"] = momentum_dtype
    return Muon([group], **muon_hparams(cfg))


def _adamw_group_step(group: dict[str, Any], state: Any) -> None:
    """torch's AdamW (the ``torch.optim.adamw.adamw`` functional, present with this
    signature from torch 2.2) on one group: the same kernel and state layout (``step``,
    ``exp_avg``, ``exp_avg_sq``) as ``torch.optim.AdamW``, so the result is bitwise
    identical to it."""
    from torch.optim.adamw import adamw

    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        st = state[p]
        if len(st) == 0:
            # As torch: a CPU scalar step in the default float dtype (not fused/capturable).
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            st["step"] = torch.tensor(0.0, dtype=scalar)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(st["exp_avg"])
        exp_avg_sqs.append(st["exp_avg_sq"])
        steps.append(st["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    adamw(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        foreach=group["foreach"], capturable=False, differentiable=False,
        fused=group["fused"], grad_scale=None, found_inf=None, has_complex=False,
        amsgrad=False, beta1=beta1, beta2=beta2,
        lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
    )


ParamArg = Union[torch.Tensor, tuple[str, torch.Tensor]]
GROUP_NAMES = ("muon", "adamw_decay", "adamw_no_decay")  # with scalar_optimizer=adamw
# The optimizers of the non-Muon groups (optimizer.muon.scalar_optimizer), by name.
_SCALAR_KINDS: dict[str, Callable[[dict[str, Any], Any], None]] = {
    "adamw": _adamw_group_step,
    "lion": lion_group_step,
}


def _names_and_tensors(
    items: Iterable[ParamArg],
) -> tuple[list[Optional[str]], list[torch.Tensor]]:
    names: list[Optional[str]] = []
    tensors: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, tuple):
            name, t = item
            names.append(str(name))
            tensors.append(t)
        else:
            names.append(None)
            tensors.append(item)
    return names, tensors


class MuonWithAdamW(_UpdateRMS, NamedStateMixin, torch.optim.Optimizer):
    """Muon for ``muon_params`` and AdamW (or Lion) for ``adamw_params``: one
    ``torch.optim.Optimizer``, lptrain's Muon for a training loop of your own (one process;
    docs/muon.md shows one). lptrain's trainer uses the distributed children instead
    (:mod:`lptrain.optim.distributed`, :mod:`lptrain.optim.layerwise`).

    Three param groups, always present (possibly empty) and always in this order, each tagged
    ``group["name"]`` and ``group["optimizer"]``:

    * ``muon`` (``optimizer="muon"``): Muon with ``optimizer_cfg.muon``'s settings;
    * ``adamw_decay`` (``"adamw"``): params with ``ndim >= 2`` (embeddings, head), decayed;
    * ``adamw_no_decay`` (``"adamw"``): 1-D params (norms, biases), ``weight_decay=0``.

    With ``optimizer.muon.scalar_optimizer=lion`` the last two are ``lion_decay`` and
    ``lion_no_decay`` (``"lion"``, :mod:`lptrain.optim.lion`, betas
    ``optimizer.lion_beta1/lion_beta2``).

    All take ``optimizer_cfg.lr``; ``for g in opt.param_groups: g["lr"] = lr`` and any
    ``torch.optim.lr_scheduler`` drive them, and :meth:`lr_by_group` reads them back for
    logging. AdamW groups run torch's AdamW kernel (bitwise ``torch.optim.AdamW``).

    Params are tensors or ``(name, tensor)`` pairs (names for all or none, e.g. the model's
    fully-qualified names): with names, groups carry ``param_names`` and ``load_state_dict``
    pairs state by name (:mod:`lptrain.optim.named_state`), so
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and resharding see
    canonical keys. The optimizer holds exactly the tensor objects passed in (e.g. fp32
    masters whose ``.grad`` the caller sets). :attr:`last_update_rms` is the Muon update RMS
    of the last step.
    """

    def __init__(
        self,
        muon_params: Iterable[ParamArg],
        adamw_params: Iterable[ParamArg],
        optimizer_cfg: OptimizerConfig,
    ) -> None:
        o, m = optimizer_cfg, optimizer_cfg.muon
        if m.scalar_optimizer not in _SCALAR_KINDS:
            raise ValueError(
                f"optimizer.muon.scalar_optimizer={m.scalar_optimizer!r} is not one of "
                f"{', '.join(_SCALAR_KINDS)}"
            )
        scalar = m.scalar_optimizer
        muon_names, muon_tensors = _names_and_tensors(muon_params)
        adamw_names, adamw_tensors = _names_and_tensors(adamw_params)
        all_names = muon_names + adamw_names
        named = any(n is not None for n in all_names)
        if named and any(n is None for n in all_names):
            raise ValueError("MuonWithAdamW: give names for all params or for none")
        if named and len(set(all_names)) != len(all_names):
            raise ValueError("MuonWithAdamW: duplicate param names")
        seen: set[int] = set()
        for p in muon_tensors + adamw_tensors:
            if id(p) in seen:
                raise ValueError("MuonWithAdamW: a tensor was passed twice (or to both lists)")
            seen.add(id(p))
        self._kind_defaults: dict[str, dict[str, Any]] = {
            "muon": muon_hparams(o),
            "adamw": dict(
                lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                eps=o.adam_eps, amsgrad=False, maximize=False, foreach=None, capturable=False,
                differentiable=False, fused=None,
            ),
            "lion": dict(lr=o.lr, weight_decay=o.weight_decay, betas=(o.lion_beta1, o.lion_beta2)),
        }
        adamw = list(zip(adamw_names, adamw_tensors, strict=True))
        names = ("muon", f"{scalar}_decay", f"{scalar}_no_decay")
        members = {
            names[0]: list(zip(muon_names, muon_tensors, strict=True)),
            names[1]: [(n, p) for n, p in adamw if p.dim() >= 2],
            names[2]: [(n, p) for n, p in adamw if p.dim() < 2],
        }
        groups: list[dict[str, Any]] = []
        for name in names:
            g: dict[str, Any] = {
                "name": name,
                "optimizer": "muon" if name == "muon" else scalar,
                "params": [p for _, p in members[name]],
            }
            if named:
                g["param_names"] = [n for n, _ in members[name]]
            if name == names[2]:
                g["weight_decay"] = 0.0
            groups.append(g)
        super().__init__(groups, {"lr": o.lr, "weight_decay": o.weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``param_group["optimizer"]`` (``muon``, ``adamw`` or ``lion``) picks the
        algorithm and its defaults (from the config this optimizer was built with)."""
        kind = param_group.get("optimizer")
        if kind not in self._kind_defaults:
            raise ValueError(
                f"MuonWithAdamW param group needs optimizer='muon', 'adamw' or 'lion', got {kind!r}"
            )
        for key, value in self._kind_defaults[kind].items():
            param_group.setdefault(key, value)
        param_group.setdefault("name", kind)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if kind == "muon":
            _validate_hparams(group)
            for p in group["params"]:
                _validate_param(p)

    def lr_by_group(self) -> dict[str, float]:
        """``{group name: lr}`` for logging."""
        return {g["name"]: float(g["lr"]) for g in self.param_groups}

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = closure_loss(closure)
        self._step_groups(lambda group: group["optimizer"] == "muon")
        return loss
