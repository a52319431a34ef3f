"""Rank arithmetic of :class:`lptrain.catalog.parallel_dims.ParallelDims` (no processes).

The layout is Megatron-LM's: dense ranks ``tp - cp - dp - pp`` (TP innermost), expert ranks
``etp - ep - edp - pp``. Every expectation below is written out by hand for small worlds, and
the partition properties (every rank in exactly one group of each kind, groups of the right
size, the dense and expert readings consistent) are checked on every world up to 16 ranks.
"""

from __future__ import annotations

import itertools

import pytest

from lptrain.catalog.parallel_dims import (
    EXPERT_ORDER,
    ParallelDims,
    ParallelSizeError,
    padded_vocab_size,
    shard_bounds,
    world_dims,
)


def test_tp_is_innermost_then_dp() -> None:
    d = ParallelDims(tp=2, dp=4)
    assert d.world_size == 8
    assert d.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.group_ranks("tp", "dp") == [list(range(8))]
    assert d.coords(5) == {"tp": 1, "cp": 0, "dp": 2, "pp": 0}
    assert d.rank_of(tp=1, dp=2) == 5
    assert all(d.rank_of(**{k: v for k, v in d.coords(r).items()}) == r for r in range(8))


def test_pipeline_is_outermost_and_context_between_tp_and_dp() -> None:
    d = ParallelDims(tp=2, cp=2, dp=2, pp=2)
    assert d.world_size == 16
    # rank = tp + 2 * (cp + 2 * (dp + 2 * pp))
    assert d.rank_of(tp=1, cp=1, dp=1, pp=1) == 15
    assert d.rank_of(pp=1) == 8
    assert d.group_ranks("pp") == [[r, r + 8] for r in range(8)]
    assert d.group_ranks("cp")[0] == [0, 2]
    assert d.group_ranks("dp")[0] == [0, 4]
    assert d.group_of(13, "tp") == [12, 13]


def test_expert_layout_reads_the_same_ranks_with_ep_innermost() -> None:
    # TP 2, DP 2, EP 2 (expert TP 1): EP groups are consecutive pairs (here the TP groups),
    # the expert-data-parallel group holds the same experts on every TP and DP rank.
    d = ParallelDims(tp=2, dp=2, ep=2)
    assert d.edp == 2
    assert d.group_ranks("ep", order=EXPERT_ORDER) == [[0, 1], [2, 3]]
    assert d.group_ranks("edp", order=EXPERT_ORDER) == [[0, 2], [1, 3]]
    d1 = ParallelDims(tp=2, dp=2, ep=1)
    assert d1.group_ranks("edp", order=EXPERT_ORDER) == [[0, 1, 2, 3]]


def test_optimizer_instances_split_dp_into_blocks_of_whole_tp_groups() -> None:
    d = ParallelDims(tp=2, dp=4)
    intra, inter = d.instance_groups(2)
    assert intra == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the expert reading (EP 2 = the TP pairs here): instance blocks of 4 consecutive ranks
    e = ParallelDims(tp=2, dp=4, ep=2)
    e_intra, e_inter = e.instance_groups(2, expert=True)
    assert e_intra == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert e_inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ParallelSizeError, match="3 optimizer instance"):
        d.instance_groups(3)


def _partitions(d: ParallelDims) -> list[list[list[int]]]:
    dense = [d.group_ranks(*dims) for n in range(1, 5) for dims in itertools.combinations(("tp", "cp", "dp", "pp"), n)]
    expert = [d.group_ranks(*dims, order=EXPERT_ORDER)
              for dims in (("ep",), ("edp",), ("ep", "edp"))]
    return dense + expert


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16])
def test_every_layout_partitions_the_world(world: int) -> None:
    for tp, cp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2)):
        if world % (tp * cp * pp):
            with pytest.raises(ParallelSizeError, match="must divide the world size"):
                ParallelDims.from_world(world, tp=tp, cp=cp, pp=pp)
            continue
        for ep in (1, 2, 4):
            if (world // pp) % ep:
                continue
            d = ParallelDims.from_world(world, tp=tp, cp=cp, pp=pp, ep=ep)
            assert d.world_size == world and d.dp == world // (tp * cp * pp)
            for groups in _partitions(d):
                flat = sorted(r for g in groups for r in g)
                assert flat == list(range(world))
                assert len({len(g) for g in groups}) == 1
            # a tensor-parallel group is TP consecutive ranks; its members differ only in tp
            for g in d.group_ranks("tp"):
                assert g == list(range(g[0], g[0] + tp))


def test_world_dims_from_dp_or_from_rank_count() -> None:
    assert world_dims(2, dp=4, world_size=None).world_size == 8  # --dp 4 at TP 2
    assert world_dims(2, dp=None, world_size=8).dp == 4  # 8 launched ranks at TP 2
    assert world_dims(1, dp=None, world_size=None).world_size == 1
    with pytest.raises(ParallelSizeError, match="2 x 1 x 1 = 2 must divide the world size 3"):
        world_dims(2, dp=None, world_size=3)


def test_shard_bounds_and_megatron_vocab_padding() -> None:
    assert [shard_bounds(12, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ParallelSizeError):
        shard_bounds(10, 3, 0)
    # vocab padded to a multiple of make_vocab_size_divisible_by * TP (Megatron-LM)
    assert padded_vocab_size(259, 1, 1) == 259
    assert padded_vocab_size(259, 1, 2) == 260
    assert padded_vocab_size(259, 128, 2) == 512
    assert padded_vocab_size(50257, 128, 8) == 51200


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ParallelSizeError, match="tp=0 must be >= 1"):
        ParallelDims(tp=0)
    with pytest.raises(ParallelSizeError, match="must divide the world size 4"):
        ParallelDims(tp=2, dp=2, ep=3)
    with pytest.raises(ValueError, match="rank 8 not in"):
        ParallelDims(tp=2, dp=4).coords(8)


def test_context_parallel_groups_chunks_and_hierarchical_levels() -> None:
    """CP ranks are TP apart; gradients reduce over CP x DP, amaxes over the stage; rank i of
    CP holds chunks i and 2CP-1-i; a2a+p2p's a2a groups are consecutive CP ranks, its rings
    the CP ranks a2a apart (Megatron's hierarchical CP); optimizer instances split CP x DP."""
    from lptrain.catalog.parallel_dims import (
        AMAX_REDUCTION_DIMS,
        GRAD_REDUCTION_DIMS,
        cp_chunk_ids,
        cp_token_ranges,
    )

    d = ParallelDims(tp=2, cp=2, dp=2)
    assert d.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.group_ranks(*GRAD_REDUCTION_DIMS) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.group_ranks(*AMAX_REDUCTION_DIMS) == [list(range(8))]
    assert d.group_ranks("tp", "cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [cp_chunk_ids(4, i) for i in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert cp_chunk_ids(1, 0) == (0,)
    assert cp_token_ranges(16, 2, 1) == [(4, 8), (8, 12)] and cp_token_ranges(16, 2, 0) == [(0, 4), (12, 16)]
    with pytest.raises(ParallelSizeError):
        cp_token_ranges(18, 2, 0)
    h = ParallelDims(cp=4, dp=2)
    assert h.cp_levels([2, 2]) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
    with pytest.raises(ParallelSizeError):
        h.cp_levels([2, 3])
    intra, inter = h.instance_groups(2)  # CP x DP = 8 ranks, 2 instances of 4 consecutive
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]] and inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert world_dims(2, None, 16, cp=2).dp == 4
