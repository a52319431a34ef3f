"""``debug.nan_module`` is checked against the whole model, before anything is written (issue
52, item 3): under pipeline parallelism each stage checked it against its own layers, so every
name was refused on some stage, after the run folder held ``resolved_config.yaml`` and
``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config import World, compose, derive
from lptrain.errors import InputError
from lptrain.train.forensics import check_nan_module

runner = CliRunner()
PP2 = "model.pipeline_model_parallel_size=2"


def test_every_stages_layers_are_accepted_and_others_refused() -> None:
    cfg = derive(compose("tiny_cpu.yaml", [PP2, "debug.nan_sample=1",
                                           "debug.nan_module=layers.1.mlp.linear_fc2"]), World(ranks=2))
    check_nan_module(cfg)  # on stage 1: accepted
    cfg.debug.nan_module = "layers.2.mlp.linear_fc2"  # 2 layers: no such module anywhere
    with pytest.raises(InputError, match="names no module of this model"):
        check_nan_module(cfg)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_refused_module_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int) -> None:
    launched: list[Any] = []
    monkeypatch.setattr("lptrain.launch.local.launch_local", lambda n, args: launched.append(args) or 0)
    monkeypatch.setattr("lptrain.train.pretrain", lambda cfg, out, **kw: pytest.fail("trained"))
    out = tmp_path / "run"
    args = ["pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out), "--nproc-per-node", str(nproc),
            "debug.nan_sample=1", "train.train_iters=8", *([PP2] if nproc == 2 else [])]
    r = runner.invoke(app, [*args, "debug.nan_module=layers.7.mlp"])
    assert r.exit_code == 2
    assert r.stderr == ("error: debug.nan_module='layers.7.mlp' names no module of this model (e.g. "
                        "layers.0.self_attention.linear_qkv, layers.0.self_attention.linear_proj, "
                        "layers.0.mlp.linear_fc1); fix: name a module by its "
                        "state-dict prefix\n")
    assert not out.exists() and not launched
    if nproc == 2:  # a module of the second stage starts the ranks
        r = runner.invoke(app, [*args, "debug.nan_module=layers.1.mlp.linear_fc2"])
        assert r.exit_code == 0, r.output
        assert len(launched) == 1
