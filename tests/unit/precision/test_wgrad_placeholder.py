"""The cached zero a fused-wgrad linear returns to autograd stays zero and is never copied.

Why: :func:`lptrain.precision.linear_ops.fused_wgrad_placeholder` hands one zero tensor
per shape to every fused linear; a write into it would turn every later placeholder into
a wrong gradient. These tests drive the cases where autograd could add into it in place.
"""

from __future__ import annotations

import torch

from lptrain.precision.layers import _HighPrecisionLinearFn
from lptrain.precision.linear_ops import fused_wgrad_placeholder


def _weight(out_f: int = 8, in_f: int = 4) -> torch.nn.Parameter:
    w = torch.nn.Parameter(torch.randn(out_f, in_f))
    w.main_grad = torch.zeros(out_f, in_f)  # type: ignore[attr-defined]
    w.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    return w


def test_placeholder_is_taken_as_grad_without_a_copy() -> None:
    w = _weight()
    x = torch.randn(3, 4, requires_grad=True)
    _HighPrecisionLinearFn.apply(x, w, True).sum().backward()
    cache = fused_wgrad_placeholder(w.shape, w.dtype, w.device)
    assert w.grad is not None and w.grad.data_ptr() == cache.data_ptr()
    assert torch.equal(w.main_grad, torch.ones(3, 8).t() @ x.detach())  # type: ignore[attr-defined]


def test_placeholder_stays_zero_when_a_weight_gets_two_grads() -> None:
    """A weight used by a fused linear and elsewhere (a tied head): the two grads are summed
    out of place, whichever arrives first, and the sum is the other use's grad."""
    for fused_first in (True, False):
        w = _weight()
        x = torch.randn(3, 4, requires_grad=True)
        y = _HighPrecisionLinearFn.apply(x, w, True).sum()
        other = (w * 3.0).sum()
        ((y + other) if fused_first else (other + y)).backward()
        assert torch.equal(w.grad, torch.full_like(w, 3.0))
        w.grad = None
        # twice in one graph, then again with the placeholder still in w.grad (no DDP hook)
        (_HighPrecisionLinearFn.apply(x, w, True) + _HighPrecisionLinearFn.apply(x, w, True)).sum().backward()
        _HighPrecisionLinearFn.apply(x, w, True).sum().backward()
        assert torch.equal(fused_wgrad_placeholder(w.shape, w.dtype, w.device), torch.zeros(8, 4))
        assert torch.equal(w.grad, torch.zeros(8, 4))
