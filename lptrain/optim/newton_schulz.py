"""Newton-Schulz orthogonalization: the polar factor ("zeroth power") of a gradient matrix.

Pure math, no torch.distributed. ``newton_schulz(x)`` approximates ``U V^T`` for
``x = U S V^T`` by iterating the odd quintic ``p(s) = a*s + b*s^3 + c*s^5`` on the singular
values (reference: /work/shared/reference/muon.md section 1.2):

* transpose so rows <= cols (the Gram matrix ``X X^T`` is then min(m, n)^2), transpose back;
* divide by ``max(||X||_F, eps)`` so every singular value is <= 1 (``||X||_2 <= ||X||_F``);
  clamping the norm (rather than adding eps) keeps ``NS(c * X) == NS(X)`` for any c > 0 up to
  rounding, which is why the EMA and sum momentum forms give the same update;
* each step ``A = X X^T; X = a*X + (b*A + c*A@A) @ X``.

Precision: lptrain runs the iterations in fp32. Upstream (Keller, torch, Megatron with
``fp32_matmul_prec="medium"``) runs them in bf16; fp32 is a superset in accuracy and, on the
CPUs this framework is tested on, much faster than bf16 GEMMs. The result is always fp32.

The quintic coefficient sets do not converge to singular values of exactly 1: they trade
accuracy near 1 for a steep slope at 0 (muon.md: ``simple`` lands in ~0.7-1.15).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

from lptrain.optim.ns_coefficients import COEFFICIENT_SETS, Coefficients

# Names that are documented but not implemented, with the reason shown to the user.
_UNAVAILABLE: dict[str, str] = {
    "polar_express": "its per-step coefficients are not in the reference (muon.md 1.2 lists only "
    "the first and last of 5 tuples), so lptrain does not implement it yet",
}

NS_EPS = 1e-7  # Keller / torch.optim.Muon (muon.md 1.2); NVIDIA uses 1e-15.

CoefficientsArg = Union[str, Sequence[Sequence[float]]]


def resolve_coefficients(coefficients: CoefficientsArg) -> Coefficients:
    """The coefficient tuples for a set name (``optimizer.muon.coefficients``) or explicit tuples.

    Raises ``ValueError`` naming ``optimizer.muon.coefficients`` for unknown or unavailable
    names and for malformed explicit tuples.
    """
    if isinstance(coefficients, str):
        if coefficients in COEFFICIENT_SETS:
            return COEFFICIENT_SETS[coefficients]
        if coefficients in _UNAVAILABLE:
            raise ValueError(
                f"optimizer.muon.coefficients={coefficients!r} is not available: "
                f"{_UNAVAILABLE[coefficients]}; use one of {', '.join(COEFFICIENT_SETS)}"
            )
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


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: CoefficientsArg = "quintic",
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Approximate polar factor of ``x`` (2-D, or 3-D = a batch of matrices), in fp32.

    ``coefficients`` is a set name or explicit ``(a, b, c)`` tuples; tuple ``i % len`` is
    used at step ``i`` (cycled). The output has the shape of ``x`` and dtype fp32.

    The transposed input is made contiguous before iterating, so ``NS(X^T)`` and ``NS(X)^T``
    run the identical computation and agree bitwise.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"newton_schulz needs a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    if steps < 1:
        raise ValueError(f"optimizer.muon.ns_steps={steps} must be >= 1")
    coeffs = resolve_coefficients(coefficients)
    transpose = x.shape[-2] > x.shape[-1]
    X = x.detach().float()
    if transpose:
        X = X.mT
    X = X.contiguous()
    norm = torch.linalg.matrix_norm(X, ord="fro", keepdim=True)
    X = X / norm.clamp_min(eps)
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if transpose:
        X = X.mT.contiguous()
    return X


def polynomial_singular_values(
    s: torch.Tensor,
    steps: int = 5,
    coefficients: CoefficientsArg = "quintic",
    eps: float = NS_EPS,
) -> torch.Tensor:
    """What ``newton_schulz`` does to singular values ``s`` (1-D, any float dtype).

    NS applies an odd polynomial, so ``NS(U diag(s) V^T) = U diag(f(s)) V^T`` exactly in exact
    arithmetic; this scalar map ``f`` is the reference the tests compare against.
    """
    coeffs = resolve_coefficients(coefficients)
    y = s / torch.linalg.vector_norm(s).clamp_min(eps)
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        y = a * y + b * y**3 + c * y**5
    return y
