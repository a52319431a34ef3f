"""Which ``torch.distributed.pipelining`` schedule each ``model.pipeline_schedule`` runs, and
that schedule's own per-rank order of actions, read without building its stages.

The order (:func:`schedule_order`) is what torch's runtime executes: every rank's list of
``(chunk, kind, micro-batch)`` -- ``F`` forward, ``B`` a whole backward, ``I`` and ``W`` the
input- and weight-gradient parts of a split one. It is computed by the schedule class's own
method on a bare instance (the order depends on the sizes alone), so the memory planner
(:func:`lptrain.catalog.pipeline.peak_in_flight`), the bench's analytic bubble
(:func:`lptrain.catalog.pipeline.simulate`) and the tests read the order that runs, not a copy
of it.
"""

from __future__ import annotations

import functools
from typing import Any

from lptrain.catalog.pipeline import Action

# model.pipeline_schedule -> torch's class (GPipe: 1F1B with fewer micro-batches than stages)
SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def schedule_class(schedule: str, pp: int, micro_batches: int) -> Any:
    """torch's schedule class for ``schedule`` (``ScheduleGPipe`` for 1F1B with fewer
    micro-batches than stages, which ``Schedule1F1B`` refuses: the same order)."""
    import torch.distributed.pipelining as pipelining

    if schedule == "1f1b" and micro_batches < pp:
        return pipelining.ScheduleGPipe
    return getattr(pipelining, SCHEDULE_CLASSES[schedule])


@functools.cache
def forward_only(cls: Any) -> Any:
    """``cls`` with its order cut to the forwards (and their P2P), for an evaluation. torch's
    V schedules run their I actions even forward-only (``eval``), and the hand-over of an I's
    input gradient between the two chunks of a rank then fails (``can't steal_bwd_input if
    this stage doesn't have backward``): without them the same forwards run in the same order.
    (The full order is built and validated first: torch refuses an order without backwards.)"""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    keep = (T.FORWARD, T.SEND_F, T.RECV_F)

    class ForwardOnly(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.pipeline_order_with_comms = {
                r: [a for a in acts if a.computation_type in keep]
                for r, acts in self.pipeline_order_with_comms.items()}

    ForwardOnly.__name__ = ForwardOnly.__qualname__ = f"{cls.__name__}ForwardOnly"
    return ForwardOnly


def _flatten(actions: list[Any]) -> list[Action]:
    out: list[Action] = []
    for a in actions:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        for s in subs if subs else (a,):
            kind = str(s.computation_type.value)
            if kind in ("F", "B", "I", "W"):
                out.append((int(s.stage_index), kind, int(s.microbatch_index)))
    return out


def _single_stage_order(rank: int, pp: int, m: int) -> list[Action]:
    """The order ``Schedule1F1B._step_microbatches`` runs (``min(m, PP - r)`` warm-up forwards,
    then a backward and a forward in turn, then the remaining backwards; with ``m < PP`` every
    forward, then every backward: ``ScheduleGPipe``'s order). Written out here: the schedules'
    ``_get_pipeline_order`` (a visualisation aid) numbers the later ranks' forwards from 1."""
    warm = min(m, pp - rank)
    out: list[Action] = [(rank, "F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [(rank, "B", i), (rank, "F", warm + i)]
    return out + [(rank, "B", i) for i in range(m - warm, m)]


def schedule_order(schedule: str, pp: int, vpp: int, micro_batches: int) -> dict[int, list[Action]]:
    """Every pipeline rank's actions in the order torch's ``schedule`` runs them (module doc)."""
    return {r: _flatten(acts) for r, acts in _torch_order(schedule, pp, vpp, micro_batches).items()}


def held_outputs(schedule: str, pp: int, vpp: int, micro_batches: int) -> dict[Action, Action]:
    """The actions whose output torch's runtime sends only after a later one: in a paired
    forward and backward (DualPipeV's ``OVERLAP_F_B``) the transfers of both run after the pair
    (``_add_send_recv`` places the sends after the whole action), so the forward's output leaves
    a backward later. Maps each such action to the one whose end releases it."""
    out: dict[Action, Action] = {}
    for acts in _torch_order(schedule, pp, vpp, micro_batches).values():
        for a in acts:
            subs = _flatten([a]) if a is not None and getattr(a, "sub_actions", None) else []
            for s in subs[:-1]:
                out[s] = subs[-1]
    return out


def _torch_order(schedule: str, pp: int, vpp: int, micro_batches: int) -> dict[int, list[Any]]:
    """torch's per-rank compute actions (its ``_Action`` objects; paired ones unflattened)."""
    cls = schedule_class(schedule, pp, micro_batches)
    s = object.__new__(cls)
    s._n_microbatches = micro_batches
    s._num_stages = pp * vpp
    s.pp_group_size = pp
    s.num_stages = pp * vpp
    s.n_local_stages = vpp
    if cls.__name__ in ("Schedule1F1B", "ScheduleGPipe"):
        from torch.distributed.pipelining.schedules import _Action

        kinds = {"F": "FORWARD", "B": "FULL_BACKWARD"}
        from torch.distributed.pipelining.schedules import _ComputationType as T

        return {r: [_Action(c, getattr(T, kinds[k]), mb) for c, k, mb in _single_stage_order(r, pp, micro_batches)]
                for r in range(pp)}
    rounds = max(1, micro_batches // pp)
    s.number_of_rounds = rounds
    s.microbatches_per_round = micro_batches // rounds
    order = {r: cls._calculate_single_rank_operations(s, r) for r in range(pp)}
    if cls.__name__ == "ScheduleInterleavedZeroBubble":
        s.pipeline_order = order
        order = s._add_bubbles_to_actions(pp * vpp)
    return order


def send_after_each_half(order_with_comms: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """torch's per-rank order with communication, each paired forward and backward
    (``OVERLAP_F_B``) run as its two actions with each one's sends right after it. torch's
    runtime runs a pair's halves one after the other anyway, but posts the transfers of both
    after the pair (:func:`held_outputs`): the forward's output waited a whole backward before
    leaving, and the next stage with it. Compute order and the per-peer order of the sends are
    unchanged (the forward's sends came first before too), so the numbers are."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    sends = (T.SEND_F, T.SEND_B)

    def sent_by(send: Any, half: Any) -> bool:
        kind = T.FORWARD if send.computation_type == T.SEND_F else (T.FULL_BACKWARD, T.BACKWARD_INPUT)
        return (send.stage_index == half.stage_index and send.microbatch_index == half.microbatch_index
                and half.computation_type in (kind if isinstance(kind, tuple) else (kind,)))

    out: dict[int, list[Any]] = {}
    for rank, acts in order_with_comms.items():
        new: list[Any] = []
        i = 0
        while i < len(acts):
            a = acts[i]
            halves = getattr(a, "sub_actions", None) if a is not None else None
            if not halves:
                new.append(a)
                i += 1
                continue
            j = i + 1
            while j < len(acts) and acts[j] is not None and acts[j].computation_type in sends:
                j += 1
            after = list(acts[i + 1:j])
            for half in halves:
                new.append(half)
                new += [s for s in after if sent_by(s, half)]
            new += [s for s in after if not any(sent_by(s, h) for h in halves)]
            i = j
        out[rank] = new
    return out
