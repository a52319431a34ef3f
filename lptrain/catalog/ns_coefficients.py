"""Newton-Schulz coefficient tables and their step rules (torch-free, so config validation can
list the names and check ``ns_steps`` without importing torch).

Each set is a sequence of quintic tuples ``(a, b, c)``; step ``i`` applies
``p(s) = a*s + b*s^3 + c*s^5`` to every singular value. Sets differ in what happens past the
end of the table and in which step counts are allowed (the rules follow Megatron /
Emerging-Optimizers, so a config that is valid there is valid here and vice versa):

* ``simple``: one tuple, used at every step; any ``ns_steps >= 1``.
* ``quintic``: five per-step tuples, cycled; ``ns_steps`` must be a multiple of 5, because the
  tuples are tuned as a 5-step sequence (the early ones have slope ~4 at 0 and overshoot 1;
  stopping mid-cycle leaves singular values wherever the overshoot put them).
* ``polar_express``: eight per-step tuples (Amsel et al., arXiv 2505.16932, Algorithm 1, as
  Megatron ships them: each paper tuple except the last has a, b, c divided by 1.01, 1.01^3,
  1.01^5, i.e. the paper's polynomial evaluated at s/1.01, a margin for singular values that
  rounding pushes just above the interval it was designed on; truncated to 4 decimals);
  ``ns_steps >= 8``, and every step past the eighth repeats the last tuple. The last tuple
  (1.875, -1.25, 0.375) has p(1) = 1 and p'(1) = 0, so extra steps converge quadratically to
  the exact polar factor.
* ``aol``: four per-step tuples (Boissin et al., "Turbocharging Newton-Schulz with AOL
  rescaling", tuned as a 4-step sequence; Megatron / Emerging-Optimizers ship them and, as
  here, apply them after the Frobenius normalization); ``ns_steps`` must be exactly 4. The
  sequence lifts normalized singular values in [0.015, 0.87] into [0.987, 1.085], but its first
  tuple has p(1) = -0.585: a second pass over the tuples (cycling, as upstream does) sends those
  ~1 values negative and flips update directions, so no other step count is allowed. Inputs
  whose top singular value exceeds ~0.874 of the Frobenius norm (a nearly rank-1 matrix) are
  outside the set's design range even at 4 steps.
"""

from __future__ import annotations

from typing import Literal, Optional

Coefficients = tuple[tuple[float, float, float], ...]
PastEnd = Literal["cycle", "repeat_last"]
StepRule = Literal["multiple", "at_least", "exactly"]

COEFFICIENT_SETS: dict[str, Coefficients] = {
    # Keller Jordan's fixed tuple (torch.optim.Muon default, Moonlight).
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Per-step tuples, cycled over the steps (Megatron/Emerging-Optimizers default, from
    # modded-nanogpt).
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Polar Express, Megatron's 8-entry table (see the module docstring).
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    # AOL's 4-step sequence (see the module docstring), as Megatron / Emerging-Optimizers ship it.
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
}

# The singular-value band each set promises: (steps, ell, top, lo, hi) = after ``steps`` steps
# (the default count for the set), every input singular value s with ell <= s / ||X||_F <= top
# lands in [lo, hi]. Computed from the scalar map over that interval (float64): simple
# 0.682-1.134 (p(1) = 0.70: it never converges to 1; Keller's docstring says "~U(0.5, 1.5)" for
# rougher inputs), quintic 0.978-1.032, polar_express 1 to 1e-12, aol 0.9874-1.0845 up to 0.87
# (its design range; above ~0.874 the map drops). Below ell the small singular values have not
# been lifted yet (e.g. ell/10 breaks every band).
SINGULAR_VALUE_BANDS: dict[str, tuple[int, float, float, float, float]] = {
    "simple": (5, 1e-2, 1.0, 0.68, 1.14),
    "quintic": (5, 1e-2, 1.0, 0.977, 1.032),
    "polar_express": (8, 1e-3, 1.0, 1.0 - 1e-6, 1.0 + 1e-6),
    "aol": (4, 1.5e-2, 0.87, 0.987, 1.085),
}

# What a set does past its last tuple.
PAST_END: dict[str, PastEnd] = {
    "simple": "cycle",
    "quintic": "cycle",
    "polar_express": "repeat_last",
    "aol": "cycle",  # as upstream; its step rule allows no second cycle
}

# Allowed step counts: ("multiple", n) = a positive multiple of n; ("at_least", n) = >= n;
# ("exactly", n) = n.
STEP_RULES: dict[str, tuple[StepRule, int]] = {
    "simple": ("at_least", 1),
    "quintic": ("multiple", 5),
    "polar_express": ("at_least", 8),
    "aol": ("exactly", 4),
}


def step_rule_text(name: str) -> str:
    """``STEP_RULES[name]`` in words (for rule messages and help texts)."""
    kind, n = STEP_RULES[name]
    return {"multiple": f"a multiple of {n}", "at_least": f">= {n}", "exactly": f"exactly {n}"}[kind]


def coefficient_index(name: Optional[str], num_tuples: int, step: int) -> int:
    """Index of the tuple used at 0-based ``step`` for set ``name`` (None = explicit tuples,
    which are cycled)."""
    if name is not None and PAST_END[name] == "repeat_last":
        return min(step, num_tuples - 1)
    return step % num_tuples


def ns_steps_problem(name: str, ns_steps: int) -> Optional[str]:
    """Why ``ns_steps`` is not allowed for coefficient set ``name``, or None when it is.

    Unknown names return None (the name itself is reported elsewhere).
    """
    if ns_steps < 1:
        return f"ns_steps={ns_steps} < 1"
    rule = STEP_RULES.get(name)
    if rule is None:
        return None
    kind, n = rule
    allowed = {"multiple": ns_steps % n == 0, "at_least": ns_steps >= n, "exactly": ns_steps == n}
    if not allowed[kind]:
        return f"coefficients={name} needs ns_steps {step_rule_text(name)}, got {ns_steps}"
    return None
