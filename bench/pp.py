"""Pipeline parallelism on this machine: where a pipeline step's time goes, against the analytic
model of the schedule that runs.

* **bubble** (PP 2: two gloo ranks, one thread each; target <= 1.10): the measured idle
  fraction of the schedule -- the time each rank is blocked waiting on a P2P transfer over the
  schedule's time, averaged over the ranks -- against the analytic bubble of the same schedule
  at the measured loads. The loads are the rank's *whole actions*: each forward, loss, backward,
  I and W step as torch's schedule runs it (the model's compute, and around it torch's stage
  bookkeeping and lptrain's wrappers), plus the rank's share of the runtime's own work between
  actions (its loop over the actions, posting each transfer), spread evenly over its actions:
  everything the rank does that is not waiting. The analytic figure runs torch's own order of
  the schedule (:func:`lptrain.distributed.pipeline_orders.schedule_order`) with every action
  costing what that (chunk, kind) measured this round -- the chunks' own loads, so a V split's
  imbalance (rank 0 holds the embedding, the head and the loss) and I != W are in it -- and
  every P2P transfer arriving one measured one-way time after its action (torch posts it
  asynchronously: the sender goes on) (:func:`lptrain.catalog.pipeline.simulate`). With equal
  stages and no P2P it is the textbook ``(p - 1) / (m + p - 1)`` (``(p - 1) / (v m + p - 1)``
  interleaved), and for the interleaved zero bubble at one chunk a rank the ZB paper's ZB-H1
  idle ``(p - 1)(F + I - W)`` (checked in the unit tests); it is the one analytic model of
  the zero-bubble schedules, whose bubble depends on F : I : W. Rows: 1F1B and interleaved
  1F1B at m in {2, 4, 8}; interleaved zero bubble, ZBV and DualPipeV at m = 8. For each row
  the note splits the step into compute, the per-action work around it, the runtime's loop and
  posting, and idle, and prints the previous bench's figure beside it (compute alone counted as
  work, every transfer occupying its sender): the difference between the two is the
  schedules' per-action overhead, which the previous model counted as bubble.
* **uneven stages** (PP 4: four gloo ranks, 16 layers, 1F1B, m = 4, a vocabulary large enough
  that the final norm, output layer and loss cost about two layers): the step of
  ``pipeline_model_parallel_layout`` = 5 | 5 | 4 | 2 + loss against the even 4 | 4 | 4 | 4 +
  loss, target <= 0.95 where the analytic gain at the measured loads is >= 5%. Two analytic
  gains are printed: with a core per rank (a GPU per stage) and with the ranks sharing this
  machine's cores (processor sharing: 4 ranks on 2 cores are bound by the total work, which no
  split changes). The target is gated on the second, the gain this machine can show: the two
  are equal with a core per rank, and on 2 cores a measured 0.95x would mean the model is wrong.
* **step time** (info): a PP 2 step against PP 1 on one rank, same model and batch.

The rounds repeat until every judged median is known within ``--spread`` or ``--cap`` seconds
pass (per world). Figures measured on a loaded machine are provisional.

    .venv/bin/python bench/pp.py [--cap 120] [--save-baseline]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from typing import Any

from harness import Figure, add_args, report
from workload import train_batches

COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=1024",
          "model.num_attention_heads=4", "model.seq_length=256", "train.micro_batch_size=2"]
MICRO = (2, 4, 8)
PP2 = ["model.pipeline_model_parallel_size=2"]
VPP2 = [*PP2, "model.virtual_pipeline_model_parallel_size=2"]
# PP 4: 16 narrow layers, a 4096-token vocabulary (the head and loss cost about two layers)
PP4_COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
              "model.num_layers=16", "model.hidden_size=128", "model.ffn_hidden_size=512",
              "model.num_attention_heads=4", "model.seq_length=256", "model.vocab_size=4096",
              "train.micro_batch_size=2", "train.global_batch_size=8", "model.pipeline_model_parallel_size=4"]
PP4_LAYOUTS = {"even": [], "uneven": ["model.pipeline_model_parallel_layout=Ettttt|ttttt|tttt|ttL"]}
PINGS = 20
GAIN_TARGET = 0.05


def _variants() -> dict[str, tuple[list[str], str, int, int]]:
    """name -> (overrides, schedule, micro-batches m, chunks per rank v)."""
    out = {}
    for m in MICRO:
        out[f"1f1b m={m}"] = ([*PP2, f"train.global_batch_size={2 * m}"], "1f1b", m, 1)
        out[f"interleaved m={m}"] = ([*VPP2, f"train.global_batch_size={2 * m}"], "interleaved_1f1b", m, 2)
    for name, schedule in (("interleaved ZB", "interleaved_zero_bubble"), ("ZBV", "zbv_zero_bubble"),
                           ("DualPipeV", "dualpipev")):
        out[f"{name} m=8"] = ([*VPP2, f"model.pipeline_schedule={schedule}", "train.global_batch_size=16"],
                              schedule, 8, 2)
    return out


def _engine(overrides: list[str], common: list[str] = COMMON) -> tuple[Any, Any, int]:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("tiny_cpu.yaml", [*common, *overrides]).cfg, World.detect())
    engine = TrainEngine(cfg)
    it, n = train_batches(cfg, engine.dp_rank, engine.dp_size)
    return engine, it, n


class _Timeline:
    """Seconds this rank spends inside the schedule, per (chunk, kind): chunk forwards (the
    loss counted in the last chunk's F), whole backwards (B), and a split one's I and W.

    * **compute** (``wall``, ``cpu``): the model's own work -- the chunk's forward, the loss,
      the autograd backward, the W queue -- as wall time (what the schedule waits for) and as
      this thread's CPU time (the work itself: what an action costs on a core of its own, where
      four ranks share two);
    * **actions** (``action``): the whole action as the schedule runs it -- torch's stage
      around the compute (its input and output bookkeeping, ``stage_backward``) and lptrain's
      (the engine's phases, the micro-batch context, the W queue's hand-over), the loss;
    * **P2P**: the time posting transfers (``posts``) and blocked waiting for them (``waits``:
      the rank has nothing to do -- the bubble).

    The step's rest (neither an action, nor posting, nor waiting) is the schedule runtime's
    own loop over its actions."""

    def __init__(self) -> None:
        from torch.distributed.pipelining.schedules import _PipelineSchedule

        from lptrain.distributed.pipeline import EngineStage, PipelineRunner
        from lptrain.model.pipeline import PipelineChunk
        from lptrain.precision.deferred_wgrad import queue

        self.wall: dict[tuple[int, str], float] = defaultdict(float)
        self.cpu: dict[tuple[int, str], float] = defaultdict(float)
        self.action: dict[tuple[int, str], float] = defaultdict(float)
        self.waits = self.posts = 0.0
        line = self

        def timed(fn: Any, key: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    k = key(*args)
                    line.wall[k] += time.perf_counter() - t0
                    line.cpu[k] += time.thread_time() - c0
            return wrapper

        def whole(fn: Any, key: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    line.action[key(*args, **kwargs)] += time.perf_counter() - t0
            return wrapper

        PipelineChunk.forward = timed(PipelineChunk.forward, lambda c, *a: (c.chunk, "F"))  # type: ignore[method-assign]
        PipelineRunner._loss = timed(PipelineRunner._loss, lambda r, *a: (r.layout.chunks - 1, "F"))  # type: ignore[method-assign]
        stage = EngineStage.stage_class()
        stage.backward_maybe_with_nosync = timed(  # type: ignore[method-assign]
            stage.backward_maybe_with_nosync, lambda s, *a: (s.stage_index, "B" if queue() is None else "I"))
        stage.backward_weight_one_chunk = timed(  # type: ignore[method-assign]
            stage.backward_weight_one_chunk, lambda s, *a: (s.stage_index, "W"))
        # the whole actions (the split backward's I: backward_one_chunk(full_backward=False))
        stage.forward_one_chunk = whole(stage.forward_one_chunk, lambda s, *a, **k: (s.stage_index, "F"))  # type: ignore[method-assign]
        stage.backward_one_chunk = whole(  # type: ignore[method-assign]
            stage.backward_one_chunk,
            lambda s, *a, **k: (s.stage_index, "B" if k.get("full_backward", a[2] if len(a) > 2 else True) else "I"))
        stage.backward_weight_one_chunk = whole(  # type: ignore[method-assign]
            stage.backward_weight_one_chunk, lambda s, *a, **k: (s.stage_index, "W"))
        _PipelineSchedule._maybe_compute_loss = whole(  # type: ignore[method-assign]
            _PipelineSchedule._maybe_compute_loss, lambda sched, st, *a, **k: (st.stage_index, "F"))
        # P2P: posting (the rank's work) and waiting (idle)
        import torch.distributed.pipelining.schedules as schedules

        unpatched_wait, unpatched_batch = schedules._wait_batch_p2p, schedules._batch_p2p

        def clocked(fn: Any, attr: str) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(line, attr, getattr(line, attr) + time.perf_counter() - t0)
            return wrapper

        schedules._wait_batch_p2p = clocked(unpatched_wait, "waits")
        schedules._batch_p2p = clocked(unpatched_batch, "posts")

    def take(self) -> tuple[dict[tuple[int, str], float], dict[tuple[int, str], float]]:
        out = (dict(self.wall), dict(self.cpu))
        self.wall, self.cpu = defaultdict(float), defaultdict(float)
        return out

    def take_actions(self) -> tuple[dict[tuple[int, str], float], float, float]:
        """The step's whole actions, posting and waiting seconds (and a fresh start)."""
        out = (dict(self.action), self.posts, self.waits)
        self.action, self.posts, self.waits = defaultdict(float), 0.0, 0.0
        return out


def _p2p_seconds(rank: int, world: int, nbytes: int) -> float:
    """One-way time of an ``nbytes`` tensor between pipeline neighbours (half a ping-pong)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(nbytes // 4)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(PINGS):
        if rank % 2 == 0 and rank + 1 < world:
            dist.send(x, rank + 1)
            dist.recv(x, rank + 1)
        elif rank % 2 == 1:
            dist.recv(x, rank - 1)
            dist.send(x, rank - 1)
    t = torch.tensor([(time.perf_counter() - t0) / PINGS / 2], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def _gather_costs(mine: Any) -> Any:
    """Every rank's per-(chunk, kind) totals, wall and CPU (each chunk is one rank's)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    wall: dict[tuple[int, str], float] = {}
    cpu: dict[tuple[int, str], float] = {}
    for w, c in every:
        wall.update(w)
        cpu.update(c)
    return wall, cpu


def _analytic(costs: dict[tuple[int, str], float], schedule: str, pp: int, v: int, m: int, p2p: float,
              cores: Any = None) -> Any:
    """:func:`simulate` of torch's order, an action costing its (chunk, kind) step total over
    the number of such actions in the order, each P2P transfer occupying its sender for the
    measured one-way time (gloo moves the bytes on the ranks' own cores)."""
    from lptrain.catalog.pipeline import simulate
    from lptrain.distributed.pipeline_orders import schedule_order

    order = schedule_order(schedule, pp, v, m)
    counts = _counts(order)
    return simulate(order, {k: costs[k] / n for k, n in counts.items()}, pp * v, cores=cores, send=p2p)


def _counts(order: dict[int, list[Any]]) -> dict[tuple[int, str], int]:
    counts: dict[tuple[int, str], int] = defaultdict(int)
    for acts in order.values():
        for chunk, kind, _mb in acts:
            counts[(chunk, kind)] += 1
    return counts


def _analytic_actions(actions: dict[tuple[int, str], float], ranks: list[tuple[float, float, float, float]],
                      schedule: str, pp: int, v: int, m: int, p2p: float, held: bool = False) -> Any:
    """The analytic bubble at the measured loads of the whole actions: :func:`simulate` of
    torch's order, an action costing its (chunk, kind) step total over the number of such
    actions, plus its share of its rank's runtime work (the schedule's loop and its P2P posting,
    spread evenly over the rank's actions); each transfer arriving the measured one-way time
    after its action (``link``: torch posts it asynchronously, the sender goes on). ``held``:
    as torch's runtime sends a paired forward's output, after the pair (lptrain sends it right
    after the forward: :func:`lptrain.distributed.pipeline_orders.send_after_each_half`)."""
    from lptrain.catalog.pipeline import simulate
    from lptrain.distributed.pipeline_orders import held_outputs, schedule_order

    order = schedule_order(schedule, pp, v, m)
    counts = _counts(order)
    rank_of = {a[0]: r for r, acts in order.items() for a in acts}
    share = {r: max(0.0, total - busy - waits) / len(order[r]) for r, (busy, _p, waits, total) in enumerate(ranks)}
    cost = {k: actions.get(k, 0.0) / n + share[rank_of[k[0]]] for k, n in counts.items()}
    return simulate(order, cost, pp * v, link=p2p, held=held_outputs(schedule, pp, v, m) if held else None)


def _rounds(rank: int, world: int, args: argparse.Namespace, engines: dict[str, Any], judged: Any,
            timeline: _Timeline) -> dict[str, list[Any]]:
    """Rounds of one step per variant until the judged medians are tight or the cap passes;
    per variant and round: (this world's per-(chunk, kind) compute costs, wall and CPU; per rank
    its compute and schedule seconds; this world's per-(chunk, kind) whole-action costs; per
    rank its whole actions', posting and waiting seconds)."""
    import torch
    import torch.distributed as dist

    series: dict[str, list[Any]] = defaultdict(list)
    started, step = time.perf_counter(), 1
    while True:
        step += 1
        record: dict[str, Any] = {}
        for name, (engine, it, n) in engines.items():
            batches = [engine._to_device(next(it)) for _ in range(n)]
            dist.barrier()
            timeline.take()
            if name.startswith("step "):
                t0 = time.perf_counter()
                engine.train_step(batches, step)
                record[name] = (timeline.take(), time.perf_counter() - t0, timeline.take_actions())
                continue
            engine.ddp.begin_step(engine.optimizer.stage)
            timeline.take_actions()
            t0 = time.perf_counter()
            engine.pipeline.forward_backward(batches)
            total = time.perf_counter() - t0
            engine.ddp.finish_grad_sync()
            engine.ddp.end_step(engine.optimizer.stage)  # (no update: the schedule is timed)
            record[name] = (timeline.take(), total, timeline.take_actions())
        if step <= 3:
            continue  # two warm-up rounds (lazy state, first receive buffers): not recorded
        for name in sorted(record):
            costs, total, (actions, posts, waits) = record[name]
            every = torch.tensor([sum(costs[0].values()), total, sum(actions.values()), posts, waits],
                                 dtype=torch.float64)
            parts = [torch.empty_like(every) for _ in range(world)]
            dist.all_gather(parts, every)
            series[name].append((_gather_costs(costs), [(float(p[0]), float(p[1])) for p in parts],
                                 _gather_costs((actions, {}))[0],
                                 [(float(p[2]), float(p[3]), float(p[4]), float(p[1])) for p in parts]))
        tight = all(f.spread <= args.spread for f in judged(series))
        over = time.perf_counter() - started >= args.cap
        stop = torch.tensor([1 if len(series[next(iter(series))]) >= args.min_rounds and (tight or over) else 0])
        dist.broadcast(stop, 0)
        if stop.item():
            return dict(series)


def _bubble_rows(series: dict[str, list[Any]], p2p: float) -> dict[str, dict[str, list[float]]]:
    """Per PP 2 variant and round: the bubble (waiting) and its analytic figure (also with
    torch's paired sends), the step's split, the previous compute-only figures, the step."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, (_ov, schedule, m, v) in _variants().items():
        rows: dict[str, list[float]] = defaultdict(list)
        for (costs, _cpu), ranks, actions, whole in series.get(name, []):
            # the rank is idle exactly while it waits on a transfer; the rest of the step is its work
            rows["idle"].append(statistics.fmean(waits / total for _b, _p, waits, total in whole))
            rows["idle_analytic"].append(_analytic_actions(actions, whole, schedule, 2, v, m, p2p).bubble)
            rows["idle_held"].append(_analytic_actions(actions, whole, schedule, 2, v, m, p2p, held=True).bubble)
            rows["compute"].append(statistics.fmean(busy / total for busy, total in ranks))
            rows["stage"].append(statistics.fmean((a - c) / total for (c, total), (a, _p, _w, _t)
                                                  in zip(ranks, whole, strict=True)))
            rows["runtime"].append(statistics.fmean((total - a - w) / total for a, _p, w, total in whole))
            rows["measured"].append(statistics.fmean(1.0 - busy / total for busy, total in ranks))
            rows["analytic"].append(_analytic(costs, schedule, 2, v, m, p2p).bubble)
            rows["step"].append(max(t for _b, t in ranks))
        out[name] = rows
    return out


def _pp2_judged(p2p: float) -> Any:
    def judged(series: dict[str, list[Any]]) -> list[Figure]:
        rows = _bubble_rows(series, p2p)
        return [Figure(n, [a / b for a, b in zip(r["idle"], r["idle_analytic"], strict=True)])
                for n, r in rows.items() if r["idle"]]
    return judged


def _pp2(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    engines = {name: _engine(ov) for name, (ov, _s, _m, _v) in _variants().items()}
    engines["step PP=2"] = _engine([*PP2, f"train.global_batch_size={2 * max(MICRO)}"])
    timeline = _Timeline()
    p2p = _p2p_seconds(rank, world, 2 * 256 * 256 * 4)
    return {"series": _rounds(rank, world, args, engines, _pp2_judged(p2p), timeline), "p2p": p2p}


def _pp4_gains(series: dict[str, list[Any]], p2p: float, cores: int) -> dict[str, list[float]]:
    """Per round: measured uneven / even step, analytic gains with a core per rank and on
    ``cores`` shared cores (even step / uneven step, from each layout's measured loads)."""
    out: dict[str, list[float]] = defaultdict(list)
    for ((_we, ce), re_, *_w), ((_wu, cu), ru, *_v) in zip(series.get("step even", []),
                                                         series.get("step uneven", []), strict=False):
        out["measured"].append(max(t for _b, t in ru) / max(t for _b, t in re_))
        for key, c in (("gain_dedicated", None), ("gain_shared", cores)):
            even = _analytic(_pipeline_costs(ce), "1f1b", 4, 1, 4, p2p, c).step
            uneven = _analytic(_pipeline_costs(cu), "1f1b", 4, 1, 4, p2p, c).step
            out[key].append(even / uneven - 1.0)
    return out


def _pipeline_costs(costs: dict[tuple[int, str], float]) -> dict[tuple[int, str], float]:
    return {k: v for k, v in costs.items() if k[1] in ("F", "B")}


def _pp4(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    engines = {f"step {name}": _engine(ov, PP4_COMMON) for name, ov in PP4_LAYOUTS.items()}
    timeline = _Timeline()
    p2p = _p2p_seconds(rank, world, 2 * 256 * 128 * 4)
    cores = len(os.sched_getaffinity(0))

    def judged(series: dict[str, list[Any]]) -> list[Figure]:
        return [Figure("pp4", [r for r in _pp4_gains(series, p2p, cores)["measured"]])]

    return {"series": _rounds(rank, world, args, engines, judged, timeline), "p2p": p2p, "cores": cores}


def _pp1_step(rounds_n: int) -> list[float]:
    """Step times of the PP 2 step's model and batch on one process (PP 1)."""
    import torch

    torch.set_num_threads(1)
    engine, it, n = _engine([f"train.global_batch_size={2 * max(MICRO)}"])
    out = []
    for step in range(1, rounds_n + 3):
        batches = [next(it) for _ in range(n)]
        t0 = time.perf_counter()
        engine.train_step(batches, step)
        if step > 2:
            out.append(time.perf_counter() - t0)
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    from rich.console import Console

    from lptrain.catalog.pipeline import bubble_fraction
    from lptrain.distributed.pipeline_orders import schedule_order
    from lptrain.testing.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, cap_s=120.0)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    two = run_distributed(_pp2, 2, args=(args,), timeout_s=900)[0]
    p2p = two["p2p"]
    figures, lines = [], [f"PP 2: one-way P2P of a {2 * 256 * 256 * 4:,}-byte hidden state: {p2p * 1e3:.2f} ms"]
    for name, r in _bubble_rows(two["series"], p2p).items():
        _ov, schedule, m, v = _variants()[name]
        figures.append(Figure(f"{name}: bubble / analytic at the measured loads",
                              [a / b for a, b in zip(r["idle"], r["idle_analytic"], strict=True)], 1.10))
        textbook = bubble_fraction(2, m, v) if schedule in ("1f1b", "interleaved_1f1b") else None
        actions = sum(len(a) for a in schedule_order(schedule, 2, v, m).values()) / 2
        step = _med(r["step"])
        lines.append(
            f"{name} ({actions:.0f} actions a rank, {step * 1e3:.0f} ms step): bubble {_med(r['idle']):.3f}, "
            f"analytic {_med(r['idle_analytic']):.3f}; the step is compute {_med(r['compute']):.0%}, per-action "
            f"work around it {_med(r['stage']):.0%} ({_med(r['stage']) * step * 1e6 / actions:.0f} us an action: "
            f"torch's stage, lptrain's wrappers), the runtime's loop and P2P posting {_med(r['runtime']):.0%} "
            f"({_med(r['runtime']) * step * 1e6 / actions:.0f} us an action), idle {_med(r['idle']):.0%}; "
            f"counting compute alone as work: bubble {_med(r['measured']):.3f} vs analytic + P2P "
            f"{_med(r['analytic']):.3f} ({_med(r['measured']) / _med(r['analytic']):.2f}x, the previous figure)"
            + (f"; textbook {textbook:.3f}" if textbook is not None else "")
            + (f"; analytic with torch's paired sends (a paired forward's output sent after the pair, "
               f"as torch's runtime does; lptrain sends it after the forward) {_med(r['idle_held']):.3f}"
               if _med(r["idle_held"]) != _med(r["idle_analytic"]) else ""))
    pp2 = [max(t for _b, t in ranks) for _c, ranks, *_w in two["series"]["step PP=2"]]
    pp1 = _pp1_step(len(pp2))
    figures.append(Figure("step: PP=2 (2 ranks) / PP=1 (1 rank)",
                          [a / b for a, b in zip(pp2, pp1, strict=False)], None, minmin=min(pp2) / min(pp1)))
    lines.append(f"step of 8 micro-batches: PP=2 {_med(pp2) * 1e3:.1f} ms, PP=1 {_med(pp1) * 1e3:.1f} ms")

    four = run_distributed(_pp4, 4, args=(args,), timeout_s=900)[0]
    gains = _pp4_gains(four["series"], four["p2p"], four["cores"])
    dedicated, shared = _med(gains["gain_dedicated"]), _med(gains["gain_shared"])
    figures.append(Figure("PP=4 step: uneven (5|5|4|2+loss) / even (4|4|4|4+loss)", gains["measured"],
                          0.95 if shared >= GAIN_TARGET else None))
    per_rank = {name: [_med([sum(t for (c, _k), t in _pipeline_costs(cpu).items() if c == r) * 1e3
                             for (_wall, cpu), _ranks, *_w in four["series"][f"step {name}"]]) for r in range(4)]
                for name in PP4_LAYOUTS}
    lines.append(
        f"PP 4 ({four['cores']} cores for 4 ranks): analytic gain of the uneven split at the measured loads "
        f"{dedicated:+.1%} with a core per rank, {shared:+.1%} with the ranks sharing this machine's cores "
        f"(bound by the total work, which no split changes; the gain this machine can show: the target "
        f"applies where it is >= {GAIN_TARGET:.0%}); "
        f"per-rank compute per step (CPU ms): even " + " | ".join(f"{x:.0f}" for x in per_rank["even"])
        + ", uneven " + " | ".join(f"{x:.0f}" for x in per_rank["uneven"]))
    load = max(load_before, os.getloadavg()[0])
    if load > len(os.sched_getaffinity(0)):
        lines.append(f"load average {load:.1f} on {len(os.sched_getaffinity(0))} cores: ranks shared their cores "
                     "with other work, so the figures above are provisional (rerun on a quiet machine)")
    report(Console(width=160), "pp", "Pipeline parallelism: bubble vs analytic (PP 2), uneven stages (PP 4), "
           "PP 2 vs PP 1", figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
