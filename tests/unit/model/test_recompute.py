"""Activation recompute is bitwise invisible (DP=1; DP=2 runs in tests/dist/test_sharding_strategies.py).

Every recipe -- bf16, FP8 delayed (history 16), tensorwise, blockwise, MXFP8, NVFP4 with its
random Hadamard transform and stochastic rounding (both on by default) -- trains 3 steps
without recompute and with one recompute setting; losses, grad norms, fp32 masters, final
params and a probe forward's logits must be ``torch.equal``. Why bitwise: a recompute
replays the same fp32 ops on the same values (torch's RNG state restored; per quantized
GEMM the forward's delayed-scaling scales and quantized weights reused, no amax recorded;
SR bits are drawn only by gradient quantizers, in the one backward), and the backward then
runs the same ops it runs without recompute.

Selection (recipe x mode is 6 x 5; one mode per recipe keeps this to seconds, and every mode
meets a stateful recipe): delayed/full-uniform, tensorwise/full-block, blockwise/selective
core_attn+mlp_act, mxfp8 with FP8 primary weights/selective mlp (GEMMs inside), nvfp4/
full-uniform in chunks of 2, bf16/selective mlp on a MoE model.

Transformer Engine (TE's own Python on a virtual GPU): the TE backend recomputes under TE's
own recompute phase (``te_adapter.te_recompute_contexts``: TE's checkpoint contexts); full
recompute equals none bitwise for delayed scaling and MXFP8, and with the phase handling
monkeypatched away (every module believes it runs a first forward) delayed scaling diverges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch.utils.checkpoint as torch_checkpoint

from lptrain.testing.parity import first_difference, patched, train_steps

# (the overrides tests/dist/_engine_cases.py uses, for the same tiny recipe)
_EMU = ["precision.backend=emulated"]
C = SimpleNamespace(
    TINY="tiny_cpu.yaml",
    BASE=["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false",
          "optimizer.warmup_iters=0", "optimizer.lr=0.01"],
    EMU=_EMU,
    DISTOPT=["ddp.use_distributed_optimizer=true"],
    MOE=["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=64",
         "model.moe.grouped_gemm=true"],
    TENSORWISE=[*_EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"],
    BLOCKWISE=[*_EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"],
    MXFP8=[*_EMU, "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"],
    DELAYED=[*_EMU, "precision.fp8_format=hybrid", "precision.fp8_recipe=delayed",
             "precision.fp8_amax_history_len=16"],
    NVFP4=[*_EMU, "precision.fp4_format=e2m1", "precision.fp4_recipe=nvfp4"],
    FP8_PG=["precision.fp8_param_gather=true"],
    REUSE=["ddp.reuse_grad_buf_for_mxfp8_param_ag=true"],
)
FULL = ["model.recompute_granularity=full"]
CASES = {
    "delayed-full-uniform": (C.DELAYED, FULL),
    "tensorwise-full-block": (C.TENSORWISE, [*FULL, "model.recompute_method=block"]),
    "blockwise-selective-act": (C.BLOCKWISE, ["model.recompute_granularity=selective",
                                              "model.recompute_modules=[core_attn,mlp_act]"]),
    "mxfp8-pg-selective-mlp": ([*C.MXFP8, *C.FP8_PG, *C.DISTOPT, *C.REUSE],
                               ["model.recompute_granularity=selective", "model.recompute_modules=[mlp]"]),
    "nvfp4-full-chunks": (C.NVFP4, [*FULL, "model.recompute_num_layers=2"]),
    "bf16-moe-selective-mlp": ([*C.EMU, *C.MOE], ["model.recompute_granularity=selective",
                                                  "model.recompute_modules=[mlp,mlp_act]"]),
}
KEYS = ("losses", "grad_norms", "masters", "raw", "logits")


def _run(ov: list[str], steps: int = 3) -> dict:
    r = train_steps(C.TINY, [*C.BASE, *ov], steps=steps)
    return {k: r[k] for k in KEYS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recompute_is_bitwise_invisible(case: str) -> None:
    recipe, mode = CASES[case]
    d = first_difference(_run(recipe), _run([*recipe, *mode]))
    assert d is None, f"{case}: recompute changed training: {d}"


def test_recomputed_amaxes_would_break_delayed_scaling() -> None:
    """The protection matters: with the recompute allowed to record amaxes again (the
    ``amax_untouched`` guard replaced by a no-op), the backward's recompute leaks this
    step's input amaxes into the next step's slot, and delayed scaling diverges."""
    import contextlib

    from lptrain.precision import autocast

    recipe, mode = CASES["delayed-full-uniform"]
    ref = _run(recipe)
    with patched(autocast, "amax_untouched", lambda slots: contextlib.nullcontext()):
        broken = _run([*recipe, *mode])
    assert first_difference(ref["masters"], broken["masters"]) is not None


# ---- Transformer Engine: TE's own recompute phase -------------------------------------------

TE = ["run.device=cuda", "precision.backend=te", "precision.first_last_layers_bf16=false"]
TE_CASES = {
    "delayed": ("sm90", [*TE, "precision.fp8_format=hybrid", "precision.fp8_recipe=delayed",
                         "precision.fp8_amax_history_len=16"]),
    "mxfp8": ("sm100", [*TE, "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]),
}


@contextlib.contextmanager
def _te_on_virtual_gpu(target: str) -> Iterator[None]:
    """TE's own Python (newest release installed) on a virtual GPU. torch's checkpoint compares every recomputed
    tensor's metadata with the forward's; inside the forward's pack hook the virtual GPU's
    tensors read as CPU tensors (and as CUDA ones in the recompute), so here the check
    compares shape and dtype only -- the bitwise parity asserted below is the stronger check."""
    from lptrain.testing.fake_gpu import virtual_gpu

    checks = torch_checkpoint._allowed_determinism_checks_to_fns
    default = checks["default"]
    checks["default"] = lambda t: {"shape": t.shape, "dtype": t.dtype}
    try:
        with virtual_gpu(target, te=True):
            yield
    finally:
        checks["default"] = default


@pytest.mark.parametrize("case", sorted(TE_CASES))
def test_te_recompute_phase_keeps_recompute_bitwise_invisible(case: str) -> None:
    target, recipe = TE_CASES[case]
    steps = 2 if case == "delayed" else 1  # (delayed scaling carries state into the next step)
    with _te_on_virtual_gpu(target):
        import transformer_engine.pytorch.module.base as te_recompute  # TE's own prepare_forward reads it

        ref = _run(recipe, steps=steps)
        got = _run([*recipe, *FULL], steps=steps)
        if case == "delayed":  # without TE's phase handling the recompute records amaxes again
            with patched(te_recompute, "in_fp8_activation_recompute_phase", lambda: False):
                broken = _run([*recipe, *FULL], steps=steps)
    d = first_difference(ref, got)
    assert d is None, f"TE {case}: recompute changed training: {d}"
    if case == "delayed":
        assert first_difference(ref["masters"], broken["masters"]) is not None


def test_te_recompute_never_stops_early() -> None:
    """Finding 6 (of the second read): up to TE 2.11 a module's ``prepare_forward`` restores its
    delayed-scaling state after its ``yield`` with no ``finally``, so torch's checkpoint early
    stop would leave the region's last TE module with the stashed scale; lptrain runs TE
    regions with the early stop off, as TE's own checkpoint does. On TE's own Python (newest
    release): the factory says so, and recompute is bitwise the run without it (the 2.11
    divergence itself needs TE 2.11's code, which the release matrix does not install)."""
    from lptrain.precision.layers import LayerFactory

    target, recipe = TE_CASES["delayed"]
    with _te_on_virtual_gpu(target):
        ref = _run(recipe, steps=2)
        got = _run([*recipe, *FULL], steps=2)
    assert first_difference(ref, got) is None
    assert LayerFactory.recompute_early_stop.fget(type("F", (), {"backend": "te"})()) is False
