"""End to end: `python -m lptrain pretrain` on the default recipe trains and writes its run folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def test_pretrain_tiny_cpu_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "lptrain", "pretrain", "--recipe", "tiny_cpu.yaml",
         "--output-dir", str(out), "train.train_iters=3", "optimizer.warmup_iters=1",
         "train.eval_iters=1", "data.builtin_max_mb=1",  # `make run` prepares the full 32 MB
         f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resolved = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert resolved["train"]["train_iters"] == 3
    assert resolved["precision"]["backend"] == "emulated"  # derived from tiny_cpu's setting
    assert resolved["ddp"]["grad_reduce_in_fp32"] is True  # derived: bf16 params
