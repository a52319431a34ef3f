"""Optimizer step time and per-rank memory: layer-wise Muon vs distributed AdamW at DP=2.

Not a test: prints two tables.

1. **Step time** (tiny_cpu, 2 gloo ranks, emulated backend): the optimizer part of a
   training step -- ``ChainedOptimizer.step`` (norm, clip, update), staging and the param
   sync, the zero count (layer-wise Muon's grad norm all-reduce is that one) and reading the
   update RMS (layer-wise Muon's RMS all-reduce runs asynchronously, waited for there) -- for distributed AdamW, layer-wise Muon compact (both gather strategies:
   ``pad`` = one padded all-gather then trim, ``broadcast`` = one broadcast per owner) and
   padded. Variants are interleaved per round so load drift hits them alike; rounds repeat
   until each ratio's median is known within ``--spread`` or ``--cap`` seconds pass
   (``bench/harness.py``; the slowest rank's time per round; REGRESSED against
   ``bench/baseline.json``).
2. **Memory per rank**: the memory model's persistent categories (:mod:`lptrain.memory.plan`:
   weights, quantized weights, grads, masters, optimizer states, padding, param-gather
   staging), for AdamW vs Muon, compact vs padded, FP8 param gather (mxfp8) on/off: measured
   on the live tiny_cpu engine (rank 0) next to the analytic model, and the analytic model
   alone for a 1B layout (nothing allocated).
   Target: compact Muon + FP8 param gather <= distributed AdamW + FP8 param gather.

    .venv/bin/python bench/optim.py [--cap 60] [--dp 2] [--save-baseline]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from harness import Figure, Ratio, Rounds, add_args, report, rounds
from rich.console import Console
from rich.table import Table
from workload import train_batches

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "optimizer.warmup_iters=0",
        "precision.backend=emulated"]
DIST = ["ddp.use_distributed_optimizer=true"]
MUON = ["optimizer.name=muon", *DIST]
MXFP8 = ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"]
FP8_PG = [*MXFP8, "precision.fp8_param_gather=true"]
TIMED: dict[str, tuple[list[str], str]] = {
    "AdamW distributed": (DIST, "pad"),
    "Muon compact, pad+trim gather": (MUON, "pad"),
    "Muon compact, per-owner broadcast": (MUON, "broadcast"),
    "Muon padded": ([*MUON, "optimizer.layer_wise_param_layout=padded"], "pad"),
}
MEMORY: dict[str, list[str]] = {
    "AdamW": DIST,
    "AdamW + fp8 pg": [*DIST, *FP8_PG],
    "AdamW + fp8 pg + reuse": [*DIST, *FP8_PG, "ddp.reuse_grad_buf_for_mxfp8_param_ag=true"],
    "Muon compact": MUON,
    "Muon compact + fp8 pg": [*MUON, *FP8_PG],
    "Muon padded": [*MUON, "optimizer.layer_wise_param_layout=padded"],
    "Muon padded, 1M buckets": [*MUON, "optimizer.layer_wise_param_layout=padded",
                                "ddp.bucket_size=1000000"],
}


def _engine(overrides: list[str]) -> tuple[Any, Any]:
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("tiny_cpu.yaml", [*BASE, *overrides]).cfg, World.detect())
    engine = TrainEngine(cfg)
    it, n = train_batches(cfg, engine.dp_rank, engine.dp_size)
    return engine, (lambda: [next(it) for _ in range(n)])


REF = "AdamW distributed"


def _ratios() -> list[Ratio]:
    return [Ratio(f"{k} vs AdamW", k, REF) for k in TIMED if k != REF]


def _timed_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from lptrain.memory.measure import measured_memory
    from lptrain.optim import compact_gather

    engines = {}
    for name, (ov, mode) in TIMED.items():
        compact_gather.GATHER_MODE = mode
        engines[name] = _engine(ov)
    r = rounds(args, _ratios())
    step = 0
    while True:
        step += 1
        times = {}
        for name, (engine, batches) in engines.items():
            spent = [0.0]

            def timed(f: Any, spent: list[float] = spent) -> Any:
                def g(*a: Any) -> Any:
                    t0 = time.perf_counter()
                    out = f(*a)
                    spent[0] += time.perf_counter() - t0
                    return out
                return g

            o = engine.optimizer
            # layer-wise Muon sums its grad norm in count_zeros' all-reduce and waits for its
            # RMS all-reduce in update_rms: both are part of its optimizer cost
            saved = o.step, engine.ddp.end_step, o.count_zeros, o.update_rms
            o.step, engine.ddp.end_step, o.count_zeros, o.update_rms = (timed(f) for f in saved)
            engine.train_step(batches(), step)
            o.step, engine.ddp.end_step, o.count_zeros, o.update_rms = saved
            times[name] = spent[0]
        if step > 2 and r.add_max_over_ranks(times):  # 2 warm-up steps
            break
    memory = {}
    for name, ov in MEMORY.items():
        engine, batches = _engine(ov)
        engine.train_step(batches(), 1)
        memory[name] = measured_memory(engine.model, engine.ddp.buffers, engine.optimizer.children)
    return {"series": r.series, "memory": memory}


def _descs(overrides: list[str], device: str = "cpu") -> tuple[list[Any], float]:
    """Param descriptions of a config (built on ``device``), and the quantized bytes/elem."""
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.memory.analytic import describe_params, quantized_bytes_per_element
    from lptrain.model import build_model
    from lptrain.precision.factory import build_factory
    from lptrain.precision.param_storage import is_quantized

    cfg = derive(load("tiny_cpu.yaml", [*BASE, *overrides]).cfg, World.detect())
    f = build_factory(cfg.precision, num_layers=cfg.model.num_layers, fuse_wgrad_accumulation=False,
                      run_cfg=cfg)
    model = build_model(cfg, f, device=torch.device(device))
    named = list(model.named_parameters())
    q = [p for _, p in named if is_quantized(p)]
    return describe_params(named), (quantized_bytes_per_element(q[0]) if q else 0.0)


def _analytic_1b(dp: int) -> dict[str, Any]:
    """The 1B layout priced analytically: a bf16 meta model for the shapes; which params
    are FP8 (and the FP8 bytes per element) from the tiny model with FP8 param gather."""
    import re
    from dataclasses import replace

    import yaml

    from lptrain.memory.analytic import analytic_memory

    spec = yaml.safe_load(Path("lptrain/_configs/model/gpt_1b.yaml").read_text())
    ov = [f"model.{k}={v}" for k, v in spec.items() if not isinstance(v, dict)]
    big, _ = _descs(ov, device="meta")
    tiny, bpe = _descs(FP8_PG)

    def suffix(n: str) -> str:
        return re.sub(r"layers\.\d+\.", "", n)

    fp8 = {suffix(d.name) for d in tiny if d.quantized}
    big_fp8 = [replace(d, quantized=suffix(d.name) in fp8) for d in big]
    rows = {}
    for name, (params, opt, layout) in {
        "AdamW": (big, "adamw", "compact"),
        "AdamW + fp8 pg": (big_fp8, "adamw", "compact"),
        "Muon compact": (big, "muon", "compact"),
        "Muon compact + fp8 pg": (big_fp8, "muon", "compact"),
        "Muon padded, 40M buckets": (big, "muon", "padded"),
    }.items():
        per_rank = analytic_memory(params, dp=dp, optimizer=opt, param_layout=layout,
                                   bucket_size=40_000_000, quantized_bpe=bpe)
        rows[name] = max(per_rank, key=lambda m: m.total)
    rows["_n"] = sum(d.numel for d in big)
    return rows


def main() -> None:
    from lptrain.memory.analytic import analytic_memory
    from lptrain.memory.breakdown import PERSISTENT
    from lptrain.testing.dist import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    add_args(ap, cap_s=60.0)
    args = ap.parse_args()
    console = Console(width=130)
    res = run_distributed(_timed_rank, args.dp, args=(args,), timeout_s=1800)
    timed = Rounds(_ratios(), series=res[0]["series"])  # every rank holds the slowest rank's times
    figures = timed.figures()
    note = f"{timed.n} rounds; " + ", ".join(f"{k} {1e3 * statistics.median(v):.2f} ms/step"
                                            for k, v in timed.series.items())

    cols = [*PERSISTENT, "total"]

    def table(title: str, rows: dict[str, Any], unit: float, unit_name: str) -> Table:
        tb = Table(title=title)
        tb.add_column("config")
        for c in cols:
            tb.add_column(f"{c} ({unit_name})", justify="right")
        for name, m in rows.items():
            d = m.as_dict()
            tb.add_row(name, *(f"{d[c] / unit:,.3f}" for c in cols))
        return tb

    measured = res[0]["memory"]
    tiny_descs: dict[str, tuple[list[Any], float]] = {}
    analytic = {}
    for name, ov in MEMORY.items():
        key = "fp8" if FP8_PG[-1] in ov else "plain"
        if key not in tiny_descs:
            tiny_descs[key] = _descs(FP8_PG if key == "fp8" else [])
        descs, bpe = tiny_descs[key]
        bucket = 1_000_000 if "ddp.bucket_size=1000000" in ov else None
        layout = "padded" if "optimizer.layer_wise_param_layout=padded" in ov else "compact"
        analytic[name] = analytic_memory(
            descs, dp=args.dp, optimizer="muon" if "optimizer.name=muon" in ov else "adamw",
            param_layout=layout, bucket_size=bucket, quantized_bpe=bpe,
            reuse_grad_buffer=any("reuse" in o for o in ov))[0]
    console.print(table(f"tiny_cpu per-rank memory, rank 0, DP={args.dp}: measured", measured, 1024, "KiB"))
    agree = all(measured[k].as_dict() == analytic[k].as_dict() for k in MEMORY)
    console.print(f"analytic model == measured for every tiny_cpu row: {agree}")
    big = _analytic_1b(args.dp)
    n = big.pop("_n")
    console.print(table(f"1B layout ({n / 1e9:.2f}B params), analytic, DP={args.dp}, "
                        "max over ranks", big, 2**30, "GiB"))
    for label, rows in (("tiny_cpu", measured), ("1B", big)):
        muon, adam = rows["Muon compact + fp8 pg"].total, rows["AdamW + fp8 pg"].total
        # deterministic byte counts: one sample; the figure is Muon's bytes over AdamW's
        figures.append(Figure(f"{label} memory, Muon compact + fp8 pg / AdamW + fp8 pg", [muon / adam], 1.0))
        note += f"\n{label}: Muon compact + fp8 pg {muon:,} B vs AdamW + fp8 pg {adam:,} B"
    report(console, "optim", f"optimizer step + param sync (tiny_cpu, DP={args.dp}) and memory", figures, args, note)


if __name__ == "__main__":
    main()
