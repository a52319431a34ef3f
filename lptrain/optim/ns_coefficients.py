"""Newton-Schulz coefficient tables (torch-free, so config validation can list the names)."""

from __future__ import annotations

Coefficients = tuple[tuple[float, float, float], ...]

COEFFICIENT_SETS: dict[str, Coefficients] = {
    # Keller Jordan's fixed tuple (torch.optim.Muon default, Moonlight); muon.md 1.2.
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Per-step tuples, cycled over the steps (Megatron/Emerging-Optimizers default);
    # megatron-behaviors.md 2.3 and muon.md 1.2.
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # "polar_express" is deliberately absent: the reference (muon.md 1.2) gives only its first
    # and last tuples, and the middle ones must not be guessed. resolve_coefficients() rejects
    # it with a message saying why, and config validation (MUON-HPARAMS) lists only these names.
}
