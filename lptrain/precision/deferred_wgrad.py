"""Weight gradients computed later than their backward: the W step of the zero-bubble
pipeline schedules (``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipev``).

Those schedules split a micro-batch's backward into an input-gradient step (I: what the
previous stage waits for) and a weight-gradient step (W: run later, in the bubble). lptrain's
GEMMs (:mod:`lptrain.precision.linear_ops`, the unquantized linear of
:mod:`lptrain.precision.layers`) compute both in one autograd backward, the weight gradient
accumulated straight into ``main_grad`` (gradient-accumulation fusion). Inside
:func:`deferring`, their backward computes the input gradient only and queues the weight
gradient here instead:

* **the micro-batch's own operands**: the job holds the operands that backward quantized
  (the columnwise ``x`` saved by its forward, the ``dy`` it just quantized -- delayed-scaling
  scales and stochastic-rounding bits drawn in the I step, in the order 1F1B draws them), so
  W computes exactly the GEMM the unsplit backward would have;
* **accumulation**: W adds into ``main_grad`` (or hands the grad to ``.grad`` without fusion)
  as the backward would have; the schedules run a chunk's W steps in micro-batch order, so
  each ``main_grad`` sums the same terms in the same order as under 1F1B;
* **readiness**: each deferred weight counts its pending jobs (``wgrad_pending``); the
  data-parallel grad hook ignores a weight with a job pending (the hook autograd fires in the
  I step), and the job calls the weight's hook (``main_grad_hook``, installed by
  :class:`lptrain.distributed.ddp.DataParallel`) once its last job has run -- so a bucket's
  overlapped reduction starts only after the W steps of its weights.

Parameters whose gradient autograd forms itself (norms, the embedding, the router, the output
head) are complete after the I step and reported there, as always.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch


class DeferredWgrads:
    """The weight-gradient jobs one I step queued (run them with :meth:`run`, in W)."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self.jobs)

    def defer(self, weights: Sequence[torch.Tensor],
              grads_of: Callable[[], Sequence[Optional[torch.Tensor]]]) -> None:
        """Queue ``grads_of`` (the weight gradients' GEMMs and fused accumulation, returning
        what autograd would have been handed per weight) for the weights needing a grad."""
        pending = [w for w in weights if w.requires_grad]
        for w in pending:
            w.wgrad_pending = getattr(w, "wgrad_pending", 0) + 1

        def job() -> None:
            for w, g in zip(weights, grads_of(), strict=True):
                if w.requires_grad:
                    _deliver(w, g)

        self.jobs.append(job)

    def run(self) -> None:
        """Every queued job, in the order queued (the backward's: last layer first), without
        grad recording (as inside the backward that queued them)."""
        jobs, self.jobs = self.jobs, []
        with torch.no_grad():
            for job in jobs:
                job()


def _deliver(w: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """What autograd would have done with ``grad`` for leaf ``w``: accumulate it into
    ``.grad``, then (once no job of ``w`` is pending) run its post-accumulate hook."""
    if grad is not None:
        w.grad = grad if w.grad is None else w.grad + grad
    w.wgrad_pending -= 1
    if w.wgrad_pending == 0:
        hook = getattr(w, "main_grad_hook", None)
        if hook is not None:
            hook(w)


_active: Optional[DeferredWgrads] = None


@contextlib.contextmanager
def deferring() -> Iterator[DeferredWgrads]:
    """Inside: the GEMMs' backwards queue their weight gradients on the yielded queue."""
    global _active
    previous, _active = _active, DeferredWgrads()
    try:
        yield _active
    finally:
        _active = previous


def queue() -> Optional[DeferredWgrads]:
    """The queue of the :func:`deferring` block in progress (None: compute wgrads now)."""
    return _active
