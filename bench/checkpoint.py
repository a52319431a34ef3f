"""What checkpoint checksums cost (not a test; prints a table and PASS/FAIL).

A checkpoint-shaped state -- fp32 masters plus two AdamW moments, ``--mb`` MB in all, in
``--tensors`` tensors, and a rank's small local state -- is saved with
:func:`lptrain.checkpoint.save_checkpoint` (DCP, ``fsync``, marker, ``latest``) into a folder
on disk (``--dir``, default the system temp folder), ``--rounds`` times.

* save: the time spent computing checksums during each save (timed inside the save: the
  local file hashed from memory, DCP's files read back from the page cache by their writer)
  as a ratio of that save's time; the target is <= 10% (PASS/FAIL). A save with checksums
  turned into no-ops is timed in the same run, alternating with the other, for reference:
  the difference of the two totals is dominated by how long DCP's write and ``fsync`` take
  on a busy disk (seconds apart from one save to the next), so the verdict uses the time
  measured inside the save, not that difference.
* load: :func:`lptrain.checkpoint.verify` (every file's checksum) against the
  :func:`lptrain.checkpoint.load_checkpoint` it is part of (reported, no target).

Medians over the rounds; the page cache is warm for every round alike. On a machine shared
with other jobs the ratios move with the disk's and the CPU's load: run it twice.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from harness import Figure, report
from rich.console import Console
from rich.table import Table

from lptrain.checkpoint import integrity, load_checkpoint, save_checkpoint, store, verify

TARGET = 0.10


class HashClock:
    """Total seconds spent in the checksum functions the save calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


@contextmanager
def patched(clock: HashClock, disabled: bool) -> Iterator[None]:
    """Time (or, for the baseline, skip) every checksum computed by a save."""
    names = [(integrity, "digest_bytes"), (integrity, "digest_file"), (store, "digest_bytes")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in names]
    try:
        for mod, name, fn in saved:
            setattr(mod, name, (lambda *a, **k: "0") if disabled else clock.wrap(fn))
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def make_state(mb: int, tensors: int) -> dict[str, Any]:
    numel = mb * 2**20 // 4 // (3 * tensors)
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}
    optim = {k: {"exp_avg": torch.randn(numel, generator=g), "exp_avg_sq": torch.rand(numel, generator=g),
                 "step": torch.tensor(10.0)} for k in model}
    return {"global": {"model": model, "optimizer": optim, "scaling": {}},
            "local": {"torch_rng": torch.get_rng_state()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=768, help="checkpoint size in MB (default 768)")
    ap.add_argument("--tensors", type=int, default=48, help="parameters (each with two moments)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to save (default: the system temp folder)")
    ap.add_argument("--save-baseline", action="store_true",
                    help="accept this run's figures into bench/baseline.json")
    args = ap.parse_args()
    state = make_state(args.mb, args.tensors)
    rows: dict[str, list[float]] = {"save": [], "hash": [], "plain": [], "load": [], "verify": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        for r in range(args.rounds):
            for disabled in ((False, True) if r % 2 == 0 else (True, False)):  # alternate: fair to both
                clock = HashClock()
                with patched(clock, disabled):
                    t0 = time.perf_counter()
                    folder = save_checkpoint(root / ("plain" if disabled else "hashed"), r + 1, state,
                                             {"consumed_samples": 0}, "bench: 1\n", rank=0, world_size=1,
                                             keep_latest=2)
                    dt = time.perf_counter() - t0
                if disabled:
                    rows["plain"].append(dt)
                else:
                    rows["save"].append(dt)
                    rows["hash"].append(clock.seconds)
                    t0 = time.perf_counter()
                    verify(folder)
                    rows["verify"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    load_checkpoint(folder, rank=0, world_size=1)
                    rows["load"].append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
    med = {k: statistics.median(v) for k, v in rows.items()}
    hash_ratio = statistics.median(h / s for h, s in zip(rows["hash"], rows["save"], strict=True))
    table = Table(title=f"checkpoint of {size:.0f} MB ({args.tensors} params x 3 fp32 tensors), "
                  f"median of {args.rounds}")
    for c in ("what", "seconds", "MB/s", "ratio"):
        table.add_column(c, justify="right")
    table.add_row("save (with checksums)", f"{med['save']:.3f}", f"{size / med['save']:.0f}", "1.00")
    table.add_row("  checksums inside it", f"{med['hash']:.3f}", f"{size / med['hash']:.0f}", f"{hash_ratio:.3f}")
    table.add_row("save, checksums off (baseline)", f"{med['plain']:.3f}", f"{size / med['plain']:.0f}",
                  f"{med['plain'] / med['save']:.3f}")
    table.add_row("load (verifies)", f"{med['load']:.3f}", f"{size / med['load']:.0f}", "1.00")
    table.add_row("  verify inside it", f"{med['verify']:.3f}", f"{size / med['verify']:.0f}",
                  f"{med['verify'] / med['load']:.3f}")
    console = Console(width=120)
    console.print(table)
    # judged through the shared harness: PASS/FAIL against the target, REGRESSED against the
    # accepted figure in bench/baseline.json
    figures = [
        Figure("checksums / save", [h / s for h, s in zip(rows["hash"], rows["save"], strict=True)], TARGET,
               minmin=min(rows["hash"]) / min(rows["save"]), unit=""),
        Figure("verify / load", [v / lo for v, lo in zip(rows["verify"], rows["load"], strict=True)],
               minmin=min(rows["verify"]) / min(rows["load"]), unit=""),
    ]
    report(console, "checkpoint", "checkpoint checksums: share of the save / load time", figures, args,
           f"checksums cost {100 * hash_ratio:.1f}% of the save time (target <= {100 * TARGET:.0f}%)")


if __name__ == "__main__":
    main()
