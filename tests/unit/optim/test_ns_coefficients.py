"""Newton-Schulz coefficient sets: tables, step rules, promised singular-value bands, polar
factor accuracy, and the update RMS each scale mode states."""

from __future__ import annotations

import math

import pytest
import torch

from lptrain.catalog.muon_scaling import SCALE_MODES, muon_scale, update_rms
from lptrain.catalog.ns_coefficients import (
    COEFFICIENT_SETS,
    SINGULAR_VALUE_BANDS,
    ns_steps_problem,
)
from lptrain.optim.muon import Muon, orthogonalize
from lptrain.optim.newton_schulz import coefficients_per_step, newton_schulz

SHAPES = [(32, 64), (64, 32), (48, 48)]  # wide, tall, square


def _conditioned(m: int, n: int, seed: int, lo: float = 0.6, hi: float = 3.0) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]:
    """(U, s, V) in float64 with singular values spread over [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return u, torch.linspace(lo, hi, k, dtype=torch.float64), v


def _scalar_map(name: str, steps: int, s: torch.Tensor) -> torch.Tensor:
    """What NS does to already-normalized singular values ``s`` (float64)."""
    y = s.clone()
    for a, b, c in coefficients_per_step(name, steps):
        y = a * y + b * y**3 + c * y**5
    return y


def test_polar_express_table() -> None:
    pe = COEFFICIENT_SETS["polar_express"]
    assert len(pe) == 8
    assert pe[0] == (8.2051, -22.9019, 16.4607)
    assert pe[-1] == (1.8750, -1.2500, 0.3750)
    # Entry 0 is the paper's first tuple evaluated at s/1.01 (a/1.01, b/1.01^3, c/1.01^5),
    # truncated to the table's 4 decimals.
    paper = (8.28721201814563, -23.595886519098837, 17.300387312530933)
    assert pe[0] == tuple(
        math.trunc(x / 1.01**k * 1e4) / 1e4 for x, k in zip(paper, (1, 3, 5), strict=True)
    )
    # The last tuple converges: p(1) = 1, p'(1) = 0.
    a, b, c = pe[-1]
    assert math.isclose(a + b + c, 1.0) and math.isclose(a + 3 * b + 5 * c, 0.0, abs_tol=1e-12)


def test_step_schedules() -> None:
    pe, q = COEFFICIENT_SETS["polar_express"], COEFFICIENT_SETS["quintic"]
    # polar_express repeats its last tuple past the end; quintic cycles.
    assert coefficients_per_step("polar_express", 10) == (*pe, pe[-1], pe[-1])
    assert coefficients_per_step("quintic", 10) == (*q, *q)
    assert coefficients_per_step("simple", 3) == COEFFICIENT_SETS["simple"] * 3
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
    # Explicit tuples run exactly as the named set with the same per-step schedule.
    assert torch.equal(newton_schulz(x, 10, "polar_express"),
                       newton_schulz(x, 10, [*pe, pe[-1], pe[-1]]))


@pytest.mark.parametrize(
    ("name", "steps", "ok"),
    [("simple", 1, True), ("simple", 7, True), ("quintic", 5, True), ("quintic", 10, True),
     ("quintic", 6, False), ("quintic", 4, False), ("polar_express", 8, True),
     ("polar_express", 12, True), ("polar_express", 7, False), ("polar_express", 5, False),
     ("simple", 0, False), ("aol", 4, True), ("aol", 5, False), ("aol", 8, False),
     ("aol", 3, False)],
)
def test_step_rules(name: str, steps: int, ok: bool) -> None:
    assert (ns_steps_problem(name, steps) is None) == ok
    if ok:
        Muon([torch.zeros(4, 4)], coefficients=name, ns_steps=steps)
    else:
        with pytest.raises(ValueError, match=r"optimizer\.muon\.ns_steps"):
            Muon([torch.zeros(4, 4)], coefficients=name, ns_steps=steps)


@pytest.mark.parametrize("name", list(SINGULAR_VALUE_BANDS))
def test_promised_band_scalar_map(name: str) -> None:
    steps, ell, top, lo, hi = SINGULAR_VALUE_BANDS[name]
    s = torch.logspace(math.log10(ell), math.log10(top), 20001, dtype=torch.float64)
    y = _scalar_map(name, steps, s)
    assert lo <= y.min().item() and y.max().item() <= hi, (y.min().item(), y.max().item())
    # The band needs ell: a tenth of it is not lifted into the band by these steps.
    below = _scalar_map(name, steps, torch.tensor([ell / 10], dtype=torch.float64))
    assert below.item() < lo


@pytest.mark.parametrize("name", list(SINGULAR_VALUE_BANDS))
@pytest.mark.parametrize("shape", SHAPES)
def test_promised_band_matrices(name: str, shape: tuple[int, int]) -> None:
    steps, ell, top, lo, hi = SINGULAR_VALUE_BANDS[name]
    u, s, v = _conditioned(*shape, seed=sum(shape))
    # The input meets the band's premise.
    assert (s.min() / s.norm()).item() >= ell and (s.max() / s.norm()).item() <= top
    out = newton_schulz(((u * s) @ v.T).float(), steps, name)
    sv = torch.linalg.svdvals(out.double())
    # fp32 GEMM rounding over the steps moves singular values by < 5e-7 (measured 3e-7 for
    # polar_express); slack 2e-6 on top of the promised band.
    assert lo - 2e-6 <= sv.min().item() and sv.max().item() <= hi + 2e-6


@pytest.mark.parametrize("steps", [8, 10])
@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48), (16, 96)])
def test_polar_express_close_to_svd_polar_factor(steps: int, shape: tuple[int, int]) -> None:
    # Condition number 60: normalized singular values down to ~4e-3, inside the promise.
    u, s, v = _conditioned(*shape, seed=shape[0] * 7 + steps, lo=0.05, hi=3.0)
    assert (s.min() / s.norm()).item() >= 1e-3
    x, vh = ((u * s) @ v.T).float(), v.T
    out = newton_schulz(x, steps, "polar_express").double()
    # Exact arithmetic puts every singular value within 1e-12 of 1 (scalar-map test); fp32
    # rounding leaves ~5e-6 spectral-norm error (measured 2e-6..5e-6). Tolerance 2e-5.
    err = torch.linalg.matrix_norm(out - u @ vh, 2).item()
    assert err < 2e-5, err
    # quintic at its default 5 steps is only as close as its band (~3%): a real difference.
    q = newton_schulz(x, 5, "quintic").double()
    assert torch.linalg.matrix_norm(q - u @ vh, 2).item() > 100 * err


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (48, 48)])
@pytest.mark.parametrize("extra", [1.0, 0.2])
def test_scale_mode_update_rms(mode: str, shape: tuple[int, int], extra: float) -> None:
    a, b = shape
    u, s, v = _conditioned(a, b, seed=a + 2 * b)
    upd = orthogonalize(((u * s) @ v.T).float(), ns_steps=10, coefficients="polar_express",
                        scale_mode=mode, extra_scale_factor=extra).double()
    rms = upd.square().mean().sqrt().item()
    # polar_express x10 is the exact polar factor to ~1e-6 (test above), so the RMS equals
    # the stated one to 1e-5 relative.
    assert rms == pytest.approx(update_rms(a, b, mode, extra), rel=1e-5)
    stated = {
        "spectral": extra,  # RMS 1 for every shape (times the extra factor)
        "shape_scaling": extra / math.sqrt(b),  # 1/sqrt(fan_in) for every shape
        "unit_rms_norm": extra * (1 / math.sqrt(b) if a >= b else math.sqrt(a) / b),
    }[mode]
    assert rms == pytest.approx(stated, rel=1e-5)
    if mode == "unit_rms_norm":
        # RMS->RMS operator norm sqrt(fan_in/fan_out) * ||update||_2 is the extra factor.
        op = math.sqrt(b / a) * torch.linalg.matrix_norm(upd, 2).item()
        assert op == pytest.approx(extra, rel=1e-5)


def test_quintic_update_rms_within_band() -> None:
    # The default quintic x5 lands singular values in [0.977, 1.032], so a spectral update's
    # RMS is within that band of 1 (not exactly 1).
    u, s, v = _conditioned(64, 128, seed=5)
    upd = orthogonalize(((u * s) @ v.T).float(), ns_steps=5, coefficients="quintic",
                        scale_mode="spectral")
    rms = upd.double().square().mean().sqrt().item()
    assert 0.977 <= rms <= 1.032
    assert muon_scale(64, 128, "spectral") == math.sqrt(128)


def test_aol_table_is_the_published_one() -> None:
    """The ``aol`` set is the 4-tuple sequence published with AOL-rescaled Newton-Schulz
    (Boissin et al., "Turbocharging Newton-Schulz with AOL rescaling", hal-05390446; the
    flash-newton-schulz repository's ``newton_schulz_triton_aol``), as Megatron-LM selects it
    with ``--muon-coefficient-type aol`` (Emerging-Optimizers ``muon_utils.py``
    ``_COEFFICIENT_SETS["aol"]``, cycled over the steps)."""
    assert COEFFICIENT_SETS["aol"] == (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    )
    assert coefficients_per_step("aol", 4) == COEFFICIENT_SETS["aol"]
    # Why exactly 4 steps: the first tuple sends a singular value of 1 to a + b + c = -0.585.
    a, b, c = COEFFICIENT_SETS["aol"][0]
    assert a + b + c == pytest.approx(-0.5852, abs=1e-12)


def test_aol_second_cycle_flips_the_update() -> None:
    """Four steps give (nearly) the polar factor; a second pass over the tuples -- what a
    cycled 8-step run (upstream's behaviour for ``aol``) does -- maps the ~1 singular values
    through p(1) < 0 and points the update away from ``U V^T``. Checked against the SVD
    polar factor (an independent computation)."""
    u, s, v = _conditioned(48, 96, seed=3)
    x = ((u * s) @ v.T).float()
    polar = u @ v.T
    k = s.numel()
    four = newton_schulz(x, 4, "aol").double()
    # <NS(X), U V^T> / k is the mean of the mapped singular values: inside the 4-step band.
    *_, lo, hi = SINGULAR_VALUE_BANDS["aol"]
    assert lo - 1e-5 <= float((four * polar).sum()) / k <= hi + 1e-5
    eight = newton_schulz(x, 8, [*COEFFICIENT_SETS["aol"]] * 2).double()
    assert float((eight * polar).sum()) / k < 0

