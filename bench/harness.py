"""Shared measurement for every bench under ``bench/``: repeated interleaved rounds, the
median's spread, and a committed baseline that turns a >25% move into ``REGRESSED``.

Why one module: on a shared 2-core machine a single timed pair can be 5x off (another
process takes a core for a second), so one outlier must not read as a regression, and every
bench has to answer the same three questions the same way: what is the figure (median of
per-round ratios, each candidate timed next to its own baseline), how well is it known (the
median's spread), and did it move against the last accepted run (``bench/baseline.json``).

* :class:`Rounds` collects one timing per candidate per round and decides when to stop: after
  ``min_rounds``, as soon as every figure's median is known within ``spread`` (the half-width
  of a distribution-free 95% confidence interval of the median, relative to it), or when the
  bench's time cap is reached (then the spread is printed as it is).
* A figure is a ratio of two timed series (``cost(num) / cost(den)`` per round); ``min/min``
  (min of num over min of den) is printed next to it as a noise indicator. Rates (tokens/s)
  enter as costs (seconds per unit), so a ratio is always cost-over-cost.
* :class:`BaselineStore` reads and (with ``--save-baseline``) writes the accepted figures;
  the verdict is ``PASS``/``FAIL`` against the target, and ``REGRESSED`` is added when the
  median is more than 25% worse than the accepted one, whatever the target says.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

BASELINE_PATH = Path(__file__).with_name("baseline.json")
REGRESSION = 1.25  # a figure this much worse than the accepted one is REGRESSED
Z95 = 1.96


def median_spread(samples: list[float]) -> float:
    """Relative half-width of the distribution-free ~95% confidence interval of the median
    (order statistics n/2 -+ 1.96 sqrt(n)/2, clamped to the sample): inf below 3 samples.

    Why this and not the standard deviation: load spikes make the distribution one-sided and
    heavy-tailed; the order-statistic interval ignores how far an outlier is, only that it is
    one, so a single 5x spike widens it by one rank, not by 5x."""
    n = len(samples)
    if n < 3:
        return math.inf
    xs = sorted(samples)
    half = Z95 * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    med = statistics.median(xs)
    return (xs[hi] - xs[lo]) / 2 / abs(med) if med else math.inf


@dataclass
class Figure:
    """One judged figure: per-round values (lower is better unless ``higher_is_better``),
    the target it is held to, and the min/min noise indicator."""

    name: str
    samples: list[float]
    target: Optional[float] = None
    higher_is_better: bool = False
    minmin: Optional[float] = None
    unit: str = "x"

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        return median_spread(self.samples) if len(self.samples) > 1 else 0.0

    def passes(self) -> Optional[bool]:
        if self.target is None:
            return None
        return self.median >= self.target if self.higher_is_better else self.median <= self.target

    def worse_than(self, accepted: float) -> bool:
        """More than :data:`REGRESSION` worse than the accepted median."""
        if self.higher_is_better:
            return self.median * REGRESSION < accepted
        return self.median > accepted * REGRESSION


@dataclass
class Ratio:
    """A figure defined as ``num / den`` over the series of a :class:`Rounds`."""

    name: str
    num: str
    den: str
    target: Optional[float] = None
    higher_is_better: bool = False


@dataclass
class Rounds:
    """Interleaved rounds of timings, repeated until the medians are tight or time is up.

    ``add({"name": seconds, ...})`` records one round (every series timed back to back in
    that round); :meth:`done` says whether to stop. ``ratios`` are the figures whose spread
    decides; series that are not in any ratio are only reported as medians.
    """

    ratios: list[Ratio]
    cap_s: float = 60.0
    spread: float = 0.05
    min_rounds: int = 5
    max_rounds: int = 1000
    # untimed calls of each fn right before its timed one (see run; --settle)
    settle: int = 0
    series: dict[str, list[float]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def add(self, times: Mapping[str, float]) -> None:
        for k, v in times.items():
            self.series.setdefault(k, []).append(v)

    @property
    def n(self) -> int:
        return min((len(v) for v in self.series.values()), default=0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def figures(self) -> list[Figure]:
        out = []
        for r in self.ratios:
            num, den = self.series[r.num], self.series[r.den]
            per_round = [a / b for a, b in zip(num, den, strict=False)]
            out.append(Figure(r.name, per_round, r.target, r.higher_is_better, min(num) / min(den)))
        return out

    def converged(self) -> bool:
        return all(f.spread <= self.spread for f in self.figures())

    def done(self) -> bool:
        if self.n < self.min_rounds:
            return self.n >= self.max_rounds
        return self.n >= self.max_rounds or self.elapsed() >= self.cap_s or self.converged()

    def run(self, fns: Mapping[str, Callable[[], Any]], warmup: int = 1) -> Rounds:
        """Time ``fns`` in rounds (in the given order, each call back to back) until done.

        With ``settle``, each fn first runs that many untimed times right before its timed
        call, so it is timed on its own warm caches (the steady state of a training loop,
        which runs the same step again and again), not on those the previous fn of the round
        left; the rounds still alternate, so drift and load hit every fn alike."""
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        while not self.done():
            times = {}
            for name, fn in fns.items():
                for _ in range(self.settle):
                    fn()
                t0 = time.perf_counter()
                fn()
                times[name] = time.perf_counter() - t0
            self.add(times)
        return self

    def run_across_ranks(self, fns: Mapping[str, Callable[[int], Any]], warmup_steps: int = 3,
                         first_step: int = 1) -> Rounds:
        """:meth:`run` for a distributed bench whose fns take the step number (from
        ``first_step``): every fn's timed call sits between barriers (the slowest rank's time
        is the step's), after its ``settle`` untimed calls; rounds are recorded from step
        ``warmup_steps + 1`` on."""
        import torch.distributed as dist

        step = first_step - 1
        while True:
            step += 1
            times = {}
            for name, fn in fns.items():
                for _ in range(self.settle):  # untimed: this fn's caches (add_args)
                    fn(step)
                dist.barrier()
                t0 = time.perf_counter()
                fn(step)
                dist.barrier()
                times[name] = time.perf_counter() - t0
            if step > warmup_steps and self.add_max_over_ranks(times):
                return self

    def add_max_over_ranks(self, times: Mapping[str, float]) -> bool:
        """:meth:`add` for a distributed bench, returning whether to stop: each series gets the
        slowest rank's time of this round (the slowest rank gates a step), so every rank
        holds the same series, and rank 0's decision is the one every rank follows."""
        import torch
        import torch.distributed as dist

        keys = sorted(times)
        t = torch.tensor([times[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.add(dict(zip(keys, t.tolist(), strict=True)))
        # elapsed time differs by microseconds between ranks: take rank 0's stop decision
        stop = torch.tensor([1 if self.done() else 0])
        dist.broadcast(stop, 0)
        return bool(stop.item())

    def stop_reason(self) -> str:
        if self.converged() and self.n >= self.min_rounds:
            return f"spread <= {self.spread:.0%}"
        return f"time cap {self.cap_s:.0f} s" if self.n < self.max_rounds else f"{self.max_rounds} rounds"


class BaselineStore:
    """The accepted figures of one bench in ``bench/baseline.json`` (``{bench: {figure:
    {"median", "spread", "minmin"}}}``); written only on request (``--save-baseline``)."""

    def __init__(self, bench: str, path: Optional[Path] = None) -> None:
        self.bench, self.path = bench, path or BASELINE_PATH
        self._all: dict[str, dict[str, dict[str, float]]] = (
            json.loads(self.path.read_text()) if self.path.exists() else {}
        )

    def accepted(self, figure: str) -> Optional[float]:
        rec = self._all.get(self.bench, {}).get(figure)
        return None if rec is None else float(rec["median"])

    def save(self, figures: Iterable[Figure]) -> None:
        section = self._all.setdefault(self.bench, {})
        for f in figures:
            section[f.name] = {
                "median": round(f.median, 4),
                "spread": round(f.spread, 4) if math.isfinite(f.spread) else None,
                "minmin": None if f.minmin is None else round(f.minmin, 4),
            }
        self.path.write_text(json.dumps(self._all, indent=1, sort_keys=True) + "\n")


def add_args(ap: argparse.ArgumentParser, cap_s: float, spread: float = 0.05, min_rounds: int = 5,
             settle: int = 0) -> None:
    """The flags every bench shares: the time cap, the spread goal, the settle steps, saving
    the baseline. Benches that alternate different models or engines in a round settle each
    one (``settle=1``): a step timed right after another model's runs on the caches that
    model left, a penalty that grows with the footprint and that no training loop pays."""
    ap.add_argument("--cap", type=float, default=cap_s, help=f"time cap per measurement, s (default {cap_s:g})")
    ap.add_argument("--spread", type=float, default=spread,
                    help="stop repeating once every median is known within this fraction")
    ap.add_argument("--min-rounds", type=int, default=min_rounds,
                    help=f"rounds before the spread may stop the repeats (default {min_rounds})")
    ap.add_argument("--settle", type=int, default=settle,
                    help="untimed runs of each variant right before its timed one "
                         f"(default {settle}; 0: time it on the caches the previous one left)")
    ap.add_argument("--save-baseline", action="store_true",
                    help="accept this run's figures into bench/baseline.json")


def rounds(args: argparse.Namespace, ratios: list[Ratio], cap_s: Optional[float] = None) -> Rounds:
    """A :class:`Rounds` configured from :func:`add_args`'s flags (``cap_s`` overrides)."""
    return Rounds(ratios, cap_s=args.cap if cap_s is None else cap_s, spread=args.spread,
                  min_rounds=args.min_rounds, settle=getattr(args, "settle", 0))


def _fmt(v: Optional[float], unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}{unit}" if abs(v) < 100 else f"{v:,.0f}{unit}"


def verdict(fig: Figure, accepted: Optional[float]) -> str:
    ok = fig.passes()
    text = "info" if ok is None else ("PASS" if ok else "FAIL")
    if accepted is not None and fig.worse_than(accepted):
        text += " REGRESSED"
    return text


def report(console: Console, bench: str, title: str, figures: list[Figure],
           args: Optional[argparse.Namespace] = None, note: str = "",
           unevaluated: Sequence[str] = ()) -> bool:
    """Print the figures as one table (median, spread, min/min, target, accepted, verdict),
    save them as the baseline when asked; True when every target passes and nothing regressed.

    ``unevaluated``: lines naming targets that could not be computed this run (a target read
    from another bench's accepted figure that is missing): printed, and the overall verdict
    is INCOMPLETE (False), never a PASS that checked nothing."""
    store = BaselineStore(bench)
    table = Table(title=title)
    for col in ("figure", "median", "spread", "min/min", "rounds", "target", "accepted", "result"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    ok = True
    for f in figures:
        acc = store.accepted(f.name)
        v = verdict(f, acc)
        ok &= "FAIL" not in v and "REGRESSED" not in v
        target = "-" if f.target is None else f"{'>=' if f.higher_is_better else '<='}{_fmt(f.target, f.unit)}"
        spread = "-" if len(f.samples) < 2 else (f"+-{f.spread:.0%}" if math.isfinite(f.spread) else "n<3")
        table.add_row(f.name, _fmt(f.median, f.unit), spread, _fmt(f.minmin, f.unit),
                      str(len(f.samples)), target, _fmt(acc, f.unit), v)
    console.print(table)
    if note:
        console.print(note)
    console.print(f"median of interleaved per-round ratios; spread = half-width of the median's 95% "
                  f"interval; REGRESSED = more than {REGRESSION - 1:.0%} worse than the accepted "
                  f"figure ({BASELINE_PATH.name})")
    if args is not None and getattr(args, "save_baseline", False):
        # a figure still spread wider than the goal (a loaded machine, the cap reached) would
        # make a noisy baseline: only converged and deterministic figures are accepted
        goal = getattr(args, "spread", 0.05)
        tight = [f for f in figures if len(f.samples) == 1 or f.spread <= goal]
        store.save(tight)
        skipped = [f.name for f in figures if f not in tight]
        console.print(f"accepted: {len(tight)} figures written to bench/{BASELINE_PATH.name} [{bench}]"
                      + (f"; not accepted (spread above {goal:.0%}): {', '.join(skipped)}" if skipped else ""))
    for line in unevaluated:
        console.print(f"target not evaluated: {line}")
    if unevaluated:
        console.print(f"overall: INCOMPLETE ({len(unevaluated)} target(s) not evaluated"
                      f"{'' if ok else '; and a FAIL or REGRESSED above'})")
        return False
    console.print(f"overall: {'PASS' if ok else 'FAIL'}")
    return ok
