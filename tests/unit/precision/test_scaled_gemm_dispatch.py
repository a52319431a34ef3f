"""precision.quantized_gemm=scaled_mm on the virtual GPU (dispatch only): which kernel each
GEMM of each recipe selects, with which scaling types and layouts, what the GPU refuses, and
each recipe's stated error bound (test_scaled_gemm.py) for the kernel's math on the stored
codes and scales -- computed by the virtual GPU from the layouts torch's CUDA kernels read
(swizzled tiles, outer-dim-major 1x128, padded 128x128), so a wrong layout is a wrong GEMM.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _scaled_helpers import assert_within_bound

from lptrain.precision import autocast as ac
from lptrain.precision import scaled_gemm as sg
from lptrain.precision.layers import GroupedLinear, Linear
from lptrain.precision.linear_ops import col_operand_t
from lptrain.precision.recipes import recipe_from_name
from lptrain.testing.virtual_cuda import VirtualCuda
from lptrain.testing.virtual_cuda.scaled_mm import ScaledMMError

# recipe -> (compute capability, fmt, (M, K, N), scaling types of fprop / dgrad / wgrad)
CASES = {
    "tensorwise": ((9, 0), "hybrid", (64, 64, 32),
                   [("TensorWise", "TensorWise")] * 3),
    "blockwise": ((9, 0), "e4m3", (256, 256, 128),
                  [("BlockWise1x128", "BlockWise128x128"), ("BlockWise1x128", "BlockWise128x128"),
                   ("BlockWise1x128", "BlockWise1x128")]),
    "mxfp8": ((10, 0), "e4m3", (64, 96, 64), [("BlockWise1x32", "BlockWise1x32")] * 3),
    "nvfp4": ((10, 0), None, (64, 96, 64), [("BlockWise1x16", "BlockWise1x16")] * 3),
}


def _recipe(name: str, fmt: str | None):
    return recipe_from_name(name, **({"fp8_format": fmt} if fmt else {}))


@pytest.mark.parametrize("name", list(CASES))
def test_each_gemm_selects_the_recipe_kernel_within_the_bound(name: str) -> None:
    cap, fmt, (m, k, n), scalings = CASES[name]
    g = torch.Generator().manual_seed(1)
    host = [torch.randn(s, generator=g) * c for s, c in (((m, k), 2.0), ((n, k), 0.05), ((m, n), 1e-3))]
    r = _recipe(name, fmt)
    with VirtualCuda(capability=cap) as vd:
        x, w, dy = (t.to("cuda", torch.bfloat16) for t in host)
        q = {role: r.make_quantizer(role, True, True) for role in ("input", "weight", "grad")}
        qx, qw, qdy = q["input"].quantize(x), q["weight"].quantize(w), q["grad"].quantize(dy)
        y = sg.fprop(qx, qw, torch.bfloat16)
        dx = sg.dgrad(qdy, qw, torch.bfloat16)
        dw = sg.wgrad(qdy, qx)
        refs = [(qx.dequantize(), qw.dequantize()), (qdy.dequantize(), qw.dequantize("columnwise").t()),
                (col_operand_t(qdy), col_operand_t(qx))]
        calls = list(vd.scaled_gemms)
    assert [(c.scaling_a, c.scaling_b) for c in calls] == scalings
    assert {c.kernel for c in calls} == {name}
    assert [c.out_dtype for c in calls] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert [c.k for c in calls] == [k, n, m]
    if cap < (10, 0):  # Hopper: cuBLASLt takes K-major operands only
        assert all(c.a_k_major and c.b_k_major for c in calls)
    for got, (a, b) in zip((y, dx, dw), refs, strict=True):
        assert_within_bound(got, a, b, name)


@pytest.mark.parametrize("name,cap", [("mxfp8", (9, 0)), ("nvfp4", (9, 0)), ("blockwise", (10, 0)),
                                      ("tensorwise", (8, 0))])
def test_the_gpu_refuses_a_kernel_it_does_not_have(name: str, cap: tuple[int, int]) -> None:
    _, fmt, (m, k, n), _ = CASES[name]
    r = _recipe(name, fmt)
    with VirtualCuda(capability=cap):
        qx = r.make_quantizer("input", True, False).quantize(torch.randn(m, k, device="cuda"))
        qw = r.make_quantizer("weight", True, False).quantize(torch.randn(n, k, device="cuda"))
        with pytest.raises(ScaledMMError, match=r"kernel on|sm"):
            sg.fprop(qx, qw, torch.float32)


def test_hopper_takes_k_major_operands_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight that keeps only its column-wise bytes (a saved operand) feeds fprop through a
    transposed view; on sm90 the dispatch copies it K-major, or cuBLASLt would refuse it
    (shown with the copy monkeypatched away)."""
    r = _recipe("tensorwise", "e4m3")
    with VirtualCuda(capability=(9, 0)) as vd:
        qx = r.make_quantizer("input", True, False).quantize(torch.randn(32, 64, device="cuda"))
        qw = r.make_quantizer("weight", True, True).quantize(torch.randn(48, 64, device="cuda"))
        qw.update_usage(rowwise=False, columnwise=True)
        sg.fprop(qx, qw, torch.float32)
        assert vd.scaled_gemms[-1].b_k_major
        monkeypatch.setattr(sg, "_tn_only", lambda t: False)
        with pytest.raises(ScaledMMError, match="row-major and column-major"):
            sg.fprop(qx, qw, torch.float32)


def test_linear_and_grouped_experts_run_every_gemm_on_the_kernel() -> None:
    """The quantized linear and the grouped expert op under autocast(gemm=scaled_mm): fprop,
    dgrad and wgrad of every member reach torch's scaled GEMMs with the stored operands (no
    dequantize: the spy on dequantize sees none), bf16 activations in and out; on sm90 the
    experts' fprop and dgrad as one F.scaled_grouped_mm each (test_scaled_grouped_gemm.py)."""
    from lptrain.precision.tensors.base import QuantizedTensor

    r = _recipe("tensorwise", "e4m3")
    deq = []
    real = QuantizedTensor.dequantize
    QuantizedTensor.dequantize = lambda self, o="rowwise": deq.append(o) or real(self, o)  # type: ignore[method-assign]
    try:
        with VirtualCuda(capability=(9, 0)) as vd:
            torch.manual_seed(0)
            lin = Linear(64, 32, params_dtype=torch.bfloat16).cuda()
            experts = GroupedLinear(2, 32, 48, params_dtype=torch.bfloat16).cuda()
            x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with ac.autocast(r, gemm="scaled_mm"):
                y = experts(lin(x), [32, 32])
            y.float().sum().backward()
            calls = list(vd.scaled_gemms)
            grouped = list(vd.grouped_gemms)
    finally:
        QuantizedTensor.dequantize = real  # type: ignore[method-assign]
    assert deq == []
    assert len(calls) == 3 + 2  # the linear's fprop, dgrad, wgrad; each expert's wgrad
    assert len(grouped) == 2  # the experts' fprop and dgrad
    assert y.dtype == x.grad.dtype == torch.bfloat16
    assert {c.kernel for c in calls} == {"tensorwise"}


def test_nvfp4_without_the_v2_entry_point_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch._scaled_mm takes one scale per operand: NVFP4's second-level scale needs
    F.scaled_mm, so an older torch is told so (the per-tensor recipes fall back to it)."""
    monkeypatch.delattr(F, "scaled_mm")
    with VirtualCuda(capability=(10, 0)) as vd:
        r = _recipe("tensorwise", "e4m3")
        qx = r.make_quantizer("input", True, False).quantize(torch.randn(32, 64, device="cuda"))
        qw = r.make_quantizer("weight", True, False).quantize(torch.randn(48, 64, device="cuda"))
        sg.fprop(qx, qw, torch.float32)
        assert vd.scaled_gemms[-1].kernel == "tensorwise"
        nv = _recipe("nvfp4", None)
        qx = nv.make_quantizer("input", True, False).quantize(torch.randn(32, 64, device="cuda"))
        qw = nv.make_quantizer("weight", True, False).quantize(torch.randn(48, 64, device="cuda"))
        with pytest.raises(RuntimeError, match=r"torch\.nn\.functional\.scaled_mm"):
            sg.fprop(qx, qw, torch.float32)
