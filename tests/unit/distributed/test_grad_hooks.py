"""Which params carry a grad hook, and that going without one changes no bit.

lptrain's fused-wgrad layers add the weight grad into ``main_grad`` and hand autograd none,
so without ``ddp.overlap_grad_reduce`` (nothing waits for their readiness) the engine keeps
no per-weight hook on them (``DataParallel._hook_free_params``); ``backward_phase`` does the
rest of the hook's work once per backward. One process, the tiny model, 2 micro-batches.
"""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.distributed.ddp import DataParallel
from lptrain.precision.params import fused_wgrad_weights
from lptrain.train.engine import TrainEngine

SMALL = ["data.builtin_max_mb=1", "train.micro_batch_size=2", "train.global_batch_size=4",
         "model.seq_length=64", "logging.progress=false", "checkpoint.save=null"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _engine(*overrides: str) -> TrainEngine:
    return TrainEngine(derive(load("tiny_cpu.yaml", [*SMALL, *overrides]).cfg, World(dp=1)))


def _batches(seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        tok = torch.randint(0, 250, (2, 65), generator=gen)
        out.append({"tokens": tok[:, :-1], "labels": tok[:, 1:]})
    return out


def _grads(e: TrainEngine) -> list[torch.Tensor]:
    return [b.grad_data.clone() for b in e.ddp.buffers]


def test_only_fused_weights_go_without_a_hook_and_only_without_overlap() -> None:
    e = _engine()
    fused = {id(p) for p in fused_wgrad_weights(e.model)}
    assert e.ddp._unhooked and {id(p) for p in e.ddp._unhooked} == fused
    assert all(p.main_grad_unhooked for p in e.ddp._unhooked)
    overlapped = _engine("ddp.overlap_grad_reduce=true")
    assert overlapped.ddp._unhooked == []
    assert not any(getattr(p, "main_grad_unhooked", False) for p in overlapped.model.parameters())


def test_unhooked_weights_accumulate_bitwise_as_hooked_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two micro-batches into the grad buffer, then two whole steps: the same bits with a
    hook on every param (the hook-free set forced empty) as without."""
    unhooked = _engine()
    monkeypatch.setattr(DataParallel, "_hook_free_params", lambda self, model: [])
    hooked = _engine()
    assert hooked.ddp._unhooked == [] and unhooked.ddp._unhooked
    for e in (unhooked, hooked):
        e.ddp.begin_step(e.optimizer.stage)
        e._forward_backward(_batches(0))
        e.ddp.finish_grad_sync()
    assert all(torch.equal(a, b) for a, b in zip(_grads(unhooked), _grads(hooked), strict=True))
    assert all(p.grad is None for p in unhooked.model.parameters())
    for e in (unhooked, hooked):
        e.ddp.zero_grad_buffer()
    results = [[e.train_step(_batches(s), s) for s in (1, 2)] for e in (unhooked, hooked)]
    assert [r.loss for r in results[0]] == [r.loss for r in results[1]]
    for (na, pa), (nb, pb) in zip(unhooked.model.named_parameters(), hooked.model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_a_stray_grad_on_an_unhooked_weight_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should autograd leave a ``.grad`` on an unhooked weight after all, the end of the
    backward moves it into ``main_grad`` as the hook would (shown failing: without that
    step the grad stays behind and never reaches the optimizer)."""
    def run(e: TrainEngine) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = e.ddp._unhooked[0]
        e.ddp.begin_step(e.optimizer.stage)
        before = w.main_grad.clone()
        with e.ddp.backward_phase():
            w.grad = torch.ones_like(w)  # as if a non-fused use of the weight had produced it
            w.grad_added_to_main_grad = False
        return w.main_grad - before, w.grad

    added, left = run(_engine())
    assert left is None and torch.equal(added, torch.ones_like(added))
    monkeypatch.setattr(DataParallel, "_collect_unhooked", lambda self: None)
    added, left = run(_engine())
    assert left is not None and not added.any()
