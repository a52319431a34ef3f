"""Tensor parallelism on this machine: two gloo ranks, one thread each.

* **step time** (info, no target): a training step at TP=2 with sequence parallelism and at
  TP=2 without it, against DP=2 on the same model and global batch (interleaved rounds, the
  slowest rank per round). On 2 CPU cores with gloo, TP pays a collective per GEMM boundary
  where DP pays one per step: this prints what TP costs here, it does not claim a speed-up
  (TP is for models that do not fit one GPU).
* **bytes** (target 1.00): the tensor-parallel activation bytes one training step moves,
  counted at the collectives (``lptrain.precision.tensor_parallel.count_tp_traffic``), against
  the analytic count ``tp_activation_traffic`` (SP: 4 all-gathers / reduce-scatters of
  b*s*h per dense layer per pass plus the embedding's and the head's; without SP 2
  all-reduces per layer per pass plus one), for each micro-batch. Both ``counted / analytic``
  and ``analytic / counted`` are held to <= 1.00, i.e. equal (deterministic, one sample).
* **host cost per TP collective** (info): an autograd TP collective (forward all-gather and
  backward reduce-scatter of a 64-element activation, the smallest case, where the host cost
  is all there is) against the same two raw flat collectives called directly, and the
  microseconds of each pair.

    .venv/bin/python bench/tp.py [--cap 60] [--save-baseline]
"""

from __future__ import annotations

import argparse
from typing import Any

from harness import Figure, Ratio, add_args, report, rounds
from workload import train_batches

CALLS = 50  # collective pairs per timed call of the host-cost series
COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
          "train.global_batch_size=8", "train.micro_batch_size=4"]
TP2 = ["model.tensor_model_parallel_size=2"]
VARIANTS = {"DP=2": [], "TP=2": TP2, "TP=2 + SP": [*TP2, "model.sequence_parallel=true"]}


def _ratios() -> list[Ratio]:
    return [Ratio("TP=2 + SP vs DP=2", "TP=2 + SP", "DP=2"), Ratio("TP=2 vs DP=2", "TP=2", "DP=2"),
            Ratio("TP collective (autograd) vs raw flat collectives", "tp collective", "raw collectives")]


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.distributed.groups import Group
    from lptrain.precision.collectives import all_gather_flat, reduce_scatter_flat
    from lptrain.precision.tensor_parallel import (
        count_tp_traffic,
        gather_sequence,
        tp_activation_traffic,
    )
    from lptrain.train.engine import TrainEngine

    engines, its, micro = {}, {}, {}
    for name, ov in VARIANTS.items():
        cfg = derive(load("tiny_cpu.yaml", [*COMMON, *ov]).cfg, World.detect())
        engines[name] = e = TrainEngine(cfg)
        its[name], micro[name] = train_batches(cfg, e.dp_rank, e.dp_size)
    traffic: dict[str, tuple[int, int]] = {}
    for name in ("TP=2", "TP=2 + SP"):
        e, m = engines[name], engines[name].cfg.model
        with count_tp_traffic() as t:
            e.train_step([next(its[name]) for _ in range(micro[name])], 1)
        _calls, nbytes = tp_activation_traffic(
            tokens=e.cfg.train.micro_batch_size * m.seq_length, hidden=m.hidden_size, itemsize=4,
            dense_layers=m.num_layers, sequence_parallel=m.sequence_parallel)
        traffic[name] = (t.activation_bytes, nbytes * micro[name])

    group = Group(dist.group.WORLD, world, rank)
    x = torch.randn(1, 2, 32, requires_grad=True)  # 64 elements: the host cost alone
    out = torch.empty(world * x.numel())
    part = torch.empty(x.numel())

    def tp_collective(step: int) -> None:
        for _ in range(CALLS):
            y = gather_sequence(x, group)
            y.backward(torch.ones_like(y))

    def raw_collectives(step: int) -> None:
        for _ in range(CALLS):
            all_gather_flat(out, x.detach().reshape(-1), group=dist.group.WORLD)
            reduce_scatter_flat(part, out, group=dist.group.WORLD)

    fns: dict[str, Any] = {name: (lambda s, e=engines[name], it=its[name], n=micro[name]:
                                  e.train_step([next(it) for _ in range(n)], s)) for name in VARIANTS}
    fns["tp collective"] = tp_collective
    fns["raw collectives"] = raw_collectives
    r = rounds(args, _ratios()).run_across_ranks(fns, first_step=2)  # (step 1: the set-up's)
    return {"series": r.series, "traffic": traffic}


def main() -> None:
    import statistics

    from harness import Rounds
    from rich.console import Console

    from lptrain.testing.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, cap_s=60.0)
    args = ap.parse_args()
    res = run_distributed(_rank, 2, args=(args,), timeout_s=900)[0]
    r = Rounds(_ratios(), series=res["series"])
    figures = r.figures()
    lines = [f"{r.n} rounds; " + ", ".join(f"{name} {statistics.median(v) * 1e3:.1f} ms"
                                          for name, v in r.series.items()),
             "host cost per all-gather + reduce-scatter pair (64 elements): "
             f"autograd {statistics.median(r.series['tp collective']) / CALLS * 1e6:.0f} us, "
             f"raw {statistics.median(r.series['raw collectives']) / CALLS * 1e6:.0f} us"]
    for name, (counted, analytic) in res["traffic"].items():
        figures.append(Figure(f"{name}: TP bytes / analytic count", [counted / analytic], 1.0))
        figures.append(Figure(f"{name}: analytic count / TP bytes", [analytic / counted], 1.0))
        lines.append(f"{name}: {counted:,} bytes of activation collectives per step (analytic {analytic:,})")
    report(Console(width=140), "tp", "Tensor parallelism: TP=2 vs DP=2 (2 gloo ranks, slowest rank per round)",
           figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
