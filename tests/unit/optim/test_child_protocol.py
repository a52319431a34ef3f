"""The engine's optimizer children, bucket hooks and groups implement the declared Protocols
(every member present), and checkpoint dispatch follows the declared ``holds_experts``."""

from __future__ import annotations

import pytest

from lptrain.config import World, compose, derive
from lptrain.distributed.bucket_group import ParamSyncHook
from lptrain.distributed.groups import SINGLE
from lptrain.model.process_group import SINGLE_RANK, ProcessGroup
from lptrain.optim.child import OptimizerChild, Piece

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "model.seq_length=32"]
MOE = ["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=64",
       "model.moe.grouped_gemm=true"]
CASES = {
    # (overrides, expected (child type, label, holds_experts) in order)
    "adamw_moe": ([*MOE, "ddp.use_distributed_optimizer=true"],
                  [("ShardedMasterOptimizer", "dense", False),
                   ("ExpertShardedMasterOptimizer", "expert", True)]),
    "layer_wise_moe": ([*MOE, "ddp.use_distributed_optimizer=true", "optimizer.name=muon"],
                       # expert weights are all matrices: Muon only on the expert side
                       [("ShardedMasterOptimizer", "dense", False), ("LayerWiseMuon", "dense", False),
                        ("LayerWiseMuon", "expert", True)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_children_follow_the_protocol(case: str) -> None:
    from lptrain.train.engine import TrainEngine

    ov, want = CASES[case]
    engine = TrainEngine(derive(compose("tiny_cpu.yaml", [*BASE, *ov]), World.detect()))
    children = engine.optimizer.children
    assert [(type(c).__name__, c.label, c.holds_experts) for c in children] == want
    for c in children:
        assert isinstance(c, OptimizerChild), type(c).__name__
        assert c.pieces and all(isinstance(pc, Piece) for pc in c.pieces)
        assert c.holds_experts == all(b.key.is_expert for b in c.buffers)
    hooks = [b.param_sync_hook for buf in engine.ddp.buffers for b in buf.buckets
             if b.param_sync_hook is not None]
    assert bool(hooks) == (case == "layer_wise_moe")  # compact layer-wise buckets only
    assert all(isinstance(h, ParamSyncHook) for h in hooks)


def test_groups_satisfy_the_models_process_group() -> None:
    assert isinstance(SINGLE, ProcessGroup) and isinstance(SINGLE_RANK, ProcessGroup)
    assert not SINGLE_RANK.active and (SINGLE_RANK.size, SINGLE_RANK.rank) == (1, 0)
