"""The grad norm's parts: one per logical matrix, whatever the expert layout.

A single grouped expert weight ``[E, out, in]`` must give the norm its ``E`` experts give as
discrete params; the engine-level check is ``test_single_grouped_equals_discrete_matrix``
(tests/dist/test_ddp_engine.py), which failed by 1 ulp in fp64 before :func:`norm_views`
and the ascending sum.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lptrain.optim.distributed import norm_views


def _piece(shape: tuple[int, ...], lo: int, hi: int, members: int | None) -> SimpleNamespace:
    param = torch.zeros(shape)
    if members is not None:
        param.num_grouped_members = members  # type: ignore[attr-defined]
    return SimpleNamespace(param=param, p_lo=lo, p_hi=hi)


def test_a_whole_grouped_weight_is_cut_into_its_members() -> None:
    g = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2)
    views = norm_views(_piece((4, 3, 2), 0, 24, 4), g)  # type: ignore[arg-type]
    assert [v.numel() for v in views] == [6, 6, 6, 6]
    assert all(torch.equal(v, g[i].reshape(-1)) for i, v in enumerate(views))


def test_a_shard_keeps_the_cuts_of_the_members_it_covers() -> None:
    g = torch.arange(10, 19, dtype=torch.float32)  # elements [10, 19) of a [4, 6] grouped param
    views = norm_views(_piece((4, 6), 10, 19, 4), g)  # type: ignore[arg-type]
    assert [v.numel() for v in views] == [2, 6, 1]  # [10, 12) | [12, 18) | [18, 19)
    assert torch.equal(torch.cat(views), g)


def test_plain_params_are_one_part() -> None:
    g = torch.randn(3, 5)
    (only,) = norm_views(_piece((3, 5), 0, 15, None), g)  # type: ignore[arg-type]
    assert only is g


def test_member_norms_summed_ascending_match_discrete_experts_in_any_order() -> None:
    """The sum the optimizer takes: squared per-matrix fp64 norms, sorted, then summed. The
    grouped cut (members 0..E-1) and discrete experts laid out in reverse give equal bits."""
    gen = torch.Generator().manual_seed(3)
    experts = [torch.randn(64, 32, generator=gen) * 10.0 ** i for i in range(-3, 3)]
    grouped = torch.stack(experts)

    def total(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(torch._foreach_norm(parts, 2, dtype=torch.float64)).square().sort().values.sum()

    cut = norm_views(_piece(tuple(grouped.shape), 0, grouped.numel(), len(experts)), grouped)  # type: ignore[arg-type]
    assert torch.equal(total(cut), total(experts[::-1]))
    # without the ascending sort (the sum in buffer order, as before) these bits differ
    def in_order(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(torch._foreach_norm(parts, 2, dtype=torch.float64)).square().sum()

    assert not torch.equal(in_order(cut), in_order(experts[::-1]))
