"""Keys whose effect comes after a first optimizer step (lptrain/config/key_effects.py lists
them, with these tests and the others that prove them): each is shown doing what it says.
Small runs: the tiny model, one micro-batch of 2 x 64 tokens, a 1 MB corpus slice."""

from __future__ import annotations

import json
import signal
import sys
import types
from pathlib import Path

import pytest
import torch

from lptrain.config import World, compose, derive
from lptrain.config.compose import load
from lptrain.distributed.groups import SINGLE, BufferGroups
from lptrain.train import TrainingDivergedError, TrainingInterrupted, pretrain
from lptrain.train.engine import TrainEngine

SMALL = ["data.builtin_max_mb=1", "train.micro_batch_size=2", "train.global_batch_size=2",
         "model.seq_length=64", "optimizer.warmup_iters=1", "train.eval_iters=1",
         "logging.progress=false", "logging.plots=false", "checkpoint.save=null"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")



@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the tiny model's GEMMs gain nothing from a second thread

def _cfg(cache: Path, *overrides: str):
    return compose("tiny_cpu.yaml", [f"data.cache_dir={cache}", *SMALL, *overrides])


def _engine(*overrides: str) -> TrainEngine:
    return TrainEngine(derive(load("tiny_cpu.yaml", [*SMALL, *overrides]).cfg, World(dp=1)))


def _batch(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    tok = torch.randint(0, 250, (2, 65), generator=torch.Generator().manual_seed(seed))
    return [{"tokens": tok[:, :-1], "labels": tok[:, 1:]}]


@pytest.mark.parametrize("average", [False, True])
def test_average_in_collective_moves_the_scaling(average: bool) -> None:
    """With two data-parallel ranks the 1/dp factor is applied to the local gradient before
    the reduction, or (average_in_collective) to the reduced shard after it. The bucket is
    given a 2-rank averaging factor with the collective itself left out (one process)."""
    e = _engine(f"ddp.average_in_collective={str(average).lower()}")
    bucket = e.ddp.buffers[0].buckets[0]
    bucket.groups = BufferGroups(SINGLE, SINGLE, dp_size=2)
    bucket.zero_grads()
    bucket.grad_view.fill_(1.0)
    cfg = e.cfg.ddp
    bucket.start_grad_sync(cfg.check_for_nan_in_grad, 0.5, cfg.average_in_collective, async_op=True)
    before = bucket.grad_view.clone()  # what goes into the collective
    bucket.finish_grad_sync(cfg.check_for_nan_in_grad, 0.5, cfg.average_in_collective)
    assert torch.equal(before, torch.full_like(before, 1.0 if average else 0.5))
    assert torch.equal(bucket.grad_view, torch.full_like(before, 0.5))  # the same mean either way


@pytest.mark.parametrize("check", [True, False])
def test_check_for_nan_in_grad_names_the_parameter(check: bool) -> None:
    """A NaN gradient: with the per-bucket check the error names the rank and parameter
    before anything is reduced; without it only the global norm shows it."""
    e = _engine(f"ddp.check_for_nan_in_grad={str(check).lower()}")
    e.model.final_norm.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(TrainingDivergedError) as err:
        e.train_step(_batch(), 1)
    if check:
        assert "rank 0: gradient of 'final_norm.weight' is not finite" in str(err.value)
    else:
        assert "global gradient norm is nan" in str(err.value)


def test_one_process_leaves_the_nan_check_to_the_grad_norm() -> None:
    """In a world of one process nothing is reduced, so ``ddp.check_for_nan_in_grad`` rides
    on the grad norm: no per-bucket pass over the grads on a finite step, and a single NaN
    element is still found and named by the scan of the failure path (shown failing: with the
    scan disabled the message only gives the norm)."""
    e = _engine()
    e.train_step(_batch(), 1)
    assert e.ddp.norm_finds_nonfinite
    assert all(k.local_sum is None for b in e.ddp.buffers for k in b.buckets)

    def one_nan(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[3] = float("nan")
        return g

    e.model.layers[1].input_norm.weight.register_hook(one_nan)
    with pytest.raises(TrainingDivergedError, match=r"step 2, rank 0: gradient of "
                       r"'layers\.1\.input_norm\.weight' is not finite"):
        e.train_step(_batch(1), 2)
    e.ddp.scan_nonfinite_code = lambda: 0  # type: ignore[method-assign]
    with pytest.raises(TrainingDivergedError, match="global gradient norm is nan"):
        e.train_step(_batch(1), 3)


def test_bf16_grads_reach_the_optimizer_as_one_cast_per_bucket() -> None:
    """``ddp.grad_reduce_in_fp32=false``: each bucket's bf16 grad span is cast to fp32 once and
    cut into the masters' grads, bitwise the per-tensor casts."""
    e = _engine("ddp.grad_reduce_in_fp32=false")
    e.train_step(_batch(), 1)
    (child,) = e.optimizer.children
    assert all(b.key.grad_dtype == torch.bfloat16 for b in child.buffers)
    e.ddp.begin_step(child.stage)
    e._forward_backward(_batch(1))
    e.ddp.finish_grad_sync()
    child.prepare_grads()
    grads = child.master_grads()
    assert all(torch.equal(g, pc.grad_view().float()) for g, pc in zip(grads, child.pieces, strict=True))
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert len(storages) == sum(len(spans) for spans in child._norm_spans.values())
    child.discard_grads()


def test_num_workers_reads_in_worker_processes(cache_dir: Path) -> None:
    """data.num_workers > 0 reads the batches through a DataLoader with worker processes
    (the same bytes as in-process reading: tests/unit/data/test_loader.py)."""
    from lptrain.data import build_train_valid_loaders

    cfg = derive(_cfg(cache_dir, "data.num_workers=1"), World(dp=1))
    it, _ = build_train_valid_loaders(cfg.data, 64, 2, 2, 0, 1, cfg.model.vocab_size)
    next(it)
    assert type(it._it).__name__ == "_MultiProcessingDataLoaderIter"
    assert it._it._num_workers == 1


def test_exit_duration_stops_the_run(cache_dir: Path, tmp_path: Path) -> None:
    summary = pretrain(_cfg(cache_dir, "train.train_iters=50", "train.exit_duration_mins=1e-9"),
                       tmp_path / "run")
    assert summary["status"] == "exit_duration" and summary["steps"] == 1


@pytest.mark.parametrize("save", [True, False])
def test_save_on_interrupt_saves_on_sigint(cache_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, save: bool) -> None:
    """Ctrl-C (SIGINT) after the first step: the run stops with 130 and writes a checkpoint
    only with checkpoint.save_on_interrupt=true."""
    step = TrainEngine.train_step

    def interrupted(self, micro_batches, n, **kw):
        out = step(self, micro_batches, n, **kw)
        signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(TrainEngine, "train_step", interrupted)
    ckpt = tmp_path / "ckpt"
    cfg = _cfg(cache_dir, "train.train_iters=5", f"checkpoint.save={ckpt}",
               f"checkpoint.save_on_interrupt={str(save).lower()}")
    with pytest.raises(TrainingInterrupted) as stop:
        pretrain(cfg, tmp_path / "run")
    assert stop.value.code == 130
    assert (ckpt / "iter_0000001" / "COMPLETE.json").is_file() is save


def test_wandb_project_and_mode_reach_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lptrain.train.outputs import start_wandb as _start_wandb

    seen: dict = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or "run")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = compose("tiny_cpu.yaml", ["logging.wandb=true", "logging.wandb_project=key-effects",
                                    "logging.wandb_mode=disabled"])
    assert _start_wandb(cfg, tmp_path, None) == "run"
    assert seen["project"] == "key-effects" and seen["mode"] == "disabled"


@pytest.mark.parametrize("plots", [True, False])
def test_plots_switch(cache_dir: Path, tmp_path: Path, plots: bool) -> None:
    pretrain(_cfg(cache_dir, "train.train_iters=2", f"logging.plots={str(plots).lower()}"),
             tmp_path / "run")
    assert (tmp_path / "run" / "loss.png").is_file() is plots
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("progress", [True, False])
def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch, progress: bool) -> None:
    from lptrain.train.console import RunLog as _Log

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cfg = compose("tiny_cpu.yaml", [f"logging.progress={str(progress).lower()}"])
    log = _Log(True, cfg)
    assert (log.progress is not None) is progress
