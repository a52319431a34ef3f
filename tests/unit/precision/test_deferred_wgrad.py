"""Weight gradients deferred to a W step (the zero-bubble pipeline schedules), on one linear:
the I step's input gradient is the unsplit backward's; after the W steps -- run after *both*
micro-batches' I steps -- ``main_grad`` is, bitwise, what two unsplit backwards accumulate, so
each W used its own micro-batch's quantized operands (delayed scaling and stochastic rounding
included); the weight's grad hook runs after the W steps, once none is pending, never in an I
step."""

from __future__ import annotations

import pytest
import torch
from _linear_helpers import IN, OUT, RECIPES, data

from lptrain.precision import deferred_wgrad
from lptrain.precision.autocast import autocast
from lptrain.precision.layers import Linear

CASES = ["bf16", *sorted(RECIPES)]


def _linear(w: torch.Tensor) -> tuple[Linear, list[float]]:
    """A fused-wgrad linear holding ``w`` with a zero ``main_grad`` and a grad hook that records
    the ``main_grad`` sum it sees (installed as the data-parallel engine installs its own)."""
    lin = Linear(IN, OUT, params_dtype=torch.float32, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        lin.weight.copy_(w)
    p = lin.weight
    p.main_grad = torch.zeros(OUT, IN)
    p.wgrad_pending = 0
    seen: list[float] = []

    def hook(q: torch.Tensor) -> None:
        if q.wgrad_pending:  # (the engine's hook: lptrain.distributed.ddp)
            return
        seen.append(float(q.main_grad.abs().sum()))
        q.grad = None

    p.main_grad_hook = hook
    p.main_grad_hooked = True
    p.register_post_accumulate_grad_hook(hook)
    return lin, seen


def _backward(lin: Linear, recipe: object, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    xx = x.clone().requires_grad_(True)
    if recipe is None:
        lin(xx).backward(dy)
    else:
        with autocast(recipe):
            lin(xx).backward(dy)
    return xx.grad


@pytest.mark.parametrize("name", CASES)
def test_w_steps_after_both_i_steps_equal_two_unsplit_backwards(name: str) -> None:
    x, w, dy = data()
    x2, _, dy2 = data(seed=1)
    make = RECIPES.get(name)
    plain, plain_seen = _linear(w)
    split, split_seen = _linear(w)
    recipe_plain = make() if make else None
    recipe_split = make() if make else None
    if recipe_plain is not None and hasattr(recipe_plain, "seed"):
        recipe_plain.seed = recipe_split.seed = 5  # (the same stochastic-rounding streams)
    dx_plain = [_backward(plain, recipe_plain, xi, dyi) for xi, dyi in ((x, dy), (x2, dy2))]
    queues = []
    dx_split = []
    for xi, dyi in ((x, dy), (x2, dy2)):  # both I steps first, as a zero-bubble warm-up may
        with deferred_wgrad.deferring() as q:
            dx_split.append(_backward(split, recipe_split, xi, dyi))
        queues.append(q)
    assert all(len(q) == 1 for q in queues) and split.weight.wgrad_pending == 2
    assert torch.count_nonzero(split.weight.main_grad) == 0 and split_seen == []  # nothing before W
    for a, b in zip(dx_plain, dx_split, strict=True):
        assert torch.equal(a, b)  # the I step's input gradient is the unsplit one
    for q in queues:  # the W steps, in micro-batch order
        q.run()
    assert split.weight.wgrad_pending == 0
    assert torch.equal(split.weight.main_grad, plain.weight.main_grad)
    # the hook ran once, when no W job of the weight was left, seeing the whole sum (the
    # unsplit backwards ran it after each)
    assert len(plain_seen) == 2 and split_seen == plain_seen[-1:] and split_seen[0] > 0


def test_w_steps_out_of_micro_batch_order_change_the_sum() -> None:
    """Why the runner refuses a W out of micro-batch order: fp32 sums in another order round
    elsewhere (unquantized fp32 linear, where nothing else differs)."""
    x, w, dy = data()
    x2, _, dy2 = data(seed=1)
    x3, _, dy3 = data(seed=2)
    sums = []
    for order in ((0, 1, 2), (2, 1, 0)):
        lin, _ = _linear(w)
        queues = []
        for xi, dyi in ((x, dy), (x2 * 1e3, dy2), (x3 * 1e-3, dy3)):
            with deferred_wgrad.deferring() as q:
                _backward(lin, None, xi, dyi)
            queues.append(q)
        for i in order:
            queues[i].run()
        sums.append(lin.weight.main_grad.clone())
    assert not torch.equal(sums[0], sums[1])
