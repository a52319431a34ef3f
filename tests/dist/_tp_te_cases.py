"""Rank side of the Transformer Engine tensor-parallel test (module-level: pickled)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BASE = ["data.builtin_max_mb=1", "train.eval_iters=1", "logging.progress=false", "run.device=cuda",
        "optimizer.warmup_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "model.seq_length=64", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
        "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]


def te_vs_emulated(rank: int, world: int, cache: str, extra: Sequence[str] = ()) -> dict[str, Any]:
    """On one virtual sm100 GPU per rank, with TE's own Python (kernels emulated): 3 steps of
    TP 2 + SP on the TE backend and on the emulated one; the TE layers' tensor-parallel
    attributes as TE's own ``Linear.__init__`` set them."""
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.testing.parity import train_steps

    seen: dict[str, dict[str, Any]] = {}

    def record(engine: Any, step: int) -> None:
        if step == 1:
            for name, m in engine.model.named_modules():
                if type(m).__module__.startswith("transformer_engine") or "TEParallel" in type(m).__name__:
                    if getattr(m, "parallel_mode", None) in ("column", "row"):
                        seen[name] = {k: getattr(m, k) for k in ("tp_size", "parallel_mode", "sequence_parallel")}
                        seen[name]["tp_group_ranks"] = _ranks(m.tp_group)
                        seen[name]["weight"] = tuple(m.weight.shape)

    out: dict[str, Any] = {}
    with virtual_gpu("sm100", te=True) as vc:
        for backend in ("te", "emulated"):
            r = train_steps("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", f"precision.backend={backend}",
                                              *extra], steps=3, before_step=record if backend == "te" else None)
            out[backend] = r["losses"]
        out["violations"] = list(vc.violations)
        out["te_backend"] = vc.te_backend
    out["layers"] = seen
    return out


def _ranks(pg: Any) -> Any:
    import torch.distributed as dist

    return None if pg is None else list(dist.get_process_group_ranks(pg))
