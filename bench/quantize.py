"""Emulated quantization cost per recipe (not a test): figures with PASS/FAIL and REGRESSED.

1. q+dq = one ``quantizer.quantize(x)`` of a 4096x4096 fp32 tensor with the usages the role
   needs in a quantized linear (input: rowwise for fprop + columnwise for wgrad; grad:
   rowwise for dgrad + columnwise for wgrad; both usages for every recipe), followed by
   ``dequantize("rowwise")`` and ``dequantize("columnwise")``, as a ratio of ``x.clone()``.
   The grad role is the one that carries stochastic rounding under NVFP4; NVFP4 RHT applies
   to the columnwise copy of both roles. Target <= 8x for every recipe and role (aim 5x).
2. quantized ``Linear`` fwd+bwd (2048x2048 weight, 4096 tokens, fp32, inside ``autocast``)
   as a ratio of fp32 ``nn.Linear`` fwd+bwd. Target <= 1.5x (NVFP4 with RHT and SR <= 2x).
3. under the table, the NVFP4 rht+sr grad q+dq split into its quantize (with its SR draws
   replayed alone, :mod:`sr_draws`) and its two dequantizes, each x clone: the parts that
   stay whatever the kernels do (no target).

Measurement (``bench/harness.py``): rounds in which every candidate is timed right after its
own baseline, repeated until every median is known within ``--spread`` or ``--cap`` seconds
pass (per part); the figure is the median of the per-round ratios, min/min is printed next
to it, and a figure more than 25% worse than ``bench/baseline.json`` reads REGRESSED. Usage:
``.venv/bin/python bench/quantize.py [--cap 60] [--threads N] [--skip-linear] [--save-baseline]``
(about 2 minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from harness import Ratio, add_args, report, rounds
from rich.console import Console
from sr_draws import record_draws, replay_draws

from lptrain.precision import recipes as R
from lptrain.precision.autocast import autocast
from lptrain.precision.layers import Linear
from lptrain.precision.scratch import Workspace

RECIPES: dict[str, Callable[[], Any]] = {
    "delayed": lambda: R.DelayedScaling(fp8_format="hybrid", amax_history_len=16),
    "tensorwise": lambda: R.TensorwiseScaling(fp8_format="hybrid"),
    "blockwise": lambda: R.BlockwiseScaling(),
    "mxfp8": lambda: R.MXFP8Scaling(),
    "nvfp4": lambda: R.NVFP4Scaling(disable_rht=True, disable_stochastic_rounding=True),
    "nvfp4 rht+sr": lambda: R.NVFP4Scaling(),
}


QDQ_TARGET = 8.0  # q+dq ratio to clone(), every recipe and role (aim 5x)


def _quantizer(recipe: Any, role: str) -> Any:
    if recipe.name == "delayed":
        return recipe.make_quantizer(role, True, True, state=recipe.make_state(role))
    return recipe.make_quantizer(role, True, True)


def qdq(recipe: Any, role: str, x: torch.Tensor) -> Callable[[], None]:
    q = _quantizer(recipe, role)

    def run() -> None:
        t = q.quantize(x)
        t.dequantize("rowwise")
        t.dequantize("columnwise")

    return run


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


def nvfp4_sr_split(x: torch.Tensor, n_rounds: int) -> str:
    """One note line: the NVFP4 rht+sr grad q+dq cut into its parts, each the median over
    ``n_rounds`` of its time over the clone timed right before it (as the figure is).

    Why: the figure's target assumes the cost can be cut; two parts cannot be without
    changing what is computed. The SR draws (:mod:`sr_draws`: the quantizer's own draws,
    replayed) are serial on the CPU generator and fixed by the seed, and each dequantize
    writes a fresh fp32 output as large as the clone's, so it pays the clone's page faults.
    """
    q = _quantizer(RECIPES["nvfp4 rht+sr"](), "grad")
    sizes = record_draws(lambda: q.quantize(x))
    gen, ws = torch.Generator().manual_seed(0), Workspace()
    t = q.quantize(x)
    parts: dict[str, Callable[[], Any]] = {
        "quantize": lambda: q.quantize(x),
        "its SR draws alone": lambda: replay_draws(sizes, gen, ws),
        "dequantize rowwise": lambda: t.dequantize("rowwise"),
        "dequantize columnwise": lambda: t.dequantize("columnwise"),
    }
    ratios: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(n_rounds):
        for k, fn in parts.items():
            t0 = time.perf_counter()
            x.clone()
            t1 = time.perf_counter()
            fn()
            ratios[k].append((time.perf_counter() - t1) / (t1 - t0))
    med = {k: statistics.median(v) for k, v in ratios.items()}
    return (f"nvfp4 rht+sr q+dq grad, split ({n_rounds} rounds, x clone): quantize {med['quantize']:.2f} "
            f"(its SR draws alone {med['its SR draws alone']:.2f}: {len(sizes)} draws, "
            f"{sum(sizes) / 2**20:.0f} MiB from the serial CPU generator), dequantize rowwise "
            f"{med['dequantize rowwise']:.2f} + columnwise {med['dequantize columnwise']:.2f} (each "
            "writes a fresh fp32 output of the clone's size)")


def paired(cands: dict[str, Callable[[], None]], base: Callable[[], None]) -> dict[str, Callable[[], None]]:
    """Each candidate right after its own baseline call (series ``base:<name>``, ``<name>``)."""
    out: dict[str, Callable[[], None]] = {}
    for name, fn in cands.items():
        out[f"base:{name}"] = base
        out[name] = fn
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--skip-linear", action="store_true")
    ap.add_argument("--split-rounds", type=int, default=7,
                    help="rounds of the NVFP4 rht+sr q+dq split printed under the table")
    add_args(ap, cap_s=60.0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    console = Console(width=150)

    # All quantize rounds first, then all linear rounds: the linear runs leave the allocator in
    # a state (large freed blocks) that makes later small-temporary workloads measurably slower.
    x = torch.randn(4096, 4096)
    cands = {f"{name} q+dq {role}": qdq(make(), role, x) for name, make in RECIPES.items()
             for role in ("input", "grad")}
    q = rounds(args, [Ratio(n, n, f"base:{n}", QDQ_TARGET) for n in cands]).run(
        paired(cands, lambda: x.clone()))
    figures = q.figures()
    notes = [f"q+dq: {q.n} rounds ({q.stop_reason()}); clone(4096x4096 fp32) "
             f"{min(q.series['base:' + next(iter(cands))]) * 1e3:.1f} ms",
             nvfp4_sr_split(x, args.split_rounds)]
    if not args.skip_linear:
        hidden, tokens = 2048, 4096
        xl, dyl = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
        ref = torch.nn.Linear(hidden, hidden, bias=False)
        ref_run = linear_fwd_bwd(ref, xl, dyl, contextlib.nullcontext)
        lin = {}
        for name, make in RECIPES.items():
            module = Linear(hidden, hidden, params_dtype=torch.float32)
            lin[f"{name} linear fwd+bwd"] = linear_fwd_bwd(module, xl, dyl, lambda r=make(): autocast(r))
        lr = rounds(args, [Ratio(n, n, f"base:{n}", 2.0 if "sr" in n else 1.5) for n in lin]).run(
            paired(lin, ref_run))
        figures += lr.figures()
        notes.append(f"linear: {lr.n} rounds ({lr.stop_reason()}); nn.Linear fwd+bwd (2048x2048, "
                     f"4096 tokens) {min(lr.series['base:' + next(iter(lin))]) * 1e3:.0f} ms")
    note = ("q+dq = quantize(x) with rowwise+columnwise usage + dequantize('rowwise') + "
            "dequantize('columnwise'), 4096x4096 fp32, x clone(); grad role = NVFP4 stochastic "
            "rounding; linear = quantized Linear fwd+bwd x fp32 nn.Linear\n" + "\n".join(notes))
    report(console, "quantize", f"Emulated quantization cost (torch threads: {torch.get_num_threads()})",
           figures, args, note)


if __name__ == "__main__":
    main()
