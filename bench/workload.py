"""The batches the engine benches feed their steps, from the trainer's own loader.

One helper for every bench that times whole training steps (train_step, host_overhead, ddp,
optim), so each builds rank ``rank``'s loader of a ``world``-rank run the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def train_batches(cfg: Any, rank: int = 0, world: int = 1) -> tuple[Iterator[dict[str, Any]], int]:
    """(rank ``rank``'s training micro-batches, micro-batches per step on each rank)."""
    from lptrain.data import build_train_valid_loaders

    t = cfg.train
    it, _ = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=rank, dp_size=world,
        vocab_size=cfg.model.vocab_size,
    )
    return it, t.global_batch_size // (t.micro_batch_size * world)


def fp32_masters_step(model: Any, cfg: Any, backward: Callable[[list[dict[str, Any]]], None]
                      ) -> Callable[[list[dict[str, Any]]], None]:
    """A plain loop doing the mixed-precision work lptrain's engine does by design, as a step
    function over one step's micro-batches: ``backward(batches)`` (the caller's forwards and
    backwards: a plain model, or one under torch DDP) leaves bf16 grads in the params; they
    are cast into fp32 master grads (``_foreach_copy_``), clipped by their global norm
    (``optimizer.clip_grad``), stepped by ``torch.optim.AdamW(foreach=True)`` on fp32 masters
    (fp32 moments; decay on matrices only, as the engine's groups) and copied back.

    Why: torch's own loops step bf16 params with bf16 moments. Against this reference the
    engine's ratio is its own host cost; this reference against the plain loop is what fp32
    masters cost whatever an engine does."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]
    for m in masters:
        m.grad = torch.zeros_like(m)
    o = cfg.optimizer
    decay = [m for p, m in zip(params, masters, strict=True) if p.dim() >= 2]
    no_decay = [m for p, m in zip(params, masters, strict=True) if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o.lr,
                            betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, foreach=True)
    grads = [m.grad for m in masters]

    def step(batches: list[dict[str, Any]]) -> None:
        backward(batches)
        torch._foreach_copy_(grads, [p.grad for p in params])
        for p in params:
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, o.clip_grad, foreach=True)
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)

    return step
