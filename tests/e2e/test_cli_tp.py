"""The command line under tensor parallelism: which world is judged.

``validate-config --dp N`` judges ``TP x N`` ranks; ``pretrain`` judges the ranks it has
(``--nproc-per-node``, 1 by default, or the torchrun world it joins), so a TP recipe started on
one process is refused by the rule, exit 1, before anything is built -- it used to validate as
a TP x 1 world and then fail creating the process groups (exit 2, no rule).
"""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from lptrain.cli import app

runner = CliRunner(env={"COLUMNS": "400"})
TP2 = "model.tensor_model_parallel_size=2"


def test_validate_config_judges_tp_times_dp() -> None:
    r = runner.invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", TP2, "model.sequence_parallel=true",
                            "--dp", "2"])
    assert r.exit_code == 0, r.output
    assert "dp 2, 4 ranks" in r.output
    r = runner.invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", "model.tensor_model_parallel_size=8"])
    assert r.exit_code == 1 and "TP-HEADS" in r.output  # 4 heads do not split over 8 ranks


def test_pretrain_on_fewer_ranks_than_tp_is_refused_by_the_rule(tmp_path: Path) -> None:
    r = runner.invoke(app, ["pretrain", "--recipe", "tiny_cpu.yaml", TP2, "--output-dir", str(tmp_path / "run"),
                            "train.train_iters=1"])
    assert r.exit_code == 1, r.output
    assert "LAUNCH-TP-DIVIDES-WORLD" in r.output and "--nproc-per-node" in r.output
    assert not (tmp_path / "run").exists()
