"""``lptrain compare`` and ``lptrain numerics`` on real run folders.

Runs (fp8_delayed_cpu at small shapes): ``base`` with a constant lr and statistics every
step, ``twin`` the same config again with statistics every 4th step (statistics never change
the run: compared where both have them), ``wsd`` (statistics every 4th step) whose schedule (warmup-stable-decay over 7 steps)
leaves the lr alone for the first 80% -- steps 1-6 -- and decays it from step 7, and ``bf16``,
the same model without FP8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli.app import app
from lptrain.config.compose import load
from lptrain.train import pretrain

SMALL = ["logging.progress=false", "logging.plots=false", "data.builtin_max_mb=1",
         "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64",
         "optimizer.warmup_iters=0", "train.eval_iters=0", "optimizer.lr_schedule=constant"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    cache = root / "cache"
    every, fourth = "logging.numerics_interval=1", "logging.numerics_interval=4"
    plan = {
        "base": ("fp8_delayed_cpu.yaml", ["train.train_iters=8", every]),
        "twin": ("fp8_delayed_cpu.yaml", ["train.train_iters=8", fourth]),
        "wsd": ("fp8_delayed_cpu.yaml", ["train.train_iters=8", fourth, "optimizer.lr_schedule=wsd",
                                         "optimizer.decay_iters=7"]),
        "bf16": ("bf16_adamw_cpu.yaml", ["train.train_iters=2", every]),
    }
    out = {}
    for name, (recipe, extra) in plan.items():
        cfg = load(recipe, [*SMALL, f"data.cache_dir={cache}", *extra]).cfg
        pretrain(cfg, root / name)
        out[name] = root / name
    return out


def _compare(a: Path, b: Path, tmp_path: Path, *extra: str) -> dict:
    r = CliRunner().invoke(app, ["compare", str(a), str(b), "--json", "--plot",
                                 str(tmp_path / "cmp.png"), *extra])
    got = json.loads(r.output)
    assert r.exit_code == (0 if got["identical"] else 1), r.output  # compare gates CI
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    return got


def test_identical_runs_say_identical(runs: dict[str, Path], tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["compare", str(runs["base"]), str(runs["twin"]),
                                 "--plot", str(tmp_path / "cmp.png")])
    assert r.exit_code == 0, r.output
    assert "identical: loss, grad norm, lr and 24 operands' statistics equal at every common step" in r.output


def test_another_lr_from_step_7_is_named_step_7(runs: dict[str, Path], tmp_path: Path) -> None:
    got = _compare(runs["base"], runs["wsd"], tmp_path)
    assert got["first_step"] == 7
    assert {d["what"].split(" ")[0] for d in got["first"]} == {"lr"}  # the loss still agrees at 7
    # the first statistics to move are the first GEMM's input after the step-7 update
    assert got["first_layer"]["step"] == 8
    assert got["first_layer"]["what"].startswith("layers.0.self_attention.linear_qkv.input")
    assert ["optimizer.lr_schedule", "constant", "wsd"] in got["settings"]


def test_bf16_against_fp8_parts_at_step_1_after_the_first_gemm(runs: dict[str, Path], tmp_path: Path) -> None:
    got = _compare(runs["bf16"], runs["base"], tmp_path)
    assert got["first_step"] == 1 and any(d["what"] == "loss" for d in got["first"])
    # the first GEMM's operands (its input, its weight) agree; its output, the next input, does not
    assert got["first_layer"]["step"] == 1
    assert got["first_layer"]["what"].startswith("layers.0.self_attention.linear_proj.input")


def test_a_tolerance_can_make_runs_agree(runs: dict[str, Path], tmp_path: Path) -> None:
    got = _compare(runs["base"], runs["wsd"], tmp_path, "--tol", "10")
    assert got["identical"] is True and got["first_step"] is None


def test_numerics_command_tables_and_heatmaps(runs: dict[str, Path]) -> None:
    r = CliRunner().invoke(app, ["numerics", str(runs["base"]), "--top", "2",
                                 "--threshold", "saturation=0"])
    assert r.exit_code == 0, r.output
    assert "statistics of 24 operands at 8 steps (1..8)" in r.output
    assert "saturation" in r.output and "snr_db" in r.output
    assert (runs["base"] / "numerics_snr_db.png").read_bytes()[:4] == b"\x89PNG"
    js = CliRunner().invoke(app, ["numerics", str(runs["base"]), "--json", "--no-plots"])
    worst = json.loads(js.output)["snr_db"][0]
    assert worst["value"] > 0 and worst["operand"].endswith(".grad")  # E5M2 grads: the lowest SNR


@pytest.mark.parametrize(("args", "fragment"), [
    (["numerics", "/nonexistent/run"], "metrics.jsonl not found"),
    (["compare", "/nonexistent/a", "/nonexistent/b"], "metrics.jsonl not found"),
    (["replay", "/nonexistent/run", "--step", "2"], "metrics.jsonl not found"),
    (["numerics", "RUN", "--threshold", "loudness=3"], "unknown statistic 'loudness'"),
])
def test_bad_input_is_one_line_exit_2(args: list[str], fragment: str, runs: dict[str, Path]) -> None:
    args = [str(runs["base"]) if a == "RUN" else a for a in args]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0]


def test_a_run_without_statistics_names_the_key(runs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    r = CliRunner().invoke(app, ["numerics", str(tmp_path)])
    assert r.exit_code == 2 and "logging.numerics_interval" in r.output
