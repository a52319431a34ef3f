"""The quantization and random state of a model that a checkpoint must carry, any backend.

A resumed run continues bitwise only if it also restores what the weights do not hold:

* **global** (identical on every rank: the amaxes are MAX-reduced over the data-parallel
  world): the emulated backend's delayed-scaling scales and amax histories, by module
  (``scaling_state_dict`` of lptrain's quantized layers);
* **per rank**: the emulated quantizers' stochastic-rounding generators
  (:mod:`lptrain.precision.rng`); the *extra state* of modules that keep one -- Transformer
  Engine keeps its delayed-scaling scales and amax histories there (``_extra_state`` in
  ``state_dict()``, a CPU byte tensor per module), and a module that overrides
  ``nn.Module.get_extra_state`` is saved whatever its backend; and the CUDA generator (TE's
  NVFP4 stochastic rounding draws from it), seeded per rank by :func:`seed_device_rng` so
  ranks draw different bits.

The per-rank part is saved per rank and restored only at the same world size (the streams
belong to ranks).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from lptrain.precision.rng import load_rng_states, rng_states


def seed_device_rng(seed: int, rank: int, device: torch.device) -> None:
    """Seed CUDA's generator distinctly per rank (reproducible from ``(seed, rank)``)."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed * 65_537 + rank)


def scaling_state(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Emulated delayed-scaling state (scales, amax histories) per quantized module, cloned."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "scaling_state_dict"):
            sd = mod.scaling_state_dict()
            if sd:
                out[name] = sd
    return out


def load_scaling_state(model: nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    for name, mod in model.named_modules():
        if name in state and hasattr(mod, "load_scaling_state_dict"):
            mod.load_scaling_state_dict(state[name])


def _keeps_extra_state(mod: nn.Module) -> bool:
    return type(mod).get_extra_state is not nn.Module.get_extra_state


def rank_state(model: nn.Module, recipe: Optional[Any], device: torch.device) -> dict[str, Any]:
    """This rank's streams and module extra state (for ``checkpoint_state()["local"]``)."""
    out: dict[str, Any] = {"torch_rng": torch.get_rng_state(), "quantizer_rng": rng_states(model, recipe)}
    extra = {}
    for name, mod in model.named_modules():
        if _keeps_extra_state(mod):
            state = mod.get_extra_state()
            if isinstance(state, torch.Tensor) and state.numel():
                extra[name] = state.detach().cpu().clone()
    if extra:
        out["module_extra_state"] = extra
    if device.type == "cuda":
        out["cuda_rng"] = torch.cuda.get_rng_state()
    return out


# TE >= 2.20 refuses to unpickle delayed-scaling extra state (its only stateful recipe's
# scales and amax histories are a pickle) unless this is set: "only from a trusted source".
_TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextlib.contextmanager
def _trusted_extra_state() -> Iterator[None]:
    """Opt in to TE's extra-state unpickling while lptrain restores the extra state that its
    own checkpoint saved from this model's modules (``rank_state``; the checkpoint's files are
    verified against their checksums before anything is loaded). The variable is restored
    afterwards, so loading anything else stays refused."""
    old = os.environ.get(_TE_UNSAFE_PICKLE_ENV)
    os.environ[_TE_UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_TE_UNSAFE_PICKLE_ENV, None)
        else:
            os.environ[_TE_UNSAFE_PICKLE_ENV] = old


def load_rank_state(model: nn.Module, state: dict[str, Any], recipe: Optional[Any]) -> None:
    """Inverse of :func:`rank_state` (keys absent from an older checkpoint are skipped)."""
    if "torch_rng" in state:
        torch.set_rng_state(state["torch_rng"])
    if "quantizer_rng" in state:
        load_rng_states(model, state["quantizer_rng"], recipe)
    extra = state.get("module_extra_state") or {}
    modules = dict(model.named_modules())
    missing = sorted(set(extra) - set(modules))
    if missing:
        raise ValueError(f"checkpoint holds extra state of modules this model lacks (e.g. {missing[:3]})")
    with _trusted_extra_state():
        for name, value in extra.items():
            modules[name].set_extra_state(value)
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
