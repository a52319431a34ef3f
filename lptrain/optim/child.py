"""What the chained optimizer and the checkpoint code ask of each child optimizer.

:class:`OptimizerChild` is the protocol: :class:`lptrain.optim.chained.ChainedOptimizer`
runs a step over a list of children (``prepare_grads``, ``grad_norm_sq``, ``count_zeros``,
``step``, ``stage``, ``discard_grads`` on a skipped step, ``lr_by_group`` and
``update_rms`` for the logs), :class:`lptrain.train.engine.TrainEngine` checkpoints them
(``full_state`` / ``load_full_state``, ``holds_experts`` choosing the per-expert checkpoint
form), and :mod:`lptrain.memory.measure` counts their ``pieces`` and ``optimizers``.

:class:`MasterOptimizer` is the part every child implements the same way: a list of pieces,
each an fp32 master whose ``.grad`` is pointed at (an fp32 view of) its reduced gradient,
and the torch optimizers stepping those masters.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Optional, Protocol, runtime_checkable

import torch

from lptrain.distributed.buffers import ParamAndGradBuffer


@runtime_checkable
class Piece(Protocol):
    """A part of a parameter this rank keeps an fp32 master of."""

    @property
    def master(self) -> torch.Tensor: ...

    @property
    def param(self) -> torch.nn.Parameter: ...

    def grad_view(self) -> torch.Tensor:
        """The reduced gradient of the piece, in the master's shape (the grad buffer's dtype)."""
        ...


@runtime_checkable
class OptimizerChild(Protocol):
    """One optimizer over a set of buffers: a child of the chained optimizer.

    ``holds_experts``: the params are routed experts under this rank's local names; the
    checkpoint saves them once per expert under global canonical names
    (:mod:`lptrain.distributed.expert_state`). ``label`` names the child in logs.
    """

    @property
    def label(self) -> str: ...

    @property
    def holds_experts(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def buffers(self) -> Sequence[ParamAndGradBuffer]: ...

    @property
    def pieces(self) -> Sequence[Piece]: ...

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]: ...

    def prepare_grads(self) -> None:
        """Point every master's ``.grad`` at its reduced gradient."""
        ...

    def discard_grads(self) -> None:
        """Drop the masters' ``.grad`` (after a step, or instead of a skipped one); a
        ``.grad`` that is a view of the grad buffer may stay (nothing steps it unprepared)."""
        ...

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared norm of the child's whole gradient (fp64 on ``device``; each element once
        over the ranks that share it). Collective for sharded children."""
        ...

    def count_zeros(self) -> Optional[int]:
        """Zero gradient entries over the world (each once), or None if the child does not
        count them. Collective when it counts."""
        ...

    def step(self, lrs: Mapping[str, float], clip_coef: Optional[float]) -> None:
        """Scale the grads by ``clip_coef`` (None: no clipping), update every group at
        ``lrs[group name]``, drop the grads."""
        ...

    def stage(self) -> None:
        """Masters -> params (or the gather's staging area), marking buckets staged."""
        ...

    def lr_by_group(self) -> dict[str, float]: ...

    def update_rms(self) -> Optional[float]:
        """RMS of the last Muon update (None for a child without Muon)."""
        ...

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{param name: {"master": ..., <optimizer state>: ...}}``, full tensors, identical
        on every rank of the child's group. Collective."""
        ...

    def load_full_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`full_state`, for any shard layout."""
        ...


def foreach_scalar(like: torch.Tensor, value: float) -> float | torch.Tensor:
    """``value`` as the multiplier of fp32 ``like``'s list in ``_foreach_mul_``.

    Why: on the CPU, ``_foreach_mul_`` with a Python scalar is a per-tensor loop that wraps
    the scalar anew for every tensor (5 extra ops each); with a 0-dim fp32 tensor it is one
    ``mul_`` each. The product is the same: the Python scalar is rounded to fp32 either way
    (fp32 math). CUDA keeps the scalar form of the fused kernel."""
    if like.device.type != "cpu" or like.dtype != torch.float32:
        return value
    return torch.tensor(value, dtype=torch.float32, device=like.device)


class MasterOptimizer:
    """The gradient and update mechanics every child shares: ``pieces`` (each with ``master``
    and ``grad_view()``) stepped by ``optimizers`` whose param groups are named."""

    pieces: Sequence[Piece]
    optimizers: list[torch.optim.Optimizer]

    @functools.cached_property
    def _grad_views(self) -> list[torch.Tensor]:
        """Every piece's reduced-gradient view, looked up once: the pieces and the buffers
        (and so the views) live as long as the optimizer, and a step should not rebuild 2
        views per tensor."""
        return [pc.grad_view() for pc in self.pieces]

    @functools.cached_property
    def _grads_are_views(self) -> bool:
        """Whether every master's fp32 grad is its reduced-gradient view itself (fp32 grad
        buffers). Then each master keeps that view as ``.grad`` for the whole run: it *is*
        the grad buffer, which every step zeroes and refills, so there is nothing to drop
        between steps, and the two checked ``.grad`` assignments per tensor per step are
        not paid. A master whose ``.grad`` someone else changed is pointed back."""
        return all(g.dtype == torch.float32 for g in self._grad_views)

    def prepare_grads(self) -> None:
        views = self._grad_views
        if self._grads_are_views:
            if all(pc.master.grad is g for pc, g in zip(self.pieces, views, strict=True)):
                return
            for pc, g in zip(self.pieces, views, strict=True):
                pc.master.grad = g
            return
        for pc, g in zip(self.pieces, views, strict=True):
            pc.master.grad = g if g.dtype == torch.float32 else g.float()

    def discard_grads(self) -> None:
        """Drop the masters' converted grads (kept when they are the buffer's own views:
        :attr:`_grads_are_views`)."""
        if self._grads_are_views:
            return
        for pc in self.pieces:
            pc.master.grad = None

    def master_grads(self) -> list[torch.Tensor]:
        """The masters' ``.grad`` tensors (set by :meth:`prepare_grads`), in piece order."""
        return [pc.master.grad for pc in self.pieces]  # type: ignore[misc]

    def step(self, lrs: Mapping[str, float], clip_coef: Optional[float]) -> None:
        """Clip (one batched multiply: elementwise, so bitwise the per-tensor result), then
        update every group at ``lrs[group name]``."""
        if clip_coef is not None and self.pieces:
            grads = self.master_grads()
            torch._foreach_mul_(grads, foreach_scalar(grads[0], clip_coef))
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lrs[g["name"]]
            opt.step()
        self.discard_grads()

    def lr_by_group(self) -> dict[str, float]:
        return {g["name"]: float(g["lr"]) for opt in self.optimizers for g in opt.param_groups}
