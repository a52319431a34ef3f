"""Export after training at expert-parallel size 2 (two gloo ranks, single grouped expert
weights): the checkpoint holds each expert once under its global canonical name, so the
exported Mixtral folder loads in ``transformers`` and gives lptrain's fp32 logits (from an
EP=1 model with the loop expert layout) within ``lptrain.testing.hf.LOGIT_ATOL``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lptrain.testing.dist import run_distributed
from lptrain.testing.hf import LOGIT_ATOL, hf_logits, max_abs_diff, reference_logits, sample_tokens

pytestmark = pytest.mark.dist

MOE = ["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=64",
       "model.num_query_groups=2"]
EP2 = ["model.moe.expert_model_parallel_size=2", "model.moe.grouped_gemm=true",
       "model.moe.single_grouped_weight=true"]


def _overrides(cache: str, out: str) -> list[str]:
    return [f"data.cache_dir={cache}", "data.builtin_max_mb=1", "logging.progress=false",
            "logging.plots=false", "train.eval_iters=1", "train.log_interval=null", "train.train_iters=3",
            "train.global_batch_size=8", "train.micro_batch_size=4", "model.seq_length=64",
            f"checkpoint.save={out}/ckpt", *MOE, *EP2]


def _train_ep2(rank: int, world: int, cache: str, out: str) -> dict[str, Any]:
    from lptrain.config import compose
    from lptrain.train import pretrain

    return pretrain(compose("tiny_cpu.yaml", _overrides(cache, out)), out)


def test_export_after_ep2_training_matches_transformers(tmp_path: Path) -> None:
    from lptrain.data.builtin import ensure_builtin_dataset
    from lptrain.interop.hf_export import export_hf, find_checkpoint, read_masters

    cache, run = tmp_path / "cache", tmp_path / "run"
    ensure_builtin_dataset("python-stdlib", str(cache), "byte", 1_000_000)  # once, not by both ranks
    summaries = run_distributed(_train_ep2, 2, (str(cache), str(run)))
    assert all(s["status"] == "completed" for s in summaries)
    rep = export_hf(run, tmp_path / "hf", dtype="fp32")
    assert rep.architecture == "MixtralForCausalLM"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_local_experts"] == 4
    masters = read_masters(find_checkpoint(run))
    assert sorted(k for k in masters if "experts.linear_fc1" in k) == [
        f"layers.{i}.mlp.experts.linear_fc1.weight.{e}" for i in range(2) for e in range(4)]
    tokens = sample_tokens(259)
    ours = reference_logits("tiny_cpu.yaml", [*MOE, "model.moe.grouped_gemm=false"], masters, tokens)
    diff = max_abs_diff(ours, hf_logits(tmp_path / "hf", tokens))
    assert diff <= LOGIT_ATOL, diff
