"""Transformer Engine's ``FusedAdam`` in plain PyTorch: the precision-aware optimizer of the
emulated backend.

Same constructor, state layout and state API as TE's (``transformer_engine/pytorch/optimizers/
fused_adam.py``), so :mod:`lptrain.optim.precision_aware` builds either one with the same
arguments, Megatron's: ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (torch.float32, float16,
bfloat16, or uint8 for FP8), and, when TE holds the masters, ``master_weights=True``,
``master_weight_dtype``, ``use_decoupled_grad=True`` (the grads are the grad buffer's, read
from ``param.decoupled_grad``) and ``store_param_remainders``.

One step, per param group (TE's ``step``):

1. ``group["step"] += 1`` (one counter per group, as TE);
2. every state is read into fp32 (:func:`lptrain.precision.optimizer_states.unscale`; an fp32
   master rebuilt from the bf16 param and its int16 remainder);
3. the kernel, elementwise in fp32, in the order of ``multi_tensor_adam``'s AdamW mode::

       m = beta1 * m + (1 - beta1) * g
       v = beta2 * v + (1 - beta2) * g * g
       update = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p
       p = p - lr * update

   with ``bc = 1 - beta^step`` computed in double and rounded to fp32 (the host code), and
   every scalar rounded to fp32 (the kernel's ``float`` arguments);
4. the param is written: an fp32 param in place; a bf16 param, when TE holds its master, as
   the master rounded to nearest even, or as the high half of the remainder split;
5. every non-fp32 state is stored back (:func:`~lptrain.precision.optimizer_states.store_scaled`,
   a new per-tensor scale for fp16 and fp8).

Each operation here is one IEEE fp32 operation. TE compiles ``multi_tensor/adam.cu`` with
``--use_fast_math`` (its CMakeLists), so on a GPU the kernel's divisions and square root are
the approximate ones, multiply-adds may fuse and subnormals flush to zero: the TE backend's
updates agree with these to a few ulps, not bitwise. The stored formats (the casts, the scales,
the remainder split) are TE's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

from lptrain.precision.optimizer_states import (
    join_remainders,
    make_state,
    split_remainders,
    store_scaled,
    unscale,
)

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def adam_kernel_(
    g: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
    beta2: float, eps: float, step: int, weight_decay: float, adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """``multi_tensor_adam``'s math on fp32 ``p``, ``m``, ``v`` in place (``g`` any float
    dtype, read as fp32), one rounded fp32 operation at a time."""
    b1, b2, one = _f32(beta1), _f32(beta2), _f32(1.0)
    bc1 = _f32(1.0 - float(b1) ** step) if bias_correction else one
    bc2 = _f32(1.0 - float(b2) ** step) if bias_correction else one
    lr_, eps_, wd = _f32(lr), _f32(eps), _f32(weight_decay)
    g = g.float()
    if not adam_w_mode:  # L2 mode: decay folded into the gradient
        g = g + wd * p
    m.mul_(b1).add_(g * (one - b1))
    v.mul_(b2).add_(g * (one - b2) * g)
    # torch's fp32 sqrt on the CPU is not correctly rounded (an approximation on AVX2); the
    # fp64 square root rounded to fp32 is (53 >= 2 * 24 + 2 bits: no double rounding error)
    denom = (v / bc2).double().sqrt_().float().add_(eps_)
    update = (m / bc1).div_(denom)
    if adam_w_mode:
        update.add_(wd * p)
    p.sub_(update.mul_(lr_))


class EmulatedFusedAdam(torch.optim.Optimizer):
    """TE's FusedAdam (AdamW mode, bias correction) as PyTorch ops: see the module doc."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
    ) -> None:
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        for name, dt in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
            if dt not in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):
                raise RuntimeError(f"FusedAdam only supports fp32/fp16/bf16/fp8 {name}.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        # TE: remainders only for fp32 masters it holds (of bf16 params: checked per param)
        self.store_param_remainders = (store_param_remainders and master_weights
                                       and master_weight_dtype == torch.float32)
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    # ---- state (TE's API: initialize_state, get_unscaled_state, set_scaled_state) ------------

    def _remainders(self, p: torch.Tensor) -> bool:
        return self.store_param_remainders and p.dtype == torch.bfloat16

    def _initialize_state(self, p: torch.Tensor, name: str, remainders: bool = False) -> None:
        dtype = self.name_to_dtype_map[name]
        if remainders:
            self.state[p][name] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
        else:
            self.state[p][name] = make_state(dtype, p)
        if dtype != torch.float32:
            self._scales.setdefault(p, {})[name] = torch.ones(1, dtype=torch.float32, device=p.device)

    def initialize_state(self, p: torch.Tensor, store_param_remainders: bool) -> None:
        """Zero moments; the master from the param (a zero remainder: the master is the bf16
        param)."""
        self._initialize_state(p, "exp_avg")
        self._initialize_state(p, "exp_avg_sq")
        if self.master_weights:
            self._initialize_state(p, "master_param", store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(p, "master_param", p.detach().clone().float())

    def get_unscaled_state(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """The fp32 value of state ``name`` (a remainder master: its int16 remainder, as TE)."""
        stored = self.state[p][name]
        if name == "master_param" and self._remainders(p):
            return stored
        return unscale(stored, self._scales.get(p, {}).get(name))

    def set_scaled_state(self, p: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        """Store fp32 ``unscaled`` (int16 for a remainder master) as state ``name``."""
        remainders = name == "master_param" and self._remainders(p)
        if name not in self.state[p]:
            self._initialize_state(p, name, remainders)
        if remainders:
            self.state[p][name].copy_(unscaled)
            return
        store_scaled(self.state[p][name], unscaled.float(), self._scales.get(p, {}).get(name))

    def master_value(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master of ``p`` (rebuilt from the remainder, or unscaled); ``p`` itself for
        an fp32 param, which is its own master."""
        if not self.master_weights or p.dtype == torch.float32:
            return p.detach()
        if self._remainders(p):
            return join_remainders(p.detach(), self.state[p]["master_param"])
        return self.get_unscaled_state(p, "master_param")

    def load_master_(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Set ``p``'s fp32 master to ``master`` and ``p`` to the value the kernel writes for it
        (the remainder split's high half, else round to nearest even)."""
        if not self.state[p]:
            self.initialize_state(p, self._remainders(p))
        with torch.no_grad():
            if self._remainders(p):
                hi, rem = split_remainders(master.float().reshape(p.shape))
                p.copy_(hi)
                self.state[p]["master_param"].copy_(rem)
                return
            if self.master_weights and p.dtype != torch.float32:
                self.set_scaled_state(p, "master_param", master.float().reshape(p.shape).clone())
            p.copy_(master.reshape(p.shape))

    # ---- the step --------------------------------------------------------------------------

    def _grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if not self.state[p]:
                    self.initialize_state(p, self._remainders(p))
                g = self._grad(p)
                if g is None:
                    continue
                self._step_one(p, g, group, beta1, beta2)
        return loss

    def _step_one(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], beta1: float,
                  beta2: float) -> None:
        st, scales = self.state[p], self._scales.get(p, {})
        m = unscale(st["exp_avg"], scales.get("exp_avg"))
        v = unscale(st["exp_avg_sq"], scales.get("exp_avg_sq"))
        holds_master = self.master_weights and p.dtype != torch.float32
        if not holds_master:
            master = p.data if p.dtype == torch.float32 else p.data.float()
        elif self._remainders(p):
            master = join_remainders(p.data, st["master_param"])
        else:
            master = unscale(st["master_param"], scales.get("master_param"))  # fp32: itself
        adam_kernel_(g.reshape(p.shape), master, m, v, lr=group["lr"], beta1=beta1, beta2=beta2,
                     eps=group["eps"], step=group["step"], weight_decay=group["weight_decay"],
                     adam_w_mode=self.adam_w_mode, bias_correction=group["bias_correction"])
        if holds_master and self._remainders(p):
            hi, rem = split_remainders(master)
            p.data.copy_(hi)
            st["master_param"].copy_(rem)
        else:
            if master is not p.data:
                p.data.copy_(master)  # bf16: round to nearest even
            if holds_master:
                store_scaled(st["master_param"], master, scales.get("master_param"))
        store_scaled(st["exp_avg"], m, scales.get("exp_avg"))
        store_scaled(st["exp_avg_sq"], v, scales.get("exp_avg_sq"))
