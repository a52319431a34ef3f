"""``lptrain pretrain --dry-run`` on a GPU target runs the fake GPU step after validation.

From a laptop, a cluster recipe is validated for the target, built on the meta device, and
then trained for two steps at tiny shapes on a virtual GPU of that target that enforces
CUDA's device rules (through TE's own Python, kernels emulated, when the recipe uses TE and TE
is not installed, saying so), so a code path that would crash on the GPU fails before the
job gets one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli import app

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _dry_run(recipe: str, target: str, tmp_path: Path, cache: Path) -> object:
    # 8 MB of the built-in corpus: the cluster recipes' 4096-token samples fit its validation split
    return runner.invoke(app, ["pretrain", "--dry-run", "--recipe", recipe, "--target", target,
                               "-o", str(tmp_path / "out"), f"data.cache_dir={cache}",
                               "data.builtin_max_mb=8"])


@pytest.mark.parametrize(("recipe", "target", "backend"), [
    ("mxfp8_muon.yaml", "sm100", "TE backend, TE 2."),
    ("fp8_blockwise.yaml", "sm90", "TE backend, TE 2."),
    ("bf16_adamw.yaml", "sm90", "TE backend, TE 2."),
    ("tiny_cpu.yaml", "sm90", "emulated backend"),
])
def test_cluster_recipe_runs_its_fake_gpu_step(recipe: str, target: str, backend: str, tmp_path: Path,
                                               cache: Path) -> None:
    r = _dry_run(recipe, target, tmp_path, cache)
    assert r.exit_code == 0, r.output
    assert f"fake GPU step ({target}, virtual CUDA, {backend}" in r.output
    assert ("TE's own Python, kernels emulated): " in r.output) == backend.startswith("TE backend")
    assert "host syncs per step" in r.output and "dry run ok" in r.output
    assert not (tmp_path / "out").exists()


def test_a_device_bug_fails_the_dry_run(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's old CPU norm accumulator, put back: the dry run stops at the op."""
    import math

    import torch

    from lptrain.optim.chained import ChainedOptimizer

    def host_accumulator(self: ChainedOptimizer) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for c in self.children:
            total += c.grad_norm_sq()
        return math.sqrt(float(total))

    monkeypatch.setattr(ChainedOptimizer, "grad_norm", host_accumulator)
    r = _dry_run("bf16_adamw.yaml", "sm90", tmp_path, cache)
    assert r.exit_code != 0
    assert "in-place op writes device results into a host tensor" in str(r.exception) + r.output


def test_tensor_parallelism_runs_on_two_gloo_ranks(tmp_path: Path, cache: Path) -> None:
    """Issue 52 item 10: the dry run shrank TP and PP to 1 ("tensor parallelism 8 -> 1;
    pipeline parallelism 8 -> 1"), so it never ran the parallel code paths it exists to check.
    TP 4 + SP runs at TP 2 on 2 gloo ranks, each on a virtual GPU; the data parallelism it does
    not run is named. (TP x PP: 4 ranks, the same launch; its shrinking is checked below.)"""
    r = runner.invoke(app, ["pretrain", "--dry-run", "--recipe", "tiny_cpu.yaml", "--target", "sm90",
                            "--dp", "2", "-o", str(tmp_path / "out"), f"data.cache_dir={cache}", "data.builtin_max_mb=1",
                            "model.tensor_model_parallel_size=4", "model.sequence_parallel=true"])
    assert r.exit_code == 0, r.output
    assert "fake GPU step (sm90, virtual CUDA, emulated backend): 2 steps on 2 gloo ranks" in r.output
    assert "fake GPU step shrank: model 2x64 -> 2x64, seq 128 -> 64; tensor parallelism 4 -> 2;" in r.output
    assert "fake GPU step ran: tensor parallelism 2 + sequence parallelism\n" in r.output
    assert ("fake GPU step did not run: data parallelism 2 (the gradient reduce-scatter / all-reduce "
            "and the param all-gather between replicas: one replica here)") in r.output
    assert "-> 1" not in r.output and not (tmp_path / "out").exists()


def test_the_405b_recipe_shrinks_to_tp2_pp2_on_four_ranks() -> None:
    from lptrain.config import World, derive, load
    from lptrain.testing.fake_gpu import shrink

    cfg = derive(load("fp8_tensorwise_405b_tp8_pp8.yaml").cfg, World.detect(dp=8, target="sm90"))
    small, changed, ran, not_run = shrink(cfg, dp=8)
    m = small.model
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.num_layers) == (2, 2, 2)
    assert "tensor parallelism 8 -> 2" in changed and "pipeline parallelism 8 -> 2" in changed
    assert ran == ["tensor parallelism 2 + sequence parallelism", "pipeline parallelism 2 (1f1b, 2 layers)"]
    assert not_run[0].startswith("data parallelism 8 ")
    vpp = derive(load("tiny_cpu.yaml", ["model.pipeline_model_parallel_size=4", "model.num_layers=8",
                                        "model.virtual_pipeline_model_parallel_size=2",
                                        "train.micro_batch_size=1"]).cfg, World.detect(dp=1, target="sm90"))
    small, changed, ran, _ = shrink(vpp)
    m = small.model
    assert (m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size, m.num_layers) == (2, 2, 4)
    assert "pipeline parallelism 4 -> 2 x 2 virtual chunks" in changed
    assert ran == ["pipeline parallelism 2 (interleaved_1f1b, 4 layers)"]
