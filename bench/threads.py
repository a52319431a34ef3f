"""A single CPU run on a busy machine: lptrain's intra-op thread count against PyTorch's default.

Issue 52 item 22: with other processes on the cores, 20 tiny steps took 18.4 s with PyTorch's
default threads and 0.9 s with one. lptrain now picks the count from the CPUs a rank can have
(``lptrain/distributed/threads.py``: affinity, cgroup quota, the node's ranks, the CPUs other
processes keep busy). Both counts are timed in the same run, in interleaved rounds, on the
same engine (``tiny_cpu`` at small shapes: the steps a laptop or CI job runs), twice:

* ``as found``: the machine as it is (quiet, or loaded by whoever else uses it; lptrain's
  choice made now);
* ``loaded``: with a background load this bench starts itself -- one spinning process per CPU
  of its affinity (``--load N`` to change) -- and stops at the end (also on Ctrl-C or an
  error); lptrain's choice is made again under it.

Figures: time of lptrain's steps / time of the default's, per round (lower is better).
Targets: loaded <= 0.5 (the default's barrier waits on a busy machine cost at least 2x);
as found <= 1.10 (no harm where nothing competes; on a quiet machine the counts are
usually equal). Figures measured on a machine other processes also load are not final.

    .venv/bin/python bench/threads.py [--cap 40] [--load N] [--steps 3] [--save-baseline]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch
from harness import Ratio, add_args, report, rounds
from rich.console import Console
from workload import train_batches

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.distributed.threads import (
    affinity_cpus,
    busy_cpus,
    cgroup_quota,
    choose_threads,
    torch_default_threads,
)
from lptrain.train.engine import TrainEngine

SMALL = ["data.builtin_max_mb=1", "logging.progress=false", "train.global_batch_size=4",
         "train.micro_batch_size=2", "model.seq_length=64"]
SPIN = "while True:\n    pass\n"


class BackgroundLoad:
    """``n`` spinning processes (started on enter, stopped on exit, whatever happens)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BackgroundLoad:
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(self.n)]
        time.sleep(0.5)  # let them reach the cores before the choice is measured
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def lptrain_choice() -> tuple[int, str]:
    """The count lptrain would pick for a single rank now, and why."""
    cpus = affinity_cpus()
    c = choose_threads(None, {}, len(cpus), busy_cpus(cpus), torch_default_threads(), cgroup_quota())
    return c.threads, c.why


def stepper(engine: TrainEngine, batches: Iterator[dict], per_step: int, steps: int) -> Callable[[int], None]:
    def run(threads: int) -> None:
        torch.set_num_threads(threads)
        for _ in range(steps):
            engine.train_step([next(batches) for _ in range(per_step)], 1)
    return run


def _measure(name: str, run: Callable[[int], None], default: int, ours: int, args: argparse.Namespace) -> tuple:
    r = rounds(args, [Ratio(f"{name}: lptrain ({ours}) / default ({default}) threads", "lptrain", "default",
                            target=0.5 if name == "loaded" else 1.10)])
    r.run({"default": lambda: run(default), "lptrain": lambda: run(ours)}, warmup=1)
    med = {k: sorted(v)[len(v) // 2] for k, v in r.series.items()}
    return r.figures(), med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=None, help="spinning processes (default: one per CPU)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per timed call")
    add_args(ap, cap_s=40.0, settle=1, min_rounds=5)
    args = ap.parse_args()
    default = torch_default_threads()
    cfg = derive(load("tiny_cpu.yaml", SMALL).cfg, World.detect())
    engine = TrainEngine(cfg)
    batches, per_step = train_batches(cfg)
    run = stepper(engine, batches, per_step, args.steps)
    console = Console(width=120)
    figures, lines = [], []
    found, why = lptrain_choice()
    figs, med = _measure("as found", run, default, found, args)
    figures += figs
    lines.append(f"as found: lptrain {found} thread(s) ({why}); "
                 f"default {med['default'] / args.steps * 1e3:.0f} vs lptrain {med['lptrain'] / args.steps * 1e3:.0f} ms/step")
    n = args.load if args.load is not None else len(affinity_cpus())
    with BackgroundLoad(n):
        loaded, why = lptrain_choice()
        figs, med = _measure("loaded", run, default, loaded, args)
    figures += figs
    lines.append(f"loaded ({n} spinning processes): lptrain {loaded} thread(s) ({why}); "
                 f"default {med['default'] / args.steps * 1e3:.0f} vs lptrain {med['lptrain'] / args.steps * 1e3:.0f} ms/step")
    torch.set_num_threads(default)
    report(console, "threads", f"intra-op threads: lptrain's choice vs PyTorch's default ({default}), "
           f"tiny_cpu, {args.steps} steps a call", figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
