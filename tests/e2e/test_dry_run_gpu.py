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
