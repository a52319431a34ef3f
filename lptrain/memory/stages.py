"""Pipeline stages in the memory plan: which stages are planned one by one, each stage's share
of the parameter count, and ``torch.distributed.pipelining``'s receive buffers on a stage."""

from __future__ import annotations

from typing import Any

import torch

from lptrain.config.schema import LPTrainConfig


def sampled_stages(pp: int) -> list[int]:
    """The pipeline stages planned one by one: all up to 8, else the first two, a middle one
    and the last two (the stages between are alike)."""
    if pp <= 8:
        return list(range(pp))
    return sorted({0, 1, pp // 2, pp - 2, pp - 1})


def whole_params(model: torch.nn.Module, stage: int, pp: int) -> int:
    """The stage's part of the whole model's parameter count (a tied head's copy of the
    embedding on the last stage counted on the first)."""
    from lptrain.model.tensor_parallel import whole_parameter_count

    n = whole_parameter_count(model)
    embedding = getattr(model, "embedding", None)
    if pp > 1 and stage > 0 and embedding is not None:
        n -= whole_parameter_count(embedding)
    return n


def pipeline_buffer_bytes(cfg: LPTrainConfig, lay: Any, stage: int, micro: int, act_bytes: int) -> int:
    """``torch.distributed.pipelining``'s receive buffers on ``stage``: one hidden-state
    tensor per micro-batch of the step for the forward input of every chunk but the first,
    and one for the output gradient of every chunk but the last (allocated once, kept)."""
    if lay.pp == 1:
        return 0
    m = cfg.model
    tp = max(1, m.tensor_model_parallel_size)
    seq = m.seq_length // max(1, m.context_parallel_size)  # (a CP rank's tokens)
    rows = seq // tp if m.sequence_parallel and tp > 1 else seq
    hidden = cfg.train.micro_batch_size * rows * m.hidden_size * act_bytes
    chunks = lay.rank_chunks(stage)
    n = sum(c != 0 for c in chunks) + sum(c != lay.chunks - 1 for c in chunks)
    return n * micro * hidden
