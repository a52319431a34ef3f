"""Per-recipe quantizer properties on random data: error bounds, idempotence, orientations."""

from __future__ import annotations

import pytest
import torch

from lptrain.precision import (
    BlockwiseScaling,
    DelayedScaling,
    MXFP8Scaling,
    NVFP4Scaling,
    QuantizedTensor,
    TensorwiseScaling,
    quantize,
)
from lptrain.precision.formats import unpack_fp4
from lptrain.precision.scaling import e8m0_to_dequant_scale, nvfp4_dequant_block_scale


def randn(*shape: int, seed: int = 0, heavy: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if heavy:  # rows spanning ~2^-6..2^6 in magnitude
        x = x * torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), generator=g).float())
    return x


def elem_scale_inv(qt: QuantizedTensor, orientation: str) -> torch.Tensor:
    """The dequantization factor of every element, in the logical [M, K] layout."""
    v = qt.storage_views()
    m, k = qt.dequantize().reshape(-1, qt.shape[-1]).shape
    name = type(qt).__name__
    if name == "Float8Tensor":
        return v["scale_inv"].expand(m, k)
    if name == "BlockwiseFP8Tensor":
        s = v[f"{orientation}_scale_inv"]
        if qt.is_2d:  # type: ignore[attr-defined]
            s = s if orientation == "rowwise" else s.t()
            return s.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1)[:, :k]
        full = s.repeat_interleave(128, 1)
        return full[:, :k] if orientation == "rowwise" else full[:, :m].t()
    if name == "MXFP8Tensor":
        d = e8m0_to_dequant_scale(v[f"{orientation}_scale_inv"])
        return d.repeat_interleave(32, 1) if orientation == "rowwise" else d.repeat_interleave(32, 0)
    if name == "NVFP4Tensor":
        d = nvfp4_dequant_block_scale(v[f"{orientation}_scale_inv"], v[f"amax_{orientation}"])
        d = d.repeat_interleave(16, 1)
        return d if orientation == "rowwise" else d.t()
    raise AssertionError(name)


FP8_CASES = [
    ("tensorwise", {}, [(3,), (7, 5), (2, 3, 40)]),
    ("tensorwise", {"power_2_scale": True}, [(7, 5)]),
    ("blockwise", {"role": "input"}, [(3, 130), (100, 200), (2, 64, 130), (256, 384)]),
    ("blockwise", {"role": "weight"}, [(100, 200), (256, 384), (130, 7)]),
    ("mxfp8", {}, [(64, 96), (2, 32, 64)]),
    ("mxfp8", {"role": "grad", "fp8_format": "hybrid"}, [(64, 96)]),
]


@pytest.mark.parametrize(("recipe", "kw", "shapes"), FP8_CASES)
def test_fp8_roundtrip_error_bound(recipe: str, kw: dict, shapes: list) -> None:
    for shape in shapes:
        x = randn(*shape, heavy=True)
        qt = quantize(x, recipe, **kw)
        assert qt.shape == x.shape and qt.dtype == x.dtype
        e5m2 = kw.get("fp8_format") == "hybrid"
        rel, sub = (2.0**-3, 2.0**-17) if e5m2 else (2.0**-4, 2.0**-10)
        for o in ("rowwise", "columnwise"):
            dq = qt.dequantize(o).reshape(-1, shape[-1])
            xf = x.reshape(-1, shape[-1])
            # Bound: half an FP8 ulp (relative 2^-4 E4M3 / 2^-3 E5M2 for normals, absolute half
            # the min subnormal times the element's scale_inv), plus fp32 rounding of the
            # dequant multiply (2^-24 relative).
            bound = rel * xf.abs() + sub * elem_scale_inv(qt, o) + 2.0**-23 * xf.abs()
            assert ((dq - xf).abs() <= bound).all(), (recipe, shape, o)


@pytest.mark.parametrize(("role", "shape"), [("input", (32, 48)), ("grad", (64, 128)), ("weight", (48, 32))])
def test_nvfp4_roundtrip_error_bound(role: str, shape: tuple) -> None:
    x = randn(*shape, seed=3)
    qt = quantize(x, "nvfp4", role=role)
    for o in ("rowwise", "columnwise"):
        dq = qt.dequantize(o)
        # Bound (Gaussian data, so every block's E4M3 scale is normal): in units of the block
        # dequant factor the E2M1 rounding error is <= 1 (half the largest grid step, 2), and
        # saturation after the E4M3 scale rounding (<= 1/16 relative) adds < 0.4 < 1.
        bound = 1.0 * elem_scale_inv(qt, o) + 1e-6 * x.abs()
        assert ((dq - x).abs() <= bound).all()
        rel_rms = ((dq - x).norm() / x.norm()).item()
        assert rel_rms < 0.15  # E2M1 + per-16 scaling on Gaussian data is ~0.1


def test_nvfp4_rht_and_sr_error_bound() -> None:
    x = randn(64, 64, seed=5)
    qt = quantize(x, "nvfp4", role="grad", rht=True, stochastic_rounding=True, seed=1)
    # Columnwise with RHT: dequantize undoes the rotation; the rotation is orthogonal, so the
    # error norm is preserved: SR error per element < one grid step (2 units), RMS < 0.25.
    for o in ("rowwise", "columnwise"):
        rel_rms = ((qt.dequantize(o) - x).norm() / x.norm()).item()
        assert rel_rms < 0.25, (o, rel_rms)


def test_idempotence_per_tensor_bytes() -> None:
    # Delayed scaling with a fixed scale: requantizing the dequantized tensor reproduces every
    # byte (x' = fl(q * fl(1/s)) * s is within a few fp32 ulps of the FP8 value q, which RNE
    # maps back to q).
    x = randn(33, 65, heavy=True)
    r = DelayedScaling(amax_history_len=1)
    st = r.make_state("input")
    st.scale.fill_(448.0 / 3.0)  # not a power of two
    a = quantize(x, r, state=st)
    b = quantize(a.dequantize(), r, state=st)
    assert torch.equal(a.storage_views()["rowwise_data"], b.storage_views()["rowwise_data"])
    assert torch.equal(a.storage_views()["scale_inv"], b.storage_views()["scale_inv"])
    # Current scaling: data bytes are reproduced; the recomputed scale may move by an fp32 ulp.
    c = quantize(x, "tensorwise")
    d = quantize(c.dequantize(), "tensorwise")
    assert torch.equal(c.storage_views()["rowwise_data"], d.storage_views()["rowwise_data"])
    si, sj = c.storage_views()["scale_inv"], d.storage_views()["scale_inv"]
    assert ((si - sj).abs() <= 2.0**-22 * si).all()


@pytest.mark.parametrize(
    ("recipe", "kw", "shape"),
    [
        ("blockwise", {"role": "input"}, (256, 384)),
        ("blockwise", {"role": "weight"}, (256, 384)),
        ("mxfp8", {}, (256, 384)),
        ("tensorwise", {"power_2_scale": True}, (256, 384)),
    ],
)
def test_idempotence_pow2_recipes_values(recipe: str, kw: dict, shape: tuple) -> None:
    # Power-of-two scales: dequantized values are reproduced exactly. Bytes are not always:
    # when a block max lands in (224, 232] * 2^k after scaling it rounds to 224 and the next
    # quantization picks a 2x larger scale (same values, other bytes); ~5% of blocks.
    x = randn(*shape, heavy=True)
    a = quantize(x, recipe, **kw)
    for o in ("rowwise", "columnwise"):
        b = quantize(a.dequantize(o), recipe, **kw)
        assert torch.equal(b.dequantize(o), a.dequantize(o))


def test_pow2_bytes_change_in_the_224_232_band() -> None:
    x = torch.zeros(1, 128)
    x[0, 0] = 230.0  # amax 230: s = pow2floor(448/230) = 1; 230 rounds to 224 in E4M3
    a = quantize(x, "blockwise", role="input", columnwise=False)
    b = quantize(a.dequantize(), "blockwise", role="input", columnwise=False)
    assert a.storage_views()["rowwise_scale_inv"].item() == 1.0
    assert b.storage_views()["rowwise_scale_inv"].item() == 0.5  # 448/224 = 2 exactly
    assert torch.equal(a.dequantize(), b.dequantize())
    assert not torch.equal(a.storage_views()["rowwise_data"], b.storage_views()["rowwise_data"])


def test_per_tensor_columnwise_is_exact_transpose() -> None:
    x = randn(2, 24, 40)
    qt = quantize(x, "tensorwise")
    v = qt.storage_views()
    assert torch.equal(v["columnwise_data"], v["rowwise_data"].t())
    assert torch.equal(qt.dequantize("columnwise"), qt.dequantize("rowwise"))


def test_blockwise_2d_columnwise_is_exact_transpose() -> None:
    qt = quantize(randn(200, 300, heavy=True), "blockwise", role="weight")
    v = qt.storage_views()
    assert v["rowwise_scale_inv"].shape == (2, 3)
    assert torch.equal(v["columnwise_data"], v["rowwise_data"].t())
    assert torch.equal(v["columnwise_scale_inv"], v["rowwise_scale_inv"].t())


def test_blockwise_1d_columnwise_quantized_separately() -> None:
    x = randn(256, 200, heavy=True)
    qt = quantize(x, "blockwise", role="input")
    v = qt.storage_views()
    assert v["columnwise_data"].shape == (200, 256) and v["columnwise_scale_inv"].shape == (200, 2)
    assert not torch.equal(qt.dequantize("rowwise"), qt.dequantize("columnwise"))
    # columnwise == rowwise quantization of x^T (1x128 blocks along M), bit for bit
    ref = quantize(x.t().contiguous(), "blockwise", role="input", columnwise=False).storage_views()
    assert torch.equal(v["columnwise_data"], ref["rowwise_data"])
    assert torch.equal(v["columnwise_scale_inv"], ref["rowwise_scale_inv"])


def test_mxfp8_orientations_independent_not_transposed() -> None:
    x = randn(64, 96, heavy=True)
    qt = quantize(x, "mxfp8")
    v = qt.storage_views()
    assert v["columnwise_data"].shape == (64, 96) and v["columnwise_scale_inv"].shape == (2, 96)
    assert v["rowwise_scale_inv"].shape == (64, 3)
    assert not torch.equal(v["rowwise_data"], v["columnwise_data"])
    ref = quantize(x.t().contiguous(), "mxfp8", columnwise=False).storage_views()
    assert torch.equal(v["columnwise_data"], ref["rowwise_data"].t())
    assert torch.equal(v["columnwise_scale_inv"], ref["rowwise_scale_inv"].t())


def test_mxfp8_2d_tiles_share_bytes() -> None:
    x = randn(64, 96, heavy=True)
    qt = quantize(x, MXFP8Scaling(enable_2d_quantization=True), role="weight")
    v = qt.storage_views()
    assert torch.equal(v["rowwise_data"], v["columnwise_data"])
    assert torch.equal(v["rowwise_scale_inv"][::32], v["columnwise_scale_inv"][:, ::32])
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(randn(48, 64), "mxfp8")


def test_nvfp4_columnwise_layouts() -> None:
    x = randn(48, 64, heavy=True)
    qt = quantize(x, "nvfp4")  # API default: no RHT, no SR, 1x16 for inputs
    v = qt.storage_views()
    assert v["rowwise_data"].shape == (48, 32) and v["rowwise_scale_inv"].shape == (48, 4)
    assert v["columnwise_data"].shape == (64, 24) and v["columnwise_scale_inv"].shape == (64, 3)
    ref = quantize(x.t().contiguous(), "nvfp4", columnwise=False).storage_views()
    assert torch.equal(v["columnwise_data"], ref["rowwise_data"])
    assert torch.equal(v["columnwise_scale_inv"], ref["rowwise_scale_inv"])
    w = quantize(x, "nvfp4", role="weight")  # 16x16 tiles: columnwise = exact transpose
    wv = w.storage_views()
    assert torch.equal(unpack_fp4(wv["columnwise_data"]), unpack_fp4(wv["rowwise_data"]).t())
    assert torch.equal(wv["columnwise_scale_inv"][::16], wv["rowwise_scale_inv"][::16].t())
    assert torch.equal(w.dequantize("columnwise"), w.dequantize("rowwise"))


def test_recipe_objects_and_roles() -> None:
    x = randn(64, 128)
    assert quantize(x, TensorwiseScaling(), role="grad").fp8_format.name == "e5m2"  # hybrid
    assert quantize(x, BlockwiseScaling(), role="grad").fp8_format.name == "e4m3"
    assert quantize(x, BlockwiseScaling(), role="weight").is_2d
    nv = NVFP4Scaling()
    assert nv.make_quantizer("grad").stochastic_rounding and nv.make_quantizer("input").with_rht
    assert nv.make_quantizer("weight").use_2d
    assert [r.alignment for r in (DelayedScaling(), TensorwiseScaling(), BlockwiseScaling(), MXFP8Scaling(), nv)] == [16, 16, 16, 32, 32]
    assert [r.grouped_alignment for r in (DelayedScaling(), BlockwiseScaling(), MXFP8Scaling(), nv)] == [16, 16, 32, 128]
    with pytest.raises(ValueError):
        TensorwiseScaling(fp8_format="e5m2")
    with pytest.raises(ValueError):
        quantize(x, TensorwiseScaling(), fp8_format="e4m3")  # conflicts with the recipe (hybrid)
    with pytest.raises(TypeError):
        quantize(x, TensorwiseScaling(), power_2_scale=True)


def test_bf16_input_keeps_logical_dtype_and_uses_bf16_value_for_inf() -> None:
    x = randn(4, 128).bfloat16()
    x[:2] = 0
    x[1, 0] = 1e-40  # bf16 subnormal: 448/amax overflows -> value_for_inf = bf16 max
    qt = quantize(x, "blockwise", role="input", columnwise=False)
    assert qt.dtype == torch.bfloat16
    s = qt.storage_views()["rowwise_scale_inv"]
    assert s[0].item() == 1.0 and s[1].item() == 2.0**-127  # pow2: bf16 max floors to 2^127
    assert torch.isfinite(qt.dequantize()).all()
    q2 = quantize(x, "blockwise", role="input", columnwise=False, power_2_scale=False)
    bf16_max = torch.tensor(torch.finfo(torch.bfloat16).max)
    assert torch.equal(q2.storage_views()["rowwise_scale_inv"][1, 0], torch.reciprocal(bf16_max))
    q3 = quantize(x.float(), "blockwise", role="input", columnwise=False, power_2_scale=False)
    flt_max = torch.tensor(torch.finfo(torch.float32).max)
    assert torch.equal(q3.storage_views()["rowwise_scale_inv"][1, 0], torch.reciprocal(flt_max))


def test_inf_and_nan_inputs_per_tensor_and_blockwise() -> None:
    # numerics.md 7.3/7.4: inf makes amax inf -> scale 1 and saturates to +-max (the inf
    # silently disappears); NaN is left out of amax and stays NaN in FP8 data.
    x = torch.ones(4, 128)
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), float("-inf"), float("nan")
    t = quantize(x, "tensorwise", columnwise=False)
    assert t.storage_views()["scale_inv"].item() == 1.0
    dq = t.dequantize()
    assert dq[0, 0].item() == 448.0 and dq[1, 1].item() == -448.0 and torch.isnan(dq[2, 2])
    b = quantize(x, "blockwise", role="input", columnwise=False).storage_views()["rowwise_scale_inv"]
    # rows 0/1: inf amax -> scale 1; row 2: NaN ignored, amax 1 -> pow2floor(448) = 256
    assert b[:, 0].tolist() == [1.0, 1.0, 1.0 / 256, 1.0 / 256]
    nv = quantize(x, "nvfp4", columnwise=False)
    assert nv.storage_views()["amax_rowwise"].item() == float("inf")
    codes = unpack_fp4(nv.storage_views()["rowwise_data"])
    assert codes[2, 2].item() == 7  # NaN -> +6 in E2M1


def test_nvfp4_sr_quantizer_seeded_and_unbiased() -> None:
    x = randn(32, 32, seed=9)
    q1 = quantize(x, "nvfp4", role="grad", stochastic_rounding=True, seed=11)
    q2 = quantize(x, "nvfp4", role="grad", stochastic_rounding=True, seed=11)
    q3 = quantize(x, "nvfp4", role="grad", stochastic_rounding=True, seed=12)
    assert torch.equal(q1.storage_views()["rowwise_data"], q2.storage_views()["rowwise_data"])
    assert not torch.equal(q1.storage_views()["rowwise_data"], q3.storage_views()["rowwise_data"])
    # Unbiased: average n draws from one generator. Per element, in units of its block factor
    # d, the mean of n draws has std <= step/2/sqrt(n) <= 1/sqrt(n) (step <= 2) and bias <=
    # step/256; averaged over 1024 elements the mean |error|/d must be far below RNE's ~0.2.
    quant = NVFP4Scaling(disable_rht=True).make_quantizer("grad", columnwise=False)
    n = 256
    acc = torch.zeros_like(x)
    for _ in range(n):
        acc += quant.quantize(x).dequantize()
    d = elem_scale_inv(quant.quantize(x), "rowwise")
    err = ((acc / n - x).abs() / d).mean().item()
    rne = ((quantize(x, "nvfp4", columnwise=False).dequantize() - x).abs() / d).mean().item()
    assert err < 0.1 < rne, (err, rne)


@pytest.mark.parametrize(
    ("recipe", "kw"),
    [
        ("tensorwise", {}),
        ("blockwise", {"role": "input"}),
        ("blockwise", {"role": "weight"}),
        ("mxfp8", {}),
        ("mxfp8", {"role": "weight", "enable_2d_quantization": True}),
        ("nvfp4", {}),
        ("nvfp4", {"role": "weight"}),
        ("nvfp4", {"rht": True}),
    ],
)
def test_row_chunking_is_bit_identical(recipe: str, kw: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # Quantization runs over row chunks of ~2 MiB (speed); chunks are whole blocks, so tiny
    # chunks must give exactly the bytes of a single full-size evaluation.
    import lptrain.precision.tensors._chunks as chunks

    x = randn(256, 384, heavy=True)
    full = quantize(x, recipe, **kw).storage_views()
    monkeypatch.setattr(chunks, "TARGET_ELEMS", 1)  # one block-row per chunk
    small = quantize(x, recipe, **kw).storage_views()
    for k, v in full.items():
        assert torch.equal(v, small[k]), k
