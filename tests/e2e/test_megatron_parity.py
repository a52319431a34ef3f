"""Megatron-LM parity at the front door: the conditions Megatron refuses that lptrain used to
accept are refused by ``lptrain validate-config`` (rule id and fix; each valid neighbour
passes), and the values Megatron supports that lptrain used to refuse -- ``sqrtsoftplus``
router scores with the expert bias, the ``aol`` Newton-Schulz coefficients, Lion for Muon's
non-matrix params -- validate and train.

Megatron sources of the refusals: ``transformer_config.py`` (EP without experts,
``moe_ffn_hidden_size`` without experts, the expert bias needs sigmoid-type scores, top-1
needs pre-softmax), ``parallel_state.py`` (the world divisible by EP) and
``optimizer_param_scheduler.py`` (``lr_warmup_steps < lr_decay_steps``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lptrain.cli import app
from lptrain.config import compose
from lptrain.train import pretrain

runner = CliRunner(env={"COLUMNS": "400"})

# (recipe, overrides, --dp, the rule that must refuse it, a neighbour that must validate)
REFUSALS: list[tuple[str, list[str], int, str, list[str]]] = [
    ("tiny_cpu.yaml", ["model.moe.expert_model_parallel_size=2"], 2, "MOE-EP-NEEDS-EXPERTS",
     ["model.moe.num_experts=4", "model.moe.expert_model_parallel_size=2"]),
    ("moe_mxfp8.yaml", [], 1, "LAUNCH-EP-DIVIDES-WORLD", ["--dp", "8"]),
    ("tiny_cpu.yaml", ["model.moe.ffn_hidden_size=128"], 1, "MOE-FFN-NEEDS-EXPERTS",
     ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=128"]),
    ("moe_mxfp8.yaml", ["model.moe.enable_expert_bias=true"], 8, "MOE-EXPERT-BIAS-SCORE",
     ["model.moe.enable_expert_bias=true", "model.moe.score_function=sqrtsoftplus"]),
    ("moe_mxfp8.yaml", ["model.moe.router_topk=1"], 8, "MOE-TOPK1-SOFTMAX",
     ["model.moe.router_topk=1", "model.moe.score_function=sigmoid"]),
    ("tiny_cpu.yaml", ["optimizer.warmup_iters=60"], 1, "SCHED-WARMUP-DECAY",
     ["optimizer.warmup_iters=59"]),
    ("tiny_cpu.yaml", ["optimizer.warmup_iters=100"], 1, "SCHED-WARMUP-DECAY",
     ["optimizer.warmup_iters=100", "train.train_iters=200"]),
    ("tiny_cpu.yaml", ["optimizer.decay_iters=20", "optimizer.warmup_iters=30"], 1,
     "SCHED-WARMUP-DECAY", ["optimizer.decay_iters=40", "optimizer.warmup_iters=30"]),
]


def _validate(recipe: str, args: list[str], dp: int) -> tuple[int, dict]:
    target = ["--target", "sm100"] if recipe == "moe_mxfp8.yaml" else []
    dp_args = [] if "--dp" in args else ["--dp", str(dp)]
    r = runner.invoke(app, ["validate-config", "--recipe", recipe, *args, *dp_args, *target, "--json"])
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.parametrize(("recipe", "overrides", "dp", "rule", "neighbour"), REFUSALS,
                         ids=[f"{c[3]}:{' '.join(c[1]) or c[0]}" for c in REFUSALS])
def test_megatron_refusal(recipe: str, overrides: list[str], dp: int, rule: str,
                          neighbour: list[str]) -> None:
    code, report = _validate(recipe, overrides, dp)
    assert code == 1 and not report["valid"]
    hits = [v for v in report["violations"] if v["rule"] == rule]
    assert len(hits) == 1, report
    (v,) = hits
    assert v["severity"] == "error" and v["fix"] and v["keys"]
    assert [x["rule"] for x in report["violations"] if x["severity"] == "error"] == [rule]
    code, report = _validate(recipe, neighbour, dp)
    assert code == 0 and report["valid"], report


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def one_thread() -> None:
    torch.set_num_threads(1)  # the tiny model's GEMMs gain nothing from a second thread


MUON = "optimizer.name=muon"
VALUES = {
    "sqrtsoftplus+bias": ("tiny_cpu.yaml", ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=64",
                                            "model.moe.score_function=sqrtsoftplus",
                                            "model.moe.enable_expert_bias=true"]),
    # Muon's lr calibrated for this model (mxfp8_muon_cpu.yaml).
    "aol": ("tiny_cpu.yaml", [MUON, "optimizer.muon.coefficients=aol", "optimizer.muon.ns_steps=4",
                              "optimizer.lr=2e-3", "optimizer.min_lr=2e-4"]),
    "lion": ("tiny_cpu.yaml", [MUON, "optimizer.muon.scalar_optimizer=lion"]),
}


@pytest.mark.parametrize("name", list(VALUES))
def test_megatron_value_trains(name: str, tmp_path: Path, cache_dir: Path, one_thread: None) -> None:
    recipe, overrides = VALUES[name]
    code, report = _validate(recipe, overrides, 1)
    assert code == 0 and report["violations"] == [], report
    # A short run: 10 steps of 4 x 128 tokens (one micro-batch), a 1 MB slice of the corpus.
    cfg = compose(recipe, [*overrides, f"data.cache_dir={cache_dir}", "data.builtin_max_mb=1",
                           "train.train_iters=10", "train.global_batch_size=4",
                           "optimizer.warmup_iters=2", "train.eval_iters=1",
                           "logging.progress=false", "logging.plots=false", "checkpoint.save=null"])
    summary = pretrain(cfg, tmp_path / "run")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 10 and all(math.isfinite(r["loss"]) for r in recs)
    # 10 steps from ~ln(259) = 5.56 on a byte-level corpus: every variant learns by more than
    # 0.3 nats (measured 0.5-0.65); a wrong sign or a dead update would not.
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    if name == "lion":
        assert {"muon", "lion_decay", "lion_no_decay"} <= set(recs[0]["lrs"])
