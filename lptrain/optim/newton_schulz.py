"""Newton-Schulz orthogonalization: the polar factor ("zeroth power") of a gradient matrix.

Pure math, no torch.distributed. ``newton_schulz(x)`` approximates ``U V^T`` for
``x = U S V^T`` by iterating the odd quintic ``p(s) = a*s + b*s^3 + c*s^5`` on the singular
values:

* transpose so rows <= cols (the Gram matrix ``X X^T`` is then min(m, n)^2), transpose back;
* divide by ``max(||X||_F, eps)`` so every singular value is <= 1 (``||X||_2 <= ||X||_F``);
  clamping the norm (rather than adding eps) keeps ``NS(c * X) == NS(X)`` for any c > 0 up to
  rounding, which is why the EMA (M <- beta*M + (1-beta)*G) and sum (M <- beta*M + G) momentum
  forms, which differ by the factor (1-beta), give the same update;
* each step ``A = X X^T; X = a*X + (b*A + c*A@A) @ X`` (cost 4*m^2*n + 2*m^3 FLOPs for m <= n);
* the tuple used at each step follows the set's rule (:mod:`lptrain.catalog.ns_coefficients`):
  cycled for ``simple``/``quintic``, last tuple repeated past the end for ``polar_express``.

Precision: lptrain runs the iterations in fp32. Upstream (Keller, torch, Megatron with
``fp32_matmul_prec="medium"``) runs them in bf16; fp32 is a superset in accuracy and, on the
CPUs this framework is tested on, much faster than bf16 GEMMs. The result is always fp32.

``simple`` and ``quintic`` do not converge to singular values of exactly 1: they trade
accuracy near 1 for a steep slope at 0 (``simple`` has p(1) = 0.70 and lands singular values in
about 0.7-1.15). ``polar_express`` ends on a tuple with p(1) = 1, p'(1) = 0 and converges to the
exact polar factor as steps are added.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Union

import torch

from lptrain.catalog.ns_coefficients import COEFFICIENT_SETS, Coefficients, coefficient_index

NS_EPS = 1e-7  # Keller / torch.optim.Muon; NVIDIA uses 1e-15.

CoefficientsArg = Union[str, Sequence[Sequence[float]]]


def resolve_coefficients(coefficients: CoefficientsArg) -> Coefficients:
    """The coefficient tuples for a set name (``optimizer.muon.coefficients``) or explicit tuples.

    Raises ``ValueError`` naming ``optimizer.muon.coefficients`` for unknown or unavailable
    names and for malformed explicit tuples.
    """
    if isinstance(coefficients, str):
        if coefficients in COEFFICIENT_SETS:
            return COEFFICIENT_SETS[coefficients]
        raise ValueError(
            f"optimizer.muon.coefficients={coefficients!r} is not one of "
            f"{', '.join(COEFFICIENT_SETS)}"
        )
    tuples = tuple(tuple(float(v) for v in t) for t in coefficients)
    if not tuples or any(len(t) != 3 for t in tuples):
        raise ValueError(
            f"optimizer.muon.coefficients: explicit coefficients must be a non-empty sequence of "
            f"(a, b, c) triples, got {coefficients!r}"
        )
    return tuples  # type: ignore[return-value]


def coefficients_per_step(coefficients: CoefficientsArg, steps: int) -> Coefficients:
    """The ``(a, b, c)`` tuple applied at each of ``steps`` steps, in order.

    ``simple`` and ``quintic`` (and explicit tuples) cycle; ``polar_express`` repeats its last
    tuple once the table is exhausted.
    """
    if isinstance(coefficients, str):
        return _named_schedule(coefficients, steps)
    coeffs = resolve_coefficients(coefficients)
    return tuple(coeffs[coefficient_index(None, len(coeffs), i)] for i in range(steps))


@functools.lru_cache(maxsize=64)
def _named_schedule(name: str, steps: int) -> Coefficients:
    """A named set's schedule, computed once per ``(name, steps)``: every Muon matrix of
    every step asks for it, and building it (validation, one index rule per step) cost
    more host time than a tiny matrix's elementwise work (~70 us per call at tiny_cpu)."""
    coeffs = resolve_coefficients(name)
    return tuple(coeffs[coefficient_index(name, len(coeffs), i)] for i in range(steps))


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: CoefficientsArg = "quintic",
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Approximate polar factor of ``x`` (2-D, or 3-D = a batch of matrices), in fp32.

    ``coefficients`` is a set name or explicit ``(a, b, c)`` tuples. A named set picks the
    tuple for each step by its own rule (:func:`coefficients_per_step`); explicit tuples are
    cycled. Step-count rules (quintic: multiples of 5, polar_express: >= 8) are enforced by the
    optimizer and the config rules, not here, so this function can evaluate any step count.
    The output has the shape of ``x`` and dtype fp32.

    The transposed input is made contiguous before iterating, so ``NS(X^T)`` and ``NS(X)^T``
    run the identical computation and agree bitwise.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"newton_schulz needs a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    if steps < 1:
        raise ValueError(f"optimizer.muon.ns_steps={steps} must be >= 1")
    schedule = coefficients_per_step(coefficients, steps)
    transpose = x.shape[-2] > x.shape[-1]
    X = x.detach().float()
    if transpose:
        X = X.mT
    X = X.contiguous()
    norm = torch.linalg.matrix_norm(X, ord="fro", keepdim=True)
    X = X / norm.clamp_min(eps)
    for a, b, c in schedule:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if transpose:
        X = X.mT.contiguous()
    return X

