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

# recipe -> (GPU, expert token splits (the middle expert gets none), in, out features, the
# grouped kernel); MXFP8 needs K a multiple of 128 and each expert's rows of 32
CASES = {"tensorwise": ((9, 0), [16, 0, 48], 32, 48, "rowwise"),
         "mxfp8": ((10, 0), [32, 0, 64], 128, 128, "mxfp8")}


def _run(name: str, cap: tuple[int, int], fmt: str = "e4m3", dtype: torch.dtype = torch.bfloat16):
    """Forward and backward of 3 experts on the virtual GPU: (y, dx, dWs, dense calls,
    grouped calls, the experts' quantized inputs and weights captured from fprop)."""
    _, splits, n_in, n_out, _ = CASES[name]
    r = recipe_from_name(name, fp8_format=fmt)
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
            experts = GroupedLinear(len(splits), n_in, n_out, params_dtype=dtype).cuda()
            x = torch.randn(sum(splits), n_in, device="cuda", dtype=dtype, requires_grad=True)
            with ac.autocast(r, gemm="scaled_mm"):
                y = experts(x, splits)
            (y.float() * torch.linspace(-1, 1, n_out, device="cuda")).sum().backward()
            dws = [experts.member_weight(i).grad for i in range(len(splits))]
            return y, x.grad, dws, list(vd.scaled_gemms), list(vd.grouped_gemms), captured
    finally:
        sg.grouped = real


def _scale_shapes(kernel_name: str, splits: list[int], k: int, n: int) -> tuple[tuple, tuple]:
    """The scale shapes each kernel takes (row-wise: one fp32 per row / per expert and
    column; MXFP8: each expert's 128x4-tiled E8M0 grid, rows padded to 128)."""
    if kernel_name == "rowwise":
        return (sum(splits),), (len(splits), n)
    c4 = -(-(k // 32) // 4) * 4
    codes_a = sum(-(-m // 128) * 128 * c4 for m in splits)
    return (codes_a // (k // 32), k // 32), (len(splits), -(-n // 128) * 128 * c4)


@pytest.mark.parametrize("name", list(CASES))
def test_experts_fprop_and_dgrad_are_one_grouped_gemm_each(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cap, splits, n_in, n_out, kern = CASES[name]
    monkeypatch.setattr(sg, "torch_built_with", lambda flag: True)  # the GPU's torch has MSLK
    y, dx, dws, dense, grouped, captured = _run(name, cap)
    ends = tuple(sum(splits[: i + 1]) for i in range(len(splits)))
    # one grouped call per GEMM: fprop (per-tensor FP8: fast accumulation, as the dense fprop) then dgrad
    assert [c.kernel for c in grouped] == [kern, kern]
    assert [c.fast_accum for c in grouped] == [name == "tensorwise", False]
    for c, (k, n) in zip(grouped, [(n_in, n_out), (n_out, n_in)], strict=True):
        assert c.offs == ends  # end rows; the empty expert repeats its predecessor's
        assert c.a_shape == (sum(splits), k) and c.a_stride == (k, 1)  # A row-major
        assert c.b_shape == (3, k, n) and c.b_stride == (k * n, 1, k)  # B column-major
        assert (c.scale_a_shape, c.scale_b_shape) == _scale_shapes(kern, splits, k, n)
        assert c.out_dtype == torch.bfloat16
    # wgrad stays one fp32 scaled GEMM per expert with tokens (the grouped kernels write bf16)
    assert [(c.kernel, c.out_dtype) for c in dense] == [(name, torch.float32)] * 2
    # each expert's rows within the stated bound of the fp64 GEMM of its dequantized operands
    (qxs, qws), = captured
    for i, (lo, hi) in enumerate(zip((0, *ends), ends, strict=False)):
        if hi > lo:
            assert_within_bound(y[lo:hi], qxs[i].dequantize(), qws[i].dequantize(), name)
    # the per-expert path (grouped kernel unavailable) gives the same bits
    monkeypatch.setattr(sg, "grouped", lambda *a: None)
    y1, dx1, dws1, dense1, grouped1, _ = _run(name, cap)
    assert grouped1 == [] and len(dense1) == 3 * 2
    assert torch.equal(y, y1) and torch.equal(dx, dx1)
    assert all(torch.equal(a, b) for a, b in zip(dws, dws1, strict=True))
    # a wrong packing fails: the empty expert's end row moved onto the last expert's rows
    monkeypatch.undo()
    monkeypatch.setattr(sg, "torch_built_with", lambda flag: True)
    real_offsets = sg.group_offsets
    wrong = [splits[0], splits[2] // 2, splits[2] // 2]
    monkeypatch.setattr(sg, "group_offsets", lambda rows, dev: real_offsets(wrong, dev))
    if kern == "rowwise":
        y2, dx2, *_ = _run(name, cap)
        assert not torch.equal(y2, y) and not torch.equal(dx2, dx)
    else:  # the tiled scales no longer match the groups: the GPU refuses the call
        with pytest.raises(ScaledMMError, match="each group's tiled grid"):
            _run(name, cap)


@pytest.mark.parametrize("name,cap,fmt,dtype,mslk,gemms", [
    ("tensorwise", (10, 0), "e4m3", torch.bfloat16, True, []),  # the row-wise kernel is sm90's
    ("tensorwise", (9, 0), "hybrid", torch.bfloat16, True, ["fprop"]),  # E5M2 gradients: dgrad per expert
    ("tensorwise", (9, 0), "e4m3", torch.float32, True, []),  # the grouped kernels write bf16 only
    ("mxfp8", (10, 0), "e4m3", torch.bfloat16, False, []),  # a torch built without MSLK
])
def test_the_per_expert_path_stays_where_there_is_no_grouped_kernel(
        name, cap, fmt, dtype, mslk, gemms, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sg, "torch_built_with", lambda flag: mslk)
    *_, dense, grouped, _ = _run(name, cap, fmt, dtype)
    assert len(grouped) == len(gemms)
    assert len(dense) == 2 * (3 - len(gemms))  # per expert with tokens: the GEMMs not grouped
    k = kernel(name)
    assert k is not None and not k.grouped_runs("wgrad", cap[0] * 10 + cap[1])


def test_the_virtual_gpu_refuses_the_row_wise_grouped_kernel_off_sm90() -> None:
    with VirtualCuda(capability=(10, 0)):
        a = torch.randn(32, 32, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(2, 16, 32, device="cuda").to(torch.float8_e4m3fn).transpose(1, 2)
        offs = torch.tensor([16, 32], dtype=torch.int32, device="cuda")
        with pytest.raises(ScaledMMError, match="no rowwise grouped kernel on sm100"):
            F.scaled_grouped_mm(a, b, torch.ones(32, device="cuda"), F.ScalingType.RowWise,
                                torch.ones(2, 16, device="cuda"), F.ScalingType.RowWise, offs=offs)
