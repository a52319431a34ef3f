#!/usr/bin/env python3
"""The GPU check: run on one CUDA GPU (an H100/H200 with a CUDA torch >= 2.11) in under 8 minutes.

    make gpu-check                  # or: PYTHONPATH=. python3 scripts/gpu_check.py --out DIR

Without Transformer Engine installed:
  1. the gpu-marked tests that need no TE (``pytest -m "gpu and not te"``);
  2. every recipe's quantizers on CUDA bit-identical to the CPU emulation;
  3. every ``*_cpu`` recipe for 20 steps with ``run.device=cuda`` (emulated backend) against
     the same run on the CPU: losses within ``LOSS_RTOL`` (lptrain.testing.gpu_check);
  4. tokens/s and MFU of a medium bf16 GPT against the device's bf16 peak, and its peak
     memory against ``lptrain estimate-memory``'s figure;
  5. bench/gpu_speed.py: every recipe with a torch scaled-GEMM kernel on this GPU against
     bf16 (tokens/s ratios, MFU; an 8B-shaped layer stack and the 24x3072 GPT), with and
     without train.compile, and the speed targets (printed, not failing the check).
With TE installed (NVIDIA's container, the project's Dockerfile) it adds the TE tests
(``pytest -m te``) and each quantized ``*_cpu`` recipe on ``precision.backend=te``.

Prints one line per check (PASS/FAIL) and writes ``gpu_check.json`` under ``--out``; exits 1
when a check fails, 2 when this python cannot import torch. On a node without network,
``make gpu-check WHEELHOUSE=dir`` first installs the other dependencies from a wheelhouse
(scripts/wheelhouse.py). ``--virtual`` runs steps 2-4 on lptrain's virtual GPU (a CPU machine),
which is how the CPU suite keeps this script working.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pytest(marker: str) -> tuple[bool, str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider",
                           str(ROOT / "tests")], capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    tail = lines[-1] if lines else proc.stderr.strip().splitlines()[-1:]
    return proc.returncode in (0, 5), f"pytest -m '{marker}': {tail}"  # 5: none collected


def _speed(args: argparse.Namespace, record: Any, results: list[dict]) -> None:
    """bench/gpu_speed.py: every recipe with a torch kernel here against bf16, with and without
    train.compile (its targets are printed, not checked: a speed figure is not a fault). On
    the virtual GPU its plan runs dry (one workload, bf16 and tensorwise, tiny shapes)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_speed as S

    try:
        if args.virtual:
            runs, sm, device = S.run(["24x3072"], steps=1, layers=1, compile_modes=[False],
                                     recipes=["bf16", "tensorwise"], dry=True)
        else:
            runs, sm, device = S.run(args.speed_workloads.split(","), steps=args.speed_steps,
                                     layers=2, compile_modes=[False, True])
        for line in S.report(runs, sm, device):
            print(f"INFO  {line}", flush=True)
        bad = [m for m in runs if m.error]
        record("gpu_speed", not bad, f"{len(runs) - len(bad)} of {len(runs)} configurations ran"
               + (f"; first failure: {bad[0].recipe} {bad[0].workload}: {bad[0].error}" if bad else ""))
        results.append({"check": "gpu_speed_figures", "ok": True,
                        "runs": [vars(m) for m in runs],
                        "targets": [{"target": n, "met": met, "detail": d}
                                    for n, met, d in S.targets(runs, sm)]})
    except Exception as e:
        record("gpu_speed", False, f"{type(e).__name__}: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="training steps per recipe comparison")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json")
    ap.add_argument("--virtual", action="store_true", help="run on the virtual GPU (CPU machine)")
    ap.add_argument("--recipes", nargs="*", default=None, help="only these *_cpu recipes")
    ap.add_argument("--speed-workloads", default="8b,24x3072", help="bench/gpu_speed.py workloads")
    ap.add_argument("--speed-steps", type=int, default=5, help="timed steps per gpu_speed run")
    args = ap.parse_args()

    try:
        import torch
    except ImportError as e:  # the wrong python (PY=...), or a venv hiding the node's torch
        print(f"error: {sys.executable} cannot import torch ({e}): run the GPU check with the "
              "python that has the node's CUDA torch (make gpu-check PY=/path/to/python)",
              file=sys.stderr)
        return 2

    from lptrain.precision.te_adapter import te_importable
    from lptrain.testing import gpu_check as G
    from lptrain.testing.virtual_cuda import VirtualCuda

    results: list[dict] = []
    t_start = time.perf_counter()

    def record(name: str, ok: bool, detail: str) -> None:
        results.append({"check": name, "ok": ok, "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    with VirtualCuda() if args.virtual else contextlib.nullcontext():
        if not torch.cuda.is_available():
            record("cuda", False, "no CUDA device (torch.cuda.is_available() is False)")
            return 1
        te = te_importable() and not args.virtual
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()} "
              f"(sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
              f"Transformer Engine {'installed' if te else 'not installed'}", flush=True)
        if not args.virtual:
            ok, detail = _pytest("gpu and not te")
            record("gpu tests (no TE)", ok, detail)
            if te:
                ok, detail = _pytest("te")
                record("TE tests", ok, detail)
        for r in G.quantizer_identity():
            record(r.name, r.ok, r.detail)
        recipes = args.recipes or sorted(p.name for p in (ROOT / "recipes").glob("*_cpu.yaml"))
        for recipe in recipes:
            try:
                r = G.compare_recipe(recipe, steps=args.steps)
                record(r.name, r.ok, r.detail)
            except Exception as e:  # report and continue: one broken recipe must not hide others
                record(f"recipe {recipe}", False, f"{type(e).__name__}: {e}")
            if te and not recipe.startswith(("tiny", "bf16")):
                try:
                    r = G.compare_recipe(recipe, steps=args.steps, overrides=("precision.backend=te",))
                    record(f"{r.name} on TE", r.ok, r.detail)
                except Exception as e:
                    record(f"recipe {recipe} on TE", False, f"{type(e).__name__}: {e}")
        small = ("model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
                 "model.num_attention_heads=4", "model.num_query_groups=4", "model.seq_length=128",
                 "train.micro_batch_size=2", "train.global_batch_size=2") if args.virtual else ()
        try:
            tp = G.throughput(steps=2 if args.virtual else 10, overrides=small)
            for line in tp.lines():
                print(f"INFO  {line}", flush=True)
            ratio = tp.peak_bytes / max(tp.estimated_bytes, 1)
            record("peak memory vs estimate-memory", 0.5 <= ratio <= 1.5, f"{ratio:.2f}x (0.5-1.5)")
            results.append({"check": "throughput", "ok": True, "tokens_per_s": tp.tokens_per_s,
                             "mfu": tp.mfu, "peak_bytes": tp.peak_bytes, "estimated_bytes": tp.estimated_bytes})
        except Exception as e:
            record("throughput", False, f"{type(e).__name__}: {e}")
        _speed(args, record, results)
    failed = [r for r in results if not r["ok"]]
    print(f"gpu-check: {len(results) - len(failed)} passed, {len(failed)} failed "
          f"in {time.perf_counter() - t_start:.0f}s", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
