"""Pure Muon math: Newton-Schulz, scale modes, momentum, QKV split."""

from __future__ import annotations

import math

import pytest
import torch

from lptrain.optim.muon import muon_momentum_, muon_scale, muon_update, orthogonalize
from lptrain.optim.newton_schulz import (
    COEFFICIENT_SETS,
    NS_EPS,
    CoefficientsArg,
    coefficients_per_step,
    newton_schulz,
    resolve_coefficients,
)

SHAPES = [(32, 64), (64, 32), (48, 48)]  # wide, tall, square

# Singular-value bands after 5 steps for matrices with condition number <= 5. ``simple``:
# upstream says ~0.7-1.15 (p(1) = 0.70, it does not converge to 1); measured 0.68-1.14 here,
# so the band is [0.65, 1.2]. ``quintic``: upstream gives no band; measured 0.977-1.032, band
# [0.95, 1.06]. Distance to the exact polar factor U V^T in spectral norm is then bounded by
# the band's worst deviation from 1.
BANDS = {"simple": (0.65, 1.2), "quintic": (0.95, 1.06)}


def polynomial_singular_values(
    s: torch.Tensor, steps: int = 5, coefficients: CoefficientsArg = "quintic", eps: float = NS_EPS
) -> torch.Tensor:
    """What ``newton_schulz`` does to singular values ``s`` (1-D, any float dtype).

    NS applies an odd polynomial, so ``NS(U diag(s) V^T) = U diag(f(s)) V^T`` exactly in exact
    arithmetic; this scalar map ``f`` is the reference the tests compare against.
    """
    y = s / torch.linalg.vector_norm(s).clamp_min(eps)
    for a, b, c in coefficients_per_step(coefficients, steps):
        y = a * y + b * y**3 + c * y**5
    return y


def _conditioned(m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U, s, V) in float64 with singular values spread over [0.6, 3] (condition number 5)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.linspace(0.6, 3.0, k, dtype=torch.float64)
    return u, s, v


@pytest.mark.parametrize("name", ["simple", "quintic"])
@pytest.mark.parametrize("shape", SHAPES)
def test_ns_approximates_polar_factor(shape: tuple[int, int], name: str) -> None:
    u, s, v = _conditioned(*shape, seed=shape[0] + shape[1])
    x = ((u * s) @ v.T).float()
    out = newton_schulz(x, 5, name)
    assert out.dtype == torch.float32 and out.shape == x.shape
    lo, hi = BANDS[name]
    sv = torch.linalg.svdvals(out.double())
    assert lo <= sv.min().item() and sv.max().item() <= hi
    polar = u @ v.T
    assert torch.linalg.matrix_norm(out.double() - polar, 2).item() <= max(1 - lo, hi - 1)
    # Same singular vectors: NS is an odd polynomial, so NS(U S V^T) = U f(S) V^T with f the
    # scalar map; fp32 GEMM rounding over 5 steps stays ~1e-6 (measured <1e-6), tol 1e-5.
    ref = (u * polynomial_singular_values(s, 5, name)) @ v.T
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
def test_ns_transpose_symmetry_bitwise(shape: tuple[int, int]) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    # Non-square: both paths iterate on the same contiguous wide matrix -> bitwise equal.
    assert torch.equal(newton_schulz(x.T), newton_schulz(x).T)
    assert torch.equal(newton_schulz(x.T.contiguous()), newton_schulz(x).T)


def test_ns_transpose_symmetry_square() -> None:
    x = torch.randn(48, 48, generator=torch.Generator().manual_seed(3))
    # Square: neither is transposed, so X X^T vs X^T X Gram products round differently;
    # equal up to fp32 GEMM noise (~1e-6 measured), tol 1e-5.
    torch.testing.assert_close(newton_schulz(x.T), newton_schulz(x).T, atol=1e-5, rtol=0)


def test_ns_batched_matches_per_matrix() -> None:
    x = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(x)
    assert out.shape == x.shape
    for i in range(3):
        # Batched vs single GEMMs may round differently; fp32 GEMM noise ~1e-6.
        torch.testing.assert_close(out[i], newton_schulz(x[i]), atol=1e-5, rtol=0)
    tall = torch.randn(2, 40, 24, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(newton_schulz(tall)[1], newton_schulz(tall[1]), atol=1e-5, rtol=0)


def test_ns_scale_invariant_and_zero_safe() -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    # Frobenius normalization removes the scale (EMA vs sum momentum forms);
    # the division rounds differently, hence a GEMM-noise tolerance.
    torch.testing.assert_close(newton_schulz(0.05 * x), newton_schulz(x), atol=1e-5, rtol=0)
    assert torch.equal(newton_schulz(torch.zeros(8, 4)), torch.zeros(8, 4))


def test_coefficient_sets_and_errors() -> None:
    assert COEFFICIENT_SETS["simple"] == ((3.4445, -4.7750, 2.0315),)
    assert len(COEFFICIENT_SETS["quintic"]) == 5
    assert COEFFICIENT_SETS["quintic"][0] == (4.0848, -6.8946, 2.9270)
    assert COEFFICIENT_SETS["quintic"][4] == (2.8366, -3.0525, 1.2012)
    with pytest.raises(ValueError, match=r"optimizer\.muon\.coefficients='bogus'"):
        resolve_coefficients("bogus")
    with pytest.raises(ValueError, match=r"optimizer\.muon\.coefficients"):
        resolve_coefficients([(1.0, 2.0)])
    with pytest.raises(ValueError, match=r"optimizer\.muon\.ns_steps"):
        newton_schulz(torch.eye(2), 0)
    # Explicit tuples are cycled: one tuple == "simple".
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(7))
    assert torch.equal(newton_schulz(x, 5, [(3.4445, -4.7750, 2.0315)]),
                       newton_schulz(x, 5, "simple"))


def test_quintic_cycles_per_step() -> None:
    # 6 steps of quintic = 5 listed tuples then the first again.
    s = torch.tensor([0.3, 0.9], dtype=torch.float64)
    q = COEFFICIENT_SETS["quintic"]
    explicit = (*q, q[0])
    torch.testing.assert_close(
        polynomial_singular_values(s, 6, "quintic"), polynomial_singular_values(s, 6, explicit)
    )
    assert not torch.equal(
        polynomial_singular_values(s, 6, "quintic"), polynomial_singular_values(s, 6, q[:1])
    )


def test_scale_modes_hand_values() -> None:
    assert muon_scale(64, 16, "spectral") == 8.0
    assert muon_scale(16, 64, "spectral") == 8.0
    assert muon_scale(64, 16, "shape_scaling") == 2.0
    assert muon_scale(16, 64, "shape_scaling") == 1.0
    assert muon_scale(64, 16, "unit_rms_norm") == 2.0
    assert muon_scale(16, 64, "unit_rms_norm") == 0.5
    assert muon_scale(48, 48, "unit_rms_norm") == 1.0
    assert math.isclose(muon_scale(32, 32, "spectral"), math.sqrt(32))
    with pytest.raises(ValueError, match=r"optimizer\.muon\.scale_mode='rms'"):
        muon_scale(4, 4, "rms")


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_two_steps_by_hand(nesterov: bool) -> None:
    beta = 0.9
    buf = torch.zeros(2)
    g1, g2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    # m1 = 0.1*g1 = [0.1, 0.2]; nesterov u1 = g1 + 0.9*(m1 - g1) = [0.19, 0.38]
    # m2 = 0.9*m1 + 0.1*g2 = [0.39, 0.08]; nesterov u2 = g2 + 0.9*(m2 - g2) = [0.651, -0.028]
    u1 = muon_momentum_(g1, buf, beta=beta, nesterov=nesterov)
    assert torch.allclose(buf, torch.tensor([0.1, 0.2]), atol=1e-6)  # fp32 rounding only
    u2 = muon_momentum_(g2, buf, beta=beta, nesterov=nesterov)
    assert torch.allclose(buf, torch.tensor([0.39, 0.08]), atol=1e-6)
    if nesterov:
        assert torch.allclose(u1, torch.tensor([0.19, 0.38]), atol=1e-6)
        assert torch.allclose(u2, torch.tensor([0.651, -0.028]), atol=1e-6)
    else:
        assert torch.allclose(u1, torch.tensor([0.1, 0.2]), atol=1e-6)
        assert torch.allclose(u2, torch.tensor([0.39, 0.08]), atol=1e-6)
        u2.add_(1.0)  # the returned vector is a copy, not the buffer
        assert torch.allclose(buf, torch.tensor([0.39, 0.08]), atol=1e-6)


def test_muon_update_is_scaled_ns_of_momentum() -> None:
    g = torch.randn(16, 48, generator=torch.Generator().manual_seed(8))
    buf = torch.zeros(16, 48)
    upd = muon_update(g, buf, beta=0.95, nesterov=True, ns_steps=5, coefficients="quintic",
                      scale_mode="spectral", extra_scale_factor=0.2)
    u = g.lerp(0.05 * g, 0.95)
    assert torch.equal(upd, newton_schulz(u) * (math.sqrt(48) * 0.2))


def _qkv(groups: int, shapes: list[int], cols: int, seed: int) -> torch.Tensor:
    return torch.randn(groups * sum(shapes), cols, generator=torch.Generator().manual_seed(seed))


def test_qkv_split_equals_separate_pieces() -> None:
    groups, shapes, cols = 2, [16, 8, 8], 32
    u = _qkv(groups, shapes, cols, seed=9)
    kw = dict(ns_steps=5, coefficients="quintic", scale_mode="spectral")
    out = orthogonalize(u, qkv_split_shapes=shapes, **kw)
    # Hand split: rows of group g are [q | k | v]; gather each kind across groups.
    per_group = u.view(groups, sum(shapes), cols)
    q = per_group[:, :16].reshape(-1, cols)
    k = per_group[:, 16:24].reshape(-1, cols)
    v = per_group[:, 24:].reshape(-1, cols)
    oq, ok, ov = (newton_schulz(t) * muon_scale(t.shape[0], cols, "spectral") for t in (q, k, v))
    expected = torch.cat(
        [oq.view(groups, 16, cols), ok.view(groups, 8, cols), ov.view(groups, 8, cols)], dim=1
    ).view_as(u)
    assert torch.equal(out, expected)
    unsplit = orthogonalize(u, **kw)
    assert (out - unsplit).abs().max().item() > 0.1  # genuinely a different update
    with pytest.raises(ValueError, match="qkv_split_shapes"):
        orthogonalize(u[:-1], qkv_split_shapes=shapes, **kw)
