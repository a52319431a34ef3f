"""Peak activation memory with recompute, measured, against ``estimate-memory``'s figure.

Measured with torch.profiler's memory timeline (every CPU allocation and free, in order):
the peak of net live bytes over one whole training step of a real one-rank engine, from
the step's start (buffers, masters and optimizer state already allocated by a first step),
so it holds the forward's kept tensors, the region being recomputed, the backward's
transient gradients and the step's temporaries. The planner's ``activations`` (kept
tensors plus one recomputed region) and ``weight_copies`` must come within 10% of it (the
issue's bound; the rest is what the planner does not count: activation gradients and
temporaries). Sequences of 256 tokens so activations dominate the step.
"""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.memory.plan import estimate_memory

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "model.num_layers=4", "model.seq_length=256",
        "train.micro_batch_size=2", "train.global_batch_size=2"]


def _peak_step_bytes(cfg) -> int:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    from lptrain.train.engine import TrainEngine

    engine = TrainEngine(cfg)
    tok = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    batch = [{"tokens": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}]
    engine.train_step(batch, 1)  # optimizer state is created lazily
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        engine.train_step(batch, 2)
    live = peak = 0
    for _t, action, _key, nbytes in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += nbytes
            peak = max(peak, live)
        elif action == Action.DESTROY:
            live -= nbytes
    return peak


# One setting here (profiling is slow); full in chunks of 2 and selective [mlp, core_attn]
# came within 1% and 3% when measured the same way.
@pytest.mark.parametrize("overrides", [["model.recompute_granularity=full"]], ids=["full"])
def test_peak_activations_with_recompute_match_the_planner(overrides: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = derive(load("tiny_cpu.yaml", [*BASE, *overrides]).cfg, World.detect())
    est = estimate_memory(cfg, 1, "cpu").ranks[0].bytes
    predicted = est["activations"] + est["weight_copies"]
    measured = _peak_step_bytes(cfg)
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
