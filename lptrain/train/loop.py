"""Single-process pretraining loop: the default CPU job (`lptrain pretrain --recipe tiny_cpu.yaml`).

Walk of one run: factory (precision) -> model -> data -> fp32 master weights + AdamW or
Muon+AdamW -> loop (micro-batches, NaN guard, clip, step, LR schedule) -> eval -> metrics
JSONL + loss-curve PNG.

This is the data-parallel-free baseline. With one rank the distributed optimizer owns every
shard (Muon's layer-wise optimizer every matrix) and overlap settings have no collective to
overlap, so ``ddp.*`` flags are honoured trivially; FP8/FP4 primary weights are requantized
from the fp32 masters every step. A multi-rank launch is refused up front until the
distributed engine lands, never run half-way.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lptrain.config import World, derive
from lptrain.config.schema import LPTrainConfig
from lptrain.optim.schedule import lr_at


class TrainingDivergedError(RuntimeError):
    """A loss or gradient went NaN/Inf; the message names the step and the tensor."""


def _check_finite_grads(model: torch.nn.Module, step: int) -> None:
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and not bool(torch.isfinite(g).all()):
            bad = int((~torch.isfinite(g)).sum())
            raise TrainingDivergedError(
                f"step {step}: gradient of '{name}' has {bad} non-finite value(s); stopping"
            )


def _master_copy(p: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a model param.

    A quantized primary weight (FP8/FP4 param gather) is seeded from its high-precision init
    value, not from its dequantized bytes, so training starts from the true init; the
    model-side copy of that value is then freed.
    """
    from lptrain.precision.tensors import QuantizedTensor

    if isinstance(p, QuantizedTensor):
        init = p.high_precision_init_value()
        master = (init if init is not None else p.dequantize()).detach().float().clone()
        p.clear_high_precision_init_value()
        return master
    return p.detach().float().clone()


class _MasterOptimizer:
    """AdamW, or Muon + AdamW, over fp32 master copies of (possibly bf16 or quantized) params.

    Why masters: updating bf16 params in place loses small updates to rounding; the masters
    keep full precision and the model params are refreshed from them after every step
    (``copy_`` into a quantized param requantizes it: fp32 -> params dtype -> quantize).
    The masters carry the model params' optimizer tags (``use_muon``, ``is_qkv``, ...), so
    Muon routing and the QKV split read the same explicit metadata the model set.
    """

    def __init__(self, model: torch.nn.Module, cfg: LPTrainConfig) -> None:
        from lptrain.optim.param_groups import copy_param_attributes, split_params_for_muon

        o = cfg.optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [copy_param_attributes(p, _master_copy(p)) for p in self.params]
        if o.name == "muon":
            from lptrain.optim.muon import MuonWithAdamW

            self.opt = MuonWithAdamW(*split_params_for_muon(self.masters), o)
        else:
            decay = [m for m in self.masters if m.ndim >= 2]
            no_decay = [m for m in self.masters if m.ndim < 2]
            self.opt = torch.optim.AdamW(
                [
                    {"params": decay, "weight_decay": o.weight_decay},
                    {"params": no_decay, "weight_decay": 0.0},
                ],
                lr=o.lr,
                betas=(o.adam_beta1, o.adam_beta2),
                eps=o.adam_eps,
            )
        self.clip = o.clip_grad

    def step(self, lr: float) -> float:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(
            self.masters, self.clip if self.clip > 0 else float("inf")
        )
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m.to(p.dtype))
                p.grad = None
        return float(norm)


def _evaluate(model: torch.nn.Module, batches: Iterator[dict[str, torch.Tensor]], n: int, ctx) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(n):
            b = next(batches)
            with ctx():
                _, aux = model(b["tokens"], labels=b["labels"])
            total += aux["lm_loss"].item()
    model.train()
    return total / max(1, n)


def _write_plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records if "loss" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _start_wandb(cfg: LPTrainConfig, out: Path) -> Any:
    """A W&B run when ``logging.wandb`` is on (offline by default: no network needed)."""
    if not cfg.logging.wandb:
        return None
    import dataclasses

    import wandb

    return wandb.init(
        project=cfg.logging.wandb_project,
        name=cfg.run.name,
        mode=cfg.logging.wandb_mode,
        dir=str(out),
        config=dataclasses.asdict(cfg),
    )


def pretrain(cfg: LPTrainConfig, output_dir: str | Path) -> dict[str, Any]:
    """Run the single-process pretraining loop; returns a summary dict (also written to disk)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from lptrain.data import build_train_valid_loaders
    from lptrain.model import build_model
    from lptrain.precision.factory import build_factory

    console = Console()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise SystemExit(
            "lptrain pretrain: this build runs a single process; "
            f"not yet supported: WORLD_SIZE={world_size} (data parallelism)"
        )
    cfg = derive(cfg, World.detect())  # idempotent: the CLI already derived; direct callers may not
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    t = cfg.train
    num_micro = t.global_batch_size // t.micro_batch_size

    factory = build_factory(
        cfg.precision,
        num_layers=cfg.model.num_layers,
        fuse_wgrad_accumulation=False,
    )
    model = build_model(cfg, factory)
    autocast = model.autocast
    train_it, valid_it = build_train_valid_loaders(
        cfg.data,
        seq_length=cfg.model.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=0,
        dp_size=1,
        vocab_size=cfg.model.vocab_size,
    )
    opt = _MasterOptimizer(model, cfg)
    decay_iters = cfg.optimizer.decay_iters or t.train_iters
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]lptrain[/] {cfg.run.name}: {n_params / 1e6:.2f}M params, "
        f"{t.train_iters} steps x {t.global_batch_size} seqs x {cfg.model.seq_length} tokens"
    )

    records: list[dict[str, Any]] = []
    wandb_run = _start_wandb(cfg, out)
    metrics_path = out / "metrics.jsonl"
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    t0 = time.perf_counter()
    with metrics_path.open("w") as mf, Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not cfg.logging.progress,
    ) as progress:
        task = progress.add_task("training", total=t.train_iters)
        for step in range(t.train_iters):
            lr = lr_at(
                step,
                lr=cfg.optimizer.lr,
                min_lr=cfg.optimizer.min_lr,
                warmup_iters=cfg.optimizer.warmup_iters,
                decay_iters=decay_iters,
                schedule=cfg.optimizer.lr_schedule,
            )
            step_loss = 0.0
            for _ in range(num_micro):
                b = next(train_it)
                with autocast():
                    loss, aux = model(b["tokens"], labels=b["labels"])
                # `loss` already includes the MoE aux/z losses; `aux` holds detached parts for logs.
                if not math.isfinite(loss.item()):
                    raise TrainingDivergedError(f"step {step}: loss is {loss.item()}; stopping")
                (loss / num_micro).backward()
                step_loss += aux["lm_loss"].item() / num_micro
            _check_finite_grads(model, step)
            grad_norm = opt.step(lr)
            model.update_expert_bias()  # aux-loss-free balancing: no-op for dense models
            rec: dict[str, Any] = {"step": step + 1, "loss": step_loss, "lr": lr, "grad_norm": grad_norm}
            eval_now = t.eval_interval and (step + 1) % t.eval_interval == 0
            if eval_now or step + 1 == t.train_iters:
                rec["val_loss"] = _evaluate(model, valid_it, t.eval_iters, autocast)
            records.append(rec)
            mf.write(json.dumps(rec) + "\n")
            if wandb_run is not None:
                wandb_run.log(rec, step=step + 1)
            progress.update(task, advance=1, description=f"training loss {step_loss:.3f}")
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": t.train_iters,
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "val_loss": records[-1].get("val_loss"),
        "tokens_per_s": tokens_per_step * t.train_iters / elapsed,
        "seconds": elapsed,
    }
    if wandb_run is not None:
        wandb_run.summary.update(summary)
        wandb_run.finish()
    if cfg.logging.plots:
        _write_plot(records, out / "loss.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(
        f"done in {elapsed:.1f}s: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
        f"val {summary['val_loss']:.3f}, {summary['tokens_per_s']:.0f} tokens/s; "
        f"metrics, loss.png in {out}"
    )
    return summary
