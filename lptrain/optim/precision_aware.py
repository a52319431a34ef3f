"""Megatron-LM's precision-aware optimizer in lptrain's optimizer children.

:class:`StatePrecision` is the run's resolved setting (``optimizer.use_precision_aware_optimizer``
and the dtype keys; None when off), built once from the config by :func:`state_precision`.
:func:`fused_adam` builds the AdamW of a child's non-Muon pieces the way Megatron builds
Transformer Engine's ``FusedAdam`` (``megatron/core/optimizer/__init__.py``): the moment
dtypes always, and when TE holds the masters (:func:`lptrain.catalog.optimizer_state.
te_holds_masters`) ``master_weights=True``, ``master_weight_dtype``, ``use_decoupled_grad=True``
and ``store_param_remainders``. The TE backend gets TE's class
(:func:`lptrain.precision.te_adapter.te_fused_adam`), the emulated backend
:class:`lptrain.precision.fused_adam.EmulatedFusedAdam`: the same arguments, state and state API.

Who holds the master of a piece (a byte range of a param in this rank's shard):

* **lptrain** (the default, and FP8 recipes other than delayed scaling, NVFP4): an fp32 master
  per piece as without the precision-aware optimizer; FusedAdam steps it (``master_weights=
  False``), its ``.grad`` an fp32 view of (or fp32 copy from) the grad buffer;
* **TE** (fp16 main params, or bf16 / delayed-scaling GEMMs): the piece's "master" handed to
  FusedAdam is the bf16 parameter's own slice of the param buffer (Megatron's
  ``shard_float16_params``), FusedAdam keeps ``master_param`` in its state (fp32, fp16 with a
  scale, or an int16 remainder) and writes the bf16 parameter itself; the grad is the grad
  buffer's slice, in its dtype, as ``decoupled_grad`` (bf16 main grads are read as they are,
  and clipping rounds them back to bf16, as Megatron's ``multi_tensor_scale`` does).

Checkpoints (:func:`piece_states` / :func:`load_piece_states`): the fp32 master (``master``,
the model's high-precision weights: unchanged for HF export), and each moment in its dtype
where that dtype stands alone (fp32, bf16: elementwise, any shard layout), as its fp32 value
where it needs a per-tensor scale (fp16, fp8: the scale belongs to this rank's piece). The
stored bits and scales of every piece go to the rank's local state (:func:`raw_states`), so a
resume at the same layout restores them bitwise; at another layout, or from a checkpoint of
other dtypes, the fp32 values are stored again and the engine warns that they were converted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lptrain.catalog.optimizer_state import SCALED
from lptrain.config.schema import LPTrainConfig, OptimizerConfig
from lptrain.precision.fused_adam import EmulatedFusedAdam
from lptrain.precision.optimizer_states import (
    TORCH_DTYPES,
    load_stored_,
    stored_bytes,
    stored_tensors,
)


@dataclass(frozen=True)
class StatePrecision:
    """The precision-aware optimizer's settings for one run (names as the config's)."""

    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    main_params: str = "fp32"
    main_grads: str = "fp32"
    remainders: bool = False
    te_holds_masters: bool = False
    backend: str = "emulated"

    def dtype(self, key: str) -> str:
        """The stored dtype of checkpoint key ``key`` (``exp_avg``, ``exp_avg_sq``,
        ``momentum_buffer`` -- Muon's momentum is stored as ``exp_avg`` -- or ``master``)."""
        if key in ("exp_avg", "momentum_buffer"):
            return self.exp_avg
        if key == "exp_avg_sq":
            return self.exp_avg_sq
        if key == "master":
            return "remainders" if self.remainders else self.main_params
        return "fp32"

    def saved_dtypes(self) -> dict[str, str]:
        """What a checkpoint records of the run's state dtypes."""
        return {k: self.dtype(k) for k in ("master", "exp_avg", "exp_avg_sq")}


FP32_DTYPES = StatePrecision().saved_dtypes()


def state_precision(cfg: LPTrainConfig) -> Optional[StatePrecision]:
    """The run's :class:`StatePrecision` (``cfg`` derived), or None without the
    precision-aware optimizer."""
    from lptrain.config.rulesets.optim_state import te_holds

    o = cfg.optimizer
    if not o.use_precision_aware_optimizer:
        return None
    backend = "te" if cfg.precision.backend == "te" else "emulated"
    return StatePrecision(o.exp_avg_dtype, o.exp_avg_sq_dtype, o.main_params_dtype, o.main_grads_dtype,
                          bool(o.store_param_remainders), te_holds(cfg), backend)


def fused_adam(
    decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: OptimizerConfig, sp: StatePrecision
) -> torch.optim.Optimizer:
    """FusedAdam over two groups named ``adamw_decay`` / ``adamw_no_decay`` (the names of
    :func:`lptrain.optim.lion.scalar_optimizer`), built with Megatron's arguments."""
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "name": "adamw_decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "adamw_no_decay"},
    ]
    kwargs: dict[str, Any] = dict(
        lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps, adam_w_mode=True, exp_avg_dtype=TORCH_DTYPES[sp.exp_avg],
        exp_avg_sq_dtype=TORCH_DTYPES[sp.exp_avg_sq],
    )
    if sp.te_holds_masters:
        kwargs.update(master_weights=True, use_decoupled_grad=True,
                      master_weight_dtype=TORCH_DTYPES[sp.main_params])
    kwargs["store_param_remainders"] = sp.remainders
    if sp.backend == "te":
        from lptrain.precision.te_adapter import te_fused_adam

        return te_fused_adam(groups, **kwargs)
    return EmulatedFusedAdam(groups, **kwargs)


# ---- the state of one piece, for checkpoints -----------------------------------------------


def _group_step(opt: torch.optim.Optimizer, t: torch.Tensor) -> int:
    for g in opt.param_groups:
        if any(p is t for p in g["params"]):
            return int(g.get("step", 0))
    raise KeyError("tensor not in the optimizer")


def master_value(opt: torch.optim.Optimizer, t: torch.Tensor) -> torch.Tensor:
    """The fp32 master of optimizer param ``t`` (TE holding it or not)."""
    if getattr(opt, "master_weights", False) and t.dtype != torch.float32:
        if not opt.state[t]:  # not stepped yet: the master is the param (TE's init)
            return t.detach().float()
        if isinstance(opt, EmulatedFusedAdam):
            return opt.master_value(t)
        from lptrain.precision.te_adapter import te_master_value

        return te_master_value(opt, t)
    return t.detach().float()


def piece_states(opt: torch.optim.Optimizer, t: torch.Tensor, sp: StatePrecision) -> dict[str, torch.Tensor]:
    """``{"exp_avg", "exp_avg_sq", "step"}`` of optimizer param ``t`` as a checkpoint keeps
    them: fp32 and bf16 states as stored, fp16 and fp8 ones as their fp32 values; ``step`` a
    0-dim float64 (the group's counter). Empty before the first step."""
    st = opt.state[t]
    if "exp_avg" not in st:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name in ("exp_avg", "exp_avg_sq"):
        stored = st[name]
        if sp.dtype(name) in ("fp32", "bf16"):
            out[name] = stored.detach()
        else:
            out[name] = opt.get_unscaled_state(t, name).float()  # type: ignore[attr-defined]
    out["step"] = torch.tensor(float(_group_step(opt, t)), dtype=torch.float64, device=t.device)
    return out


def load_piece_states(opt: torch.optim.Optimizer, t: torch.Tensor, master: torch.Tensor,
                      states: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`piece_states` plus the fp32 ``master``: each value stored in this
    run's dtype (a conversion when the checkpoint had another; the engine warns)."""
    with torch.no_grad():
        opt.state[t].clear()
        holds = getattr(opt, "master_weights", False) and t.dtype != torch.float32
        if isinstance(opt, EmulatedFusedAdam):
            opt.load_master_(t, master)
        elif holds:
            from lptrain.precision.te_adapter import te_load_master

            te_load_master(opt, t, master)
        else:
            t.copy_(master.reshape(t.shape))
        if "exp_avg" not in states:  # saved before the first step: TE's zero moments
            return
        if not opt.state[t]:
            opt.initialize_state(t, False)  # type: ignore[attr-defined]
        for name in ("exp_avg", "exp_avg_sq"):
            value = states[name].float().reshape(t.shape).clone()
            opt.set_scaled_state(t, name, value)  # type: ignore[attr-defined]
        if "step" in states:
            for g in opt.param_groups:
                if any(p is t for p in g["params"]):
                    g["step"] = int(float(states["step"]))


def raw_states(opt: torch.optim.Optimizer, t: torch.Tensor) -> dict[str, Any]:
    """Every stored tensor of ``t``'s state, and its scales, as saved bits (copies)."""
    scales = getattr(opt, "_scales", {}).get(t, {})
    return {name: {"stored": {k: v.detach().clone() for k, v in stored_tensors(stored).items()},
                   "scale": scales[name].clone() if name in scales else None}
            for name, stored in opt.state[t].items()}


def load_raw_states(opt: torch.optim.Optimizer, t: torch.Tensor, raw: dict[str, Any]) -> bool:
    """Restore :func:`raw_states` bitwise; False (nothing changed) when its names or shapes
    are not this state's."""
    st = opt.state[t]
    if set(raw) != set(st):
        return False
    for name, entry in raw.items():
        have = stored_tensors(st[name])
        if set(have) != set(entry["stored"]) or any(
                have[k].numel() != entry["stored"][k].numel() or have[k].dtype != entry["stored"][k].dtype
                for k in have):
            return False
    scales = getattr(opt, "_scales", {}).get(t, {})
    for name, entry in raw.items():
        load_stored_(st[name], entry["stored"])
        if entry["scale"] is not None and name in scales:
            scales[name].copy_(entry["scale"])
    return True


def state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    """``(master bytes, other state bytes, 0-dim state bytes)`` of ``opt``'s state as stored
    (``master_param`` is a master; scales count with their state)."""
    masters = states = scalars = 0
    for t, st in opt.state.items():
        scales = getattr(opt, "_scales", {}).get(t, {})
        for name, stored in st.items():
            if not (torch.is_tensor(stored) or hasattr(stored, "nbytes")):
                continue
            n = stored_bytes(stored) + (scales[name].numel() * 4 if name in scales else 0)
            if name == "master_param":
                masters += n
            else:
                states += n
                if torch.is_tensor(stored) and stored.dim() == 0:
                    scalars += n
    return masters, states, scalars


# ---- loading a checkpoint: conversions and the bitwise restore ---------------------------------

LOSSLESS = {("remainders", "fp32"), ("fp32", "remainders"), ("bf16", "fp32"), ("fp16", "fp32"),
            ("fp8", "fp32")}


def optimizer_state_notes(sp: Optional[StatePrecision], saved_global: dict[str, Any],
                          children: Sequence[Any], raw: Optional[list[Any]]) -> list[str]:
    """After every child's ``load_full_state``: restore the saved bits of this rank's pieces
    (``raw``, the checkpoint's local ``optimizer_raw``) when the dtypes match, and say what was
    converted: state saved in other dtypes (stored again in this run's), or fp16 / fp8 state
    re-scaled because this rank's pieces are not the ones that saved it (another layout)."""
    if not saved_global.get("optimizer"):
        return []
    saved = dict(FP32_DTYPES)
    saved.update(saved_global.get("optimizer_state_dtypes") or {})
    run = sp.saved_dtypes() if sp is not None else dict(FP32_DTYPES)
    changed = [k for k in run if saved[k] != run[k]]
    notes = []
    if changed:
        parts = ", ".join(f"{k} {saved[k]} -> {run[k]}" for k in changed)
        exact = all((saved[k], run[k]) in LOSSLESS for k in changed)
        notes.append(f"the checkpoint's optimizer state was saved in other dtypes ({parts}); "
                     f"converted to this run's ({'exactly' if exact else 'rounded: not bitwise'})")
    if sp is None or changed:
        return notes
    restored = raw is not None and len(raw) == len(children)
    for child, r in zip(children, raw or [], strict=False):
        restored = child.load_raw_state(r) and restored
    scaled = [k for k in ("exp_avg", "exp_avg_sq", "master") if run[k] in SCALED]
    if not restored and scaled:
        notes.append(f"{', '.join(scaled)} ({', '.join(run[k] for k in scaled)}) re-scaled: this "
                     "rank's optimizer pieces are not the ones that saved them (another layout or "
                     "world size), so their per-tensor scales were computed afresh (not bitwise)")
    return notes

