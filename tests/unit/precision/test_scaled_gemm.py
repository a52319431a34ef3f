"""precision.quantized_gemm=scaled_mm on this CPU: torch's scaled GEMM runs the TensorWise
kernel here, so the per-tensor recipes (tensorwise, delayed) go through it for real; the
GPU-only kernels are dispatch-checked on the virtual GPU (test_scaled_gemm_dispatch.py).

Error bound (lptrain.catalog.scaled_gemm.error_bound): against the fp64 GEMM of the same
dequantized operands, every output element is within ``a * sum_k |A_ik B_kj| + b * |C_ij|``,
a = (K + 2 * blocks + 2) * 2^-24 for fp32 accumulation (one rounding per product and sum, at
most two per block scale), b the output dtype's half ulp (0 for fp32 outputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _scaled_helpers import assert_within_bound

from lptrain.config import World, check, derive, load
from lptrain.precision import scaled_gemm as sg
from lptrain.precision.linear_ops import col_operand_t
from lptrain.precision.recipes import recipe_from_name
from lptrain.testing.parity import train_steps


@pytest.fixture
def scaled_mm_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Every torch.nn.functional.scaled_mm call: the scaling types of A and B."""
    calls: list[tuple[str, ...]] = []
    real = F.scaled_mm

    def spy(a, b, sa, ra, sb, rb, *args, **kwargs):
        calls.append(tuple(str(r).split(".")[-1] for r in (*ra, *rb)))
        return real(a, b, sa, ra, sb, rb, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", spy)
    return calls


@pytest.mark.parametrize("recipe,fmt", [("tensorwise", "e4m3"), ("tensorwise", "hybrid"),
                                        ("delayed", "hybrid")])
def test_cpu_per_tensor_gemms_run_the_kernel_within_the_bound(
        recipe: str, fmt: str, scaled_mm_calls: list) -> None:
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(s, generator=g) * m for s, m in (((48, 64), 3.0), ((32, 64), 0.1),
                                                               ((48, 32), 1e-3)))
    r = recipe_from_name(recipe, fp8_format=fmt)
    st = {role: r.make_state(role) for role in ("input", "weight", "grad")} if recipe == "delayed" else {}
    q = {role: r.make_quantizer(role, True, True, **({"state": st[role]} if st else {}))
         for role in ("input", "weight", "grad")}
    qx, qw, qdy = q["input"].quantize(x), q["weight"].quantize(w), q["grad"].quantize(dy)
    y = sg.fprop(qx, qw, torch.float32)
    dx = sg.dgrad(qdy, qw, torch.float32)
    dw = sg.wgrad(qdy, qx)
    assert scaled_mm_calls == [("TensorWise",) * 2] * 3
    assert_within_bound(y, qx.dequantize(), qw.dequantize(), recipe)
    assert_within_bound(dx, qdy.dequantize(), qw.dequantize("columnwise").t(), recipe)
    assert_within_bound(dw, col_operand_t(qdy), col_operand_t(qx), recipe)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32


def test_tiny_cpu_trains_through_scaled_mm_like_dequantized(scaled_mm_calls: list) -> None:
    """The issue's check at a smaller scale (2 steps of a 1-layer model: the second loss
    follows the first step's scaled dgrad and wgrad; the 30-step run of tiny_cpu.yaml is in
    docs/scaled-gemm.md): every quantized GEMM goes through torch.nn.functional.scaled_mm and
    the losses stay within 2% of the dequantized run."""
    small = ["precision.fp8_format=e4m3", "precision.fp8_recipe=tensorwise", "model.num_layers=1",
             "model.seq_length=32", "train.micro_batch_size=4", "train.global_batch_size=4"]
    deq = train_steps("tiny_cpu.yaml", [*small, "precision.quantized_gemm=dequantized"], steps=2)
    assert scaled_mm_calls == []
    got = train_steps("tiny_cpu.yaml", [*small, "precision.quantized_gemm=scaled_mm"], steps=2)
    # per step, 4 linears (qkv, proj, fc1, fc2) x fprop, dgrad and wgrad, all TensorWise; the
    # probe forward after the last step adds 4 fprops
    assert len(scaled_mm_calls) == 2 * 4 * 3 + 4
    assert set(scaled_mm_calls) == {("TensorWise", "TensorWise")}
    for step, (a, b) in enumerate(zip(deq["losses"], got["losses"], strict=True), 1):
        assert abs(a - b) <= 0.02 * abs(a), (step, a, b)


def _violations(recipe: str, target: str, *overrides: str) -> set[str]:
    cfg = load(recipe, list(overrides)).cfg
    return {v.rule for v in check(cfg, World.detect(dp=1, target=target)) if v.severity == "error"}


def test_validate_config_scaled_mm_where_torch_has_the_kernel() -> None:
    sm = ["precision.quantized_gemm=scaled_mm"]
    emu = [*sm, "precision.backend=emulated"]
    # NVFP4 has no kernel on sm90: refused on TE (its own rule) and on the emulated backend
    assert "PREC-TARGET-SUPPORT" in _violations("nvfp4_adamw.yaml", "sm90", *sm)
    assert _violations("nvfp4_adamw.yaml", "sm90", *emu) == {"PREC-SCALED-MM-KERNEL"}
    assert _violations("fp8_tensorwise.yaml", "sm90", *sm) == set()
    assert _violations("fp8_tensorwise.yaml", "sm90", *emu) == set()
    assert _violations("mxfp8_adamw.yaml", "sm100", *sm) == set()
    assert _violations("mxfp8_adamw.yaml", "sm100", *emu) == set()
    # blockwise's kernel is Hopper-only; on the CPU only the per-tensor recipes have one
    assert _violations("fp8_blockwise.yaml", "sm100", *emu) == {"PREC-SCALED-MM-KERNEL"}
    assert _violations("mxfp8_adamw_cpu.yaml", "cpu", *sm) == {"PREC-SCALED-MM-KERNEL"}
    assert _violations("fp8_tensorwise_cpu.yaml", "cpu", *sm) == set()
    # an old CUDA: blockwise needs cuBLASLt 12.9
    cfg = load("fp8_blockwise.yaml", emu).cfg
    old = World.detect(dp=1, target="sm90", cuda_version="12.8")
    assert "PREC-SCALED-MM-KERNEL" in {v.rule for v in check(cfg, old)}
    # dequantized has no meaning on TE; scaled_mm has none without a quantized recipe
    assert _violations("fp8_tensorwise.yaml", "sm90", "precision.quantized_gemm=dequantized") == {
        "PREC-DEQUANTIZED-TE"}
    assert _violations("tiny_cpu.yaml", "cpu", *sm) == {"INERT-QUANTIZED-GEMM"}


@pytest.mark.parametrize("recipe,target,backend,resolved", [
    ("fp8_tensorwise_cpu.yaml", "cpu", "emulated", "dequantized"),  # CPU: the bit-exact reference
    ("fp8_tensorwise.yaml", "sm90", "emulated", "scaled_mm"),
    ("fp8_blockwise.yaml", "sm100", "emulated", "dequantized"),  # no 1x128 kernel on Blackwell
    ("nvfp4_adamw.yaml", "sm90", "emulated", "dequantized"),
    ("nvfp4_adamw.yaml", "sm100", "emulated", "scaled_mm"),
    ("fp8_tensorwise.yaml", "sm90", "te", "scaled_mm"),  # TE's GEMMs take stored operands
    ("tiny_cpu.yaml", "cpu", "emulated", "dequantized"),
])
def test_auto_resolves_per_recipe_and_device(recipe: str, target: str, backend: str,
                                             resolved: str) -> None:
    cfg = load(recipe, [f"precision.backend={backend}"]).cfg
    assert cfg.precision.quantized_gemm == "auto"
    assert derive(cfg, World.detect(dp=1, target=target)).precision.quantized_gemm == resolved


def test_swizzled_scales_follow_cublas_tile_layout() -> None:
    """sg.swizzle_scales (a view/permute) against cuBLAS's documented offset of scale (r, c)
    in the 128x4 tiled layout, computed element by element; padding is zero codes."""
    rows, cols = 200, 6
    grid = torch.arange(rows * cols, dtype=torch.int32).remainder(251).add(1).to(torch.uint8).view(rows, cols)
    flat = sg.swizzle_scales(grid).reshape(-1)
    tiles_per_row = -(-cols // 4)
    assert flat.numel() == 256 * 8
    seen = torch.zeros_like(flat, dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            off = ((r // 128) * tiles_per_row + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert flat[off] == grid[r, c], (r, c)
            seen[off] = True
    assert bool((flat[~seen] == 0).all())
