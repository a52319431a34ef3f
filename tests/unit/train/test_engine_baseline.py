"""The engine at DP=1 against the single-process trainer it replaced (the DP=1 baseline).

Intended numerical change: the old trainer accumulated each micro-batch's gradient in the
params' own dtype (``p.grad``, bf16 for bf16 params) and upcast once; the engine accumulates
into fp32 ``main_grad`` views of the grad buffer (``ddp.grad_reduce_in_fp32``). With fp32
params the two compute the same fp32 sums; the only other difference is AdamW's foreach
kernel, which is elementwise identical: losses and masters agree to 1e-6 relative. With bf16
params the old bf16 accumulation rounds each micro-batch's gradient: losses agree to 1e-3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _reference_trainer import MasterOptimizer

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.data import build_train_valid_loaders
from lptrain.model import build_model
from lptrain.optim.schedule import lr_at
from lptrain.precision.factory import build_factory
from lptrain.testing.parity import train_steps

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "checkpoint.save=null",
        "train.micro_batch_size=2", "train.gradient_accumulation_fusion=false"]


def _reference(overrides: list[str], steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = derive(load("tiny_cpu.yaml", overrides).cfg, World(dp=1))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, build_factory(cfg.precision, num_layers=cfg.model.num_layers))
    opt = MasterOptimizer(model, cfg)
    t, o = cfg.train, cfg.optimizer
    it, _ = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=0, dp_size=1, vocab_size=cfg.model.vocab_size,
    )
    n = t.global_batch_size // t.micro_batch_size
    losses = []
    for step in range(steps):
        total = 0.0
        for _ in range(n):
            b = next(it)
            loss, aux = model(b["tokens"], labels=b["labels"])
            (loss / n).backward()
            total += aux["lm_loss"].item() / n
        lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_iters=o.warmup_iters,
                   decay_iters=o.decay_iters or t.train_iters, schedule=o.lr_schedule)
        opt.step(lr)
        losses.append(total)
    names = {id(p): n for n, p in model.named_parameters()}
    return losses, {names[id(p)]: m.detach() for p, m in zip(opt.params, opt.masters, strict=True)}


@pytest.mark.parametrize(("dtype", "rtol", "extra"), [
    ("fp32", 1e-6, []), ("bf16", 1e-3, []),
    # Muon with Lion for the non-matrix params: the engine's sharded-master path against
    # MuonWithAdamW's Lion groups.
    ("fp32", 1e-6, ["optimizer.name=muon", "optimizer.muon.scalar_optimizer=lion"]),
], ids=["fp32", "bf16", "fp32-muon-lion"])
def test_engine_dp1_matches_the_single_process_trainer(dtype: str, rtol: float, extra: list[str]) -> None:
    ov = [*BASE, f"precision.params_dtype={dtype}", *extra]
    ref_losses, ref_masters = _reference(ov, 3)
    got = train_steps("tiny_cpu.yaml", ov, steps=3)
    assert got["losses"] == pytest.approx(ref_losses, rel=rtol)
    assert got["masters"].keys() == ref_masters.keys()
    for name, ref in ref_masters.items():
        a = got["masters"][name].reshape(ref.shape)
        # masters move by lr-sized steps from identical inits: normwise within 10x rtol
        assert float((a - ref).norm() / ref.norm()) < 10 * rtol, name


def test_muon_and_adamw_groups_follow_their_own_lr() -> None:
    """optimizer.muon.lr gives the Muon group its own schedule; AdamW groups keep optimizer.lr
    (min lr scaled by the same ratio), through warmup and decay."""
    from lptrain.train.engine import TrainEngine

    ov = [*BASE, "optimizer.name=muon", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
          "optimizer.muon.lr=3e-3", "optimizer.warmup_iters=2", "train.train_iters=6"]
    engine = TrainEngine(derive(load("tiny_cpu.yaml", ov).cfg, World(dp=1)))
    for step in range(1, 7):
        lrs = engine.lr_for_step(step)
        assert set(lrs) >= {"muon", "adamw_decay", "adamw_no_decay"}
        assert lrs["muon"] == pytest.approx(3 * lrs["adamw_decay"], rel=1e-12)
    assert engine.lr_for_step(7)["adamw_decay"] == pytest.approx(1e-4)  # end of the decay
    assert engine.lr_for_step(7)["muon"] == pytest.approx(3e-4)
    tokens = torch.randint(0, 200, (2, 128))
    res = engine.train_step([{"tokens": tokens, "labels": tokens}], 1)
    assert res.lrs["muon"] == pytest.approx(1.5e-3) and res.lrs["adamw_decay"] == pytest.approx(5e-4)
    groups = {g["name"]: g["lr"] for c in engine.optimizer.children for o in c.optimizers for g in o.param_groups}
    assert groups["muon"] == pytest.approx(1.5e-3) and groups["adamw_no_decay"] == pytest.approx(5e-4)
