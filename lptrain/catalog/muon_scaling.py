"""Muon update scale modes (torch-free, so config rules can reason about update sizes).

A full-rank exact polar factor ``O`` of an A x B (fan_out x fan_in) matrix has every singular
value 1, so ``RMS(O) = sqrt(min(A, B) / (A * B)) = 1 / sqrt(max(A, B))`` (Moonlight, Lemma 1).
Muon steps by ``lr * s(A, B) * extra_scale_factor * O``; the mode picks ``s``.
"""

from __future__ import annotations

import math

SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")


def muon_scale(out_features: int, in_features: int, mode: str) -> float:
    """Update scale s(A, B) for an A x B (fan_out x fan_in) matrix.

    * ``spectral``: sqrt(max(A, B)) -- update RMS 1 for every shape; Megatron's default.
      Times ``extra_scale_factor=0.2`` it is Moonlight's "match AdamW's update RMS ~0.2";
    * ``shape_scaling``: sqrt(max(1, A/B)) -- Keller's original (torch's ``original``):
      update RMS 1/sqrt(B) = 1/sqrt(fan_in) for every shape;
    * ``unit_rms_norm``: sqrt(A/B) -- RMS->RMS operator norm ``sqrt(B/A) * ||s*O||_2 = 1``
      (Scion; Dion's default); update RMS 1/sqrt(B) when A >= B, sqrt(A)/B when A < B.
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


def update_rms(
    out_features: int, in_features: int, mode: str, extra_scale_factor: float = 1.0
) -> float:
    """RMS of the update ``s * extra_scale_factor * O`` for an exact full-rank polar factor O.

    Newton-Schulz lands singular values near 1, not exactly (``quintic``: 0.98-1.03), and a
    rank-deficient gradient has fewer unit singular values, so a real update is this or less.
    """
    scale = muon_scale(out_features, in_features, mode)
    return scale * extra_scale_factor / math.sqrt(max(out_features, in_features))
