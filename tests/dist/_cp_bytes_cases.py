"""Rank side of the context-parallel quantized-bytes test: every quantized operand of one GEMM
layer, as raw storage, in call order (module-level: pickled).

The same function runs at one rank (the reference, in the parent) and on each CP rank; a CP
rank builds the layer through :class:`lptrain.model.context_parallel.ContextParallelFactory`
and feeds it its two chunks of the input and of the output gradient (fixed tensors, so the
comparison is of the quantization alone, never of a GEMM's rounding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from _tp_bytes_cases import RECIPES, recording

H_IN, H_OUT = 256, 128
SEQ = 512  # 4 chunks of 128 tokens at CP 2: every chunk holds whole blocks (128, 32, 16)
STEPS = 2  # delayed scaling quantizes with the previous step's reduced amax from step 2 on
CASES = ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"]


def _data(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(1, SEQ, H_IN, generator=g)
    x[0, 5] *= 40.0  # the largest |x| in rank 0's first chunk: the other rank must learn it
    gy = torch.randn(1, SEQ, H_OUT, generator=g) * 1e-2
    gy[0, 300] *= 40.0  # (rank 1's chunk 2)
    return {"x": x, "gy": gy}


def run_layer(recipe: str) -> list[tuple[str, str, dict[str, torch.Tensor]]]:
    """``[(layer, role, storage), ...]`` over :data:`STEPS` steps of forward and backward of
    one linear, context parallel when a process group of several ranks is running."""
    import torch.distributed as dist

    from lptrain.catalog.parallel_dims import cp_token_ranges
    from lptrain.config import World, compose, derive
    from lptrain.distributed.groups import Group
    from lptrain.model.context_parallel import ContextParallelFactory
    from lptrain.model.init import named_normal_init
    from lptrain.precision.factory import build_factory

    cp = dist.get_world_size() if dist.is_initialized() else 1
    cfg = derive(compose("tiny_cpu.yaml", ["precision.backend=emulated", "precision.params_dtype=fp32",
                                            *RECIPES[recipe]]), World(dp=1))
    factory = build_factory(cfg.precision, num_layers=1)
    if cp > 1:
        factory = ContextParallelFactory(factory, Group(dist.group.WORLD, cp, dist.get_rank()))
    with factory.model_init():
        layer = factory.linear(H_IN, H_OUT, init_method=named_normal_init(7, "lin.weight", 0.05), name="lin")
    cols = torch.cat([torch.arange(lo, hi) for lo, hi in cp_token_ranges(SEQ, cp, dist.get_rank() if cp > 1 else 0)])
    log: list[tuple[str, str, dict[str, torch.Tensor]]] = []
    for step in range(STEPS):
        d = _data(step)
        x = d["x"][:, cols].clone().requires_grad_(True)
        with recording(log, ["lin"]):
            with factory.autocast():  # (the amax-reduction group: the world, as the engine's stage)
                y = layer(x)
            y.backward(d["gy"][:, cols])
    return log


def run_cases(rank: int, world: int, cases: Sequence[str], without_fix: str = "") -> dict[str, Any]:
    """:func:`run_layer` for each case; ``without_fix`` monkeypatches a CP amax reduction
    away (``delayed``: the autocast region reduces over no group; ``current``: the CP
    factory gives the layer no amax-reduction group for its sequence-split operands)."""
    from lptrain.model.context_parallel import ContextParallelFactory
    from lptrain.precision import autocast
    from lptrain.testing.parity import patched

    ctx: Any = contextlib.nullcontext()
    if without_fix == "delayed":
        ctx = patched(autocast, "default_amax_reduction_group", lambda: None)
    elif without_fix == "current":
        ctx = patched(ContextParallelFactory, "linear", lambda self, i, o, **kw: self.base.linear(i, o, **kw))
    with ctx:
        return {c: run_layer(c) for c in cases}


def run_all(rank: int, world: int, plan: dict[str, tuple[Sequence[str], str]]) -> dict[str, Any]:
    """Several :func:`run_cases` calls in one world: ``{name: (cases, without_fix)}``."""
    return {name: run_cases(rank, world, *args) for name, args in plan.items()}
