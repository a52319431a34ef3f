"""On a real CUDA device, without Transformer Engine (``make gpu-check`` runs these).

The emulated backend is device-independent: every recipe's quantizers give the same bytes
and scales on CUDA as on the CPU, and every ``*_cpu`` recipe trains with ``run.device=cuda``
close to its CPU run (bf16 activations and cuBLAS's summation order; the tolerance and its
reasoning are ``lptrain.testing.gpu_check.LOSS_RTOL``). The CPU suite runs the same checks
on the virtual GPU (tests/e2e/test_gpu_check_script.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lptrain.testing import gpu_check as G

pytestmark = pytest.mark.gpu

RECIPES = sorted(p.name for p in (Path(__file__).parents[2] / "recipes").glob("*_cpu.yaml"))


def test_quantizers_are_bit_identical_on_cuda() -> None:
    bad = [r for r in G.quantizer_identity() if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("recipe", RECIPES)
def test_cpu_recipe_trains_on_cuda_close_to_the_cpu(recipe: str) -> None:
    r = G.compare_recipe(recipe, steps=3)
    assert r.ok, r.detail


def test_bf16_wgrad_on_cuda_is_fp32_accurate() -> None:
    """``wgrad_fp32`` on CUDA (a bf16 GEMM with an fp32 output) against the fp64 product of
    the same bf16 operands: fp32 accumulation over M=4096 terms stays within 4096 * 2^-24
    (2.4e-4) of the sum of |products| per element; a bf16 result would be off by 2^-9 of the
    value, which the second bound (the fp32 sgemm's own result, 1e-5 relative) catches."""
    import torch

    from lptrain.precision.gemm import wgrad_fp32

    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    x = torch.randn(4096, 256, device="cuda", generator=g).bfloat16()
    out = wgrad_fp32(dy, x)
    assert out.dtype == torch.float32
    ref = dy.double().t() @ x.double()
    bound = 4096 * 2.0**-24 * (dy.double().abs().t() @ x.double().abs())
    assert bool(((out.double() - ref).abs() <= bound).all())
    sgemm = dy.float().t() @ x.float()
    torch.testing.assert_close(out, sgemm, rtol=1e-5, atol=1e-3)
