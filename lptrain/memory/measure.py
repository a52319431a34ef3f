"""The planner's persistent categories measured on a live :class:`TrainEngine`.

Read from the real tensors -- the buffers' ``grad_data``/``param_data``, the parameters, the
optimizers' masters and state -- so comparing it with :func:`lptrain.memory.plan.estimate_memory`
checks the planner against what a run really allocates (call it after one step: optimizer
state is created lazily).
"""

from __future__ import annotations

from typing import Any

import torch

from lptrain.memory.plan import PERSISTENT


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_engine(engine: Any) -> dict[str, int]:
    """Bytes per persistent category on this rank (same definitions as the planner)."""
    from lptrain.precision.param_storage import is_quantized, storage_bytes

    out = dict.fromkeys(PERSISTENT, 0)
    for p in engine.model.parameters():
        if not p.requires_grad:
            continue
        if is_quantized(p):
            out["quantized_weights"] += storage_bytes(p)
        else:
            out["weights"] += _nbytes(p)
    for buf in engine.ddp.buffers:
        used = sum(s.end - s.start for s in buf.spec.params)
        es = buf.grad_data.element_size()
        out["grads"] += used * es
        out["padding"] += (buf.grad_data.numel() - used) * es
        pd = buf.param_data
        if pd is not None and not buf.reuses_grad_buffer:
            out["padding"] += (pd.numel() - used) * pd.element_size()
            if buf.key.quantized and pd.dtype != torch.uint8:
                out["param_gather_staging"] += used * pd.element_size()
    seen: set[int] = set()
    for child in engine.optimizer.children:
        for pc in child.pieces:
            out["masters"] += _nbytes(pc.master)
        for opt in child.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and id(v) not in seen:
                        seen.add(id(v))
                        out["optimizer_states"] += _nbytes(v)
    return out
