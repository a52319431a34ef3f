"""The QuantizedTensor interface: subclass behaviour, in-place requantize, accounting, grouping."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lptrain.precision import (
    BlockwiseScaling,
    GroupedQuantizedTensor,
    MXFP8Scaling,
    NVFP4Scaling,
    QuantizedTensor,
    TensorwiseScaling,
    quantize,
)

RECIPES = {
    "tensorwise": TensorwiseScaling(),
    "blockwise": BlockwiseScaling(),
    "mxfp8": MXFP8Scaling(),
    "nvfp4": NVFP4Scaling(),
}
STAGING = {"tensorwise": torch.uint8, "blockwise": torch.uint8, "mxfp8": torch.bfloat16, "nvfp4": torch.bfloat16}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(RECIPES))
def test_parameter_detach_clone_and_fallback_ops(name: str) -> None:
    w = RECIPES[name].make_quantizer("weight").quantize(randn(64, 128))
    p = nn.Parameter(w)
    assert isinstance(p, QuantizedTensor) and isinstance(p, nn.Parameter)
    assert p.requires_grad and p.shape == (64, 128) and p.dtype == torch.float32
    d = p.detach()
    assert type(d) is type(w) and d.storage_views()["rowwise_data"] is w.storage_views()["rowwise_data"]
    c = w.clone()
    assert type(c) is type(w)
    assert c.storage_views()["rowwise_data"].data_ptr() != w.storage_views()["rowwise_data"].data_ptr()
    assert torch.equal(c.dequantize(), w.dequantize())
    # ops fall back to the dequantized value; autograd sees a plain gradient of logical shape
    x = randn(3, 128, seed=1)
    y = x @ p.t()
    assert torch.equal(y, x @ w.dequantize().t())
    y.sum().backward()
    assert type(p.grad) is torch.Tensor and p.grad.shape == (64, 128)
    assert STAGING[name] == w.staging_dtype


@pytest.mark.parametrize("name", list(RECIPES))
def test_requantize_in_place_keeps_storage(name: str) -> None:
    q = RECIPES[name].make_quantizer("weight")
    w = q.quantize(randn(64, 128))
    ptrs = {k: v.data_ptr() for k, v in w.storage_views().items()}
    new = randn(64, 128, seed=5) * 3
    w.requantize_from(new)
    assert {k: v.data_ptr() for k, v in w.storage_views().items()} == ptrs
    fresh = q.quantize(new)
    for k, v in w.storage_views().items():
        assert torch.equal(v, fresh.storage_views()[k]), k
    # copy_ from a high-precision tensor requantizes; from the same layout it copies bytes
    w.copy_(randn(64, 128, seed=6))
    assert torch.equal(w.dequantize(), q.quantize(randn(64, 128, seed=6)).dequantize())
    w.copy_(fresh)
    assert torch.equal(w.dequantize(), fresh.dequantize())
    # in-place arithmetic runs on dequantized values and requantizes into the same buffers
    with torch.no_grad():
        w.mul_(2.0)
    assert torch.equal(w.dequantize(), q.quantize(fresh.dequantize() * 2).dequantize())
    assert {k: v.data_ptr() for k, v in w.storage_views().items()} == ptrs


def test_requantize_casts_master_to_model_dtype_first() -> None:
    q = BlockwiseScaling().make_quantizer("weight")
    w = q.quantize(randn(64, 128).bfloat16())
    master = randn(64, 128, seed=3)
    w.requantize_from(master)
    ref = q.quantize(master.bfloat16())
    assert torch.equal(w.storage_views()["rowwise_data"], ref.storage_views()["rowwise_data"])


def test_nbytes_and_storage_views() -> None:
    x = randn(64, 128)
    t = quantize(x, "tensorwise")
    assert sorted(t.storage_views()) == ["columnwise_data", "rowwise_data", "scale_inv"]
    assert t.nbytes("rowwise") == 64 * 128 + 4 and t.nbytes() == 2 * 64 * 128 + 4
    b = quantize(x, "blockwise", role="input")
    assert b.nbytes("rowwise") == 64 * 128 + 64 * 1 * 4 and b.nbytes("columnwise") == 64 * 128 + 128 * 1 * 4
    m = quantize(x, "mxfp8")
    assert m.nbytes("rowwise") == 64 * 128 + 64 * 4 and m.nbytes("columnwise") == 64 * 128 + 2 * 128
    n = quantize(x, "nvfp4")
    assert n.nbytes("rowwise") == 64 * 64 + 64 * 8 + 4 and n.nbytes("columnwise") == 128 * 32 + 128 * 4 + 4
    r = quantize(x, "nvfp4", columnwise=False)
    assert not r.has_orientation("columnwise") and r.has_orientation("rowwise")
    assert r.nbytes() == r.nbytes("rowwise") and r.nbytes("columnwise") == 0
    assert torch.equal(r.dequantize("columnwise"), r.dequantize("rowwise"))  # falls back


def test_high_precision_init_value() -> None:
    x = randn(32, 32).bfloat16()
    w = TensorwiseScaling().make_quantizer("weight").quantize(x, preserve_high_precision_init_val=True)
    assert torch.equal(w.high_precision_init_value(), x)
    w.clear_high_precision_init_value()
    assert w.high_precision_init_value() is None


def test_deepcopy_keeps_type_and_values() -> None:
    p = nn.Parameter(quantize(randn(32, 64), "mxfp8", role="weight"))
    p2 = copy.deepcopy(p)
    assert type(p2) is type(p) and torch.equal(p2.dequantize(), p.dequantize())


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_members_equal_separate_quantization(name: str) -> None:
    q = RECIPES[name].make_quantizer("weight")
    experts = [randn(32, 64, seed=i) * (i + 1) for i in range(3)]
    experts[1].zero_()  # an expert with a zero weight keeps its own (scale 1) blocks
    grp = q.quantize_grouped(experts)
    assert isinstance(grp, GroupedQuantizedTensor) and grp.shape == (3, 32, 64)
    assert grp.num_members == 3
    flat = grp.storage_views()
    for i, e in enumerate(experts):
        alone = q.quantize(e)
        mem = grp.member(i)
        for k, v in alone.storage_views().items():
            assert torch.equal(mem.storage_views()[k], v), (i, k)
            assert mem.storage_views()[k].untyped_storage().data_ptr() == flat[k].untyped_storage().data_ptr()
    assert all(v.dim() == 1 and v.is_contiguous() for v in flat.values())
    assert grp.nbytes() == sum(v.numel() * v.element_size() for v in flat.values())
    assert torch.equal(grp.dequantize(), torch.stack([q.quantize(e).dequantize() for e in experts]))
    # requantizing the group writes through the member views into the flat buffers
    new = [randn(32, 64, seed=10 + i) for i in range(3)]
    grp.requantize_from(new)
    assert torch.equal(grp.member(2).dequantize(), q.quantize(new[2]).dequantize())
    assert torch.equal(grp.dequantize()[0], q.quantize(new[0]).dequantize())
    c = grp.clone()
    assert isinstance(c, GroupedQuantizedTensor) and torch.equal(c.dequantize(), grp.dequantize())
    p = nn.Parameter(grp)  # a single grouped weight parameter (TE single_grouped_weight)
    assert isinstance(p, GroupedQuantizedTensor) and p.member(1).storage_views().keys() == flat.keys()
    assert p.staging_dtype == STAGING[name]


def test_save_load_roundtrip(tmp_path: pytest.TempPathFactory) -> None:
    for name in RECIPES:
        w = RECIPES[name].make_quantizer("weight").quantize(randn(32, 64))
        path = tmp_path / f"{name}.pt"  # type: ignore[operator]
        torch.save({"w": w}, path)
        r = torch.load(path, weights_only=False)["w"]
        assert type(r) is type(w) and torch.equal(r.dequantize(), w.dequantize())


def test_import_does_not_pull_transformer_engine() -> None:
    import subprocess
    import sys

    code = (
        "import sys, lptrain.precision; "
        "sys.exit(any(m.startswith('transformer_engine') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("name", list(RECIPES))
def test_update_usage_drops_and_rederives(name: str) -> None:
    x = randn(64, 128)
    q = RECIPES[name].make_quantizer("input")
    t = q.quantize(x)
    col = t.dequantize("columnwise")
    t.update_usage(rowwise=False, columnwise=True)
    assert not t.has_orientation("rowwise") and t.has_orientation("columnwise")
    assert t.nbytes() == t.nbytes("columnwise") and "rowwise_data" not in t.storage_views()
    assert torch.equal(t.dequantize("columnwise"), col)
    t.requantize_from(x * 2)  # only the kept buffers are rewritten
    assert torch.equal(t.dequantize("columnwise"), q.quantize(x * 2).dequantize("columnwise"))
    derivable = name == "tensorwise"  # per-tensor: rowwise is the exact transpose
    if derivable:
        t.update_usage(rowwise=True, columnwise=True)
        assert torch.equal(t.storage_views()["rowwise_data"], q.quantize(x * 2).storage_views()["rowwise_data"])
    else:
        with pytest.raises(ValueError, match="cannot rebuild"):
            t.update_usage(rowwise=True, columnwise=False)


def test_update_usage_blockwise_2d_rederives_transpose() -> None:
    q = BlockwiseScaling().make_quantizer("weight")
    w = q.quantize(randn(200, 136))
    full = {k: v.clone() for k, v in w.storage_views().items()}
    w.update_usage(rowwise=True, columnwise=False)
    assert "columnwise_data" not in w.storage_views()
    w.update_usage(rowwise=True, columnwise=True)
    for k, v in full.items():
        assert torch.equal(w.storage_views()[k], v), k


def test_grouped_update_usage_and_hp_init() -> None:
    q = MXFP8Scaling().make_quantizer("weight")
    experts = [randn(32, 64, seed=i) for i in range(2)]
    g = q.quantize_grouped(experts, preserve_high_precision_init_val=True)
    assert torch.equal(g.high_precision_init_value(), torch.stack(experts))
    g.update_usage(rowwise=True, columnwise=False)
    assert set(g.storage_views()) == {"rowwise_data", "rowwise_scale_inv"}
    assert not g.member(1).has_orientation("columnwise")
    g.requantize_from([e * 3 for e in experts])
    assert torch.equal(g.member(1).dequantize(), q.quantize(experts[1] * 3).dequantize())


@pytest.mark.parametrize("name", list(RECIPES))
def test_empty_tensor_quantizes(name: str) -> None:
    # MoE experts that receive zero tokens produce [0, K] operands.
    for role in ("input", "weight", "grad"):
        t = RECIPES[name].make_quantizer(role).quantize(torch.zeros(0, 64))  # type: ignore[arg-type]
        assert t.dequantize().shape == (0, 64) and t.dequantize("columnwise").shape == (0, 64)
