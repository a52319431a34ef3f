"""The precision-aware optimizer through ``pretrain`` and the checkpoint files (DCP global
state, per-rank local state).

* A run stopped by ``train.exit_interval`` and resumed logs the same losses, grad norms and
  lrs (float equality) and ends with the same checkpoint (fp32 masters, each optimizer state
  in its saved dtype, the step counters) as the run that went straight through: TE holding
  fp32 masters as bf16-param remainders, an FP8 first moment, an fp16 second moment and bf16
  main grads -- the stored FP8 codes, fp16 values and their per-tensor scales come back
  bitwise from the rank's local state.
* The same checkpoint resumed by a run that keeps fp32 state (no precision-aware optimizer):
  loaded, converted, and the log says so.
* The Hugging Face export of a precision-aware run holds its fp32 masters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.checkpoint import find_checkpoints, load_checkpoint
from lptrain.config import compose
from lptrain.testing.parity import first_difference
from lptrain.train import pretrain

N = 4
PAO = ["ddp.use_distributed_optimizer=true", "optimizer.use_precision_aware_optimizer=true",
       "optimizer.exp_avg_dtype=fp8", "optimizer.exp_avg_sq_dtype=fp16", "optimizer.main_grads_dtype=bf16"]


def _train(out: Path, *extra: str) -> dict[str, Any]:
    ov = ["logging.progress=false", "logging.plots=false", "train.eval_iters=1", "train.log_interval=null",
          f"train.train_iters={N}", "train.global_batch_size=4", "train.micro_batch_size=4",
          "model.seq_length=64", "data.builtin_max_mb=1", f"checkpoint.save={out}/ckpt",
          f"optimizer.decay_iters={N + 1}", *extra]  # one schedule for the run and its longer resume
    return pretrain(compose("tiny_cpu.yaml", ov), out)


def _metrics(out: Path) -> list[tuple]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in recs]


def _final_state(out: Path) -> dict[str, Any]:
    state, _ = load_checkpoint(find_checkpoints(out / "ckpt").valid[0], rank=0, world_size=1)
    return state["global"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pao") / "straight"
    _train(out, *PAO)
    return out


def test_exit_interval_then_resume_is_bitwise(straight: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    first = _train(out, *PAO, f"train.exit_interval={N // 2}")
    assert first["status"] == "exit_interval" and first["steps"] == N // 2
    second = _train(out, *PAO, f"train.exit_interval={N // 2}")
    assert second["status"] == "completed" and second["resumed_from_step"] == N // 2
    assert _metrics(out) == _metrics(straight)
    final = _final_state(out)
    assert first_difference(final, _final_state(straight)) is None
    assert final["optimizer_state_dtypes"] == {"master": "remainders", "exp_avg": "fp8", "exp_avg_sq": "fp16"}


def test_other_dtypes_resume_converted_with_a_warning(straight: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An fp32 run resumes the precision-aware checkpoint: every state widened exactly, and the
    log says so (the other way, rounded into the lower dtypes, takes the same path:
    tests/dist/test_precision_aware_dist.py re-scales FP8 state for another layout)."""
    out = tmp_path / "fp32"
    ckpt = find_checkpoints(straight / "ckpt").valid[0]
    summary = _train(out, "ddp.use_distributed_optimizer=true", f"checkpoint.load={ckpt}",
                     f"train.train_iters={N + 1}")
    assert summary["status"] == "completed" and summary["resumed_from_step"] == N
    log = capsys.readouterr().out
    assert ("warning: the checkpoint's optimizer state was saved in other dtypes (master remainders -> "
            "fp32, exp_avg fp8 -> fp32, exp_avg_sq fp16 -> fp32); converted to this run's (exactly)") in log


def test_hf_export_holds_the_fp32_masters(straight: Path, tmp_path: Path) -> None:
    """The export reads the checkpoint's model section: the fp32 masters (rebuilt from the
    remainders), as without the precision-aware optimizer."""
    from safetensors.torch import load_file

    from lptrain.interop.hf_export import export_hf, read_masters

    export_hf(straight, tmp_path / "hf", dtype="fp32")
    masters = read_masters(find_checkpoints(straight / "ckpt").valid[0])
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.norm.weight"], masters["final_norm.weight"])
