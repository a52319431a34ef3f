"""Low precision against bf16 on one GPU: tokens/s and MFU of every recipe torch has a scaled
kernel for, with and without ``train.compile``, measured in one run (``make gpu-check`` runs
it). The ratios are each recipe's tokens/s over bf16's with the same compile setting.

Workloads (``--workloads``):

* ``8b``: an 8B-shaped layer stack (Llama-3-8B layers: hidden 4096, ffn 14336, 32 heads, 8
  KV groups), 8192 tokens per micro-batch (seq 8192), ``--layers`` layers (default 2), a
  byte vocabulary so the stack is what is timed;
* ``24x3072``: the 24-layer, hidden-3072 GPT the last gpu-check measured (ffn 12288, 24 heads,
  seq 2048, 4 sequences per micro-batch).

Every run is the real engine (``TrainEngine``: AdamW, fp32 masters, the data-parallel buffers
at dp 1) on the emulated backend with ``precision.quantized_gemm=scaled_mm``: the GEMMs of
Transformer Engine's recipes on torch's own kernels, the path a user without TE gets.
MFU is against the GPU's dense bf16 peak (``lptrain.catalog.gpus``) for every recipe, the
way torchtitan reports it. Targets (printed with PASS/FAIL, not failures of the check):
FP8 tensorwise and blockwise >= 1.30x bf16 tokens/s on H100/H200 (sm90), bf16 MFU >= 45% on
24x3072.

``--dry`` runs the same plan on lptrain's virtual GPU (a CPU machine) at tiny shapes, one
timed step, compile off: the bench's logic, not its figures (tests/unit/test_bench_gpu_speed.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# recipe name -> precision overrides (bf16: the baseline)
RECIPES: dict[str, tuple[str, ...]] = {
    "bf16": (),
    "tensorwise": ("precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise"),
    "blockwise": ("precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"),
    "mxfp8": ("precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"),
    "nvfp4": ("precision.fp4_format=e2m1",),
}
WORKLOADS: dict[str, tuple[str, ...]] = {
    "8b": ("model.hidden_size=4096", "model.ffn_hidden_size=14336", "model.num_attention_heads=32",
           "model.num_query_groups=8", "model.seq_length=8192", "train.micro_batch_size=1",
           "train.global_batch_size=1"),
    "24x3072": ("model.num_layers=24", "model.hidden_size=3072", "model.ffn_hidden_size=12288",
                "model.num_attention_heads=24", "model.num_query_groups=24",
                "model.seq_length=2048", "train.micro_batch_size=4", "train.global_batch_size=4"),
}
DRY = ("model.num_layers=1", "model.hidden_size=128", "model.ffn_hidden_size=256",
       "model.num_attention_heads=4", "model.num_query_groups=4", "model.seq_length=64",
       "train.micro_batch_size=2", "train.global_batch_size=2")
COMMON = ("logging.progress=false", "run.device=cuda", "precision.backend=emulated",
          "data.builtin_max_mb=8", "precision.params_dtype=bf16")
FP8_SPEEDUP_TARGET = 1.30  # FP8 tensorwise / blockwise over bf16 on sm90 (torchao: 1.25-1.28)
BF16_MFU_TARGET = 0.45  # bf16 on 24x3072 (torchtitan's Llama-3-8B: 33-39%)


@dataclass
class Measurement:
    workload: str
    recipe: str
    compiled: bool
    tokens_per_s: float
    mfu: Optional[float]
    error: str = ""


def recipes_for(sm: int, cuda_version: Optional[str]) -> list[str]:
    """bf16 and every recipe torch has a scaled kernel for here (lptrain.catalog.scaled_gemm)."""
    from lptrain.catalog.scaled_gemm import recipes_with_kernel

    have = set(recipes_with_kernel(sm, cuda_version))
    return ["bf16", *(r for r in RECIPES if r != "bf16" and r in have)]


def overrides_for(workload: str, recipe: str, compiled: bool, layers: int, dry: bool) -> list[str]:
    shape = list(WORKLOADS[workload])
    if workload == "8b":
        shape.append(f"model.num_layers={layers}")
    if dry:
        shape = list(DRY)
    gemm = ["precision.quantized_gemm=scaled_mm"] if RECIPES[recipe] else []  # bf16: none quantized
    return [*COMMON, *shape, *RECIPES[recipe], *gemm, f"train.compile={str(compiled).lower()}"]


def measure(workload: str, recipe: str, compiled: bool, *, steps: int, layers: int,
            dry: bool = False) -> Measurement:
    """Build the engine, run 2 warm-up steps (compilation, lazy state), then time ``steps``."""
    import torch

    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.data import build_train_valid_loaders
    from lptrain.model.flops import flops_per_token
    from lptrain.train.engine import TrainEngine
    from lptrain.train.metrics import peak_flops

    cfg = derive(load("tiny_cpu.yaml", overrides_for(workload, recipe, compiled, layers, dry)).cfg,
                 World.detect())
    engine = TrainEngine(cfg)
    t = cfg.train
    it, _ = build_train_valid_loaders(cfg.data, seq_length=cfg.model.seq_length,
                                      micro_batch_size=t.micro_batch_size,
                                      global_batch_size=t.global_batch_size, dp_rank=0, dp_size=1,
                                      vocab_size=cfg.model.vocab_size)
    n = t.global_batch_size // t.micro_batch_size
    warm = 1 if dry else 2
    for step in range(1, warm + 1):
        engine.train_step([next(it) for _ in range(n)], step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(warm + 1, warm + steps + 1):
        engine.train_step([next(it) for _ in range(n)], step)
    torch.cuda.synchronize()
    tps = steps * t.global_batch_size * cfg.model.seq_length / (time.perf_counter() - t0)
    peak = peak_flops(engine.device, "bf16")
    mfu = flops_per_token(cfg.model).total * tps / peak if peak else None
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return Measurement(workload, recipe, compiled, tps, mfu)


def ratios(results: list[Measurement]) -> dict[tuple[str, str, bool], float]:
    """Each recipe's tokens/s over bf16's, same workload and compile setting."""
    base = {(m.workload, m.compiled): m.tokens_per_s for m in results
            if m.recipe == "bf16" and not m.error}
    return {(m.workload, m.recipe, m.compiled): m.tokens_per_s / base[(m.workload, m.compiled)]
            for m in results if not m.error and (m.workload, m.compiled) in base}


def targets(results: list[Measurement], sm: int) -> list[tuple[str, Optional[bool], str]]:
    """(target, met: True/False/None when not measured here, detail)."""
    out: list[tuple[str, Optional[bool], str]] = []
    rs = ratios(results)
    for recipe in ("tensorwise", "blockwise"):
        got = {k: v for k, v in rs.items() if k[1] == recipe}
        name = f"FP8 {recipe} >= {FP8_SPEEDUP_TARGET:.2f}x bf16 tokens/s (H100/H200)"
        if sm != 90 or not got:
            out.append((name, None, f"not measured here (sm{sm})" if sm != 90 else "no run"))
            continue
        best = max(got.items(), key=lambda kv: kv[1])
        shown = ", ".join(f"{w}{' compiled' if c else ''} {v:.2f}x" for (w, _, c), v in sorted(got.items()))
        out.append((name, best[1] >= FP8_SPEEDUP_TARGET, shown))
    mfus = [m for m in results if m.workload == "24x3072" and m.recipe == "bf16" and not m.error
            and m.mfu is not None]
    name = f"bf16 MFU >= {100 * BF16_MFU_TARGET:.0f}% on 24x3072"
    if not mfus:
        out.append((name, None, "not measured"))
    else:
        best_m = max(mfus, key=lambda m: m.mfu or 0.0)
        shown = ", ".join(f"{'compiled' if m.compiled else 'eager'} {100 * (m.mfu or 0):.1f}%" for m in mfus)
        out.append((name, (best_m.mfu or 0.0) >= BF16_MFU_TARGET, shown))
    return out


def report(results: list[Measurement], sm: int, device: str) -> list[str]:
    """The table and the targets, as printed lines."""
    rs = ratios(results)
    lines = [f"gpu_speed on {device} (sm{sm}): tokens/s, x bf16 (same compile setting), MFU vs bf16 peak"]
    lines.append(f"{'workload':<9} {'recipe':<11} {'compile':<8} {'tokens/s':>12} {'x bf16':>7} {'MFU':>7}")
    for m in results:
        if m.error:
            lines.append(f"{m.workload:<9} {m.recipe:<11} {m.compiled!s:<8} FAILED: {m.error}")
            continue
        ratio = rs.get((m.workload, m.recipe, m.compiled))
        mfu = f"{100 * m.mfu:.1f}%" if m.mfu is not None else "n/a"
        lines.append(f"{m.workload:<9} {m.recipe:<11} {m.compiled!s:<8} {m.tokens_per_s:>12,.0f} "
                     f"{(f'{ratio:.2f}x' if ratio is not None else '-'):>7} {mfu:>7}")
    for name, met, detail in targets(results, sm):
        verdict = "n/a " if met is None else ("PASS" if met else "FAIL")
        lines.append(f"TARGET {verdict} {name}: {detail}")
    return lines


def run(workloads: list[str], *, steps: int, layers: int, compile_modes: list[bool],
        recipes: Optional[list[str]] = None, dry: bool = False) -> tuple[list[Measurement], int, str]:
    """Every (workload, recipe, compile) of the plan; a failing run is recorded and skipped."""
    import torch

    from lptrain.testing.virtual_cuda import VirtualCuda, active

    # dry: an H100 of the virtual GPU, unless the caller runs on one already (gpu_check --virtual)
    with VirtualCuda(capability=(9, 0)) if dry and active() is None else contextlib.nullcontext():
        major, minor = torch.cuda.get_device_capability()
        sm = major * 10 + minor
        device = torch.cuda.get_device_name()
        plan = recipes or recipes_for(sm, torch.version.cuda if not dry else None)
        results: list[Measurement] = []
        for workload in workloads:
            for compiled in compile_modes:
                for recipe in plan:
                    try:
                        m = measure(workload, recipe, compiled, steps=steps, layers=layers, dry=dry)
                    except Exception as e:  # one broken configuration must not hide the others
                        m = Measurement(workload, recipe, compiled, 0.0, None, f"{type(e).__name__}: {e}"[:200])
                    results.append(m)
                    print(f"  {workload} {recipe} compile={compiled}: "
                          f"{m.error or f'{m.tokens_per_s:,.0f} tokens/s'}", flush=True)
    return results, sm, device


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="8b,24x3072")
    ap.add_argument("--recipes", default=None, help="comma list (default: bf16 + every recipe "
                    "with a kernel on this GPU)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--layers", type=int, default=2, help="layers of the 8B-shaped stack")
    ap.add_argument("--compile", choices=("both", "on", "off"), default="both")
    ap.add_argument("--dry", action="store_true", help="the plan on the virtual GPU (CPU), tiny shapes")
    ap.add_argument("--out", type=Path, default=None, help="write gpu_speed.json here")
    args = ap.parse_args(argv)
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.compile]
    if args.dry:
        modes = [False]
    results, sm, device = run(args.workloads.split(","), steps=1 if args.dry else args.steps,
                              layers=args.layers, compile_modes=modes, dry=args.dry,
                              recipes=args.recipes.split(",") if args.recipes else None)
    for line in report(results, sm, device):
        print(line, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_speed.json").write_text(json.dumps(
            {"device": device, "sm": sm, "results": [asdict(m) for m in results],
             "targets": [{"target": n, "met": met, "detail": d} for n, met, d in targets(results, sm)]},
            indent=2) + "\n")
    return 1 if any(m.error for m in results) else 0


if __name__ == "__main__":
    sys.exit(main())
