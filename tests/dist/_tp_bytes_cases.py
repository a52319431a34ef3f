"""Rank side of the quantized-bytes test: every quantized operand of a column-parallel and a
row-parallel linear, as raw storage, in call order (module-level: pickled).

The same function runs at one rank (the reference, in the parent) and on each TP rank; only
the tensor-parallel arguments differ. Inputs are fixed tensors (the row-parallel layer gets
this rank's columns of its input, the column-parallel layer's output gradient likewise), so
the comparison is of the quantization alone, never of a GEMM's rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

H_IN, H_OUT, TOKENS = 256, 128, 128  # every split falls on a 128 block (blockwise's largest)
STEPS = 2  # delayed scaling quantizes with the previous step's reduced amax from step 2 on

RECIPES: dict[str, list[str]] = {
    "bf16": [],
    "delayed": ["precision.fp8_format=hybrid", "precision.fp8_recipe=delayed", "precision.fp8_amax_history_len=4"],
    "tensorwise": ["precision.fp8_format=hybrid", "precision.fp8_recipe=tensorwise"],
    "blockwise": ["precision.fp8_format=e4m3", "precision.fp8_recipe=blockwise"],
    "mxfp8": ["precision.fp8_format=e4m3", "precision.fp8_recipe=mxfp8"],
    "nvfp4": ["precision.fp4_format=e2m1", "precision.nvfp4_rht=true", "precision.nvfp4_stochastic_rounding=true"],
}


def _data(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "x": torch.randn(1, TOKENS, H_IN, generator=g),  # column-parallel input (whole)
        "gy1": torch.randn(1, TOKENS, H_IN, generator=g) * 1e-2,  # its output grad
        "z": torch.randn(1, TOKENS, H_IN, generator=g) * 3,  # row-parallel input
        "gy2": torch.randn(1, TOKENS, H_OUT, generator=g) * 1e-3,  # its output grad (whole)
    }


@contextlib.contextmanager
def recording(log: list[tuple[str, str, dict[str, torch.Tensor]]], layer: list[str]) -> Iterator[None]:
    """Record ``(layer, role, raw storage)`` of every operand the linear ops quantize."""
    from lptrain.precision import linear_ops

    quantize = linear_ops._quantize

    def spy(quantizer: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Any:
        q = quantize(quantizer, x, rowwise, columnwise)
        views = getattr(q, "storage_views", None)
        log.append((layer[0], quantizer.role, {k: v.clone() for k, v in views().items()} if views else {}))
        return q

    linear_ops._quantize = spy
    try:
        yield
    finally:
        linear_ops._quantize = quantize


def run_layers(recipe: str, sequence_parallel: bool, primary: bool = False) -> dict[str, Any]:
    """``{"ops": [(layer, role, storage), ...], "weights": {layer: storage}}`` over
    :data:`STEPS` steps of fwd + bwd of both linears (tensor parallel when a process group
    with more than one rank is running). ``primary``: quantized primary weights."""
    import torch.distributed as dist

    from lptrain.config import World, compose, derive
    from lptrain.model.init import named_normal_init
    from lptrain.precision.factory import build_factory
    from lptrain.precision.tensor_parallel import TPShard, sliced_init, split_dim
    from lptrain.catalog.parallel_dims import ShardLayout

    tp_size = dist.get_world_size() if dist.is_initialized() else 1
    cfg = derive(compose("tiny_cpu.yaml", ["precision.backend=emulated", "precision.params_dtype=fp32",
                                            *RECIPES[recipe]]), World(dp=1))
    factory = build_factory(cfg.precision, num_layers=1)
    factory.quantized_params = primary and factory.recipe is not None
    group = _group(tp_size)
    layers = {}
    with factory.model_init():
        for name, mode, n_in, n_out in (("col", "column", H_IN, H_IN), ("row", "row", H_IN, H_OUT)):
            init = named_normal_init(7, f"{name}.weight", 0.05)
            if tp_size > 1:
                layout = ShardLayout(dim=0 if mode == "column" else 1)
                layers[name] = factory.linear(n_in, n_out, parallel_mode=mode, tp_group=group,
                                              tp_size=tp_size, sequence_parallel=sequence_parallel,
                                              init_method=sliced_init(init, (n_out, n_in), layout,
                                                                      tp_size, group.rank), name=name)
                assert isinstance(layers[name].weight.tp_shard, TPShard)
            else:
                layers[name] = factory.linear(n_in, n_out, init_method=init, name=name)
    log: list[tuple[str, str, dict[str, torch.Tensor]]] = []
    current = [""]
    for step in range(STEPS):
        d = _data(step)
        x, gy1, z, gy2 = d["x"], d["gy1"], d["z"], d["gy2"]
        if tp_size > 1:
            gy1, z = split_dim(gy1, group, 2), split_dim(z, group, 2)
            if sequence_parallel:
                x = split_dim(x, group, 1)
                gy2 = split_dim(gy2, group, 1)
        x.requires_grad_(True)
        z.requires_grad_(True)
        with recording(log, current):
            with factory.autocast():
                current[0] = "col"
                y1 = layers["col"](x)
                current[0] = "row"
                y2 = layers["row"](z)
            current[0] = "col"
            y1.backward(gy1)
            current[0] = "row"
            y2.backward(gy2)
    weights = {n: _storage(m.weight) for n, m in layers.items()}
    return {"ops": log, "weights": weights}


def _storage(w: torch.Tensor) -> dict[str, torch.Tensor]:
    views = getattr(w, "storage_views", None)
    return {k: v.clone() for k, v in views().items()} if views else {"value": w.detach().clone()}


def _group(tp_size: int) -> Any:
    import torch.distributed as dist

    from lptrain.distributed.groups import SINGLE, Group

    if tp_size == 1:
        return SINGLE
    return Group(dist.group.WORLD, tp_size, dist.get_rank())


CASES = [*RECIPES, "tensorwise+primary"]  # the last: FP8 primary weights (quantized at init)


def run_recipes(rank: int, world: int, cases: Sequence[str], sequence_parallel: bool,
                without_fix: str = "") -> dict[str, Any]:
    """:func:`run_layers` for each case (a recipe, ``+primary`` for quantized primary
    weights); ``without_fix`` monkeypatches the TP amax reduction away (``delayed``: the
    autocast region reduces over no group; ``tensorwise``: the sharded operands' quantizers
    get no amax-reduction group)."""
    from lptrain.precision import autocast, tensor_parallel
    from lptrain.testing.parity import patched

    ctx: Any = contextlib.nullcontext()
    if without_fix == "delayed":
        ctx = patched(autocast, "default_amax_reduction_group", lambda: None)
    elif without_fix == "tensorwise":
        ctx = patched(tensor_parallel, "SHARDED_ROLES", {"column": (), "row": ()})
    with ctx:
        return {c: run_layers(c.split("+")[0], sequence_parallel, primary=c.endswith("+primary"))
                for c in cases}


def run_all(rank: int, world: int, plan: dict[str, tuple[Sequence[str], bool, str]]) -> dict[str, Any]:
    """Several :func:`run_recipes` calls in one world: ``{name: (cases, sp, without_fix)}``."""
    return {name: run_recipes(rank, world, *args) for name, args in plan.items()}
