"""The bf16 weight gradient on a GPU: one 16-bit GEMM with an fp32 result, not an fp32 GEMM.

Found on an H200: the wgrad of every unquantized linear upcast its bf16 operands and ran as a
SIMT fp32 sgemm, 66% of the step of a 16x2048 bf16 GPT (11% MFU). On CUDA it is now
``mm(dy^T, x, out_dtype=float32)``: tensor cores, fp32 accumulation, the same fp32 result up
to summation order. Here the virtual GPU runs that op the way the device computes it (exact
products, fp32 sums), so the result is compared bitwise with the upcast product; the real
device's accuracy is tests/gpu/test_cuda_emulated.py's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lptrain.precision import gemm
from lptrain.precision.layers import _HighPrecisionLinearFn
from lptrain.testing.virtual_cuda import VirtualCuda

aten = torch.ops.aten
pytestmark = pytest.mark.skipif("dtype" not in aten.mm.overloads(), reason="torch without mm(out_dtype)")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _backward(device: bool) -> tuple[list[Any], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused-wgrad backward of a bf16 linear; the aten ops of its backward and main_grad."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, 32, generator=g).bfloat16()
    w = torch.randn(16, 32, generator=g).bfloat16()
    dy = torch.randn(2, 48, 16, generator=g).bfloat16()
    if device:
        x, w, dy = x.cuda(), w.cuda(), dy.cuda()
    w.requires_grad_(True)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    x.requires_grad_(True)
    y = _HighPrecisionLinearFn.apply(x, w, True)
    with _Ops() as ops:
        y.backward(dy)
    return ops.seen, w.main_grad.cpu(), dy.cpu(), x.detach().cpu()


def _reference(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return dy.reshape(-1, dy.shape[-1]).float().t() @ x.reshape(-1, x.shape[-1]).float()


def test_on_a_gpu_the_bf16_wgrad_is_a_16bit_gemm_with_an_fp32_result() -> None:
    with VirtualCuda() as vd:
        seen, main_grad, dy, x = _backward(device=True)
    assert not vd.violations, vd.violations
    assert seen.count(aten.mm.dtype) == 1, "the wgrad is one mm(out_dtype=float32)"
    assert torch.equal(main_grad, _reference(dy, x))


def test_the_gemm_check_fails_with_the_upcast_wgrad(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fix removed (no out_dtype GEMM): the wgrad is an fp32 mm again, which the test sees."""
    monkeypatch.setattr(gemm, "_MM_OUT_DTYPE", False)
    with VirtualCuda():
        seen, main_grad, dy, x = _backward(device=True)
    assert aten.mm.dtype not in seen
    assert torch.equal(main_grad, _reference(dy, x))


def test_on_the_cpu_the_wgrad_stays_an_fp32_gemm() -> None:
    """CPU has no 16-bit GEMM with a wide output (and bf16 matmul is ~80x slower there)."""
    seen, main_grad, dy, x = _backward(device=False)
    assert aten.mm.dtype not in seen
    assert torch.equal(main_grad, _reference(dy, x))
