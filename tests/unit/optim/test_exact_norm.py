"""The gradient norm's sharded part: a sum of squares that depends on the elements only.

Pipeline stages change where the data-parallel shards cut the params (each stage has its own,
smaller buffers); a per-piece norm summed in any order then differs from the unpipelined one
in its last bits -- measured 1 ulp of the fp64 norm at PP 2 x DP 2 with the distributed
optimizer before this sum (tests/dist/test_pipeline_parallel.py). Here the result is the
exactly rounded sum for any cut and any order.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from lptrain.optim.exact_norm import world_square_sum

CPU = torch.device("cpu")


def _values(seed: int, n: int = 4000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)).float()


def test_equals_the_exactly_rounded_sum_for_any_cut_and_order() -> None:
    for seed in range(5):
        x = _values(seed)
        exact = float(sum(Fraction(float(v)) ** 2 for v in x.tolist()))
        perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))
        shuffled = x[perm]
        cuts = [shuffled[:17], shuffled[17:1234], shuffled[1234:]]
        assert world_square_sum([x], CPU) == exact
        assert world_square_sum(cuts, CPU) == exact


def test_plain_cuts_of_a_sum_differ_where_this_one_does_not() -> None:
    """Why it is needed: norms of pieces, squared and summed, depend on the cut."""
    x = _values(7).double()

    def pieces(k: int) -> torch.Tensor:
        return torch.stack([x[:k].norm(), x[k:].norm()]).square().sum()

    moved = [k for k in range(1001, 1100) if not torch.equal(pieces(k), pieces(1000))]
    assert moved  # (the per-piece sum moves with the cut)
    k = moved[0]
    assert world_square_sum([x[:1000].float(), x[1000:].float()], CPU) == \
        world_square_sum([x[:k].float(), x[k:].float()], CPU)


def test_bf16_inputs_zero_and_non_finite() -> None:
    x = _values(3).bfloat16()
    assert world_square_sum([x], CPU) == float(sum(Fraction(float(v)) ** 2 for v in x.float().tolist()))
    assert world_square_sum([torch.zeros(5)], CPU) == 0.0
    assert world_square_sum([], CPU) == 0.0
    assert math.isnan(world_square_sum([torch.tensor([1.0, float("nan"), float("inf")])], CPU))
    assert world_square_sum([torch.tensor([1.0, float("-inf")])], CPU) == math.inf
