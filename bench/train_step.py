"""The whole training step as the trainer runs it: vs a plain PyTorch loop at DP=1, and
layer-wise Muon vs distributed AdamW at DP=2.

lptrain: ``TrainEngine.train_step`` on batches from lptrain's loader (forward, backward into
the fp32 grad buffer, NaN check, grad norm and clip, AdamW on fp32 masters, masters written
back into the bf16 params). Baseline, measured in the same run on the same model and
batches: ``loss.backward(); torch.optim.AdamW.step(); zero_grad()`` on the bf16 params.
Steps alternate between the two so machine-load drift hits both alike; the rounds repeat
until each ratio's median is known within ``--spread`` or ``--cap`` seconds pass per shape
(``bench/harness.py``; REGRESSED against ``bench/baseline.json``).
Target: lptrain at most 1.05x the plain loop, at tiny_cpu's shape and at 4 layers, hidden
256, seq 256. Reference (no target): ``plain, fp32 masters``, the plain loop doing the
mixed-precision work the engine does by design (``workload.fp32_masters_step``: fp32 master
grads, clipping, AdamW on fp32 masters and moments, the copy back), so ``lptrain vs plain,
fp32 masters`` is the engine's own cost and ``plain, fp32 masters vs plain`` what fp32
masters cost any loop.

DP=2 (two spawned gloo ranks, one thread each, every variant alternating inside one world on
the same model and batches, the slowest rank's time per round): the whole engine step with
layer-wise Muon, compact and padded layouts, against the distributed optimizer with AdamW.
Target: Muon at most 1.10x AdamW at both shapes (upstream reports layer-wise Muon 5-6%
slower than distributed Adam end to end). The Newton-Schulz iterations are the floor of
Muon's extra cost, so their time per step is measured in the same steps (every
``newton_schulz`` call timed) and printed on its own, with the "above the NS floor" figure
``(Muon step - NS time) / AdamW step``: what gathers, staging and Python per unit cost.

    .venv/bin/python bench/train_step.py [--cap 40] [--threads 1] [--sections dp1,dp2] [--save-baseline]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from harness import Figure, Ratio, add_args, report, rounds
from rich.console import Console
from workload import fp32_masters_step, train_batches

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.model import build_model
from lptrain.train.engine import TrainEngine

TARGET = 1.05
MASTERS = "plain, fp32 masters"  # the DP=1 reference: see the module doc
DP2_TARGET = 1.10
DP2_REF = "AdamW distributed"
DP2_VARIANTS = {
    DP2_REF: ["ddp.use_distributed_optimizer=true"],
    "Muon compact": ["ddp.use_distributed_optimizer=true", "optimizer.name=muon"],
    "Muon padded": ["ddp.use_distributed_optimizer=true", "optimizer.name=muon",
                    "optimizer.layer_wise_param_layout=padded"],
}
SHAPES = {
    "tiny_cpu": [],
    "4x256, seq 256": [
        "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
        "model.seq_length=256",
    ],
}
COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "train.global_batch_size=8", "train.micro_batch_size=4"]


def _bench(name: str, overrides: list[str], args: Any) -> tuple[list[Figure], float, float]:
    cfg = derive(load("tiny_cpu.yaml", [*COMMON, *overrides]).cfg, World.detect())
    engine = TrainEngine(cfg)
    plain_model = build_model(cfg)  # same layers and init (seeded by name), no engine
    opt = torch.optim.AdamW(plain_model.parameters(), lr=cfg.optimizer.lr, foreach=True)
    train_it, n = train_batches(cfg)
    step = [0]

    def lptrain_step() -> None:
        step[0] += 1
        engine.train_step([next(train_it) for _ in range(n)], step[0])

    def plain_step() -> None:
        for _ in range(n):
            b = next(train_it)
            loss, _ = plain_model(b["tokens"], labels=b["labels"])
            (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    masters_model = build_model(cfg)

    def masters_backward(batches: list[dict[str, Any]]) -> None:
        for b in batches:
            loss, _ = masters_model(b["tokens"], labels=b["labels"])
            (loss / n).backward()

    masters = fp32_masters_step(masters_model, cfg, masters_backward)
    ratios = [Ratio(name, "lptrain", "plain", TARGET),  # the reference (no target): module doc
              Ratio(f"{name}: lptrain vs {MASTERS}", "lptrain", MASTERS),
              Ratio(f"{name}: {MASTERS} vs plain", MASTERS, "plain")]
    r = rounds(args, ratios)
    r.run({"lptrain": lptrain_step, "plain": plain_step,
           MASTERS: lambda: masters([next(train_it) for _ in range(n)])}, warmup=3)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    return (r.figures(), tokens / statistics.median(r.series["lptrain"]),
            tokens / statistics.median(r.series["plain"]))


def _dp2_ratios(shape: str) -> list[Ratio]:
    out = []
    for name in DP2_VARIANTS:
        if name == DP2_REF:
            continue
        out.append(Ratio(f"{shape}: {name} vs AdamW", f"{shape}/{name}", f"{shape}/{DP2_REF}", DP2_TARGET))
        # informational: what is above Newton-Schulz (gathers, staging, Python per unit)
        out.append(Ratio(f"{shape}: {name} above the NS floor vs AdamW", f"{shape}/{name} - NS",
                         f"{shape}/{DP2_REF}"))
    return out


class _NSClock:
    """Times every ``newton_schulz`` call of the Muon optimizer (patched into
    :mod:`lptrain.optim.orthogonal_update`, where the update calls it), so NS's share is
    measured in the very steps it is part of."""

    def __init__(self) -> None:
        import lptrain.optim.orthogonal_update as muon_mod

        self.mod, self.inner, self.spent = muon_mod, muon_mod.newton_schulz, 0.0

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = self.inner(*a, **kw)
            self.spent += time.perf_counter() - t0
            return out

        muon_mod.newton_schulz = timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def _dp2_rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    """One rank of the DP=2 section: every variant of every shape, interleaved per round."""
    torch.set_num_threads(1)
    clock = _NSClock()
    out: dict[str, dict[str, list[float]]] = {}
    for shape, overrides in SHAPES.items():
        engines, its = {}, {}
        for name, ov in DP2_VARIANTS.items():
            cfg = derive(load("tiny_cpu.yaml", [*COMMON, *overrides, *ov]).cfg, World.detect())
            engines[name] = TrainEngine(cfg)
            its[name], n = train_batches(cfg, rank, world)
        r = rounds(args, _dp2_ratios(shape))
        step = 0
        while True:
            step += 1
            times = {}
            for name, engine in engines.items():
                for _ in range(r.settle):  # untimed: this engine's caches (harness.add_args)
                    engine.train_step([next(its[name]) for _ in range(n)], step)
                torch.distributed.barrier()
                clock.take()
                t0 = time.perf_counter()
                engine.train_step([next(its[name]) for _ in range(n)], step)
                torch.distributed.barrier()
                times[f"{shape}/{name}"] = time.perf_counter() - t0
                ns = clock.take()
                if name != DP2_REF:
                    times[f"{shape}/{name} NS"] = ns
                    times[f"{shape}/{name} - NS"] = times[f"{shape}/{name}"] - ns
            if step > 3 and r.add_max_over_ranks(times):  # 3 warm-up steps
                break
        out[shape] = r.series
    return out


def _dp2(args: Any, console: Console) -> bool:
    from harness import Rounds

    from lptrain.testing.dist import run_distributed

    res = run_distributed(_dp2_rank, 2, args=(args,), timeout_s=1800)[0]
    figures, lines = [], []
    for shape in SHAPES:
        r = Rounds(_dp2_ratios(shape), series=res[shape])
        figures += r.figures()
        med = {k.split("/", 1)[1]: 1e3 * statistics.median(v) for k, v in res[shape].items()}
        lines.append(f"{shape}: {r.n} rounds; " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
        for name in DP2_VARIANTS:
            if name != DP2_REF:
                lines.append(f"  {name}: NS floor {med[f'{name} NS']:.2f} ms/step = "
                             f"{med[f'{name} NS'] / med[DP2_REF]:.1%} of the AdamW step")
    return report(console, "train_step_dp2", "layer-wise Muon vs distributed AdamW, whole step "
                  "(DP=2, 2 gloo ranks, 1 thread each, slowest rank per round)", figures, args,
                  "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    add_args(ap, cap_s=40.0, settle=1)
    ap.add_argument("--sections", default="dp1,dp2", help="which sections to run (dp1, dp2)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    console = Console(width=120)
    if "dp1" in sections:
        _dp1(args, console)
    if "dp2" in sections:
        _dp2(args, console)


def _dp1(args: Any, console: Console) -> None:
    torch.set_num_threads(args.threads)
    figures, lines = [], []
    for name, ov in SHAPES.items():
        figs, ours, theirs = _bench(name, ov, args)
        figures.extend(figs)
        lines.append(f"{name}: lptrain {ours:,.0f} tokens/s, plain {theirs:,.0f} tokens/s, {len(figs[0].samples)} rounds")
    report(console, "train_step", f"training step vs plain PyTorch loop (DP=1, {args.threads} thread(s))",
           figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
