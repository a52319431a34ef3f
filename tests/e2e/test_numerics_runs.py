"""The quantization statistics in training: every ``*_cpu`` recipe collects them, they never
change the run, they cost no host sync between intervals, and on the TE backend they come
from TE's tensors.

* **Invariance.** For every ``*_cpu`` recipe, two engines on the same batches, one collecting
  every step (``logging.numerics_interval=1``), one never: losses, grad norms and every fp32
  master after the steps are bitwise equal (``torch.equal``) -- delayed-scaling histories and
  NVFP4 stochastic rounding included.
* **Host syncs.** On the virtual GPU (``lptrain.testing.virtual_cuda`` counts every host
  read of a device value): a step without statistics after a step with them syncs exactly
  like the step before it, and the step with them adds exactly one device-to-host copy.
* **TE.** Through TE's own Python on the virtual GPU, the probe reads TE's tensors: the
  run is bitwise the run without it, and its statistics equal the emulated backend's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load

RECIPES = sorted(p.name for p in (Path(__file__).parents[2] / "lptrain" / "_recipes").glob("*_cpu.yaml"))
# 2 micro-batches of 2 x 32 tokens: 64-row operands, aligned for every recipe (MXFP8: 32)
SEQ = 32
SMALL = ["logging.progress=false", "data.builtin_max_mb=1", "train.global_batch_size=4",
         "train.micro_batch_size=2", f"model.seq_length={SEQ}", "optimizer.warmup_iters=0",
         "optimizer.lr=0.01"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _steps(recipe: str, cache: Path, numerics: bool, steps: int = 2, extra: tuple[str, ...] = ()
           ) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor], list[Any]]:
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    cfg = derive(load(recipe, [*SMALL, f"data.cache_dir={cache}", *extra]).cfg, World.detect())
    engine = TrainEngine(cfg)
    it, _ = build_train_valid_loaders(cfg.data, seq_length=SEQ, micro_batch_size=2, global_batch_size=4,
                                      dp_rank=0, dp_size=1, vocab_size=cfg.model.vocab_size)
    out, stats = [], []
    for step in range(1, steps + 1):
        res = engine.train_step([next(it), next(it)], step, numerics=numerics)
        out.append((res.loss, res.grad_norm))
        stats.append(res.numerics)
    with engine.params_synced():
        masters = engine.checkpoint_state()["global"]["model"]
    return out, masters, stats


@pytest.mark.parametrize("recipe", RECIPES)
def test_statistics_never_change_the_run(recipe: str, cache: Path) -> None:
    """logging.numerics_interval=1 against 0: bitwise the same run, every recipe."""
    off, masters_off, none = _steps(recipe, cache, numerics=False)
    on, masters_on, stats = _steps(recipe, cache, numerics=True)
    assert on == off
    assert masters_on.keys() == masters_off.keys()
    assert all(torch.equal(masters_on[k], masters_off[k]) for k in masters_off)
    assert none == [None, None]
    for figures in stats:  # every linear's three operands, with finite figures
        names = {op.rsplit(".", 1)[0] for op in figures}
        assert {f"layers.{i}.self_attention.linear_qkv" for i in range(2)} <= names
        for op in figures:
            if op.endswith(("input", "weight", "grad")):
                assert all(math.isfinite(v) for v in figures[op].values()), (op, figures[op])
        roles = {op.rsplit(".", 1)[1].rstrip("0123456789") for op in figures}
        assert roles == {"input", "weight", "grad"}
    quantized = not recipe.startswith(("tiny", "bf16"))
    some = stats[-1]["layers.0.self_attention.linear_qkv.input"]
    assert ("snr_db" in some) == quantized and some["amax"] > 0


def _step_syncs(vc: Any, engine: Any, it: Any, plan: list[bool]) -> list[dict[str, int]]:
    """Host syncs of each step (by kind), steps collecting statistics where ``plan`` says."""
    out = []
    for step, numerics in enumerate(plan, 1):
        before = dict(vc.stats.syncs)
        engine.train_step([next(it), next(it)], step, numerics=numerics)
        out.append({k: v - before.get(k, 0) for k, v in vc.stats.syncs.items() if v - before.get(k, 0)})
    return out


@pytest.mark.parametrize(("recipe", "te"), [("mxfp8_adamw_cpu.yaml", False), ("fp8_delayed_cpu.yaml", True)],
                         ids=["mxfp8", "te-fp8-delayed"])
def test_one_device_read_per_interval_and_none_between(recipe: str, te: bool, cache: Path) -> None:
    from lptrain.data import build_train_valid_loaders
    from lptrain.testing.fake_gpu import virtual_gpu
    from lptrain.train.engine import TrainEngine

    extra = ["run.device=cuda", *(["precision.backend=te"] if te else [])]
    target = "sm100" if "mxfp8" in recipe or "nvfp4" in recipe else "sm90"
    with virtual_gpu(target, te=te) as vc:
        cfg = derive(load(recipe, [*SMALL, f"data.cache_dir={cache}", *extra]).cfg, World.detect())
        engine = TrainEngine(cfg)
        it, _ = build_train_valid_loaders(cfg.data, seq_length=SEQ, micro_batch_size=2,
                                          global_batch_size=4, dp_rank=0, dp_size=1,
                                          vocab_size=cfg.model.vocab_size)
        _, plain1, armed, plain2 = _step_syncs(vc, engine, it, [False, False, True, False])
    assert vc.violations == []
    assert plain2 == plain1  # an armed step leaves nothing behind that syncs later
    extra_syncs = {k: armed.get(k, 0) - plain1.get(k, 0) for k in {*armed, *plain1}}
    assert {k: v for k, v in extra_syncs.items() if v} == {"device-to-host copy": 1}, (armed, plain1)


@pytest.mark.parametrize(("recipe", "target"), [("mxfp8_adamw_cpu.yaml", "sm100"),
                                                ("fp8_delayed_cpu.yaml", "sm90"),
                                                ("nvfp4_adamw_cpu.yaml", "sm100")],
                         ids=["mxfp8", "delayed", "nvfp4-sr"])
def test_te_probe_changes_nothing_and_reads_what_the_emulation_records(
        recipe: str, target: str, cache: Path) -> None:
    """Steps on the TE backend (TE's own Python, virtual GPU) with and without the probe are
    bitwise the same run -- delayed scaling's amax history and NVFP4's stochastic rounding
    on the CUDA generator included. For MXFP8 the TE run is also bitwise the emulated
    backend's on the same device, and the probe's figures, read from TE's tensors through
    TE's attribute names, equal the emulated recorder's exactly."""
    from lptrain.testing.fake_gpu import virtual_gpu

    te = ("run.device=cuda", "precision.backend=te")
    with virtual_gpu(target, te=True) as vc:
        te_steps, te_masters, te_stats = _steps(recipe, cache, numerics=True, extra=te)
        off_steps, off_masters, _ = _steps(recipe, cache, numerics=False, extra=te)
    assert vc.te_backend.endswith("TE's own Python, kernels emulated") and vc.violations == []
    assert te_steps == off_steps
    assert all(torch.equal(te_masters[k], off_masters[k]) for k in off_masters)
    assert "layers.0.self_attention.linear_qkv.grad" in te_stats[-1]
    if recipe.startswith("mxfp8"):
        with virtual_gpu(target):
            emu_steps, _, emu_stats = _steps(recipe, cache, numerics=True, extra=("run.device=cuda",))
        assert te_steps == emu_steps
        assert te_stats == emu_stats
