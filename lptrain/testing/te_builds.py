"""What the imported Transformer Engine release (its own Python, kernels emulated:
:mod:`lptrain.testing.te_python`) runs of a ``precision.backend=te`` config, for the tests that
hold the rule catalog's TE version table to TE: the rules must accept a config exactly when
TE runs it.

Used in-process on the newest release (tests/unit/config/test_te_versions.py) and in the
older releases' subprocesses (tests/e2e/_te_release_checks.py); one TE release per process.
"""

from __future__ import annotations

import torch

from lptrain.config import World, check, compose
from lptrain.precision import te_adapter
from lptrain.testing.fake_gpu import virtual_gpu

TE = "precision.backend=te"
# every recipe, and a GPU it runs on (blockwise: Hopper, where every TE lptrain supports runs it)
RECIPES = {
    "delayed": ["precision.fp8_format=hybrid", "precision.fp8_recipe=delayed"],
    "tensorwise": ["precision.fp8_format=hybrid", "precision.fp8_recipe=tensorwise"],
    "blockwise": ["precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"],
    "mxfp8": ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"],
    "nvfp4": ["precision.fp4_format=e2m1"],
}
GPU = {"delayed": "sm90", "tensorwise": "sm90", "blockwise": "sm90", "mxfp8": "sm100", "nvfp4": "sm100"}
# a single grouped expert weight (MXFP8, which TE's grouped-tensor path needs)
SINGLE_GROUPED_WEIGHT = ["model.moe.num_experts=4", "model.moe.grouped_gemm=true",
                         "model.moe.single_grouped_weight=true", *RECIPES["mxfp8"]]


def world(target: str, te_version: str, cuda: str = "12.9") -> World:
    """A GPU ``target`` with TE ``te_version`` (major.minor of a release) and CUDA ``cuda``."""
    return World(target=target, te_version=te_version, cuda=True, cuda_version=cuda)


def refusals(overrides: list[str], world: World) -> list[str]:
    """The TE rules (version, MXFP8 on sm120, blockwise's CUDA) refusing ``backend=te`` with
    ``overrides`` in ``world``."""
    return [v.rule for v in check(compose(None, [TE, *overrides]), world)
            if v.rule.startswith("PREC-TE") or v.rule in ("PREC-MXFP8-SM120", "PREC-BLOCKWISE-CUDA")]


def builds(overrides: list[str], target: str) -> bool:
    """Whether lptrain's TE adapter builds the recipe of ``overrides`` and a ``Linear`` on a
    virtual ``target`` GPU, and TE runs the Linear's forward under it (where TE checks the
    recipe against the GPU). False
    when the adapter refuses the release (:class:`~lptrain.precision.te_adapter.
    BackendUnavailableError`); TE's own errors propagate (a rule accepted what TE refuses)."""
    cfg = compose(None, [TE, *overrides])
    with virtual_gpu(target, te=True):
        try:
            recipe = te_adapter.te_recipe(cfg.precision)
            lin = te_adapter.te_linear(64, 64, name="fc")
        except te_adapter.BackendUnavailableError:
            return False
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
        with te_adapter.te_autocast(recipe):
            y = lin(x)
        return bool(torch.isfinite(y).all())


def trains_experts() -> bool:
    """Whether a single grouped expert weight (MXFP8 on sm100) gets a weight gradient from a
    backward (TE 2.14-2.18 run its GEMMs on the members, made with ``requires_grad=False``:
    the grouped parameter never gets one); False when the adapter refuses the release."""
    import transformer_engine.common.recipe as ter

    with virtual_gpu("sm100", te=True, cuda_version="13.3"):
        recipe = ter.MXFP8BlockScaling(fp8_format=ter.Format.E4M3)
        try:
            with te_adapter.te_model_init(recipe):
                m = te_adapter.te_grouped_linear(4, 128, 128, single_grouped_weight=True,
                                                 params_dtype=torch.bfloat16)
        except te_adapter.BackendUnavailableError:
            return False
        x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        with te_adapter.te_autocast(recipe):
            y = m(x, [128, 128, 128, 128])
        y.float().sum().backward()
        grad = m.weight.grad
    return grad is not None and bool(grad.float().abs().sum() > 0)
