"""Whole training runs with ``run.device=cuda`` on the virtual CUDA device, one rank.

Every ``*_cpu`` recipe on the emulated backend runs the real loop for two steps: forward,
backward, the data-parallel engine, the optimizer, an evaluation and a checkpoint save
(DCP) -- with CUDA's device rules enforced (``lptrain.testing.virtual_cuda``): no op mixes
device and host tensors, no in-place op writes device results into a host tensor, no random
op on device tensors draws from a host generator. Before the engine became device-correct
the first optimizer step of every run failed here (``optim/distributed.py`` ``grad_norm_sq``
added CUDA squares into a CPU accumulator), as it would on a GPU.

The host syncs of a step are counted too: they must not grow with the number of parameter
tensors (a per-parameter ``.item()`` caps GPU utilisation for small and medium models).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lptrain.config.compose import load
from lptrain.testing.virtual_cuda import VirtualCuda

RECIPES = sorted(p.name for p in (Path(__file__).parents[2] / "lptrain" / "_recipes").glob("*_cpu.yaml"))
SHORT = ["logging.progress=false", "logging.plots=false", "data.builtin_max_mb=1",
         "train.train_iters=2", "train.eval_interval=2", "train.eval_iters=1",
         "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64",
         "optimizer.warmup_iters=0", "run.device=cuda"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_evaluates_and_saves_on_virtual_cuda(recipe: str, cache: Path, tmp_path: Path) -> None:
    from lptrain.train import pretrain

    overrides = [*SHORT, f"data.cache_dir={cache}", f"checkpoint.save={tmp_path / 'ckpt'}",
                 "checkpoint.save_interval=2"]
    with VirtualCuda() as vc:
        summary = pretrain(load(recipe, overrides).cfg, tmp_path / "run")
    assert summary["status"] == "completed" and vc.violations == []
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["val_loss"])
    assert (tmp_path / "ckpt" / "iter_0000002" / "COMPLETE.json").is_file()
    assert vc.stats.bytes_peak > 0  # parameters, buffers and activations lived on the device


TE_RECIPES = [r for r in RECIPES if not r.startswith(("tiny", "bf16"))]


@pytest.mark.parametrize("recipe", TE_RECIPES)
def test_recipe_on_the_te_backend_through_the_stand_in(recipe: str, cache: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run on ``precision.backend=te``: TE's module, tensor and checkpoint API (TE's
    own Python, its kernels emulated) under the same device rules. The single grouped expert
    weight runs TE's native grouped-tensor path (its grouped GEMM is called)."""
    import sys

    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.train import pretrain

    target = "sm100" if ("mxfp8" in recipe or "nvfp4" in recipe) else "sm90"
    overrides = [*SHORT, f"data.cache_dir={cache}", "precision.backend=te",
                 f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=2"]
    cfg = load(recipe, overrides).cfg
    grouped = bool(cfg.model.moe.num_experts and cfg.model.moe.single_grouped_weight)
    calls: list[bool] = []
    with virtual_gpu(target, te=True) as vc:
        tex = sys.modules["transformer_engine_torch"]
        if grouped:
            gemm = tex.te_general_grouped_gemm_for_grouped_tensor
            monkeypatch.setattr(tex, "te_general_grouped_gemm_for_grouped_tensor",
                                lambda *a, **k: calls.append(True) or gemm(*a, **k))
        summary = pretrain(cfg, tmp_path / "run")
    assert vc.te_backend.endswith("TE's own Python, kernels emulated") and vc.violations == [], vc.te_backend
    assert bool(calls) is grouped
    assert summary["status"] == "completed" and math.isfinite(summary["final_loss"])
    assert (tmp_path / "ckpt" / "iter_0000002" / "COMPLETE.json").is_file()


def _step_syncs(layers: int, cache: Path, extra: list[str]) -> dict[str, int]:
    from lptrain.config import World, derive
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    with VirtualCuda() as vc:
        cfg = derive(load("tiny_cpu.yaml", [*SHORT, f"data.cache_dir={cache}",
                                            f"model.num_layers={layers}", *extra]).cfg, World.detect())
        engine = TrainEngine(cfg)
        it, _ = build_train_valid_loaders(cfg.data, seq_length=64, micro_batch_size=2,
                                          global_batch_size=4, dp_rank=0, dp_size=1, vocab_size=259)
        engine.train_step([next(it), next(it)], 1)  # first step: lazy state is created
        before = dict(vc.stats.syncs)
        engine.train_step([next(it), next(it)], 2)
        return {k: v - before.get(k, 0) for k, v in vc.stats.syncs.items() if v - before.get(k, 0)}


@pytest.mark.parametrize("extra", [
    ["ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"],
    ["optimizer.name=muon", "optimizer.use_layer_wise_optimizer=true", "ddp.use_distributed_optimizer=true"],
], ids=["distopt", "layerwise_muon"])
def test_host_syncs_per_step_do_not_grow_with_the_parameter_count(extra: list[str], cache: Path) -> None:
    small, big = _step_syncs(2, cache, extra), _step_syncs(4, cache, extra)
    assert small == big, (small, big)
    assert sum(small.values()) <= 6, small  # loss/NaN codes, the norm, Muon's statistics
