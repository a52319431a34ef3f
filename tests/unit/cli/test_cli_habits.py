"""What a Megatron user meets first on the command line (issue 52, items 4, 12 and 13): rule
violations as one line each on stderr, Megatron's flags and abbreviations, the world in the
report's header, shell completion, and fixes that, applied, make the config valid.

In-process (Typer's CliRunner, whose stdout and stderr are not terminals) and through the
checker itself: no subprocess, no training."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.cli import common as cli_common
from lptrain.cli.common import complete_override, complete_recipe
from lptrain.config.check import check
from lptrain.config.compose import compose
from lptrain.config.world import World
from lptrain.launch.local import REPORTED_ENV

runner = CliRunner()

TP3_LINES = [
    "error: TP-HEADS: num_attention_heads=4 must be a multiple of tensor_model_parallel_size=3: "
    "each TP rank holds whole attention heads; keys: model.num_attention_heads, "
    "model.tensor_model_parallel_size; fix: set model.tensor_model_parallel_size=2 (every "
    "tensor-parallel rule holds at 1, 2, 4)",
    "error: TP-FFN: ffn_hidden_size=256 must be a multiple of tensor_model_parallel_size=3: "
    "fc1's gate and up halves and fc2's input columns are split over the TP ranks; keys: "
    "model.ffn_hidden_size, model.tensor_model_parallel_size; fix: set "
    "model.tensor_model_parallel_size=2 (every tensor-parallel rule holds at 1, 2, 4)",
]


def _validate(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", *args])
    return r.exit_code, r.stdout, r.stderr


# ---- item 4: one line per violation on stderr, the table on a terminal only ----------------


def test_violations_are_one_line_each_on_stderr_off_a_terminal() -> None:
    code, out, err = _validate("model.tensor_model_parallel_size=3")
    assert code == 1
    assert err.splitlines() == TP3_LINES  # whole keys, the fix last: copyable from a log
    assert out == "tiny_cpu.yaml: invalid (2 error(s), 0 warning(s); target cpu, dp 1, 3 ranks)\n"
    assert not re.search("[┃│┏━]", out + err)  # no box table in a log


@pytest.mark.parametrize("args", [
    ["validate-config", "--recipe", "tiny_cpu.yaml", "model.tensor_model_parallel_size=8"],  # a rule
    ["pretrain", "--recipe", "tiny_cpu.yaml", "model.tensor_model_parallel_size=2", "--nproc-per-node", "3"],
    ["validate-config", "--recipe", "tiny_cpu.yaml", "model.tp=2"],  # an unknown key
    ["validate-config", "--recipe", "no_such_recipe.yaml"],
    ["replay", "no_such_run", "--step", "1"],
])
def test_every_expected_failure_is_one_line_on_stderr(args: list[str]) -> None:
    """README: "Every expected failure is one line on stderr" -- a rule violation included (it
    was a table on stdout, and a SLURM .err file got nothing)."""
    r = runner.invoke(app, args)
    assert r.exit_code in (1, 2), r.output
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr
    assert "Traceback" not in r.output


def test_the_table_is_for_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_common, "is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal: keys still whole
    code, out, err = _validate("model.tensor_model_parallel_size=3")
    assert code == 1 and err == ""
    assert "┃ rule" in out and "model.tensor_model_parallel_size" in out
    # stdout a terminal, stderr a log (2> job.err): the lines still reach the log
    monkeypatch.setattr(cli_common, "is_terminal", lambda stream: stream == "stdout")
    assert _validate("model.tensor_model_parallel_size=3")[2].splitlines() == TP3_LINES


def test_a_launchs_ranks_do_not_repeat_its_rule_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The launcher of --nproc-per-node prints the warnings; its rank 0 printed them again."""
    monkeypatch.setattr("lptrain.train.pretrain", lambda cfg, out, **kw: {})
    warn = ["model.pipeline_model_parallel_size=2", "train.global_batch_size=2", "train.micro_batch_size=1",
            "--dry-run", "--dp", "2", "--output-dir", str(tmp_path / "run")]
    r = runner.invoke(app, ["validate-config", "--recipe", "tiny_cpu.yaml", *warn[:3], "--dp", "2"])
    assert r.exit_code == 0 and "warning: PP-FEW-MICRO-BATCHES: " in r.stdout
    monkeypatch.setenv(REPORTED_ENV, "1")
    monkeypatch.setattr("lptrain.cli.preflight.dry_run", lambda cfg, world: _NoLines())
    r = runner.invoke(app, ["pretrain", "--recipe", "tiny_cpu.yaml", *warn])
    assert r.exit_code == 0, r.output
    assert "PP-FEW-MICRO-BATCHES" not in r.output


class _NoLines:
    def lines(self) -> list[str]:
        return []


# ---- item 12: Megatron habits ----------------------------------------------------------------


def test_megatron_flags_are_read_as_their_keys() -> None:
    code, out, err = _validate("--tensor-model-parallel-size", "2", "--sequence-parallel", "--lr=2e-3",
                               "--no-load-optim", "--lr-warmup-iters", "3")
    assert code == 0, err
    assert err.splitlines() == [
        "note: --tensor-model-parallel-size 2 is Megatron-LM's flag: read as model.tensor_model_parallel_size=2",
        "note: --sequence-parallel is Megatron-LM's flag: read as model.sequence_parallel=true",
        "note: --lr=2e-3 is Megatron-LM's flag: read as optimizer.lr=2e-3",
        "note: --no-load-optim is Megatron-LM's flag: read as checkpoint.load_optimizer=false",
        "note: --lr-warmup-iters 3 is Megatron-LM's flag: read as optimizer.warmup_iters=3",
    ]
    assert out == "tiny_cpu.yaml: valid (0 warning(s); target cpu, dp 1, 2 ranks)\n"
    r = runner.invoke(app, ["show-config", "--recipe", "tiny_cpu.yaml", "--pipeline-model-parallel-size", "2"])
    assert "pipeline_model_parallel_size: 2" in r.stdout
    # a flag for no key is still Typer's error; an own option is never taken for a key
    assert "No such option: --use-flash-attn" in runner.invoke(
        app, ["validate-config", "--use-flash-attn"]).output


@pytest.mark.parametrize(("override", "tail"), [
    ("model.tp=2", "did you mean 'model.tensor_model_parallel_size'?"),
    ("model.ep=2", "did you mean 'model.moe.expert_model_parallel_size'?"),
    ("train.lr_warmup_iters=2", "did you mean 'optimizer.warmup_iters'?"),
    ("train.dp=2", "the data-parallel size is not a key: it is the ranks left by TP x PP "
                   "(--nproc-per-node, or --dp N to check a config)"),
])
def test_abbreviations_say_the_key(override: str, tail: str) -> None:
    code, _, err = _validate(override)
    key = override.split("=")[0]
    assert code == 2 and err == f"error: command-line override: unknown key '{key}'; {tail}\n"


def test_shell_completion_of_recipes_and_keys() -> None:
    assert complete_recipe("fp8_tensorwise_70") == ["fp8_tensorwise_70b_tp8.yaml", "fp8_tensorwise_70b_tp8_cpu.yaml"]
    assert complete_override("model.tensor") == ["model.tensor_model_parallel_size="]
    assert "model.moe." in complete_override("model.mo")
    assert complete_override("precision.fp8_recipe=mx") == ["precision.fp8_recipe=mxfp8"]


# ---- item 13: one fix for every violated rule, and the fix works when applied ---------------


def _settings(fix: str) -> tuple[str, ...]:
    """The ``key=value`` settings a fix names first (``set a=1 b=2 (...)``)."""
    m = re.search(r"set ((?:[\w.]+=[^\s,()]+ ?)+)", fix)
    return tuple(m.group(1).split()) if m else ()


def _launch(fix: str) -> int | None:
    """The rank count a fix asks a launch for (``launch a multiple of N ranks``), if any."""
    m = re.search(r"launch a multiple of (\d+) ranks", fix)
    return int(m.group(1)) if m else None


def _fires(overrides: list[str], world: World) -> dict[str, str]:
    cfg = compose("tiny_cpu.yaml", overrides)
    return {v.rule: v.fix for v in check(cfg, world.for_config(cfg)) if v.severity == "error"}


@pytest.mark.parametrize(("overrides", "world", "rules"), [
    (["model.tensor_model_parallel_size=3"], World(), {"TP-HEADS", "TP-FFN"}),
    (["model.tensor_model_parallel_size=3"], World(ranks=4), {"TP-HEADS", "TP-FFN", "LAUNCH-TP-DIVIDES-WORLD"}),
    (["model.tensor_model_parallel_size=2"], World(ranks=3), {"LAUNCH-TP-DIVIDES-WORLD"}),
    (["model.tensor_model_parallel_size=3"], World(ranks=3), {"TP-HEADS", "TP-FFN"}),
    (["model.tensor_model_parallel_size=4", "model.sequence_parallel=true", "model.seq_length=126"],
     World(ranks=4), {"SP-SEQ-DIVIDES"}),
    (["model.tensor_model_parallel_size=4", "precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"],
     World(), {"TP-BLOCK-BOUNDARY"}),
    (["model.tensor_model_parallel_size=4", "precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"],
     World(), {"TP-BLOCK-BOUNDARY", "PREC-GEMM-ALIGN"}),
    (["model.tensor_model_parallel_size=2", "model.num_query_groups=1"], World(), {"TP-KV-HEADS"}),
    (["model.pipeline_model_parallel_size=2", "model.pipeline_schedule=interleaved_1f1b",
      "model.num_layers=4"], World(), {"PP-SCHEDULE-VIRTUAL"}),
    (["model.pipeline_model_parallel_size=2", "model.pipeline_schedule=1f1b", "model.num_layers=4",
      "model.virtual_pipeline_model_parallel_size=2"], World(), {"PP-SCHEDULE-VIRTUAL"}),
    (["model.pipeline_model_parallel_size=2", "model.tensor_model_parallel_size=2"], World(ranks=6),
     {"LAUNCH-PP-DIVIDES-WORLD"}),
    (["model.pipeline_model_parallel_size=2", "model.tensor_model_parallel_size=2", "train.global_batch_size=12"],
     World(ranks=6), {"LAUNCH-PP-DIVIDES-WORLD"}),
])
def test_each_fix_applied_validates(overrides: list[str], world: World, rules: set[str]) -> None:
    fires = _fires(overrides, world)
    assert set(fires) == rules, fires
    settings = {_settings(f) for f in fires.values()} - {()}
    assert len(settings) <= 1, fires  # one fix for all of them (TP 3 used to get two that disagreed)
    fix = settings.pop() if settings else ()
    # a launch the fix asks for with its settings, or alone when it has none
    launches = {_launch(f) for f in fires.values() if _launch(f) and (" and launch " in f or not fix)}
    fixed_world = World(ranks=launches.pop()) if launches else world
    assert not _fires([*overrides, *fix], fixed_world), (fix, fixed_world)
    for f in fires.values():  # a launch of the size asked for, the config as it is
        n = _launch(f)
        if n and " and launch " not in f:
            assert "LAUNCH-TP-DIVIDES-WORLD" not in _fires(overrides, World(ranks=n))
            assert "LAUNCH-PP-DIVIDES-WORLD" not in _fires(overrides, World(ranks=n))


def test_alternative_fix_of_a_single_tp_rule_works_too() -> None:
    fires = _fires(["model.tensor_model_parallel_size=2", "model.ffn_hidden_size=255"], World())
    assert fires == {"TP-FFN": "set model.tensor_model_parallel_size=1, or set model.ffn_hidden_size=254"}
    assert not _fires(["model.tensor_model_parallel_size=2", "model.ffn_hidden_size=254"], World())


def test_header_of_a_world_tp_does_not_divide() -> None:
    cfg = compose("tiny_cpu.yaml", ["model.tensor_model_parallel_size=2"])
    assert World(ranks=3).for_config(cfg).describe() == "3 ranks, not a multiple of TP x PP = 2"
    assert World(ranks=4).for_config(cfg).describe() == "dp 2, 4 ranks"
    assert World(dp=3).for_config(cfg).describe() == "dp 3, 6 ranks"


def test_slurm_fix_names_its_own_launch_options() -> None:
    r = runner.invoke(app, ["slurm", "--recipe", "tiny_cpu.yaml", "--nodes", "3", "--gpus-per-node", "1",
                            "model.pipeline_model_parallel_size=2", "--dry-run"])
    assert r.exit_code == 1
    line = next(x for x in r.stderr.splitlines() if x.startswith("error: LAUNCH-PP-DIVIDES-WORLD"))
    assert line.endswith("fix: launch a multiple of 2 ranks (--nodes x --gpus-per-node)"), line
    assert "--nproc-per-node" not in r.stderr
    world = replace(World(ranks=2), launcher="--nodes x --gpus-per-node")
    assert not _fires(["model.pipeline_model_parallel_size=2"], world)


def test_replay_before_a_pruned_checkpoint_blames_keep_latest(tmp_path: Path) -> None:
    """``replay --step 15`` of a run that saved every 5 steps and kept 2 used to blame
    ``checkpoint.save_interval``; the checkpoints before 15 were pruned (keep_latest)."""
    from lptrain.train.replay import _no_checkpoint_before

    cfg = compose("tiny_cpu.yaml", [f"checkpoint.save={tmp_path}", "checkpoint.save_interval=5"])
    kept = [tmp_path / "iter_0000025", tmp_path / "iter_0000020"]
    e = _no_checkpoint_before(cfg, 15, kept)
    assert str(e) == (f"no valid checkpoint before step 15 in {tmp_path}: checkpoint.keep_latest=2 kept the "
                      "newest 2 (step(s) 20, 25); the older ones were pruned; fix: replay a step after 20 "
                      "(--step 21 or later), or raise checkpoint.keep_latest for the run to replay")
    assert e.key == "checkpoint.keep_latest"
    # none written before the step yet: the interval is to blame
    e = _no_checkpoint_before(cfg, 3, kept)
    assert e.key == "checkpoint.save_interval" and "(the first is at step 20)" in str(e)
