"""The size of one checkpoint: what the free-space check before a run compares with the disk.

Why not one rank's figure: a checkpoint holds every rank's fp32 masters and optimizer state,
and under tensor and pipeline parallelism a rank holds only its shards of its stage's layers
(a 70B model at TP 8 is 1/8 of its checkpoint on each rank; at TP 8 x PP 8, about 1/64). At
data-parallel size 1 the ranks of the world are the ``TP x PP`` model-parallel ranks, each
holding its whole shard (no distributed-optimizer split), so their sum is the checkpoint;
every tensor-parallel rank has the same shapes (:func:`lptrain.memory.plan.meta_model`), so a
stage's sum is ``TP`` times its first rank's. Parameters every TP rank replicates (the norms)
are counted ``TP`` times: an overestimate of well under 1%, on the safe side of a disk check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lptrain.config.schema import LPTrainConfig

if TYPE_CHECKING:
    from lptrain.memory.plan import MemoryEstimate

# what a checkpoint stores of each rank's memory (the planner's categories)
SAVED = ("masters", "optimizer_states")


def checkpoint_bytes(cfg: LPTrainConfig) -> Optional[int]:
    """Bytes of one checkpoint of a derived ``cfg``: every rank's fp32 masters and optimizer
    state at data-parallel size 1, summed over the tensor- and pipeline-parallel ranks; None
    when the planner cannot size this config at dp 1 (an expert layout that needs dp > 1)."""
    from lptrain.memory.plan import estimate_memory

    try:
        est = estimate_memory(cfg, 1)
    except Exception:  # e.g. an expert layout that needs dp > 1: no free-space check then
        return None
    return saved_bytes(cfg, est)


def saved_bytes(cfg: LPTrainConfig, est: MemoryEstimate) -> int:
    """The checkpoint's bytes from the planner's estimate of ``cfg`` at dp 1 (its ranks: one
    per pipeline stage it sized)."""
    from lptrain.memory.plan import parallel_dims

    dims = parallel_dims(cfg, 1)
    stage = {dims.coords(r.rank)["pp"]: sum(r.bytes.get(k, 0) for k in SAVED) for r in est.ranks}
    # stages the planner did not size one by one (beyond 8) are alike its middle one
    middle = stage.get(est.pp // 2, max(stage.values()))
    return int(est.tp * sum(stage.get(s, middle) for s in range(est.pp)))
