"""MoE experts under precision.quantized_gemm=scaled_mm on the virtual GPU (dispatch only; torch
has no CPU ``scaled_grouped_mm``): fprop and dgrad of the grouped experts run as one
``F.scaled_grouped_mm`` each where the catalog says torch has the grouped kernel (per-tensor
E4M3 on sm90), with the operand layouts, scales and offsets the row-wise kernel checks; the
virtual GPU computes it from the packed codes and scales, so the result equals the per-expert
path bit for bit, a wrong offset does not, and each expert's rows are within the stated
error bound of the fp64 GEMM of its dequantized operands. Elsewhere the per-expert path stays.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _scaled_helpers import assert_within_bound

from lptrain.catalog.scaled_gemm import kernel
from lptrain.precision import autocast as ac
from lptrain.precision import scaled_gemm as sg
from lptrain.precision.layers import GroupedLinear
from lptrain.precision.recipes import recipe_from_name
from lptrain.testing.virtual_cuda import VirtualCuda
from lptrain.testing.virtual_cuda.scaled_mm import ScaledMMError

SPLITS = [16, 0, 48]  # the middle expert gets no tokens
IN, OUT = 32, 48


def _run(cap: tuple[int, int], fmt: str = "e4m3", dtype: torch.dtype = torch.bfloat16):
    """Forward and backward of 3 experts on the virtual GPU: (y, dx, dWs, dense calls,
    grouped calls, the experts' quantized inputs and weights captured from fprop)."""
    r = recipe_from_name("tensorwise", fp8_format=fmt)
    captured: list = []
    real = sg.grouped

    def spy(gemm, qas, qbs, out_dtype):
        if gemm == "fprop":
            captured.append((list(qas), list(qbs)))
        return real(gemm, qas, qbs, out_dtype)

    sg.grouped = spy  # restored below (the spy only records)
    try:
        with VirtualCuda(capability=cap) as vd:
            torch.manual_seed(0)
            experts = GroupedLinear(len(SPLITS), IN, OUT, params_dtype=dtype).cuda()
            x = torch.randn(sum(SPLITS), IN, device="cuda", dtype=dtype, requires_grad=True)
            with ac.autocast(r, gemm="scaled_mm"):
                y = experts(x, SPLITS)
            (y.float() * torch.linspace(-1, 1, OUT, device="cuda")).sum().backward()
            dws = [experts.member_weight(i).grad for i in range(len(SPLITS))]
            return y, x.grad, dws, list(vd.scaled_gemms), list(vd.grouped_gemms), captured
    finally:
        sg.grouped = real


def test_experts_fprop_and_dgrad_are_one_grouped_gemm_each(monkeypatch: pytest.MonkeyPatch) -> None:
    y, dx, dws, dense, grouped, captured = _run((9, 0))
    # one grouped call per GEMM: fprop (fast accumulation, as the dense fprop) then dgrad
    assert [c.kernel for c in grouped] == ["rowwise", "rowwise"]
    assert [c.fast_accum for c in grouped] == [True, False]
    for c, (k, n) in zip(grouped, [(IN, OUT), (OUT, IN)], strict=True):
        assert c.offs == (16, 16, 64)  # end rows; the empty expert repeats its predecessor's
        assert c.a_shape == (64, k) and c.a_stride == (k, 1)  # A row-major
        assert c.b_shape == (3, k, n) and c.b_stride == (k * n, 1, k)  # B column-major
        assert c.scale_a_shape == (64,) and c.scale_b_shape == (3, n)
        assert c.out_dtype == torch.bfloat16
    # wgrad stays one fp32 scaled GEMM per expert with tokens (the grouped kernels write bf16)
    assert [(c.kernel, c.out_dtype) for c in dense] == [("tensorwise", torch.float32)] * 2
    # each expert's rows within the stated bound of the fp64 GEMM of its dequantized operands
    (qxs, qws), = captured
    for i, (lo, hi) in enumerate([(0, 16), (16, 16), (16, 64)]):
        if hi > lo:
            assert_within_bound(y[lo:hi], qxs[i].dequantize(), qws[i].dequantize(), "tensorwise")
    # the per-expert path (grouped kernel unavailable) gives the same bits
    monkeypatch.setattr(sg, "grouped", lambda *a: None)
    y1, dx1, dws1, dense1, grouped1, _ = _run((9, 0))
    assert grouped1 == [] and len(dense1) == 3 * 2
    assert torch.equal(y, y1) and torch.equal(dx, dx1)
    assert all(torch.equal(a, b) for a, b in zip(dws, dws1, strict=True))
    # a wrong packing fails: the empty expert's end row moved onto the last expert's rows
    monkeypatch.undo()
    real_offsets = sg.group_offsets
    monkeypatch.setattr(sg, "group_offsets", lambda rows, dev: real_offsets([16, 8, 40], dev))
    y2, dx2, *_ = _run((9, 0))
    assert not torch.equal(y2, y) and not torch.equal(dx2, dx)


@pytest.mark.parametrize("cap,fmt,dtype,gemms", [
    ((10, 0), "e4m3", torch.bfloat16, []),  # the row-wise grouped kernel is sm90's
    ((9, 0), "hybrid", torch.bfloat16, ["fprop"]),  # E5M2 gradients: dgrad per expert
    ((9, 0), "e4m3", torch.float32, []),  # the grouped kernels write bf16 only
])
def test_the_per_expert_path_stays_where_there_is_no_grouped_kernel(cap, fmt, dtype, gemms) -> None:
    *_, dense, grouped, _ = _run(cap, fmt, dtype)
    assert len(grouped) == len(gemms)
    assert len(dense) == 2 * (3 - len(gemms))  # per expert with tokens: the GEMMs not grouped
    k = kernel("tensorwise")
    assert k is not None and k.grouped_runs("fprop", 90) and not k.grouped_runs("fprop", 100)
    assert not k.grouped_runs("wgrad", 90)


def test_the_virtual_gpu_refuses_the_row_wise_grouped_kernel_off_sm90() -> None:
    with VirtualCuda(capability=(10, 0)):
        a = torch.randn(32, 32, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(2, 16, 32, device="cuda").to(torch.float8_e4m3fn).transpose(1, 2)
        offs = torch.tensor([16, 32], dtype=torch.int32, device="cuda")
        with pytest.raises(ScaledMMError, match="no row-wise FP8 grouped kernel on sm100"):
            F.scaled_grouped_mm(a, b, torch.ones(32, device="cuda"), F.ScalingType.RowWise,
                                torch.ones(2, 16, device="cuda"), F.ScalingType.RowWise, offs=offs)
