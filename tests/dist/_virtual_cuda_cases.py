"""Rank-side functions for the virtual-CUDA engine tests (module-level: they are pickled).

Each rank enters one virtual CUDA device and runs several configurations in the same world:
the process group is requested as NCCL by the engine (``run.device=cuda``), becomes gloo with
NCCL's rule that every collective's tensors be device tensors, and stays up for all cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BASE = ["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false",
        "logging.plots=false", "run.device=cuda", "optimizer.warmup_iters=0",
        "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64"]


def run_cases(rank: int, world: int, cases: dict[str, tuple[str, Sequence[str]]], cache: str,
              run_dir: str) -> dict[str, Any]:
    """``{case: (losses, grad norms)}`` of two steps with an eval after each, then one run of
    the real loop with a checkpoint save (``"loop"``), all on one virtual device."""
    from lptrain.config.compose import load
    from lptrain.testing.parity import train_steps
    from lptrain.testing.virtual_cuda import VirtualCuda
    from lptrain.train import pretrain

    out: dict[str, Any] = {}
    with VirtualCuda() as vc:
        for name, (recipe, overrides) in cases.items():
            r = train_steps(recipe, [*BASE, f"data.cache_dir={cache}", *overrides], steps=2, eval_every=1)
            out[name] = (r["losses"], r["grad_norms"])
        cfg = load("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", "train.train_iters=2",
                                     "ddp.use_distributed_optimizer=true",
                                     f"checkpoint.save={run_dir}/ckpt", "checkpoint.save_interval=2"]).cfg
        out["loop"] = pretrain(cfg, f"{run_dir}/run", overwrite=True)["status"]
        out["violations"] = list(vc.violations)
        out["collectives"] = dict(vc.stats.collectives)
    return out


def te_param_gather_cases(rank: int, world: int, cases: dict[str, tuple[str, Sequence[str]]],
                          cache: str) -> dict[str, Any]:
    """On TE's own Python (kernels emulated): ``{case: losses}`` of three steps, the CUDA generator's seed of
    this rank, and the byte-gathered params' aliasing. Cases run on the target in their name's
    recipe (mxfp8: sm100, else sm90)."""
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.testing.parity import train_steps

    out: dict[str, Any] = {}
    for name, (target, overrides) in cases.items():
        with virtual_gpu(target, te=True) as vc:
            r = train_steps("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", "precision.backend=te",
                                              "ddp.use_distributed_optimizer=true", *overrides], steps=3)
            out[name] = r["losses"]
            out[f"{name}/seed"] = vc.generator.initial_seed()
            out[f"{name}/violations"] = list(vc.violations)
    return out


def te_pp_weight_casts(cache: str) -> dict[str, Any]:
    """Issue 48 finding 5 under pipeline parallelism: TE casts of this rank's bf16 weights in
    the second of two steps of PP 2 (4 micro-batches of one sequence, tensorwise FP8, TE's own
    Python), with the schedule passing ``is_first_microbatch`` and with that patched away
    (``None``, as before); the TE linears this rank holds; and whether both runs agree bit
    for bit."""
    import contextlib

    import torch

    from lptrain.distributed.pipeline import PipelineRunner
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.testing.parity import patched, train_steps

    overrides = [*BASE, f"data.cache_dir={cache}", "precision.backend=te", "model.pipeline_model_parallel_size=2",
                 "train.micro_batch_size=1", "precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise",
                 "precision.first_last_layers_bf16=false"]
    out: dict[str, Any] = {}
    with virtual_gpu("sm90", te=True):
        import transformer_engine_torch as tex

        real = tex.quantize
        runs: dict[str, Any] = {}
        for name in ("fixed", "unfixed"):
            seen: dict[str, Any] = {"weights": set(), "casts": 0, "linears": 0}

            def count(engine: Any, step: int, seen: dict[str, Any] = seen) -> None:
                if step == 2:  # (the first step's casts include TE's one-time setup)
                    mods = [m for m in engine.model.modules() if type(m).__name__ == "TEParallelLinear"]
                    seen["linears"] = len(mods)
                    seen["weights"] = {m.weight.data_ptr() for m in mods}

            def counting(tensor: Any, quantizer: Any, *a: Any, seen: dict[str, Any] = seen, **k: Any) -> Any:
                if isinstance(tensor, torch.Tensor) and tensor.data_ptr() in seen["weights"]:
                    seen["casts"] += 1
                return real(tensor, quantizer, *a, **k)

            tex.quantize = counting
            patch = (contextlib.nullcontext() if name == "fixed" else
                     patched(PipelineRunner, "micro_batch", lambda self, i: contextlib.nullcontext()))
            try:
                with patch:
                    runs[name] = train_steps("tiny_cpu.yaml", overrides, steps=2, before_step=count)
            finally:
                tex.quantize = real
            out[name] = (seen["casts"], seen["linears"])
    # the cached casts change no bit: the same losses, grad norms and final params as casting
    # every micro-batch (a cast cached across the optimizer step would differ)
    fixed, unfixed = runs["fixed"], runs["unfixed"]
    out["bitwise_as_before"] = (fixed["losses"] == unfixed["losses"] and fixed["grad_norms"] == unfixed["grad_norms"]
                                and len(fixed["raw"]) > 0
                                and _same(fixed["raw"], unfixed["raw"]) and _same(fixed["main_grads"], unfixed["main_grads"]))
    return out


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two parameter snapshots (tensors, or dicts / tuples of them)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)



def te_cases(rank: int, world: int, cases: dict[str, tuple[str, Sequence[str]]], cache: str) -> dict[str, Any]:
    """tests/dist/test_te_dist.py's battery in one spawn: the param-gather cases, then the
    pipeline's weight casts."""
    return {**te_param_gather_cases(rank, world, cases, cache), "pp_casts": te_pp_weight_casts(cache)}
