"""bench/quantizer_calls.py: the record / replay / timing seams behind model_step's kernel split.

The diagnostic is only worth reading if it sees every quantize and dequantize call of a
quantized linear, replays exactly those, and leaves linear_ops as it found it; these check
that on a two-linear model (MXFP8, emulated), with no timing asserted."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quantizer_calls as qc

from lptrain.precision import linear_ops
from lptrain.precision import recipes as R
from lptrain.precision.autocast import autocast
from lptrain.precision.layers import Linear


def _step() -> tuple[torch.nn.Module, Callable[[], None]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 96, params_dtype=torch.float32),
                                Linear(96, 64, params_dtype=torch.float32))
    x = torch.randn(128, 64)

    def go() -> None:
        model.zero_grad(set_to_none=True)
        with autocast(R.MXFP8Scaling()):
            y = model(x.requires_grad_(True))
        y.square().sum().backward()

    return model, go


def test_record_sees_each_linears_three_operands_and_their_two_dequantizes() -> None:
    _, go = _step()
    calls = qc.record(go)
    # per linear: input, weight (forward), grad (backward); each dequantized twice
    assert len(calls) == 6
    roles = sorted(c.quantizer.role for c in calls)
    assert roles == ["grad", "grad", "input", "input", "weight", "weight"]
    uses = {c.quantizer.role: sorted(c.uses) for c in calls}
    assert uses == {"input": ["col_t", "rowwise"], "weight": ["columnwise", "rowwise"],
                    "grad": ["col_t", "rowwise"]}
    shapes = sorted(tuple(c.x.shape) for c in calls if c.quantizer.role == "weight")
    assert shapes == [(64, 96), (96, 64)]


def test_replay_makes_the_steps_quantize_calls_with_the_same_bytes(monkeypatch) -> None:
    _, go = _step()
    real = linear_ops._quantize
    made: list = []

    def keep(quantizer, x, rowwise, columnwise):
        out = real(quantizer, x, rowwise, columnwise)
        made.append(out)
        return out

    monkeypatch.setattr(linear_ops, "_quantize", keep)
    calls = qc.record(go)  # the recorder wraps ``keep``: ``made`` holds the step's tensors
    step_tensors, made[:] = list(made), []
    qc.replay(calls)
    assert len(made) == len(step_tensors) == len(calls)
    for a, b in zip(step_tensors, made, strict=True):  # MXFP8 is deterministic
        assert a.quantizer.role == b.quantizer.role
        for k, v in b.storage_views().items():
            if k in a.storage_views():  # the step dropped rowwise buffers kept for backward
                assert torch.equal(v, a.storage_views()[k]), k
    kernel_ops = qc.count_ops(lambda: qc.replay(calls))
    assert 0 < kernel_ops < qc.count_ops(go)


def test_kernel_timer_accumulates_inside_the_seams_and_restores_them() -> None:
    _, go = _step()
    real = linear_ops._quantize, linear_ops._OpContext.deq, linear_ops._OpContext.col_t
    t0 = time.perf_counter()
    with qc.kernel_timer() as inside:
        go()
    total = time.perf_counter() - t0
    assert 0 < inside[0] < total
    assert (linear_ops._quantize, linear_ops._OpContext.deq, linear_ops._OpContext.col_t) == real
    with qc.kernel_timer() as idle:
        pass
    assert idle == [0.0]  # nothing quantized, nothing counted


def test_record_refuses_a_dequantize_it_did_not_see_quantized(monkeypatch) -> None:
    """A dequantize of an operand the recorder did not see made is an error, not a replay
    that silently misses work (here the forward's quantize calls escape the spy)."""
    _, go = _step()
    real, seams = linear_ops._quantize, qc._seams

    @contextmanager
    def leaky(quantize, deq, col_t):
        with seams(quantize, deq, col_t):
            linear_ops._quantize = real
            yield

    monkeypatch.setattr(qc, "_seams", leaky)
    with pytest.raises(RuntimeError, match="no recorded quantize call"):
        qc.record(go)
