"""Emulated quantization cost per recipe (not a test): prints a rich table with PASS/FAIL.

1. q+dq = one ``quantizer.quantize(x)`` of a 4096x4096 fp32 tensor with the usages the role
   needs in a quantized linear (input: rowwise for fprop + columnwise for wgrad; grad:
   rowwise for dgrad + columnwise for wgrad; both usages for every recipe), followed by
   ``dequantize("rowwise")`` and ``dequantize("columnwise")``, as a ratio of ``x.clone()``.
   The grad role is the one that carries stochastic rounding under NVFP4; NVFP4 RHT applies
   to the columnwise copy of both roles. Target <= 8x for every recipe and role (aim 5x).
2. quantized ``Linear`` fwd+bwd (2048x2048 weight, 4096 tokens, fp32, inside ``autocast``)
   as a ratio of fp32 ``nn.Linear`` fwd+bwd. Target <= 1.5x (NVFP4 with RHT and SR <= 2x).

Each ratio: warm-up, then ``--repeats`` pairs (baseline, candidate) timed back to back; the
ratio is the median of the per-pair ratios (on a shared machine the load drifts; pairing
keeps each candidate next to its own baseline). min(candidate)/min(baseline) is printed in
parentheses as a noise indicator: the two agree when the machine was quiet. PASS/FAIL uses
the smaller of the two (the paired median is inflated by load spikes, min/min by a lucky
baseline; both are printed). Usage:
``.venv/bin/python bench/quantize.py [--quick] [--repeats 3] [--threads N] [--skip-linear]``
(default: ~1-2 minutes on 2 shared cores; ``--quick`` uses one timed pair per figure).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from lptrain.precision import recipes as R
from lptrain.precision.autocast import autocast
from lptrain.precision.layers import Linear

RECIPES: dict[str, Callable[[], Any]] = {
    "delayed": lambda: R.DelayedScaling(fp8_format="hybrid", amax_history_len=16),
    "tensorwise": lambda: R.TensorwiseScaling(fp8_format="hybrid"),
    "blockwise": lambda: R.BlockwiseScaling(),
    "mxfp8": lambda: R.MXFP8Scaling(),
    "nvfp4": lambda: R.NVFP4Scaling(disable_rht=True, disable_stochastic_rounding=True),
    "nvfp4 rht+sr": lambda: R.NVFP4Scaling(),
}


QDQ_TARGET = 8.0  # q+dq ratio to clone(), every recipe and role (aim 5x)


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def paired_ratio(fn: Callable[[], Any], base: Callable[[], Any], repeats: int) -> tuple[float, float, float]:
    """(median per-pair ratio fn/base, min fn / min base, min base time in seconds)."""
    fn()
    base()
    ratios: list[float] = []
    bases: list[float] = []
    cands: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0))
        bases.append(t1 - t0)
        cands.append(t2 - t1)
    return statistics.median(ratios), min(cands) / min(bases), min(bases)


def _quantizer(recipe: Any, role: str) -> Any:
    if recipe.name == "delayed":
        return recipe.make_quantizer(role, True, True, state=recipe.make_state(role))
    return recipe.make_quantizer(role, True, True)


def qdq_ratio(recipe: Any, role: str, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    q = _quantizer(recipe, role)

    def run() -> None:
        t = q.quantize(x)
        t.dequantize("rowwise")
        t.dequantize("columnwise")

    r, alt, _ = paired_ratio(run, lambda: x.clone(), repeats)
    return r, alt


def linear_fwd_bwd(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
                   ctx: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        xx = x.clone().requires_grad_(True)
        for p in module.parameters():
            p.grad = None
        with ctx():
            y = module(xx)
        y.backward(dy)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one timed pair per figure (noisier)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--skip-linear", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    console = Console(width=150)

    x = torch.randn(4096, 4096)
    base_clone = min(median_time(lambda: x.clone(), 1) for _ in range(args.repeats))
    hidden, tokens = 2048, 4096
    xl = torch.randn(tokens, hidden)
    dyl = torch.randn(tokens, hidden)
    ref = torch.nn.Linear(hidden, hidden, bias=False)
    ref_run = linear_fwd_bwd(ref, xl, dyl, contextlib.nullcontext)
    lin_bases: list[float] = []

    table = Table(title=f"Emulated quantization cost (torch threads: {torch.get_num_threads()})")
    table.add_column("recipe")
    table.add_column("q+dq input\n(x clone)", justify="right")
    table.add_column("q+dq grad\n(x clone)", justify="right")
    table.add_column("linear fwd+bwd\n(x fp32 nn.Linear)", justify="right")
    table.add_column("targets\nq+dq / linear", justify="right")
    table.add_column("result", justify="center")
    # All quantize rows first, then all linear rows: the linear runs leave the allocator in a
    # state (large freed blocks) that makes later small-temporary workloads measurably slower.
    qdq = {}
    for name, make in RECIPES.items():
        recipe = make()
        qdq[name] = (qdq_ratio(recipe, "input", x, args.repeats), qdq_ratio(recipe, "grad", x, args.repeats))
    all_pass = True
    for name, make in RECIPES.items():
        recipe = make()
        lin_txt, lin_ok = "-", True
        lin_target = 2.0 if "sr" in name else 1.5
        if not args.skip_linear:
            lin = Linear(hidden, hidden, params_dtype=torch.float32)
            run = linear_fwd_bwd(lin, xl, dyl, lambda r=recipe: autocast(r))
            ratio, alt, b = paired_ratio(run, ref_run, args.repeats)
            lin_bases.append(b)
            lin_txt = f"{ratio:.2f} ({alt:.2f})"
            lin_ok = min(ratio, alt) <= lin_target
        r_in, r_gr = qdq[name]
        in_ok, gr_ok = min(r_in) <= QDQ_TARGET, min(r_gr) <= QDQ_TARGET
        checks = [("in", in_ok), ("grad", gr_ok)] + ([] if args.skip_linear else [("lin", lin_ok)])
        verdict = " ".join(f"{label} {'PASS' if ok else 'FAIL'}" for label, ok in checks)
        all_pass &= in_ok and gr_ok and lin_ok
        table.add_row(name, f"{r_in[0]:.1f} ({r_in[1]:.1f})", f"{r_gr[0]:.1f} ({r_gr[1]:.1f})",
                      lin_txt, f"<={QDQ_TARGET:g} / <={lin_target:g}", verdict)
    console.print(table)
    console.print(
        "q+dq = quantize(x) with rowwise+columnwise usage (what the role needs in a quantized "
        "linear) + dequantize('rowwise') + dequantize('columnwise'), 4096x4096 fp32; "
        "grad role = NVFP4 stochastic rounding"
    )
    console.print("ratio = median of interleaved per-pair ratios; (min/min) shows the noise; "
                  "PASS/FAIL on the smaller of the two")
    console.print(
        f"baselines: clone(4096x4096 fp32) {base_clone * 1e3:.1f} ms; "
        + (f"nn.Linear fwd+bwd (2048x2048, 4096 tokens) {min(lin_bases) * 1e3:.0f} ms"
           if lin_bases else "linear skipped")
    )
    console.print(f"overall: {'PASS' if all_pass else 'FAIL'} (repeats={args.repeats})")


if __name__ == "__main__":
    main()
