"""Pipeline splits and schedules without running a pipeline: Megatron-LM's uneven keys and
layout grammar (the layers per chunk, against Megatron's own offset formulas worked by hand),
the V placement, torch's schedule orders (every action once; each chunk's W steps in
micro-batch order, which the bitwise claim of the zero-bubble schedules rests on), the
simulated bubble against the analytic formulas, and the memory planner on an uneven split."""

from __future__ import annotations

from collections import Counter

import pytest

from lptrain.catalog.pipeline import PipelineLayout, bubble_fraction, peak_in_flight, simulate
from lptrain.catalog.pipeline_split import SplitError, SplitKeys, chunk_sizes, parse_layout
from lptrain.distributed.pipeline_orders import held_outputs, schedule_order


def test_first_and_last_stage_counts_as_megatron_splits_them() -> None:
    # pp 4: first 1, last 1, the 6 others over the 2 middle ranks
    assert chunk_sizes(SplitKeys(8, pp=4, first=1, last=1)) == (1, 3, 3, 1)
    # only the first set: the last rank is a middle one
    assert chunk_sizes(SplitKeys(7, pp=4, first=1)) == (1, 2, 2, 2)
    # interleaved: each rank's layers cut into VPP chunks, chunk s = v * PP + r in model order.
    # Megatron's offset of pp rank 1, vp stage 1: 1 * (1 + 6 + 1) + 1 + 0 = 9 = sum(sizes[:5])
    sizes = chunk_sizes(SplitKeys(16, pp=4, vpp=2, first=2, last=2))
    assert sizes == (1, 3, 3, 1, 1, 3, 3, 1) and sum(sizes[:5]) == 9


def test_embedding_and_loss_counted_as_layers() -> None:
    assert chunk_sizes(SplitKeys(6, pp=4, embedding=True, loss=True)) == (1, 2, 2, 1)
    assert chunk_sizes(SplitKeys(7, pp=4, loss=True)) == (2, 2, 2, 1)
    # 126 layers of Llama-3.1-405B over 8 stages, as Megatron-Bridge splits them
    assert chunk_sizes(SplitKeys(126, pp=8, embedding=True, loss=True)) == (15, *[16] * 6, 15)
    # interleaved: the first and the last *chunk* lose the layer
    assert chunk_sizes(SplitKeys(6, pp=2, vpp=2, embedding=True, loss=True)) == (1, 2, 2, 1)


def test_layout_grammar_as_megatron_parses_it() -> None:
    assert parse_layout("Ettt|(tt|)*2,L") == ["Ettt", "tt", "tt", "L"]  # (Megatron's own example)
    assert parse_layout("E|(tt|)*2,t*3L") == ["E", "tt", "tt", "tttL"]
    assert chunk_sizes(SplitKeys(6, pp=2, vpp=2, layout="Et|(tt|)*2,tL")) == (1, 2, 2, 1)
    # an embedding-only and a loss-only chunk (Megatron's standalone stages)
    assert chunk_sizes(SplitKeys(2, pp=2, vpp=2, layout="E|t|t|L", v_shape=True)) == (0, 1, 1, 0)


@pytest.mark.parametrize(("keys", "rule"), [
    (SplitKeys(3, pp=2), "PP-LAYERS-DIVIDE"),
    (SplitKeys(4, pp=2, first=1, embedding=True), "PP-UNEVEN-EXCLUSIVE"),
    (SplitKeys(4, pp=2, first=0), "PP-UNEVEN-POSITIVE"),
    (SplitKeys(6, pp=2, vpp=2, first=3), "PP-UNEVEN-VIRTUAL"),
    (SplitKeys(3, pp=2, first=1, last=1), "PP-UNEVEN-MIDDLE"),
    (SplitKeys(9, pp=4, first=1, last=1), "PP-UNEVEN-MIDDLE"),
    (SplitKeys(4, pp=2, vpp=2, first=2, v_shape=True), "PP-UNEVEN-V-SHAPE"),
    (SplitKeys(4, pp=2, embedding=True), "PP-ACCOUNT-DIVIDES"),
    (SplitKeys(2, pp=2, layout="Et|tL", loss=True), "PP-LAYOUT-EXCLUSIVE"),
    (SplitKeys(2, pp=2, layout="Et|tmL"), "PP-LAYOUT-GRAMMAR"),
    (SplitKeys(2, pp=2, layout="Et|t|L"), "PP-LAYOUT-STAGES"),
    (SplitKeys(2, pp=2, vpp=2, layout="Et|tL"), "PP-LAYOUT-STAGES"),
    (SplitKeys(2, pp=2, layout="tE|tL"), "PP-LAYOUT-CONTENTS"),
    (SplitKeys(3, pp=2, layout="Et|tL"), "PP-LAYOUT-CONTENTS"),
    (SplitKeys(2, pp=2, vpp=2, layout="Et||tL|"), "PP-LAYOUT-CONTENTS"),
])
def test_refused_splits_name_their_rule(keys: SplitKeys, rule: str) -> None:
    with pytest.raises(SplitError) as e:
        chunk_sizes(keys)
    assert e.value.rule == rule, e.value.message


def test_v_placement_puts_the_first_and_last_chunk_on_rank_0() -> None:
    lay = PipelineLayout.of(SplitKeys(8, pp=4, vpp=2, v_shape=True))
    assert [lay.rank_chunks(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert lay.holds_embedding(0) and lay.holds_head(0) and lay.loss_rank == 0
    loop = PipelineLayout.of(SplitKeys(8, pp=4, vpp=2))
    assert loop.rank_chunks(0) == [0, 4] and loop.loss_rank == 3
    uneven = PipelineLayout.of(SplitKeys(2, pp=2, vpp=2, layout="E|t|t|L", v_shape=True))
    assert uneven.rank_layers(0) == [] and uneven.rank_layers(1) == [0, 1]
    assert uneven.describe().splitlines() == ["pipeline rank 0: chunk 0: embedding; chunk 3: loss",
                                              "pipeline rank 1: chunk 1: layer 0; chunk 2: layer 1"]


ORDERS = [("1f1b", 1, 4, 2), ("1f1b", 1, 4, 8), ("interleaved_1f1b", 2, 2, 4), ("interleaved_zero_bubble", 1, 4, 8),
          ("interleaved_zero_bubble", 2, 2, 4), ("zbv_zero_bubble", 2, 2, 2), ("zbv_zero_bubble", 2, 4, 8),
          ("dualpipev", 2, 2, 4), ("dualpipev", 2, 4, 8)]


@pytest.mark.parametrize(("schedule", "vpp", "pp", "m"), ORDERS)
def test_schedule_orders_run_everything_once_and_w_in_micro_batch_order(schedule: str, vpp: int, pp: int,
                                                                         m: int) -> None:
    """torch's order (read off the schedule class itself): every forward and every backward
    (whole, or I + W) of every chunk and micro-batch exactly once, and each chunk's
    gradient-accumulating steps (B or W) in micro-batch order -- so each ``main_grad`` sums
    the same terms in the same order as 1F1B (the runner refuses a W out of order)."""
    order = schedule_order(schedule, pp, vpp, m)
    count = Counter(a for acts in order.values() for a in acts)
    assert set(count.values()) == {1}
    for c in range(pp * vpp):
        assert {mb for (cc, k, mb) in count if cc == c and k == "F"} == set(range(m))
        assert {mb for (cc, k, mb) in count if cc == c and k in ("B", "W")} == set(range(m))
        for acts in order.values():
            accumulating = [mb for (cc, k, mb) in acts if cc == c and k in ("B", "W")]
            assert accumulating == sorted(accumulating)


def _equal_costs(chunks: int, vpp: int) -> dict:
    return {(c, k): (2.0 if k == "B" else 1.0) / vpp for c in range(chunks) for k in "FBIW"}


@pytest.mark.parametrize(("schedule", "vpp", "pp", "m"), [("1f1b", 1, 2, 4), ("1f1b", 1, 4, 8),
                                                          ("interleaved_1f1b", 2, 2, 8), ("interleaved_1f1b", 2, 4, 8)])
def test_simulated_bubble_is_the_analytic_one_for_equal_stages(schedule: str, vpp: int, pp: int, m: int) -> None:
    sim = simulate(schedule_order(schedule, pp, vpp, m), _equal_costs(pp * vpp, vpp), pp * vpp)
    assert sim.bubble == pytest.approx(bubble_fraction(pp, m, vpp))


def test_p2p_transfers_occupy_their_sender() -> None:
    """A transfer that occupies its sender (``send``) is idle time on every hop: interleaving
    crosses ranks at every chunk boundary, so at PP 2 it pays 3 hops to 1F1B's 1 per direction
    -- the per-chunk P2P count that makes interleaved 1F1B's bubble on a CPU transport."""
    one = simulate(schedule_order("1f1b", 2, 1, 8), _equal_costs(2, 1), 2, send=0.1)
    inter = simulate(schedule_order("interleaved_1f1b", 2, 2, 8), _equal_costs(4, 2), 4, send=0.1)
    assert one.bubble > bubble_fraction(2, 8) and inter.bubble > bubble_fraction(2, 8, 2)
    assert inter.step - 25.5 > 2 * (one.step - 27.0)  # (25.5, 27: the steps without transfers)


def test_zero_bubble_schedules_fill_the_bubble_with_w() -> None:
    """With F = I = W the zero-bubble orders idle less than 1F1B's (p - 1) / (m + p - 1); a
    slower last stage (the loss) is what a split that unloads it wins back."""
    one = simulate(schedule_order("1f1b", 4, 1, 8), _equal_costs(4, 1), 4).bubble
    for schedule, vpp in (("interleaved_zero_bubble", 1), ("zbv_zero_bubble", 2), ("dualpipev", 2)):
        zb = simulate(schedule_order(schedule, 4, vpp, 8), _equal_costs(4 * vpp, vpp), 4 * vpp).bubble
        assert zb < 0.6 * one, (schedule, zb, one)
    heavy = {**_equal_costs(4, 1), **{(3, k): 1.5 * v for (c, k), v in _equal_costs(4, 1).items() if c == 3}}
    assert simulate(schedule_order("1f1b", 4, 1, 8), heavy, 4).step > simulate(
        schedule_order("1f1b", 4, 1, 8), _equal_costs(4, 1), 4).step


@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 1.0), (1.0, 1.2, 0.6), (1.0, 1.5, 0.5)])
@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_zero_bubble_idles_as_the_zb_paper_counts(pp: int, f: float, i: float, w: float) -> None:
    """torch's interleaved zero bubble at one chunk a rank is the ZB paper's ZB-H1 (its "ZB1P"),
    whose idle time per rank is ``(p - 1)(F + I - W)`` (1F1B's ``(p - 1)(F + I + W)``): the
    simulated order at I != W (what the bench measures: I is not B / 2) gives exactly that."""
    m = 8
    cost = {(c, k): {"F": f, "I": i, "W": w, "B": i + w}[k] for c in range(pp) for k in "FBIW"}
    sim = simulate(schedule_order("interleaved_zero_bubble", pp, 1, m), cost, pp)
    assert sim.step - m * (f + i + w) == pytest.approx((pp - 1) * (f + i - w))
    one = simulate(schedule_order("1f1b", pp, 1, m), cost, pp)
    assert one.step - m * (f + i + w) == pytest.approx((pp - 1) * (f + i + w))


def test_in_flight_from_the_order_matches_megatrons_1f1b_count() -> None:
    lay = PipelineLayout(8, pp=4)
    order = schedule_order("1f1b", 4, 1, 8)
    assert [peak_in_flight(order[r], {r: 2}) for r in range(4)] == [lay.in_flight(r, 8) for r in range(4)]
    # ZB-H1 holds no more than 1F1B on the first stage (its W steps trail by at most PP - r)
    zb = schedule_order("interleaved_zero_bubble", 4, 1, 8)
    assert peak_in_flight(zb[0], {0: 2}) == 4.0


def test_memory_plan_follows_an_uneven_split() -> None:
    """The planner builds each stage from its own part of the split: moving layers off the
    last stage (the one with the head) moves its parameters to the others."""
    from lptrain.config import World, compose, derive
    from lptrain.memory.plan import estimate_memory

    base = ["data.builtin_max_mb=1", "logging.progress=false", "train.micro_batch_size=2",
            "train.global_batch_size=8", "model.seq_length=32", "model.num_layers=4",
            "model.pipeline_model_parallel_size=2"]
    even = estimate_memory(derive(compose("tiny_cpu.yaml", base), World(dp=1)), dp=1)
    uneven = estimate_memory(derive(compose("tiny_cpu.yaml", [*base, "model.pipeline_model_parallel_layout=Ettt|tL"]),
                                    World(dp=1)), dp=1)
    assert even.params == uneven.params  # (the same model, cut elsewhere)
    even_w, uneven_w = ({r.rank: r.bytes["weights"] for r in e.ranks} for e in (even, uneven))
    assert uneven_w[0] > even_w[0] and uneven_w[1] < even_w[1]


def _dualpipev_plan(pp: int, m: int) -> dict:
    """torch's DualPipeV order with its communication, as its runtime lowers it."""
    from torch.distributed.pipelining.schedules import _add_send_recv

    from lptrain.distributed.pipeline_orders import _torch_order

    order = _torch_order("dualpipev", pp, 2, m)
    return _add_send_recv({r: [a for a in acts if a is not None] for r, acts in order.items()},
                          lambda s: s if s < pp else 2 * pp - 1 - s, 2 * pp)


def test_a_paired_forward_sends_its_output_before_the_paired_backward() -> None:
    """DualPipeV pairs a forward with a backward; torch's runtime runs the two in turn but
    posts both halves' sends after the pair, so the forward's output waits a whole backward
    (the next stage with it). lptrain's plan sends it right after the forward: the same
    compute order and the same sends to each peer in the same order (so the same numbers)."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    from lptrain.distributed.pipeline_orders import send_after_each_half

    plan = _dualpipev_plan(2, 8)
    fixed = send_after_each_half(plan)
    sends = (T.SEND_F, T.SEND_B)

    def leaves(acts: list) -> list:
        return [s for a in acts for s in (a.sub_actions or (a,))]

    late = 0
    for rank, acts in plan.items():
        for is_send in (False, True):
            assert ([str(a) for a in leaves(acts) if (a.computation_type in sends) == is_send]
                    == [str(a) for a in fixed[rank] if (a.computation_type in sends) == is_send])
        assert not any(a.sub_actions for a in fixed[rank])
        for i, a in enumerate(fixed[rank]):
            if a.computation_type == T.SEND_F:
                assert str(fixed[rank][i - 1]) == f"{a.stage_index}F{a.microbatch_index}", (rank, i)
        # torch's own plan: a paired forward's send comes after the pair, its backward run
        for i, a in enumerate(acts):
            if a.sub_actions and a.sub_actions[0].computation_type == T.FORWARD:
                f = a.sub_actions[0]
                late += any(b.computation_type == T.SEND_F and (b.stage_index, b.microbatch_index)
                            == (f.stage_index, f.microbatch_index) for b in acts[i + 1:])
    assert late > 0
    # in the analytic model: torch's held sends idle more than lptrain's
    order = schedule_order("dualpipev", 2, 2, 8)
    cost = _equal_costs(4, 2)
    held = held_outputs("dualpipev", 2, 2, 8)
    assert held and not held_outputs("zbv_zero_bubble", 2, 2, 8)
    assert simulate(order, cost, 4, held=held).bubble > simulate(order, cost, 4).bubble
