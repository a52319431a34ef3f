"""One memory model: the analytic model of parameter descriptions, the planner and the
measurement of a live engine agree category by category, and the engine's report is the
same bytes regrouped by buffer.

Exact equality (integers of bytes): all three run the same layout code, and the tiny
shapes are whole multiples of the quantized formats' blocks.
"""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, compose, derive
from lptrain.memory.analytic import analytic_memory, describe_params, quantized_bytes_per_element
from lptrain.memory.measure import measured_memory
from lptrain.memory.plan import estimate_memory
from lptrain.precision.param_storage import is_quantized, staging_dtype

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "train.micro_batch_size=2",
        "train.global_batch_size=2", "model.seq_length=32"]
CASES = {
    # sharded AdamW buffers with bucket padding in the grad and the param buffer
    "adamw_distopt": ("tiny_cpu.yaml", ["ddp.use_distributed_optimizer=true", "ddp.bucket_size=3000"]),
    # MXFP8 primary weights gathered through the reused grad buffer (param views, no copy)
    "mxfp8_adamw_reuse": ("mxfp8_adamw_cpu.yaml", ["ddp.bucket_size=3000"]),
    # layer-wise Muon (owned matrices) with MXFP8 primary weights
    "mxfp8_muon": ("mxfp8_muon_cpu.yaml", ["ddp.bucket_size=3000"]),
}


def _engine(recipe: str, overrides: list[str]):
    from lptrain.train.engine import TrainEngine

    cfg = derive(compose(recipe, [*BASE, *overrides]), World.detect())
    engine = TrainEngine(cfg)
    tok = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    engine.train_step([{"tokens": tok[:, :-1], "labels": tok[:, 1:]}], 1)
    return cfg, engine


@pytest.mark.parametrize("case", sorted(CASES))
def test_measured_analytic_planned_and_reported_agree(case: str) -> None:
    recipe, ov = CASES[case]
    cfg, engine = _engine(recipe, ov)
    measured = measured_memory(engine.model, engine.ddp.buffers, engine.optimizer.children)
    named = list(engine.model.named_parameters())
    q = [p for _, p in named if is_quantized(p)]
    o, d = cfg.optimizer, cfg.ddp
    analytic = analytic_memory(
        describe_params(named), dp=1, optimizer=o.name, distributed=d.use_distributed_optimizer,
        param_layout=o.layer_wise_param_layout, bucket_size=d.bucket_size,
        quantized_bpe=quantized_bytes_per_element(q[0]) if q else 0.0,
        quantized_staging_dtype=staging_dtype(q[0]) if q else torch.bfloat16,
        reuse_grad_buffer=bool(d.reuse_grad_buf_for_mxfp8_param_ag),
    )[0]
    assert measured == analytic  # every category and every split of one
    planned = estimate_memory(cfg, 1, "cpu").ranks[0].bytes
    assert {k: planned[k] for k in measured.categories()} == measured.categories()
    report = engine.memory_breakdown()
    assert report == measured.engine_report()
    # the report regroups the same bytes: nothing lost or counted twice but the 0-dim states
    assert report["total"] == measured.total - measured.optimizer_scalars
    assert report["padding"] == measured.padding + measured.view_padding
    if case == "adamw_distopt":
        assert measured.padding > measured.grad_padding > 0  # grad and param buffers padded
    if case == "mxfp8_adamw_reuse":  # the gather stages in the grad buffer: no copy
        assert measured.quantized_weights > 0 and measured.param_gather_staging == 0
