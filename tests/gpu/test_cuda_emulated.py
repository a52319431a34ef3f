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
