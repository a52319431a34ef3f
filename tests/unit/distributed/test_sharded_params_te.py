"""Sharded params (``optim_grads_params``) on Transformer Engine's tensors, through TE's
own Python on a virtual GPU (one rank: the release / regather / requantize cycle of every
bucket still runs twice per step).

The quantized primary weights' data bytes are freed between uses and refilled from the
shards (bf16 gather + requantize: MXFP8 here; NVFP4 takes the same path), through the parameter-storage
interface's TE answers; the losses must equal ``optim``'s bitwise, and between steps no TE
weight holds its data bytes. (TE's byte-gathered FP8 -- current scaling, blockwise -- casts
masters into the whole weight: rule DDP-SHARDED-PARAMS-TE-BYTES refuses it.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lptrain.config import World, derive
from lptrain.config.compose import load
from lptrain.testing import te_python
from lptrain.testing.fake_gpu import virtual_gpu

BASE = ["data.builtin_max_mb=1", "logging.progress=false", "run.device=cuda", "precision.backend=te",
        "train.global_batch_size=4", "train.micro_batch_size=2", "model.seq_length=64",
        "optimizer.warmup_iters=0", "optimizer.lr=0.01", "train.eval_iters=1",
        "precision.first_last_layers_bf16=false", "ddp.use_distributed_optimizer=true"]
MXFP8 = ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8", "precision.fp8_param_gather=true"]


def _losses(overrides: list[str], cache: Path) -> tuple[list[float], list[int]]:
    from lptrain.train.engine import TrainEngine

    cfg = derive(load("tiny_cpu.yaml", [*BASE, f"data.cache_dir={cache}", *overrides]).cfg, World.detect())
    engine = TrainEngine(cfg)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in (1, 2):
        tok = torch.randint(0, cfg.model.vocab_size, (2, 2, 65), generator=g)
        batches = [{"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()} for t in tok]
        losses.append(engine.train_step(batches, step).loss)
    held = [p._data.untyped_storage().nbytes() if getattr(p, "_data", None) is not None
            else p._rowwise_data.untyped_storage().nbytes()
            for p in engine.model.parameters() if isinstance(p, te_python.te_class("QuantizedTensor"))]
    return losses, held


@pytest.mark.parametrize(("target", "recipe"), [("sm100", MXFP8)], ids=["mxfp8"])
def test_te_sharded_params_equal_optim(target: str, recipe: list[str], tmp_path: Path) -> None:
    with virtual_gpu(target, te=True):
        reuse = ["ddp.reuse_grad_buf_for_mxfp8_param_ag=true"] if recipe is MXFP8 else []
        ref, _ = _losses([*recipe, *reuse], tmp_path)
        got, held = _losses([*recipe, "ddp.data_parallel_sharding_strategy=optim_grads_params"], tmp_path)
    assert got == ref
    assert held and all(n == 0 for n in held), held
