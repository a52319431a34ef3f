"""Pipeline parallelism on this machine: two gloo ranks (one pipeline stage each), one thread each.

* **bubble fraction** (target <= 1.10): the measured idle fraction of the schedule --
  ``1 - compute / schedule time`` on each rank, averaged, compute being the stage's chunk
  forwards, loss and backwards, timed inside the step -- against the analytic bubble plus the
  P2P time of the step. The analytic bubble is ``(p - 1) / (m + p - 1)`` for 1F1B and
  ``(p - 1) / (v m + p - 1)`` interleaved over ``v`` chunks per rank (Narayanan et al. 2021)
  for equal stages; here the last stage also runs the final norm, the output layer and the
  loss, so the judged figure evaluates the same model at the stages' measured loads
  (:func:`loaded_bubble`: the step is the slowest stage's ``m`` micro-batches plus the
  others' fill and drain, ``1 / v`` of theirs each), which is the equal-stage formula when
  the loads are equal (printed too). The P2P time is ``2 m (v p - 1)`` hidden-state
  transfers (each micro-batch's activation forward and its gradient back across each of the
  ``v p - 1`` chunk boundaries), one measured as half a ping-pong of the same tensor. Printed
  as ``measured / (analytic + P2P)`` at p = 2 and m in {2, 4, 8}: within 10% of that sum
  passes. The rounds repeat until every bubble figure's median is known within ``--spread``
  or ``--cap`` seconds pass.
* **step time** (info, no target): a whole training step at PP 2 (2 ranks) against PP 1 on one
  rank, on the same model and global batch of 8 micro-batches; what pipelining two stages
  over two cores gives here (its bubble and P2P included).

    .venv/bin/python bench/pp.py [--cap 120] [--save-baseline]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import Figure, add_args, report
from workload import train_batches

COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=1024",
          "model.num_attention_heads=4", "model.seq_length=256", "train.micro_batch_size=2"]
MICRO = (2, 4, 8)
PP2 = ["model.pipeline_model_parallel_size=2"]
VPP2 = [*PP2, "model.virtual_pipeline_model_parallel_size=2"]
PINGS = 20


def _variants() -> dict[str, tuple[list[str], int, int]]:
    """name -> (overrides, micro-batches m, chunks per rank v)."""
    out = {}
    for m in MICRO:
        out[f"1f1b m={m}"] = ([*PP2, f"train.global_batch_size={2 * m}"], m, 1)
        out[f"interleaved m={m}"] = ([*VPP2, f"train.global_batch_size={2 * m}"], m, 2)
    return out


def _engine(overrides: list[str]) -> tuple[Any, Any, int]:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("tiny_cpu.yaml", [*COMMON, *overrides]).cfg, World.detect())
    engine = TrainEngine(cfg)
    it, n = train_batches(cfg, engine.dp_rank, engine.dp_size)
    return engine, it, n


class _Busy:
    """Seconds this rank computes inside the schedule: chunk forwards, the loss, backwards."""

    def __init__(self) -> None:
        from lptrain.distributed.pipeline import EngineStage, PipelineRunner
        from lptrain.model.pipeline import PipelineChunk

        self.seconds = 0.0
        busy = self

        def timed(fn: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    busy.seconds += time.perf_counter() - t0
            return wrapper

        PipelineChunk.forward = timed(PipelineChunk.forward)  # type: ignore[method-assign]
        PipelineRunner._loss = timed(PipelineRunner._loss)  # type: ignore[method-assign]
        stage = EngineStage.stage_class()
        stage.backward_maybe_with_nosync = timed(stage.backward_maybe_with_nosync)  # type: ignore[method-assign]


def _p2p_seconds(rank: int, nbytes: int) -> float:
    """One-way time of an ``nbytes`` tensor between the two ranks (half a ping-pong)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(nbytes // 4)
    peer = 1 - rank
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(PINGS):
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    return (time.perf_counter() - t0) / PINGS / 2


def loaded_bubble(compute: list[float], m: int, v: int) -> float:
    """The analytic bubble (mean over the ranks) of a pipeline whose ranks compute
    ``compute[r]`` seconds per step: the step is the slowest rank's compute plus the fill and
    drain of the others (``1 / (v m)`` of each one's compute: one chunk's forward and backward
    of one micro-batch). With equal loads this is ``(p - 1) / (v m + p - 1)``."""
    slowest = max(compute)
    step = slowest + (sum(compute) - slowest) / (v * m)
    return 1.0 - (sum(compute) / len(compute)) / step


def _bubble_samples(series: dict[str, list[float]], p2p: float) -> dict[str, list[float]]:
    """Per round, each variant's measured idle fraction over its analytic bubble (at the
    measured stage loads) + P2P."""
    out = {}
    for name, (_ov, m, v) in _variants().items():
        transfers = 2 * m * (v * 2 - 1)
        out[name] = [i / (a + transfers * p2p / s) for i, a, s in
                     zip(series[f"{name} idle"], series[f"{name} analytic"], series[f"{name} step"], strict=True)]
    return out


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from harness import Figure

    engines = {name: _engine(ov) for name, (ov, _m, _v) in _variants().items()}
    engines["PP=2 step"] = _engine([*PP2, f"train.global_batch_size={2 * max(MICRO)}"])
    busy = _Busy()
    hidden = 2 * 256 * 256 * 4  # micro-batch x seq x hidden, fp32
    p2p = _p2p_seconds(rank, hidden)
    series: dict[str, list[float]] = {}
    started, step = time.perf_counter(), 1
    while True:
        step += 1
        mine: dict[str, tuple[float, float]] = {}  # name -> (compute seconds, schedule seconds)
        for name, (engine, it, n) in engines.items():
            batches = [engine._to_device(next(it)) for _ in range(n)]
            dist.barrier()
            if name == "PP=2 step":
                t0 = time.perf_counter()
                engine.train_step(batches, step)
                mine[name] = (0.0, time.perf_counter() - t0)
                continue
            engine.ddp.begin_step(engine.optimizer.stage)
            busy.seconds = 0.0
            t0 = time.perf_counter()
            engine.pipeline.forward_backward(batches)
            total = time.perf_counter() - t0
            engine.ddp.finish_grad_sync()
            engine.ddp.end_step(engine.optimizer.stage)  # (no update: the schedule is timed)
            mine[name] = (busy.seconds, total)
        if step <= 3:
            continue  # two warm-up rounds (lazy state, first receive buffers): not recorded
        keys = sorted(mine)
        local = torch.tensor([mine[k] for k in keys], dtype=torch.float64)
        every = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(every, local)
        both = torch.stack(every)  # rank x variant x (compute, schedule)
        for j, k in enumerate(keys):
            if k == "PP=2 step":
                series.setdefault(k, []).append(float(both[:, j, 1].max()))
                continue
            _ov, m, v = _variants()[k]
            series.setdefault(f"{k} idle", []).append(float((1.0 - both[:, j, 0] / both[:, j, 1]).mean()))
            series.setdefault(f"{k} step", []).append(float(both[:, j, 1].max()))
            series.setdefault(f"{k} analytic", []).append(loaded_bubble(both[:, j, 0].tolist(), m, v))
            series.setdefault(f"{k} load", []).append(float(both[:, j, 0].max() / both[:, j, 0].min()))
        rounds_done = len(series["PP=2 step"])
        tight = all(Figure(n, v).spread <= args.spread for n, v in _bubble_samples(series, p2p).items())
        over = time.perf_counter() - started >= args.cap
        stop = torch.tensor([1 if rounds_done >= args.min_rounds and (tight or over) else 0])
        dist.broadcast(stop, 0)
        if stop.item():
            break
    return {"series": series, "p2p": p2p}


def _pp1_step(args: argparse.Namespace, rounds_n: int) -> list[float]:
    """Step times of the same model and batch on one process (PP 1)."""
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


def main() -> None:
    from rich.console import Console

    from lptrain.catalog.pipeline import bubble_fraction
    from lptrain.testing.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, cap_s=120.0)
    args = ap.parse_args()
    res = run_distributed(_rank, 2, args=(args,), timeout_s=900)[0]
    series, p2p = res["series"], res["p2p"]
    figures, lines = [], [f"one-way P2P of a {2 * 256 * 256 * 4:,}-byte hidden state: {p2p * 1e3:.2f} ms"]
    for name, samples in _bubble_samples(series, p2p).items():
        _ov, m, v = _variants()[name]
        steps = series[f"{name} step"]
        figures.append(Figure(f"{name}: bubble / (analytic + P2P)", samples, 1.10))
        lines.append(f"{name}: measured bubble {statistics.median(series[f'{name} idle']):.3f}, analytic "
                     f"{statistics.median(series[f'{name} analytic']):.3f} at the stages' loads "
                     f"(slowest / fastest {statistics.median(series[f'{name} load']):.3f}; equal stages "
                     f"{bubble_fraction(2, m, v):.3f}), P2P "
                     f"{statistics.median(2 * m * (v * 2 - 1) * p2p / s for s in steps):.3f} of the step, "
                     f"schedule {statistics.median(steps) * 1e3:.1f} ms")
    pp2 = series["PP=2 step"]
    pp1 = _pp1_step(args, len(pp2))
    figures.append(Figure("step: PP=2 (2 ranks) / PP=1 (1 rank)",
                          [a / b for a, b in zip(pp2, pp1, strict=False)], None, minmin=min(pp2) / min(pp1)))
    lines.append(f"step of 8 micro-batches: PP=2 {statistics.median(pp2) * 1e3:.1f} ms, "
                 f"PP=1 {statistics.median(pp1) * 1e3:.1f} ms")
    report(Console(width=140), "pp", "Pipeline parallelism: bubble vs analytic, PP=2 vs PP=1 (2 gloo ranks)",
           figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
