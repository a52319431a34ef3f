"""Data-parallel engine at DP=2 on this machine (two gloo ranks, one thread each).

Per training step, median over steps (all variants alternate inside one spawned world):
lptrain's engine with overlap off, with overlap on (grad reduce + param gather, several
buckets), the distributed optimizer, and ``torch.nn.parallel.DistributedDataParallel`` +
``torch.optim.AdamW`` on the same model and batches (the baseline). Also the bytes per rank
held by lptrain's buffers against the analytic minimum (every param's grad in the grad
dtype, plus its param-buffer bytes with the distributed optimizer, no padding).
Targets: lptrain's step at most 1.05x torch DDP's for the overlapped variants (torch DDP
overlaps its all-reduce with the backward, so they are the like-for-like comparison; the
non-overlapped ones are printed for reference), and overlap on faster than overlap off
(``overlap on / overlap off`` below 1.0, for plain DDP and for the distributed optimizer);
padding under 1%.

Reference (no target): ``torch DDP, overlap off`` -- torch DDP with every micro-batch under
``no_sync()`` and one all-reduce of the flattened grads after the last backward (what DDP
does without overlap), against ``torch DDP``: ``torch DDP: overlap on / overlap off`` is the
bound for lptrain's own on/off ratio (on 2 cores with gloo, a collective overlapped with the
backward takes its CPU time from that backward).

Reference (no target): ``torch DDP, fp32 masters`` -- torch DDP doing the mixed-precision
work the engine does by design (bf16 grads cast into fp32 master grads, clipped, AdamW on fp32
masters and moments, copied back: ``workload.fp32_masters_step``). ``<variant> vs torch DDP,
fp32 masters`` is the engine's own cost; ``torch DDP, fp32 masters vs torch DDP`` is the part
of every ``vs torch DDP`` ratio that fp32 masters cost torch DDP too (torch's loop steps bf16
params with bf16 moments).

The bucket count and sizes of every variant are printed. Rounds (every variant
once, each after a barrier, the slowest rank's time) repeat until each ratio's median is
known within ``--spread`` or ``--cap`` seconds pass (``bench/harness.py``; REGRESSED
against ``bench/baseline.json``).

The sharding strategies (``ddp.data_parallel_sharding_strategy``) against ``optim`` (the
distributed optimizer with overlap) in the same world: ``optim_grads`` at most 1.05x its
step, ``optim_grads_params`` with prefetch (``ddp.overlap_param_gather``) at most 1.25x;
their bytes per rank against the analytic minimum of the strategy (grads and/or params
divided by the data-parallel size).

    .venv/bin/python bench/ddp.py [--cap 60] [--save-baseline]
"""

from __future__ import annotations

import argparse
from typing import Any

from harness import Ratio, add_args, report, rounds
from workload import fp32_masters_step, train_batches

STEP_TARGET = 1.05
OVERLAP_TARGET = 1.0  # overlap on / overlap off: overlapping must pay
OVERLAP_PAIRS = {"ddp": ("ddp, overlap on", "ddp, overlap off"),
                 "distopt": ("distopt, overlap on", "distopt, overlap off")}
PAD_TARGET = 1.0  # percent
STRATEGY_TARGETS = {"optim_grads": 1.05, "optim_grads_params": 1.25}  # x the optim step
# Overlapped variants: 1M-element buckets, 2 on this model (1,050,624 + 919,296 elements), as
# torch DDP's default cap gives it 2 buckets here. On gloo the collectives take CPU time from
# the compute they overlap, so each extra bucket is a collective's fixed cost without a gain:
# 6 buckets of 300k measured ~6% slower per step than 2 (loaded 2-core machine).
BUCKETS = "ddp.bucket_size=1000000"
COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
          "train.global_batch_size=8", "train.micro_batch_size=4"]
VARIANTS = {
    "ddp, overlap off": [],
    "ddp, overlap on": ["ddp.overlap_grad_reduce=true", BUCKETS],
    "distopt, overlap off": ["ddp.use_distributed_optimizer=true"],
    "distopt, overlap on": ["ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true",
                            "ddp.overlap_param_gather=true", BUCKETS],
    # torch DDP reduces the params' own dtype (bf16): the same bytes on the wire
    "ddp, bf16 grads, overlap on": ["ddp.grad_reduce_in_fp32=false", "ddp.overlap_grad_reduce=true",
                                    BUCKETS],
    "ddp, bf16 grads, no NaN check": ["ddp.grad_reduce_in_fp32=false", "ddp.overlap_grad_reduce=true",
                                      BUCKETS, "ddp.check_for_nan_in_grad=false"],
    "optim_grads, overlap on": ["ddp.data_parallel_sharding_strategy=optim_grads",
                                "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true",
                                BUCKETS],
    "optim_grads_params, prefetch": ["ddp.data_parallel_sharding_strategy=optim_grads_params",
                                     "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true",
                                     BUCKETS],
}
MASTERS = "torch DDP, fp32 masters"  # reference: see the module doc
OPTIM = "distopt, overlap on"  # the strategies' baseline (data_parallel_sharding_strategy=optim)


def _strategy(name: str) -> str:
    return name.split(",")[0]


def _ratios() -> list[Ratio]:
    """The engine variants against torch DDP; the sharding strategies against ``optim``."""
    vs_torch = [Ratio(f"{name} vs torch DDP", name, "torch DDP",
                      STEP_TARGET if "overlap on" in name and _strategy(name) not in STRATEGY_TARGETS else None)
                for name in VARIANTS]
    vs_optim = [Ratio(f"{name} vs optim", name, OPTIM, STRATEGY_TARGETS[_strategy(name)])
                for name in VARIANTS if _strategy(name) in STRATEGY_TARGETS]
    on_off = [Ratio(f"{what}: overlap on / overlap off", on, off, OVERLAP_TARGET)
              for what, (on, off) in OVERLAP_PAIRS.items()]
    # the bound of on_off (no target): torch's own overlap against torch reducing after the backward
    torch_on_off = [Ratio("torch DDP: overlap on / overlap off", "torch DDP", "torch DDP, overlap off")]
    # the engine's own cost (no target): the overlapped variants against torch DDP doing the
    # engine's fp32-master work, and what that work costs torch DDP itself
    vs_masters = [Ratio(f"{name} vs {MASTERS}", name, MASTERS)
                  for name in VARIANTS if "overlap on" in name and _strategy(name) not in STRATEGY_TARGETS]
    masters_cost = [Ratio(f"{MASTERS} vs torch DDP", MASTERS, "torch DDP")]
    return vs_torch + vs_optim + on_off + torch_on_off + vs_masters + masters_cost


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.model import build_model
    from lptrain.train.engine import TrainEngine

    engines, its = {}, {}
    for name, ov in VARIANTS.items():
        cfg = derive(load("tiny_cpu.yaml", [*COMMON, *ov]).cfg, World.detect())
        engines[name] = TrainEngine(cfg)
    for name in VARIANTS:
        its[name], n = train_batches(cfg, rank, world)
    torch_model = build_model(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(torch_model)
    opt = torch.optim.AdamW(torch_model.parameters(), lr=cfg.optimizer.lr, foreach=True)
    torch_it, _ = train_batches(cfg, rank, world)
    flat_model = build_model(cfg)  # the same init: torch DDP reducing once, after the backward
    flat_ddp = torch.nn.parallel.DistributedDataParallel(flat_model)
    flat_opt = torch.optim.AdamW(flat_model.parameters(), lr=cfg.optimizer.lr, foreach=True)
    flat_it, _ = train_batches(cfg, rank, world)

    def torch_step(step: int) -> None:
        for i in range(n):
            b = next(torch_it)
            ctx = ddp.no_sync() if i < n - 1 else torch.enable_grad()
            with ctx:
                loss, _ = ddp(b["tokens"], labels=b["labels"])
                (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def torch_flat_step(step: int) -> None:
        for _ in range(n):
            b = next(flat_it)
            with flat_ddp.no_sync():
                loss, _ = flat_ddp(b["tokens"], labels=b["labels"])
                (loss / n).backward()
        grads = [p.grad for p in flat_model.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat)
        flat.div_(world)
        for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(f)
        flat_opt.step()
        flat_opt.zero_grad(set_to_none=True)

    masters_model = build_model(cfg)  # the same init: torch DDP with the engine's fp32 masters
    masters_ddp = torch.nn.parallel.DistributedDataParallel(masters_model)
    masters_it, _ = train_batches(cfg, rank, world)

    def masters_backward(batches: list[dict[str, Any]]) -> None:
        for i, b in enumerate(batches):
            with masters_ddp.no_sync() if i < n - 1 else torch.enable_grad():
                loss, _ = masters_ddp(b["tokens"], labels=b["labels"])
                (loss / n).backward()

    masters_step = fp32_masters_step(masters_model, cfg, masters_backward)

    fns = {name: (lambda s, e=engines[name], it=its[name]: e.train_step([next(it) for _ in range(n)], s))
           for name in VARIANTS}
    fns["torch DDP"] = torch_step
    fns["torch DDP, overlap off"] = torch_flat_step
    fns[MASTERS] = lambda s: masters_step([next(masters_it) for _ in range(n)])
    r = rounds(args, _ratios()).run_across_ranks(fns)
    memory = {}
    for name, e in engines.items():
        held = sum(sum(b.nbytes().values()) for b in e.ddp.buffers)
        # unpadded elements x (grad dtype bytes + param-buffer dtype bytes when sharded)
        # (sharded grads / params: this rank's 1/dp of them)
        minimum = sum(
            b.numel_unpadded * (b.key.grad_dtype.itemsize / (world if b.shards_grads else 1)
                                + (b.key.param_dtype.itemsize / (world if b.shards_params else 1)
                                   if b.sharded else 0))
            for b in e.layout.buffers
        )
        memory[name] = (held, minimum, e.layout.padding_percent())
    buckets = {name: [[k.end - k.start for k in b.buckets] for b in e.ddp.buffers]
               for name, e in engines.items()}
    return {"series": r.series, "memory": memory, "buckets": buckets}


def main() -> None:
    import statistics

    from harness import Figure, Rounds
    from rich.console import Console

    from lptrain.testing.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, cap_s=60.0)
    args = ap.parse_args()
    res = run_distributed(_rank, 2, args=(args,), timeout_s=900)[0]
    r = Rounds(_ratios(), series=res["series"])
    figures = r.figures()
    lines = [f"{r.n} rounds; " + ", ".join(f"{name} {statistics.median(v) * 1e3:.1f} ms"
                                          for name, v in r.series.items())]
    for name, (held, minimum, pad) in res["memory"].items():
        # deterministic: one sample, no spread
        figures.append(Figure(f"{name} padding", [pad], PAD_TARGET, unit="%"))
        lines.append(f"{name}: buffer bytes/rank {held:,} (analytic min {minimum:,.0f})")
    for name, per_buffer in res["buckets"].items():
        sizes = "; ".join(", ".join(f"{n:,}" for n in b) for b in per_buffer)
        lines.append(f"{name}: {sum(len(b) for b in per_buffer)} bucket(s) of {sizes} elements")
    report(Console(width=140), "ddp", "DP=2 step time vs torch DDP (2 gloo ranks, slowest rank per round)",
           figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
