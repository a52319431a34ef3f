"""Host cost per parameter tensor: the engine's step vs a plain loop on a deep narrow model.

The model is 24 layers of hidden 32 (147 parameter tensors, a 2 x 32-token micro-batch), so
the GEMMs cost next to nothing and what is timed is the Python and kernel-launch work done
per tensor: grad hooks, the NaN check, the grad norm, clipping, the optimizer, the master
write-back and (with quantized primary weights) the requantization. On a GPU this per-tensor
host cost caps utilisation for small and medium models; on this CPU it is the part that can
be measured.

Per variant, in the same run on a model with the same layers and init:

* lptrain: ``TrainEngine.train_step`` at DP=1 (the distributed optimizer, as the recipes
  run it, so masters live in the optimizer and are staged back every step);
* plain: ``forward; backward; clip_grad_norm_; optimizer.step(); zero_grad()`` on the
  model's own params.

Variants:

* ``bf16``: bf16 params, AdamW; plain: ``torch.optim.AdamW(foreach=True)``;
* ``mxfp8 param gather``: MXFP8 GEMMs with MXFP8 primary weights
  (``precision.fp8_param_gather``) staged through the grad buffer
  (``ddp.reuse_grad_buf_for_mxfp8_param_ag``); plain: the same MXFP8 GEMMs on bf16 weights
  (a plain loop cannot step quantized primary weights), ``torch.optim.AdamW(foreach=True)``;
* ``layer-wise muon``: Muon on the hidden matrices through the layer-wise distributed
  optimizer (``optimizer.use_layer_wise_optimizer``, derived from Muon + the distributed
  optimizer), AdamW on the rest; plain: ``torch.optim.Muon`` (present in this torch) on the
  2-D hidden matrices plus ``torch.optim.AdamW(foreach=True)`` on the rest. QKV is
  orthogonalised whole on both sides (``optimizer.muon.split_qkv=false``) so both run the
  same Newton-Schulz work.

Reference (bf16 only, no target): ``plain, fp32 masters`` -- the plain loop doing the same
mixed-precision work as the engine by design: bf16 params, an fp32 master copy of each, the
bf16 grads cast into fp32 master grads (``_foreach_copy_``), the norm and clipping on those,
``torch.optim.AdamW(foreach=True)`` on the masters (fp32 moments), the masters copied back
into the bf16 params. ``lptrain vs plain, fp32 masters`` is the engine's host cost alone;
``plain, fp32 masters vs plain`` the part of the bf16 ratio that fp32 masters and moments
cost whatever the engine does.

Target: lptrain at most 1.05x the plain loop for every variant. Rounds alternate the two
and repeat until each ratio's median is known within ``--spread`` or ``--cap`` seconds pass
per variant (``bench/harness.py``; REGRESSED against ``bench/baseline.json``).

    .venv/bin/python bench/host_overhead.py [--cap 40] [--only bf16] [--save-baseline]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from harness import Figure, Ratio, add_args, report, rounds
from rich.console import Console
from workload import fp32_masters_step, train_batches

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.model import build_model
from lptrain.model.params import is_muon_param
from lptrain.train.engine import TrainEngine

TARGET = 1.05
MODEL = ["model.num_layers=24", "model.hidden_size=32", "model.ffn_hidden_size=128",
         "model.num_attention_heads=2", "model.num_query_groups=2", "model.seq_length=32"]
COMMON = ["data.builtin_max_mb=2", "logging.progress=false", "checkpoint.save=null",
          "train.global_batch_size=2", "train.micro_batch_size=2",
          "ddp.use_distributed_optimizer=true", *MODEL]
VARIANTS = {
    "bf16": [],
    "mxfp8 param gather": ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8",
                           "precision.fp8_param_gather=true",
                           "ddp.reuse_grad_buf_for_mxfp8_param_ag=true"],
    "layer-wise muon": ["optimizer.name=muon", "optimizer.muon.split_qkv=false"],
}
# the plain loop's model: the same GEMM recipe on ordinary (bf16) weights
PLAIN_DROPS = ("precision.fp8_param_gather", "ddp.reuse_grad_buf")


def _plain_optimizers(model: torch.nn.Module, cfg: Any) -> list[torch.optim.Optimizer]:
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    adamw = {"lr": o.lr, "weight_decay": o.weight_decay, "betas": (o.adam_beta1, o.adam_beta2),
             "eps": o.adam_eps, "foreach": True}
    if o.name != "muon":
        return [torch.optim.AdamW(params, **adamw)]
    matrices = [p for p in params if is_muon_param(p) and p.dim() == 2]
    rest = [p for p in params if not any(p is m for m in matrices)]
    return [torch.optim.Muon(matrices, lr=o.lr, weight_decay=o.weight_decay,
                             momentum=o.muon.momentum, nesterov=o.muon.nesterov, ns_steps=o.muon.ns_steps),
            torch.optim.AdamW(rest, **adamw)]


def _masters_step(model: torch.nn.Module, cfg: Any) -> Any:
    """The plain loop with fp32 masters (the module doc's reference), as a step function."""

    def backward(batches: list[dict[str, torch.Tensor]]) -> None:
        n = len(batches)
        for b in batches:
            with model.autocast():
                loss, _ = model(b["tokens"], labels=b["labels"])
            (loss / n).backward()

    return fp32_masters_step(model, cfg, backward)


def _bench(name: str, overrides: list[str], args: Any) -> tuple[list[Figure], int, dict[str, float]]:
    cfg = derive(load("tiny_cpu.yaml", [*COMMON, *overrides]).cfg, World.detect())
    engine = TrainEngine(cfg)
    plain_ov = [o for o in overrides if not o.startswith(PLAIN_DROPS)]
    plain_cfg = derive(load("tiny_cpu.yaml", [*COMMON, *plain_ov]).cfg, World.detect())
    plain_model = build_model(plain_cfg)  # same layers and init (seeded by name), no engine
    opts = _plain_optimizers(plain_model, cfg)
    params = [p for p in plain_model.parameters() if p.requires_grad]
    train_it, n = train_batches(cfg)
    step = [0]

    def lptrain_step() -> None:
        step[0] += 1
        engine.train_step([next(train_it) for _ in range(n)], step[0])

    def plain_step() -> None:
        for _ in range(n):
            b = next(train_it)
            with plain_model.autocast():
                loss, _ = plain_model(b["tokens"], labels=b["labels"])
            (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optimizer.clip_grad, foreach=True)
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)

    fns = {"lptrain": lptrain_step, "plain": plain_step}
    ratios = [Ratio(name, "lptrain", "plain", TARGET)]
    if name == "bf16":  # the reference (no target): see the module doc
        masters_model = build_model(plain_cfg)
        masters_step = _masters_step(masters_model, cfg)
        fns["plain, fp32 masters"] = lambda: masters_step([next(train_it) for _ in range(n)])
        ratios += [Ratio(f"{name}: lptrain vs plain, fp32 masters", "lptrain", "plain, fp32 masters"),
                   Ratio(f"{name}: plain, fp32 masters vs plain", "plain, fp32 masters", "plain")]
    r = rounds(args, ratios)
    r.run(fns, warmup=3)
    import statistics

    return r.figures(), len(params), {k: statistics.median(v) for k, v in r.series.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=list(VARIANTS), action="append",
                    help="run only this variant (repeatable)")
    add_args(ap, cap_s=40.0, settle=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    figures, lines = [], []
    for name, ov in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        figs, tensors, medians = _bench(name, ov, args)
        figures.extend(figs)
        steps = ", ".join(f"{k} {v * 1e3:.1f} ms/step" for k, v in medians.items())
        lines.append(f"{name}: {tensors} param tensors; {steps}, {len(figs[0].samples)} rounds")
    report(Console(width=120), "host_overhead",
           f"engine step vs plain loop, 24 x hidden 32 (DP=1, {args.threads} thread(s))",
           figures, args, "\n".join(lines))


if __name__ == "__main__":
    main()
