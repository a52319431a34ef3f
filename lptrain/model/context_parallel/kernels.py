"""Causal attention between chunks of a sequence, with its log-sum-exp, forward and backward.

A context-parallel rank holds some of the ``2 x CP`` equal chunks of each sequence
(:func:`lptrain.catalog.parallel_dims.cp_chunk_ids`) and sees the keys and values of other
chunks one block at a time (ring attention) or all at once. Causality between chunks is a
matter of their indices: query chunk ``i`` sees key chunk ``j < i`` whole, chunk ``i`` itself
under the causal (lower-triangular) mask, and nothing of ``j > i``. So each block is computed
only where something is visible -- the load balancing's point: every rank computes the same
number of (query, key) pairs.

:func:`block_forward` returns the block's output and the log-sum-exp of its scores per query
(``-inf`` where the block shows the query nothing); :func:`merge` folds a block into the
running result by online softmax (FlashAttention's rescaling). :func:`block_backward` is
FlashAttention-2's backward for one block, given the *final* output and log-sum-exp: the
probabilities ``exp(s - lse)`` of every block are then exactly the whole softmax's, so the
blocks' gradients add up to the whole attention's.

Plain PyTorch in fp32 (scores materialised per block, never kept for the backward: the ring
keeps only q, k, v, the output and the log-sum-exp). ``q`` is ``[b, heads, n x c, d]``; ``k``
and ``v`` have their kv heads (grouped-query attention), expanded here to the query heads and
their gradients folded back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads ``[b, g, s, d]`` repeated to ``heads`` query heads (head ``h`` reads group
    ``h // (heads / g)``, as :class:`lptrain.model.attention.CausalAttention`)."""
    per = heads // x.shape[1]
    return x.repeat_interleave(per, dim=1) if per > 1 else x


def fold_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_kv`'s output summed back onto the ``groups`` kv heads."""
    b, h, s, d = dx.shape
    per = h // groups
    return dx.view(b, groups, per, s, d).sum(dim=2) if per > 1 else dx


def _visible(qi: int, kv_ids: Sequence[int]) -> list[tuple[int, bool]]:
    """``(position of the key chunk, whether it is the diagonal one)`` of every key chunk
    query chunk ``qi`` sees."""
    return [(j, kj == qi) for j, kj in enumerate(kv_ids) if kj <= qi]


def _keys(x: torch.Tensor, cols: list[tuple[int, bool]], c: int) -> torch.Tensor:
    return torch.cat([x[:, :, j * c:(j + 1) * c] for j, _ in cols], dim=2) if len(cols) > 1 else \
        x[:, :, cols[0][0] * c:(cols[0][0] + 1) * c]


def _scores(qa: torch.Tensor, kk: torch.Tensor, cols: list[tuple[int, bool]], c: int,
            scale: float) -> torch.Tensor:
    s = torch.matmul(qa, kk.transpose(-1, -2)) * scale
    for pos, (_, diag) in enumerate(cols):
        if diag:
            upper = torch.ones(c, c, dtype=torch.bool, device=s.device).triu_(1)
            s[..., pos * c:(pos + 1) * c].masked_fill_(upper, NEG_INF)
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_ids: Sequence[int],
                  kv_ids: Sequence[int], c: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the queries of chunks ``q_ids`` over the keys of chunks ``kv_ids``
    (fp32; ``k``, ``v`` already expanded to the query heads)."""
    out = q.new_zeros(q.shape)
    lse = q.new_full(q.shape[:-1], NEG_INF)
    for a, qi in enumerate(q_ids):
        cols = _visible(qi, kv_ids)
        if not cols:
            continue
        rows = slice(a * c, (a + 1) * c)
        s = _scores(q[:, :, rows], _keys(k, cols, c), cols, c, scale)
        m = torch.logsumexp(s, dim=-1)
        out[:, :, rows] = torch.matmul(torch.exp(s - m[..., None]), _keys(v, cols, c))
        lse[:, :, rows] = m
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running ``(out, lse)`` with one more block folded in (online softmax). ``lse`` is
    finite (the running result starts with the rank's own chunks: every query sees its own
    token); a block's ``-inf`` rows get weight zero."""
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None],
            new)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, q_ids: Sequence[int],
                   kv_ids: Sequence[int], c: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block (fp32, ``k``/``v``/``dk``/``dv`` at the query heads)
    from the final ``lse`` and ``delta = rowsum(dout * out)`` of the whole attention."""
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for a, qi in enumerate(q_ids):
        cols = _visible(qi, kv_ids)
        if not cols:
            continue
        rows = slice(a * c, (a + 1) * c)
        qa, da = q[:, :, rows], dout[:, :, rows]
        kk, vv = _keys(k, cols, c), _keys(v, cols, c)
        p = torch.exp(_scores(qa, kk, cols, c, scale) - lse[:, :, rows, None])
        dvv = torch.matmul(p.transpose(-1, -2), da)
        ds = p * (torch.matmul(da, vv.transpose(-1, -2)) - delta[:, :, rows, None])
        dq[:, :, rows] += torch.matmul(ds, kk) * scale
        dkk = torch.matmul(ds.transpose(-1, -2), qa) * scale
        for pos, (j, _) in enumerate(cols):
            dk[:, :, j * c:(j + 1) * c] += dkk[:, :, pos * c:(pos + 1) * c]
            dv[:, :, j * c:(j + 1) * c] += dvv[:, :, pos * c:(pos + 1) * c]
    return dq, dk, dv
