"""The end-of-step syncs launch every bucket's collective before waiting on any.

Why it matters: with several buffers (dense and Muon, dense and expert) or several buckets
reduced at the end of the backward, waiting on each collective before launching the next
pays every latency in turn (on gloo, two in flight took 3.3 ms against 5.1 ms one after
the other). One process, the tiny model with Muon (a dense and a Muon buffer); the order
is recorded at the bucket seams, and the same predicate is shown false on the one-by-one
order it replaced.
"""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.distributed.bucket_group import Bucket
from lptrain.distributed.ddp import DataParallel
from lptrain.train.engine import TrainEngine

SMALL = ["data.builtin_max_mb=1", "train.micro_batch_size=2", "train.global_batch_size=4",
         "model.seq_length=64", "logging.progress=false", "checkpoint.save=null",
         "ddp.use_distributed_optimizer=true", "optimizer.name=muon"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 250, (2, 65), generator=gen)
    return [{"tokens": tok[:, :-1], "labels": tok[:, 1:]}] * 2


def _record(monkeypatch: pytest.MonkeyPatch, start: str, wait: str) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []
    for name, tag in ((start, "start"), (wait, "wait")):
        inner = getattr(Bucket, name)

        def wrapped(self: Bucket, *a: object, _inner: object = inner, _tag: str = tag, **k: object) -> object:
            events.append((_tag, id(self)))
            return _inner(self, *a, **k)  # type: ignore[operator]

        monkeypatch.setattr(Bucket, name, wrapped)
    return events


def _launched_before_waiting(events: list[tuple[str, int]]) -> bool:
    starts = [i for i, (t, _) in enumerate(events) if t == "start"]
    waits = [i for i, (t, _) in enumerate(events) if t == "wait"]
    return len(starts) >= 2 and len(waits) == len(starts) and max(starts) < min(waits)


def _one_by_one_grad_sync(self: DataParallel) -> int:
    """The order this replaced: each bucket reduced and waited on before the next."""
    check = bool(self.cfg.check_for_nan_in_grad) and not self.norm_finds_nonfinite
    for b in self.buffers:
        for bucket in b.buckets:
            bucket.finish_grad_sync(check, self.grad_scale, bool(self.cfg.average_in_collective))
    return self._local_nonfinite_code() if check else 0


def _grad_sync_events(monkeypatch: pytest.MonkeyPatch) -> tuple[TrainEngine, list[tuple[str, int]]]:
    e = TrainEngine(derive(load("tiny_cpu.yaml", SMALL).cfg, World(dp=1)))
    assert len(e.ddp.buffers) >= 2  # dense and Muon
    e.ddp.begin_step(e.optimizer.stage)
    e._forward_backward(_batches())
    events = _record(monkeypatch, "start_grad_sync", "_after_reduce")
    e.ddp.finish_grad_sync()
    return e, events


def test_grad_reductions_are_all_launched_before_the_first_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    _, events = _grad_sync_events(monkeypatch)
    assert _launched_before_waiting(events), events


def test_the_check_fails_on_the_one_by_one_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DataParallel, "finish_grad_sync", _one_by_one_grad_sync)
    _, events = _grad_sync_events(monkeypatch)
    assert not _launched_before_waiting(events), events


def test_launching_first_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two whole steps each way: the same losses and params, bit for bit."""
    def run() -> tuple[list[float], list[torch.Tensor]]:
        e = TrainEngine(derive(load("tiny_cpu.yaml", SMALL).cfg, World(dp=1)))
        losses = [e.train_step(_batches(), s).loss for s in (1, 2)]
        return losses, [p.detach().clone() for p in e.model.parameters()]

    new = run()
    with monkeypatch.context() as m:
        m.setattr(DataParallel, "finish_grad_sync", _one_by_one_grad_sync)
        old = run()
    assert new[0] == old[0]
    assert all(torch.equal(a, b) for a, b in zip(new[1], old[1], strict=True))


def _one_by_one_param_sync(self: DataParallel, buckets: object = None) -> None:
    """The order this replaced: each bucket gathered and waited on before the next."""
    for bucket in buckets if buckets is not None else self.gathered_buckets():  # type: ignore[attr-defined]
        bucket.finish_param_sync()


def _param_sync_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    e = TrainEngine(derive(load("tiny_cpu.yaml", SMALL).cfg, World(dp=1)))
    e.train_step(_batches(), 1)
    assert len(e.ddp.gathered_buckets()) >= 2
    e.optimizer.stage()  # every gathered bucket staged again, as after a step
    events = _record(monkeypatch, "start_param_sync", "finish_param_sync")
    e.ddp.sync_params()
    # (one by one, finish_param_sync of a staged bucket starts the gather itself, which
    # finishes it again: wait, start, wait per bucket, so the predicate is false there)
    return events


def test_param_gathers_are_all_launched_before_the_first_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    events = _param_sync_events(monkeypatch)
    assert _launched_before_waiting(events), events


def test_the_param_check_fails_on_the_one_by_one_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DataParallel, "sync_params", _one_by_one_param_sync)
    events = _param_sync_events(monkeypatch)
    assert not _launched_before_waiting(events), events
