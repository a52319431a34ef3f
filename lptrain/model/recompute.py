"""Activation recompute: which parts of the forward are checkpointed, and how.

``model.recompute_granularity``:

* ``full``: whole transformer layers. ``recompute_method=uniform`` checkpoints every layer,
  in chunks of ``recompute_num_layers`` (only each chunk's input is kept); ``block``
  checkpoints the first ``recompute_num_layers`` layers one by one and keeps the rest.
* ``selective``: parts of every layer, by ``recompute_modules``: ``core_attn`` (the
  attention kernel: its saved output and log-sum-exp), ``mlp_act`` (the SwiGLU activation:
  its fp32 copies), ``mlp`` (the whole MLP or MoE block, GEMMs included).

Every region goes through :func:`torch.utils.checkpoint.checkpoint` with
``use_reentrant=False`` (torch's RNG state preserved), torch's early stop of the recompute
only where the factory allows it (``recompute_early_stop``: not on Transformer Engine), and
the layer factory's ``recompute_context_fn``: on the emulated backend the forward records, per quantized GEMM,
the delayed-scaling scales and the quantized weights it used, and the recompute reuses them
without recording amaxes (:mod:`lptrain.precision.autocast`), so a recomputed step is
bitwise the step without recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

_REGIONS = [0]  # checkpointed regions entered by forwards since the last take_region_count()


def take_region_count() -> int:
    """Checkpointed regions the forwards entered since the last call (the step metric
    ``recompute_regions``), and reset the count."""
    n, _REGIONS[0] = _REGIONS[0], 0
    return n


@dataclass(frozen=True)
class RecomputePlan:
    """The model config's recompute settings, read once at build time."""

    granularity: Any = None
    method: str = "uniform"
    num_layers: int = 1
    modules: tuple[str, ...] = ()

    @staticmethod
    def of(cfg: Any) -> RecomputePlan:
        g = getattr(cfg, "recompute_granularity", None)
        return RecomputePlan(
            granularity=g,
            method=getattr(cfg, "recompute_method", "uniform"),
            num_layers=max(1, int(getattr(cfg, "recompute_num_layers", 1))),
            modules=tuple(getattr(cfg, "recompute_modules", ()) or ()) if g == "selective" else (),
        )

    def selects(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` (core_attn, mlp_act, mlp)."""
        return module in self.modules

    def layer_chunks(self, n: int) -> list[tuple[int, int, bool]]:
        """``(start, end, checkpointed)`` runs of layers covering ``range(n)`` in order."""
        if self.granularity != "full":
            return [(0, n, False)]
        k = self.num_layers
        if self.method == "block":
            head = [(i, i + 1, True) for i in range(min(k, n))]
            return head + ([(k, n, False)] if k < n else [])
        return [(i, min(i + k, n), True) for i in range(0, n, k)]


def run_checkpointed(enabled: bool, factory: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, as a checkpointed region when ``enabled`` and a backward can follow."""
    if not (enabled and torch.is_grad_enabled()):
        return fn(*args)
    _REGIONS[0] += 1
    context_fn = getattr(factory, "recompute_context_fn", None)
    kw = {"context_fn": context_fn} if context_fn is not None else {}
    with set_checkpoint_early_stop(bool(getattr(factory, "recompute_early_stop", True))):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kw)
