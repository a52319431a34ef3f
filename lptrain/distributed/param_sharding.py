"""Sharded params (``ddp.data_parallel_sharding_strategy=optim_grads_params``, ZeRO-3): the
module hooks that gather a bucket's params when a forward or backward needs them and free
them after.

Per step, for each bucket (forward order; buckets hold whole layers' params in layer order):

* forward: the pre-hook of the first module reading the bucket gathers it from the shards
  (all-gather of the staged masters into the bucket's full params, which plain params are
  views of); with ``ddp.overlap_param_gather`` it also starts the next bucket's gather;
  when every module reading the bucket has run its forward, the bucket is freed (a tied
  embedding is kept: the head reads it again);
* backward: the first gradient of a module's outputs (before its own backward runs)
  gathers the bucket again, and prefetches the bucket the backward needs next; when the
  last of its params' gradients is accumulated, the bucket is freed;
* a recompute's forwards (inside the backward) gather what they read and free nothing.

The values and collectives are those of ``optim``: the same masters, staged into the same
shards, gathered by the same all-gather -- only when, and how often, differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lptrain.distributed.bucket_group import Bucket
    from lptrain.distributed.ddp import DataParallel


def _sharded_buckets(ddp: DataParallel, module: nn.Module) -> list[Bucket]:
    names = [ddp.param_names[id(p)] for p in module.parameters(recurse=False)]
    found = (ddp.bucket_of[n] for n in names if n in ddp.bucket_of)
    return list(dict.fromkeys(b for b in found if b.full_param is not None))


def install_param_sharding_hooks(ddp: DataParallel) -> list[Any]:
    """Register the forward pre/post hooks on every module with sharded params; returns the
    handles. (The backward side lives in DataParallel's grad hooks.)"""
    handles = []
    for b in ddp.forward_order:
        if b.full_param is not None:
            b.keep_through_forward = any(
                getattr(b.buffer.params[n], "shared_embedding", False) for n in b.param_names
            )
    for m in ddp.model.modules():
        buckets = _sharded_buckets(ddp, m)
        if not buckets:
            continue
        for b in buckets:
            b.forward_modules.add(id(m))
        handles.append(m.register_forward_pre_hook(_pre_hook(ddp, buckets)))
        handles.append(m.register_forward_hook(_post_hook(ddp, buckets)))
    return handles


def _pre_hook(ddp: DataParallel, buckets: list[Bucket]) -> Any:
    prefetch = bool(ddp.cfg.overlap_param_gather)

    def hook(_module: nn.Module, _args: Any) -> None:
        if not ddp.hooks_active:
            return
        for b in buckets:
            b.ensure_params(async_op=False)
        nxt = buckets[-1].next_in_forward
        if prefetch and nxt is not None and nxt.full_param is not None:
            nxt.ensure_params(async_op=True)

    return hook


def _post_hook(ddp: DataParallel, buckets: list[Bucket]) -> Any:
    def hook(module: nn.Module, _args: Any, _out: Any) -> None:
        if not ddp.hooks_active or ddp.in_backward or not torch.is_grad_enabled():
            return
        for b in buckets:
            b.forward_done(id(module))

    return hook
