"""One step's gathered losses, combined per data-parallel replica.

The engine gathers one row ``(lm_loss, total_loss, non-finite code)`` per rank of a pipeline
stage (tensor parallelism innermost in the rank order, then context parallelism, then data
parallelism). The ranks of one replica hold different parts of its losses:

* tensor-parallel ranks hold the same LM loss (the vocab-parallel cross-entropy gives every
  rank the whole), and their auxiliary losses (the MoE losses of their sequence shards under
  sequence parallelism) add up;
* context-parallel ranks hold parts of both: each rank's LM loss is its tokens' cross-entropy
  sum divided by the replica's token count (:mod:`lptrain.model.context_parallel.loss`), and
  its auxiliary losses are its tokens' parts; the parts add up to the replica's loss, exactly
  the loss at CP 1 up to the order of the fp32 sums.

:func:`replica_losses` writes each replica's losses into every one of its rows, so a mean over
the rows is a mean over replicas.
"""

from __future__ import annotations

import torch


def replica_losses(rows: torch.Tensor, tp: int, cp: int) -> torch.Tensor:
    """``rows`` ([ranks of a stage, 3], fp64) with the loss columns replaced by each
    data-parallel replica's losses (see the module doc); unchanged without tensor or context
    parallelism. The non-finite codes (column 2) stay per rank."""
    if tp == 1 and cp == 1:
        return rows
    per = rows.view(-1, cp, tp, 3)  # [dp, cp, tp]
    lm = per[:, :, 0, 0].sum(dim=1)  # one TP rank's LM loss per CP rank, summed over CP
    aux = (per[:, :, :, 1] - per[:, :, :, 0]).sum(dim=(1, 2))
    per[:, :, :, 0] = lm[:, None, None]
    per[:, :, :, 1] = (lm + aux)[:, None, None]
    return rows
