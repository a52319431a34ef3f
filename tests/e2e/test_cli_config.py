"""CLI: validate-config, show-config, rules, pretrain's refusal path, exit codes and help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config import World, derive, load
from lptrain.config.compose import repo_root
from lptrain.config.render import rules_markdown
from lptrain.config.rules import rule_ids

# Wide terminal so the rich table never folds a key or a fix across lines.
runner = CliRunner(env={"COLUMNS": "400"})
BROKEN = ["ddp.reuse_grad_buf_for_mxfp8_param_ag=false",
          "ddp.num_distributed_optimizer_instances=2", "--dp", "8"]


def run(*args: str):
    return runner.invoke(app, list(args))


def test_acceptance_mxfp8_muon_valid_for_sm100() -> None:
    r = run("validate-config", "--recipe", "mxfp8_muon.yaml", "--target", "sm100")
    assert r.exit_code == 0, r.output
    assert "mxfp8_muon.yaml: valid" in r.output


def test_acceptance_broken_mxfp8_muon_lists_both_problems() -> None:
    r = run("validate-config", "--recipe", "mxfp8_muon.yaml", *BROKEN)
    assert r.exit_code == 1, r.output
    for text in ("PREC-MXFP8-PG-NEEDS-REUSE", "MUON-LAYERWISE-ONE-INSTANCE",
                 "set ddp.reuse_grad_buf_for_mxfp8_param_ag=true",
                 "set ddp.num_distributed_optimizer_instances=1", "invalid"):
        assert text in r.output, text


def test_json_report_shape() -> None:
    r = run("validate-config", "--recipe", "mxfp8_muon.yaml", *BROKEN, "--target", "sm100",
            "--json")
    assert r.exit_code == 1
    report = json.loads(r.stdout)
    assert list(report) == ["valid", "violations"] and report["valid"] is False
    assert [v["rule"] for v in report["violations"]] == [
        "PREC-MXFP8-PG-NEEDS-REUSE", "MUON-LAYERWISE-ONE-INSTANCE"]
    for v in report["violations"]:
        assert list(v) == ["rule", "severity", "keys", "message", "fix"]
        assert v["severity"] == "error" and isinstance(v["keys"], list)
    assert report["violations"][0]["fix"] == "set ddp.reuse_grad_buf_for_mxfp8_param_ag=true"

    ok = run("validate-config", "--recipe", "tiny_cpu.yaml", "--target", "cpu", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout) == {"valid": True, "violations": []}


def test_warnings_only_exit_zero() -> None:
    # warmup past this job's train_iters but before the decay ends: a warning, not an error
    r = run("validate-config", "--target", "cpu", "optimizer.warmup_iters=1000",
            "optimizer.decay_iters=2000", "--json")
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["valid"] is True
    assert [v["rule"] for v in report["violations"]] == ["SCHED-WARMUP"]


def test_cpu_target_reports_missing_te_backend() -> None:
    # Checking for a CPU box: a te recipe cannot run there.
    r = run("validate-config", "--recipe", "mxfp8_muon.yaml", "--target", "cpu", "--json")
    assert r.exit_code == 1
    assert "PREC-BACKEND-AVAILABLE" in {v["rule"] for v in json.loads(r.stdout)["violations"]}


def test_te_version_option() -> None:
    r = run("validate-config", "--recipe", "nvfp4_adamw.yaml", "--target", "sm100",
            "--te-version", "2.5", "--json")
    assert r.exit_code == 1
    assert [v["rule"] for v in json.loads(r.stdout)["violations"]] == ["PREC-TE-VERSION"]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model.hiden_size=64"], ["unknown key 'model.hiden_size'", "did you mean 'model.hidden_size'"]),
        (["model.hidden_size=abc"], ["model.hidden_size expects int"]),
        (["--recipe", "no_such.yaml"], ["recipe 'no_such.yaml' not found"]),
        (["--recipe", "FILE:model:\n  num_layers: 2\n   hidden_size: 3\n"], [":3: YAML syntax error"]),
        (["--recipe", "FILE:model:\n  hidden_sise: 64\n"], [":2: unknown key 'model.hidden_sise'"]),
        (["--recipe", "FILE:train:\n  train_iters: many\n"], [":2: train.train_iters expects int"]),
    ],
)
def test_unreadable_input_exits_2_without_traceback(
    tmp_path: Path, args: list[str], expected: list[str]
) -> None:
    args = [str(_write(tmp_path, a[5:])) if a.startswith("FILE:") else a for a in args]
    for command in ("validate-config", "show-config", "pretrain"):
        r = run(command, *args)
        assert r.exit_code == 2, (command, r.output)
        assert "Traceback" not in r.output
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
        for text in expected:
            assert text in r.stderr
        if args[0] == "--recipe" and args[1].endswith("r.yaml"):
            assert str(tmp_path / "r.yaml") in r.stderr


def test_show_config_is_resolved_and_round_trips(tmp_path: Path) -> None:
    r = run("show-config", "--recipe", "mxfp8_muon_cpu.yaml")
    assert r.exit_code == 0
    data = yaml.safe_load(r.stdout)
    assert data["optimizer"]["use_layer_wise_optimizer"] is True  # derived
    assert data["ddp"]["grad_reduce_in_fp32"] is True
    assert data["checkpoint"]["save"] == "runs/mxfp8_muon_cpu/checkpoints"  # interpolated
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(r.stdout)
    world = World()
    assert derive(load(resolved).cfg, world) == derive(load("mxfp8_muon_cpu.yaml").cfg, world)


def test_show_config_diff_and_explain() -> None:
    r = run("show-config", "--recipe", "mxfp8_muon_cpu.yaml", "--diff")
    assert r.exit_code == 0
    data = yaml.safe_load(r.stdout)
    assert data["precision"]["fp8_recipe"] == "mxfp8"
    assert data["optimizer"]["name"] == "muon"
    assert "norm_epsilon" not in r.stdout  # defaults left out
    assert data["logging"] == {"numerics_interval": 100}  # only what the recipe sets there
    e = run("show-config", "--explain")
    assert "hidden_size: 64  # Model (residual stream) width." in e.stdout
    assert yaml.safe_load(e.stdout)["model"]["hidden_size"] == 64


def test_rules_command() -> None:
    r = run("rules")
    assert r.exit_code == 0
    for rid in rule_ids():
        assert rid in r.output
    md = run("rules", "--markdown")
    assert md.stdout == rules_markdown() == (repo_root() / "docs/rules.md").read_text()


def test_pretrain_refuses_invalid_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[object] = []
    monkeypatch.setattr("lptrain.train.pretrain", lambda cfg, out: called.append(cfg))
    r = run("pretrain", "--output-dir", str(tmp_path / "run"), "model.num_attention_heads=3")
    assert r.exit_code == 1 and "MODEL-HEADS" in r.output and "refusing to start" in r.output
    assert not (tmp_path / "run" / "resolved_config.yaml").exists() and called == []


def test_pretrain_writes_resolved_config_then_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[object, Path]] = []
    monkeypatch.setattr("lptrain.train.pretrain", lambda cfg, out: calls.append((cfg, out)))
    out = tmp_path / "run"
    r = run("pretrain", "--recipe", "tiny_cpu.yaml", "--output-dir", str(out), "train.train_iters=3",
            "optimizer.warmup_iters=1")
    assert r.exit_code == 0, r.output
    written = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert written["run"]["output_dir"] == str(out) and written["train"]["train_iters"] == 3
    ((cfg, passed_out),) = calls
    assert passed_out == out and cfg.train.train_iters == 3 and cfg.model.num_query_groups == 4


def test_help_lists_commands_and_documented_options() -> None:
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("validate-config", "show-config", "pretrain", "rules", "--install-completion"):
        assert cmd in r.output
    for cmd, opts in (("validate-config", ("--recipe", "--dp", "--target", "--json", "--te-version")),
                      ("show-config", ("--diff", "--explain")),
                      ("pretrain", ("--output-dir",)), ("rules", ("--markdown",))):
        h = run(cmd, "--help")
        assert h.exit_code == 0
        for opt in opts:
            assert opt in h.output, (cmd, opt)


def test_python_dash_m_and_no_torch_on_validate_path() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from lptrain.cli import app\n"
        "r = CliRunner().invoke(app, ['validate-config', '--recipe', 'mxfp8_muon.yaml', "
        "'--target', 'sm100'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    m = subprocess.run([sys.executable, "-m", "lptrain", "--help"], capture_output=True, text=True)
    assert m.returncode == 0 and "validate-config" in m.stdout


def test_sm120_target_refuses_mxfp8() -> None:
    """The CLI offers every target the rules know; MXFP8 is refused on sm120 (TE does too)."""
    from typer.testing import CliRunner

    from lptrain.cli import app

    r = CliRunner().invoke(app, ["validate-config", "--recipe", "mxfp8_adamw.yaml", "--target", "sm120", "--json"])
    assert r.exit_code == 1, r.output
    import json

    rules = {v["rule"] for v in json.loads(r.output)["violations"]}
    assert "PREC-MXFP8-SM120" in rules
