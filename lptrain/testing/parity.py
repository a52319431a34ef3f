"""Run a few training steps of a recipe through the real engine and return what to compare.

The parity tests (DP sizes, overlap on/off, FP8 param gather on/off, train-eval-train,
forced syncs, layouts) are one line each on top of :func:`train_steps`: run two
configurations, then :func:`first_difference` on the results. It works in a single process
and inside every rank of :func:`lptrain.testing.dist.run_distributed` (which initialises the
process group the engine joins).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from lptrain.precision import param_storage
from lptrain.precision.tensors import QuantizedTensor


def _param_snapshot(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Exact contents: a plain param's values, or every raw buffer of a quantized one,
    lptrain's or Transformer Engine's (``param_storage.storage_views``; a TE grouped weight's
    ``detach().clone()`` would be TE's dequantize-and-stack dispatch, not its bytes)."""
    return {k: v.clone() for k, v in param_storage.storage_views(p).items()}


def canonical_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 high-precision values by name, with single-grouped expert weights split into
    per-expert entries, so single-grouped and discrete layouts compare name by name."""
    from lptrain.model.state_dict_adapter import canonical_state_dict

    out = {}
    for k, v in canonical_state_dict(model).items():
        if torch.is_floating_point(v):
            out[k] = (v.dequantize() if isinstance(v, QuantizedTensor) else v).detach().float().clone()
    return out


def train_steps(
    recipe: str,
    overrides: Sequence[str] = (),
    *,
    steps: int = 3,
    eval_every: int = 0,
    sync_after: Sequence[int] = (),
    before_step: Optional[Callable[[Any, int], None]] = None,
) -> dict[str, Any]:
    """Train ``steps`` steps; returns per-step losses and grad norms, the final params (raw
    buffers and canonical fp32 values) and the fp32 masters."""
    from lptrain.config import World, derive
    from lptrain.config.compose import load
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    cfg = derive(load(recipe, list(overrides)).cfg, World.detect())
    engine = TrainEngine(cfg)
    t = cfg.train
    train_it, valid_it = build_train_valid_loaders(
        cfg.data,
        seq_length=cfg.model.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=engine.dp_rank,
        dp_size=engine.dp_size,
        vocab_size=cfg.model.vocab_size,
        context_parallel=engine.context_parallel,
    )
    n = t.global_batch_size // (t.micro_batch_size * engine.dp_size)
    losses, norms = [], []
    grads: dict[str, torch.Tensor] = {}
    from lptrain.distributed.bucket_group import Bucket

    unpatched = Bucket.start_grad_sync

    def capture_then_reduce(bucket: Bucket, *args: Any, **kwargs: Any) -> None:
        # this rank's accumulated main_grads, before scaling and the collective
        for name in bucket.param_names:
            grads[name] = bucket.buffer.params[name].main_grad.detach().clone()
        unpatched(bucket, *args, **kwargs)

    for step in range(1, steps + 1):
        if before_step is not None:
            before_step(engine, step)
        capture = patched(Bucket, "start_grad_sync", capture_then_reduce) if step == steps else None
        with capture if capture is not None else contextlib.nullcontext():
            res = engine.train_step([next(train_it) for _ in range(n)], step)
        losses.append(res.loss)
        norms.append(res.grad_norm)
        if eval_every and step % eval_every == 0:
            engine.evaluate(valid_it, 1)
        if step in sync_after:
            with engine.params_synced():
                pass
    state = engine.checkpoint_state()
    probe = torch.randint(
        0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(7)
    )
    with engine.params_synced(), torch.no_grad():
        raw = {n: _param_snapshot(p) for n, p in engine.model.named_parameters()}
        canonical = canonical_params(engine.model)
        # (a pipeline stage holds part of the model, a context-parallel rank part of each
        # sequence: their params are compared)
        logits = None
        if engine.pipeline is None and engine.context_parallel[1] == 1:
            with engine.model.autocast():
                logits = engine.model(probe.to(engine.device)).detach().cpu()
    return {
        "losses": losses,
        "grad_norms": norms,
        "main_grads": grads,
        "logits": logits,
        "raw": raw,
        "canonical": canonical,
        "masters": state["global"]["model"],
    }


def first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """None when ``a`` and ``b`` are bitwise equal (tensors via ``torch.equal``), else a
    readable description of the first difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if torch.is_tensor(a) and torch.is_tensor(b):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            return f"{path}: max abs diff {float(diff.max()):.3e} at {int(diff.argmax())}"
        return None
    if a != b and not (a != a and b != b):  # NaN == NaN for reporting purposes
        return f"{path}: {a!r} vs {b!r}"
    return None


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest normwise relative difference over matching tensors."""
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return worst


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any):
    """Temporarily replace ``obj.name`` (for regression tests that remove a fix)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
