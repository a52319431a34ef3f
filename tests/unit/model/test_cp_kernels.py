"""The context-parallel attention math in one process: the blocks a CP rank computes, merged
by online softmax, are the whole causal attention of its chunks' queries; their backward
(from the final output and log-sum-exp) is the whole attention's gradient; and the rotary
tables of a CP rank are the whole sequence's rows at its chunks' true positions.

The ring runs here as a loop over the source ranks (what the P2P steps hand over), so the
math is checked apart from the communication (tests/dist/test_context_parallel.py runs the
real collectives). Tolerance: fp32 attention in blocks against SDPA's own blocking, 2e-6 of
the largest value (measured ~3e-7).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lptrain.catalog.parallel_dims import cp_chunk_ids, cp_token_ranges
from lptrain.model.context_parallel import ContextParallelRotary
from lptrain.model.context_parallel.kernels import (
    block_backward,
    block_forward,
    expand_kv,
    fold_kv,
    merge,
)
from lptrain.model.rope import RotaryEmbedding

TOL = 2e-6


def _inputs(s: int, heads: int = 4, groups: int = 2, d: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, s, d, generator=g)
    k = torch.randn(2, groups, s, d, generator=g)
    v = torch.randn(2, groups, s, d, generator=g)
    do = torch.randn(2, heads, s, d, generator=g)
    return q, k, v, do


def _rows(ids: tuple[int, ...], c: int) -> torch.Tensor:
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in ids])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), is_causal=True)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOL * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_blocks_are_the_whole_causal_attention(cp: int) -> None:
    """Each CP rank's queries (chunks i and 2CP-1-i) against every rank's key/value block in
    ring order: the merged output and the summed gradients equal the whole attention's."""
    s, c = 64, 64 // (2 * cp)
    q, k, v, do = _inputs(s)
    o_ref, dq_ref, dk_ref, dv_ref = _reference(q, k, v, do)
    heads, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for r in range(cp):
        mine = cp_chunk_ids(cp, r)
        qr, dor = q[:, :, _rows(mine, c)], do[:, :, _rows(mine, c)]
        out = lse = None
        for step in range(cp):
            src = cp_chunk_ids(cp, (r - step) % cp)
            kr, vr = (expand_kv(t[:, :, _rows(src, c)], heads) for t in (k, v))
            o, m = block_forward(qr, kr, vr, mine, src, c, scale)
            out, lse = (o, m) if out is None else merge(out, lse, o, m)
        assert _close(out, o_ref[:, :, _rows(mine, c)]), r
        delta = (dor * out).sum(-1)
        dq = torch.zeros_like(qr)
        for step in range(cp):
            src = cp_chunk_ids(cp, (r - step) % cp)
            kr, vr = (expand_kv(t[:, :, _rows(src, c)], heads) for t in (k, v))
            a, b, e = block_backward(qr, kr, vr, dor, lse, delta, mine, src, c, scale)
            dq += a
            dk[:, :, _rows(src, c)] += fold_kv(b, k.shape[1])
            dv[:, :, _rows(src, c)] += fold_kv(e, v.shape[1])
        assert _close(dq, dq_ref[:, :, _rows(mine, c)]), r
    assert _close(dk, dk_ref) and _close(dv, dv_ref)


def test_blocks_that_show_nothing_leave_the_running_result_alone() -> None:
    """A key block entirely after a query chunk: log-sum-exp -inf, zero weight in the merge."""
    q, k, v, _ = _inputs(16, heads=2, groups=2)
    o, m = block_forward(q[:, :, :4], k[:, :, 8:12], v[:, :, 8:12], (0,), (2,), 4, 0.5)
    assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(m).all())
    base_o, base_m = block_forward(q[:, :, :4], k[:, :, :4], v[:, :, :4], (0,), (0,), 4, 0.5)
    got_o, got_m = merge(base_o, base_m, o, m)
    assert torch.equal(got_o, base_o) and torch.equal(got_m, base_m)


@pytest.mark.parametrize(("cp", "rank"), [(2, 0), (2, 1), (4, 2)])
def test_cp_rotary_rows_are_the_chunks_true_positions(cp: int, rank: int) -> None:
    """RoPE of a CP rank: rows [i c, (i+1) c) and [(2CP-1-i) c, (2CP-i) c) of the whole
    sequence's tables, not rows 0 .. s/CP - 1."""
    seq = 32
    rope = RotaryEmbedding(8, 10000.0, seq)
    cos, sin = rope(seq)
    got_cos, got_sin = ContextParallelRotary(rope, cp, rank)(seq // cp)
    rows = torch.cat([torch.arange(lo, hi) for lo, hi in cp_token_ranges(seq, cp, rank)])
    assert torch.equal(got_cos, cos[rows]) and torch.equal(got_sin, sin[rows])
    if rank:
        assert not torch.equal(got_cos, cos[: seq // cp])
