"""The quantizer kernels of one model step, timed where they run and replayed alone (not a test).

Why: ``bench/model_step.py``'s targets assume that where a recipe's whole-model ratio is far
above its per-GEMM ratio, the extra cost lies outside the quantizer kernels (per-call set-up,
amax bookkeeping, small-tensor overheads around them). This module measures that split
instead of assuming it, through the seams of ``lptrain.precision.linear_ops`` (``_quantize``
and the op context's ``deq`` / ``col_t``, the only places a quantized linear quantizes or
dequantizes):

- :func:`kernel_timer` sums the seconds a step spends inside those calls;
- :func:`record` keeps every quantize call of one step (its quantizer with the usages the
  step asked for, and a copy of its input) with the dequantize calls made on the result, and
  :func:`replay` makes exactly those calls again with nothing around them;
- :func:`count_ops` counts the aten ops a call dispatches (exact, unlike any timing): a
  step's count minus its replay's minus the bf16 step's is the work the quantized path adds
  outside the kernels; :func:`dispatch_floor_s` times one trivial op, so a count times it
  estimates the fixed per-op part of the kernels' time (what a small model's operands feel).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lptrain.precision import linear_ops


@dataclass
class QuantizeCall:
    """One quantize call of a step and the dequantize calls made on its result, in order
    (``"rowwise"``, ``"columnwise"``: ``dequantize``; ``"col_t"``: the wgrad operand)."""

    quantizer: Any
    x: torch.Tensor
    rowwise: bool
    columnwise: bool
    uses: list[str] = field(default_factory=list)


@contextmanager
def _seams(quantize: Callable[..., Any], deq: Callable[..., Any], col_t: Callable[..., Any]) -> Iterator[None]:
    """linear_ops' three seams replaced for the duration of the block."""
    saved = linear_ops._quantize, linear_ops._OpContext.deq, linear_ops._OpContext.col_t
    linear_ops._quantize = quantize
    linear_ops._OpContext.deq = staticmethod(deq)  # type: ignore[method-assign]
    linear_ops._OpContext.col_t = staticmethod(col_t)  # type: ignore[method-assign]
    try:
        yield
    finally:
        linear_ops._quantize = saved[0]
        linear_ops._OpContext.deq = staticmethod(saved[1])  # type: ignore[method-assign]
        linear_ops._OpContext.col_t = staticmethod(saved[2])  # type: ignore[method-assign]


@contextmanager
def kernel_timer() -> Iterator[list[float]]:
    """Inside the block, every quantize / dequantize call of a quantized linear adds its
    seconds to the yielded one-element list (two clock reads per call, ~0.1 us each)."""
    acc = [0.0]
    real = linear_ops._quantize, linear_ops._OpContext.deq, linear_ops._OpContext.col_t

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                acc[0] += time.perf_counter() - t0
        return call

    with _seams(*(timed(f) for f in real)):
        yield acc


def record(step: Callable[[], None]) -> list[QuantizeCall]:
    """Run ``step`` once with linear_ops' ``_quantize`` and its ``deq`` / ``col_t`` seams
    spied on. A dequantize of an operand no recorded call produced (a quantized primary
    weight) raises: the replay would miss its quantize."""
    calls: list[QuantizeCall] = []
    by_id: dict[int, QuantizeCall] = {}
    keep: list[Any] = []  # the step's quantized tensors stay alive, so ids stay unique
    real_quantize, real_deq, real_col_t = linear_ops._quantize, linear_ops._OpContext.deq, linear_ops._OpContext.col_t

    def quantize(quantizer: Any, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Any:
        out = real_quantize(quantizer, x, rowwise, columnwise)
        call = QuantizeCall(quantizer, x.detach().clone(), rowwise, columnwise)
        calls.append(call)
        by_id[id(out)] = call
        keep.append(out)
        return out

    def use(q: Any, how: str) -> None:
        call = by_id.get(id(q))
        if call is None:
            raise RuntimeError(f"dequantize ({how}) of an operand no recorded quantize call made")
        call.uses.append(how)

    def deq(q: Any, orientation: str) -> torch.Tensor:
        use(q, orientation)
        return real_deq(q, orientation)

    def col_t(q: Any) -> torch.Tensor:
        use(q, "col_t")
        return real_col_t(q)

    with _seams(quantize, deq, col_t):
        step()
    return calls


def replay(calls: list[QuantizeCall]) -> None:
    """The recorded quantize and dequantize calls, in order, with nothing around them."""
    with torch.no_grad():
        for c in calls:
            q = linear_ops._quantize(c.quantizer, c.x, c.rowwise, c.columnwise)
            for how in c.uses:
                linear_ops.col_operand_t(q) if how == "col_t" else q.dequantize(how)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], None]) -> int:
    """Aten ops ``fn`` dispatches (views and in-place ops included: each is a dispatcher call)."""
    with _OpCounter() as counter:
        fn()
    return counter.n


def dispatch_floor_s(repeats: int = 2000) -> float:
    """Median seconds of one trivial op (an in-place add on a 16-element fp32 tensor): the
    fixed cost every dispatched op pays before it touches any data."""
    t = torch.zeros(16)
    for _ in range(100):
        t.add_(1.0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.add_(1.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
