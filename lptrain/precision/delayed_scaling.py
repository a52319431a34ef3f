"""Delayed scaling's per-slot state and its update rule (TE ``DelayedScaling``, numerics.md 2.1).

A slot is one tensor role of one module: its fp32 scale and amax history. The recipe
(:class:`lptrain.precision.recipes.DelayedScaling`) updates all of a region's slots after the
step with :func:`update_slots`, one batch for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from .formats import FLT_MAX, FP8Format
from .scaling import fp32_value


@dataclass
class DelayedScalingState:
    """One delayed-scaling slot: fp32 ``scale`` (1,) = 1 and ``amax_history`` (L,) = 0.

    ``amax_history[0]`` accumulates max|x| of the quantizations of the current step (TE's
    kernels atomic-max into it; for one quantization per step that is plain assignment).
    """

    history_len: int
    fp8_format: FP8Format
    scale: torch.Tensor = field(init=False)
    amax_history: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise ValueError("amax_history_len must be >= 1")
        self.scale = torch.ones(1, dtype=torch.float32)
        self.amax_history = torch.zeros(self.history_len, dtype=torch.float32)

    def follow(self, device: torch.device) -> None:
        """Keep the slot on the device of the tensors it scales (created on the CPU, before
        the model's device is known; moved once, at the first quantization)."""
        if self.scale.device != device:
            self.scale = self.scale.to(device)
            self.amax_history = self.amax_history.to(device)

    def record_amax(self, amax: torch.Tensor) -> None:
        self.follow(amax.device)
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.reshape(()).float())

    @property
    def scale_inv(self) -> torch.Tensor:
        return torch.reciprocal(self.scale)

    def update(self, margin: float, algo: str, reduced_amax: Optional[torch.Tensor] = None) -> None:
        """TE's fused ``kernel_bulk`` update (numerics.md 2.1) for this slot alone: see
        :func:`update_slots`, which applies the rule to any number of slots at once.

        last = reduced amax (if nonzero) else hist[0]. If last == 0: nothing rolls and the scale
        is kept. Otherwise window = max(hist[1:], last), hist becomes [0, hist[2:], last];
        amax = window ("max") or last ("most_recent"); s = fp32(fp32(max * 2^-margin) / amax)
        when amax is finite and > 0 (else kept), inf -> FLT_MAX.
        """
        update_slots([self], margin, algo, None if reduced_amax is None else reduced_amax.reshape(1))


_SCALED_MAX: dict[tuple[tuple[float, ...], float, torch.device], torch.Tensor] = {}


def _scaled_maxes(maxes: tuple[float, ...], margin: float, device: torch.device) -> torch.Tensor:
    """fp32(max * fp32(2^-margin)) per slot, as a tensor on ``device`` (cached: the same slots
    are updated every step, and a fresh tensor would be a host-to-device copy each time)."""
    key = (maxes, margin, device)
    t = _SCALED_MAX.get(key)
    if t is None:
        with torch.inference_mode(False):
            t = torch.tensor([fp32_value(m * fp32_value(2.0 ** (-margin))) for m in maxes],
                             dtype=torch.float32, device=device)
        t = _SCALED_MAX.setdefault(key, t)
    return t


def update_slots(
    states: Sequence[DelayedScalingState], margin: float, algo: str,
    reduced_amax: Optional[torch.Tensor] = None,
) -> None:
    """The :meth:`DelayedScalingState.update` rule for every slot at once (same history
    length and device; ``reduced_amax`` [S] or None): the histories stacked into one [S, L]
    tensor, the rule's branches as masks, the results copied back with one ``_foreach_copy_``
    per field.

    Why batched: slot by slot the rule is ~10 dispatcher calls per slot and step (a model has
    three slots per linear) and, on a GPU, host reads of ``last`` and the window (a device
    sync each); this is ~25 calls for all slots and never reads a device value on the host.
    The fp32 quotient is the correctly rounded one, as the per-slot fp64-then-fp32 one was;
    NaN counts as a nonzero amax, then as not finite (scale kept). Tested bit for bit against
    the branchy per-slot reference (tests/unit/precision/test_delayed.py)."""
    hist = torch.stack([st.amax_history for st in states])  # [S, L], a copy
    old_scale = torch.cat([st.scale for st in states])
    last = hist[:, 0]
    if reduced_amax is not None:
        red = reduced_amax.reshape(-1).float()
        last = torch.where(red != 0, red, last)
    active = last != 0
    if hist.shape[1] == 1:
        window = last
        new_hist = torch.where(active[:, None], torch.zeros_like(hist), hist)
    else:
        window = torch.maximum(hist[:, 1:].amax(1), last)
        rolled = torch.roll(hist, -1, 1)  # [h1, ..., h_{L-1}, h0] -> [0, h2, ..., last]
        rolled[:, 0] = 0.0
        rolled[:, -1] = last
        new_hist = torch.where(active[:, None], rolled, hist)
    a = window if algo == "max" else last
    s = _scaled_maxes(tuple(st.fp8_format.max for st in states), margin, hist.device) / a
    s = torch.where(torch.isinf(s), torch.full_like(s, FLT_MAX), s)
    keep = ~(active & torch.isfinite(a) & (a > 0))
    new_scale = torch.where(keep, old_scale, s)
    torch._foreach_copy_([st.amax_history for st in states], list(new_hist.unbind(0)))
    torch._foreach_copy_([st.scale for st in states], list(new_scale.unsqueeze(1).unbind(0)))
