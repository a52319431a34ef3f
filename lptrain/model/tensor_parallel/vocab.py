"""Vocab-parallel embedding, output head and cross-entropy (Megatron-LM's), and the norms
whose gradient is summed over the tensor-parallel ranks.

Every tensor-parallel rank holds ``V / TP`` consecutive rows of the embedding and the output
head, where ``V`` is the vocab padded to a multiple of ``make_vocab_size_divisible_by x TP``
(:func:`lptrain.catalog.parallel_dims.padded_vocab_size`). Rows past the single-rank padded
vocab start at zero and stay zero (no token selects them, their logits are masked, so their
gradient is exactly zero and weight decay keeps zero), which is why a checkpoint can hold the
single-rank shape and be resumed at any TP size.

* Embedding: each rank looks up the tokens of its rows (zeros elsewhere); the partial results
  are summed -- all-reduced, or reduce-scattered along the sequence under sequence
  parallelism. One rank holds each token's row, so the sum is that row exactly.
* Output head: the final hidden states are gathered (sequence parallelism) or replicated, and
  each rank computes the logits of its vocab rows.
* Cross-entropy on the vocab shards: the row max and the sum of exponentials and the target
  logit are reduced over the ranks (two collectives: MAX, then one SUM of both), columns past
  the real vocab are masked to -inf (the single-rank model cuts them off), and the backward is
  ``softmax - one_hot`` on the local columns, without any collective.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lptrain.catalog.parallel_dims import ShardLayout
from lptrain.model.gpt import OutputHead, TiedHead, TokenEmbedding, head_logits
from lptrain.model.norm import RMSNorm
from lptrain.precision.tensor_parallel import (
    TPShard,
    all_reduce_sum,
    copy_to_tp,
    gather_last_dim,
    gather_sequence,
    reduce_from_tp,
    reduce_grad,
    reduce_scatter_sequence,
    take_shard,
)

IGNORE = -100


def _vocab_shard(whole: torch.Tensor, rows: int, group: Any) -> torch.Tensor:
    """This rank's rows of ``whole`` ([V_single, h]) padded with zero rows to ``rows``."""
    padded = whole.new_zeros((rows, whole.shape[1]))
    padded[: whole.shape[0]] = whole
    return take_shard(padded, ShardLayout(dim=0), group.size, group.rank)


class VocabParallelEmbedding(TokenEmbedding):
    """This rank's ``[V / TP, h]`` rows of the token embedding (see the module doc)."""

    def __init__(self, whole: TokenEmbedding, padded_rows: int, group: Any, sequence_parallel: bool,
                 sequence_first: bool = False) -> None:
        per = padded_rows // group.size
        nn.Embedding.__init__(self, per, whole.embedding_dim, dtype=whole.weight.dtype,
                              device=whole.weight.device)
        with torch.no_grad():
            if not whole.weight.is_meta:
                self.weight.copy_(_vocab_shard(whole.weight.data, padded_rows, group))
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.sequence_first = sequence_first  # the shard stored sequence-first (lptrain.model.layout)
        self.vocab_start = group.rank * per
        self.weight.tp_shard = TPShard(ShardLayout(dim=0), group, canonical_size=whole.num_embeddings)
        self.weight.tensor_model_parallel = True

    def forward(self, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # type: ignore[override]
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight.to(dtype))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            if self.sequence_first:  # the one copy: the scatter then leaves each shard in place
                out = out.transpose(0, 1).contiguous().transpose(0, 1)
            return reduce_scatter_sequence(out, self.group)
        return reduce_from_tp(out, self.group)


def _head_input(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """The whole final hidden states, batch-first (the loss's token order): gathered along the
    sequence in the shards' storage (no copy when stored sequence-first), then one copy."""
    return gather_sequence(x, group).contiguous() if sequence_parallel else copy_to_tp(x, group)


class VocabParallelOutputHead(OutputHead):
    """This rank's ``[V / TP, h]`` rows of an untied output head: logits of its vocab columns."""

    def __init__(self, whole: OutputHead, padded_rows: int, group: Any, sequence_parallel: bool) -> None:
        nn.Linear.__init__(self, whole.in_features, padded_rows // group.size, bias=False,
                           dtype=whole.weight.dtype, device=whole.weight.device)
        with torch.no_grad():
            if not whole.weight.is_meta:
                self.weight.copy_(_vocab_shard(whole.weight.data, padded_rows, group))
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight.tp_shard = TPShard(ShardLayout(dim=0), group, canonical_size=whole.out_features)
        self.weight.tensor_model_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return head_logits(_head_input(x, self.group, self.sequence_parallel), self.weight)


class TiedVocabParallelHead(TiedHead):
    """The tied head on the embedding's vocab shard (see :class:`VocabParallelOutputHead`)."""

    def __init__(self, group: Any, sequence_parallel: bool) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return head_logits(_head_input(x, self.group, self.sequence_parallel), weight)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy of ``[N, V/TP]`` fp32 logit shards (see the module doc)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, start: int, vocab: int,  # type: ignore[override]
                group: Any, token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
        lg = logits.float()
        cols = lg.shape[1]
        pad_from = max(0, min(cols, vocab - start))  # local columns past the real vocab
        if pad_from < cols:
            lg = lg.clone()
            lg[:, pad_from:] = float("-inf")
        row_max = lg.max(dim=1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group.pg)
        exp = (lg - row_max[:, None]).exp_()
        valid = labels != IGNORE
        local = labels - start
        mine = valid & (local >= 0) & (local < cols)
        idx = local.masked_fill(~mine, 0)
        target = (lg.gather(1, idx[:, None]).squeeze(1) - row_max).masked_fill(~mine, 0.0)
        sums = all_reduce_sum(torch.stack([exp.sum(dim=1), target]), group, activation=False)
        per_token = sums[0].log() - sums[1]
        count = valid.sum() if token_count is None else token_count
        loss = per_token.masked_fill(~valid, 0.0).sum() / count
        ctx.save_for_backward(exp.div_(sums[0][:, None]), idx, mine, valid, count)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None, None, None]:  # type: ignore[override]
        softmax, idx, mine, valid, count = ctx.saved_tensors
        grad = softmax
        rows = mine.nonzero().squeeze(1)
        grad[rows, idx[rows]] -= 1.0
        grad.masked_fill_(~valid[:, None], 0.0)
        grad.mul_(g / count)
        return grad, None, None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """:class:`lptrain.model.gpt.LMLoss` on vocab-parallel logits (``[b, s, V/TP]``)."""

    def __init__(self, vocab_size: int, padded_rows: int, group: Any) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.group = group
        self.vocab_start = group.rank * (padded_rows // group.size)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole ``[b, s, vocab]`` logits (gathered over the ranks)."""
        return gather_last_dim(logits, self.group)[..., : self.vocab_size]

    def forward(self, logits: torch.Tensor, labels: torch.Tensor,
                token_count: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                      self.vocab_start, self.vocab_size, self.group, token_count)


class TPRMSNorm(RMSNorm):
    """An RMSNorm whose uses on this rank see part of the data -- a sequence shard (sequence
    parallelism), or this rank's heads (a q/k norm): its weight's gradient is summed over the
    tensor-parallel ranks, so every rank holds the whole gradient of the replicated weight."""

    def __init__(self, norm: RMSNorm, group: Any) -> None:
        nn.Module.__init__(self)
        self.eps = norm.eps
        self.weight = norm.weight  # the same parameter
        self.group = group

    def scale(self) -> torch.Tensor:
        return reduce_grad(self.weight, self.group)
