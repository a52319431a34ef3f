"""Delayed scaling's amax and scale update, and ``compute_amax``.

``fused_amax_and_scale_update_after_reduction(buffer, amax_histories, scales, algo, fp8_dtype,
margin)``: per module direction, ``amax_histories[i]`` is ``[L, n]`` (one column per
quantized tensor) and ``scales[i]`` ``[n]``; ``buffer`` holds the MAX-reduced ``history[0]``
rows of all of them, concatenated. Each column is one delayed-scaling slot updated by TE's
rule as :func:`lptrain.precision.delayed_scaling.update_slots` emulates it (the reduced amax
if nonzero, else the slot's own; roll; ``max`` or ``most_recent``; ``fp8_max * 2^-margin /
amax``), in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lptrain.precision import scaling as S
from lptrain.precision.delayed_scaling import update_slots
from lptrain.precision.formats import FP8Format

from .layouts import _fmt


@dataclass
class _Slot:
    amax_history: torch.Tensor  # [L] view of one column
    scale: torch.Tensor  # [1] view
    fp8_format: FP8Format


def fused_amax_and_scale_update_after_reduction(buffer: torch.Tensor, amax_histories: Sequence[torch.Tensor],
                                                scales: Sequence[torch.Tensor], amax_compute_algo: str,
                                                fp8_dtype: Any, margin: float) -> None:
    fmt = _fmt(fp8_dtype)
    offset = 0
    with torch.no_grad():
        for hist, scale in zip(amax_histories, scales, strict=True):
            h2 = hist.reshape(hist.shape[0], -1)
            n = h2.shape[1]
            slots = [_Slot(h2[:, j], scale.reshape(-1)[j:j + 1], fmt) for j in range(n)]
            update_slots(slots, float(margin), amax_compute_algo, buffer.reshape(-1)[offset:offset + n])
            offset += n


def compute_amax(tensor: torch.Tensor, amax: torch.Tensor) -> None:
    with torch.no_grad():
        amax.reshape(1).copy_(S.amax(tensor.detach().float()).reshape(1))


def functions() -> dict[str, Any]:
    return {"fused_amax_and_scale_update_after_reduction": fused_amax_and_scale_update_after_reduction,
            "compute_amax": compute_amax}
