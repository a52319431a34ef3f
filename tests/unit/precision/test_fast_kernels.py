"""The speed-oriented kernels agree bit for bit with slow, independent references.

The production casts work on fp32 bit patterns, lookup tables and reused scratch buffers
(see formats.py / rht.py); here each is checked against a direct restatement of the spec
(numerics.md P2, P6, 2.5) on tie points, specials and random bit patterns, so that a faster
rewrite cannot silently change a byte.
"""

from __future__ import annotations

import pytest
import torch

from lptrain.precision import formats, scaling
from lptrain.precision import recipes as R
from lptrain.precision.formats import (
    E2M1_GRID,
    E4M3,
    E5M2,
    cast_to_e2m1,
    draw_rbits,
    e2m1_codes_i32,
    e4m3_bits_to_float,
    e5m2_bits_to_float,
    fp8_to_float,
    pack_fp4,
    pack_fp4_col_words,
    pack_fp4_i32,
    pack_fp4_rows,
    stochastic_round_e2m1,
)
from lptrain.precision.rht import apply_rht, rotate_token_groups
from lptrain.precision.scratch import Workspace, operand
from lptrain.precision.tensors import fp4_decode as fp4_decode_mod
from lptrain.precision.tensors import nvfp4 as nvfp4_mod

GRID = torch.tensor(E2M1_GRID, dtype=torch.float64)


def _probe_values() -> torch.Tensor:
    """Every grid point and tie, their fp32 neighbours, specials, and random bit patterns."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    base = torch.tensor(list(E2M1_GRID) + ties + [7.0, 8.0, 1e-40, 3e38, float("inf"), float("nan")])
    up = torch.nextafter(base, torch.tensor(float("inf")))
    down = torch.nextafter(base, torch.tensor(0.0))
    pos = torch.cat([base, up, down])
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    small = torch.rand(20000, generator=g) * 8
    return torch.cat([pos, -pos, torch.tensor([-0.0]), bits.view(torch.float32), small, -small])


def _e2m1_reference(y: torch.Tensor) -> torch.Tensor:
    """Nearest grid point in fp64, ties to the even code; NaN -> +6; sign iff y < 0."""
    a = y.double().abs().nan_to_num(nan=6.0, posinf=6.0).clamp(max=6.0)
    d = (a[:, None] - GRID[None, :]).abs()
    dmin = d.min(dim=1, keepdim=True).values
    cand = d == dmin
    idx = torch.arange(8).expand_as(cand)
    # among tied candidates prefer the even code (two candidates are adjacent codes)
    score = torch.where(cand, idx % 2 * 16 + idx, torch.full_like(idx, 99))
    code = score.argmin(dim=1)
    return (code + 8 * (y < 0).long()).to(torch.uint8)


def test_e2m1_cast_matches_nearest_even_reference() -> None:
    y = _probe_values()
    assert torch.equal(cast_to_e2m1(y), _e2m1_reference(y))


def test_e2m1_workspace_path_equals_public_path_and_public_keeps_input() -> None:
    y = _probe_values()
    keep = y.clone()
    public = cast_to_e2m1(y)
    assert torch.equal(y.view(torch.int32), keep.view(torch.int32))  # input untouched
    ws_codes = e2m1_codes_i32(y.clone(), Workspace()).to(torch.uint8)
    assert torch.equal(ws_codes, public)


def _sr_reference(y: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """TE's software model in fp64 (exact here: t = a + u*step needs <= 32 significant bits
    for |y| <= 8 on the probe grid below)."""
    a = y.double().abs().nan_to_num(nan=6.0)
    step = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5)).double()
    t = a + rbits.double() / 256 * step
    st = torch.where(t >= 4, 2.0, torch.where(t >= 2, 1.0, 0.5)).double()
    q = torch.clamp(torch.floor(t / st) * st, max=6.0)
    code = torch.searchsorted(GRID, q)
    return (code + 8 * (y < 0).long()).to(torch.uint8)


def test_sr_matches_software_model_for_every_rbits_value() -> None:
    # values with few significant bits (so the fp64 model is exactly the fp32 fma)
    vals = torch.arange(0, 8 * 64 + 1, dtype=torch.float32) / 64
    y = torch.cat([vals, -vals[1:], torch.tensor([float("nan")])])
    yy = y.repeat_interleave(256)
    rb = torch.arange(256, dtype=torch.uint8).repeat(y.numel())
    assert torch.equal(stochastic_round_e2m1(yy, rbits=rb), _sr_reference(yy, rb))


def test_draw_rbits_deterministic_and_uniform() -> None:
    a = draw_rbits(1 << 16, torch.Generator().manual_seed(3), torch.device("cpu"))
    b = draw_rbits(1 << 16, torch.Generator().manual_seed(3), torch.device("cpu"))
    c = draw_rbits(1 << 16, torch.Generator().manual_seed(4), torch.device("cpu"))
    assert a.dtype == torch.uint8 and a.numel() == 1 << 16
    assert torch.equal(a, b) and not torch.equal(a, c)
    counts = torch.bincount(a.long(), minlength=256).double()
    # 256 expected per value; chi-square with 255 dof has mean 255, sd ~22.6: 400 is > 6 sd,
    # while a stuck high bit (the int64 default range's bias) would give ~65000.
    chi2 = ((counts - 256.0) ** 2 / 256.0).sum().item()
    assert chi2 < 400.0


@pytest.mark.parametrize("shape", [(6, 10), (32, 64), (2, 2)])
def test_int_packers_match_pack_fp4(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    assert torch.equal(pack_fp4_i32(codes.int()), pack_fp4(codes))
    assert torch.equal(pack_fp4_rows(codes.int()).t(), pack_fp4(codes.t()))


@pytest.mark.parametrize("shape", [(8, 1), (16, 10), (64, 48), (128, 3), (0, 4)])
@pytest.mark.parametrize("with_ws", [False, True])
def test_columnwise_word_packer_transposed_is_pack_fp4_of_the_transpose(
    shape: tuple[int, int], with_ws: bool
) -> None:
    """Every code value in every nibble, the top nibble (into the int32 sign bit) included:
    the words, transposed and viewed as bytes, must be the [K, r/2] packing of codes^T."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    if codes.numel():
        codes[-1] = 15  # row 8q+7 of the last word: its high nibble is bit 31
    words = torch.full((shape[0] // 8, shape[1]), 0x5A5A5A5A, dtype=torch.int32)  # stale content
    ws = Workspace() if with_ws else None
    pack_fp4_col_words(codes.int(), words, ws)
    got = words.t().clone(memory_format=torch.contiguous_format).view(torch.uint8)
    assert got.shape == (shape[1], shape[0] // 2)
    assert torch.equal(got, pack_fp4(codes.t()))


def test_columnwise_word_packer_rejects_rows_not_divisible_by_8() -> None:
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_fp4_col_words(torch.zeros(12, 4, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32))


def test_e4m3_bits_to_float_is_torchs_cast_for_every_byte() -> None:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3).view(3, 256)
    ref = bits.view(torch.float8_e4m3fn).float()
    got = e4m3_bits_to_float(bits)
    into = e4m3_bits_to_float(bits, torch.full((3, 256), 7.0))
    assert got.shape == ref.shape
    # compared as bit patterns: the two NaN bytes must give torch's NaN payload too
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(into.view(torch.int32), ref.view(torch.int32))


def test_e5m2_shift_decode_is_torchs_cast_for_every_byte_and_layout() -> None:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4).view(16, 64)
    for b in (bits, bits.t(), bits[:, ::2], bits.reshape(-1)):  # any layout: an elementwise shift
        ref = b.view(torch.float8_e5m2).float()
        got = e5m2_bits_to_float(b)
        assert got.shape == ref.shape
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # NaN payloads too


def test_operand_is_a_cached_zero_dim_tensor_of_the_dtype_that_keeps_negative_zero_apart() -> None:
    x = torch.zeros(4, dtype=torch.int32)
    a, b = operand(31, x), operand(31, x)
    assert a is b and a.dim() == 0 and a.dtype == torch.int32 and int(a) == 31
    f = torch.zeros(4)
    pz, nz = operand(0.0, f), operand(-0.0, f)
    assert pz is not nz and torch.signbit(nz) and not torch.signbit(pz)
    assert operand(2.0, torch.zeros(2, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _specials(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, generator=g) * 4
    y[:8] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 6.0, -0.25, 3.0e38])
    return y


@pytest.mark.parametrize("role", ["input", "grad"])
def test_tensor_operands_give_the_python_scalar_results_bit_for_bit(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    """The kernels' cached 0-dim operands against plain Python scalars (``operand`` patched
    to return the number), on every kernel that takes one: RNE/SR codes, the packers, the
    block amaxes and the NVFP4 (RHT + SR) quantize-dequantize."""
    y = _specials(4096, 3)
    rb = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    x = _specials(512 * 512, 5).view(512, 512)  # above the small-operand gather decode

    def run() -> list[torch.Tensor]:
        q = R.NVFP4Scaling().make_quantizer(role, True, True)
        t = q.quantize(x)
        codes = e2m1_codes_i32(y)
        return [codes, stochastic_round_e2m1(y, rbits=rb), pack_fp4_i32(codes.view(64, 64) & 15),
                pack_fp4_rows(codes.view(64, 64) & 15), scaling.block_amax(y.view(256, 16), 1),
                scaling.block_amax(y.bfloat16().view(256, 16), 1),
                t.dequantize("rowwise"), t.dequantize("columnwise")]

    with_tensors = run()
    for mod in (formats, scaling, fp4_decode_mod):
        monkeypatch.setattr(mod, "operand", lambda value, like: value)
    with_scalars = run()
    for a, b in zip(with_tensors, with_scalars, strict=True):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(256,), (16, 16), (7, 6), (5, 3), (600, 500)])
def test_fp8_decode_bit_identical_to_torch(fmt: object, shape: tuple[int, ...]) -> None:
    n = 1
    for d in shape:
        n *= d
    bits = (torch.arange(n) % 256).to(torch.uint8).reshape(shape)
    want = bits.view(fmt.torch_dtype).float()  # type: ignore[attr-defined]
    got = fp8_to_float(bits, fmt)  # type: ignore[arg-type]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN payloads too


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(16, 16), (512, 64), (600, 500)])
def test_fp8_decode_with_one_scale_is_decode_then_multiply(fmt: object, shape: tuple[int, int]) -> None:
    """``scale=`` (per-tensor FP8): small E4M3 operands gather from a scaled table instead of
    multiplying the operand; every byte, NaNs and a non-power-of-two scale included."""
    n = shape[0] * shape[1]
    bits = (torch.arange(n) % 256).to(torch.uint8).reshape(shape)
    s = torch.tensor([0.3141592], dtype=torch.float32)
    want = bits.view(fmt.torch_dtype).float() * s  # type: ignore[attr-defined]
    got = fp8_to_float(bits, fmt, scale=s)  # type: ignore[arg-type]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match="not both"):
        fp8_to_float(bits, fmt, lambda o, r0, r1: None, scale=s)  # type: ignore[arg-type]


def test_fp8_decode_fused_row_scaling_equals_separate_multiply() -> None:
    bits = (torch.arange(640 * 256) % 256).to(torch.uint8).reshape(640, 256)
    scale = torch.rand(640, 1) * 1000
    fused = fp8_to_float(bits, E4M3, lambda o, r0, r1: o.mul_(scale[r0:r1]), align=32)
    plain = bits.view(torch.float8_e4m3fn).float() * scale
    assert torch.equal(fused.view(torch.int32), plain.view(torch.int32))


def test_block_amax_int_path_ignores_nan_keeps_inf_and_no_negative_zero() -> None:
    x = torch.tensor(
        [
            [1.0, -3.0, float("nan"), 2.0],
            [float("nan")] * 4,
            [-0.0, -0.0, 0.0, -0.0],
            [1.0, float("-inf"), 2.0, float("nan")],
        ]
    )
    got = scaling.block_amax(x, 1)
    assert torch.equal(got, torch.tensor([3.0, 0.0, 0.0, float("inf")]))
    assert not torch.signbit(got).any()
    big = torch.randn(3, 1 << 19)
    big[1, 12345] = float("nan")
    assert scaling.amax(big).item() == big.nan_to_num(nan=0.0).abs().max().item()  # chunked


def test_rotate_token_groups_is_the_transpose_of_apply_rht() -> None:
    """Both RHT layouts (quantizer's [M, K] path, contiguous [K, M] path) give identical
    bits, also on heavy-tailed data where the fp32 summation order would show."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 48, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 48), generator=g).float())
    for inverse in (False, True):
        for rnd in (False, True):
            a = rotate_token_groups(x, inverse, rnd)
            b = apply_rht(x.t().contiguous(), inverse, rnd)  # contiguous [K, M] path
            assert torch.equal(a, b.t()), (inverse, rnd)
            assert torch.equal(apply_rht(x.t(), inverse, rnd), b)  # transposed-view path


def _e4m3_reference(b: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) byte -> value from the bit fields in fp64 (exact), then fp32: sign, 4-bit
    exponent with bias 7, 3-bit mantissa, subnormals at exponent 0, NaN at magnitude 0x7F."""
    v = b.long()
    e, m = (v >> 3) & 0xF, v & 7
    mag = torch.where(e == 0, m.double() * 2.0**-9, (1 + m.double() / 8) * torch.exp2(e.double() - 7))
    val = torch.where(v & 0x80 != 0, -mag, mag)
    return val.masked_fill((v & 0x7F) == 0x7F, float("nan")).float()


@pytest.mark.parametrize("shape", [(1, 256), (2, 128), (700, 512), (33, 7)])
def test_e4m3_int_decode_matches_bit_field_reference(shape: tuple[int, int]) -> None:
    # (700, 512) spans several 2^18-element chunks; (33, 7) has odd columns.
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    bits.view(-1)[: min(256, bits.numel())] = torch.arange(min(256, bits.numel()), dtype=torch.uint8)
    got = fp8_to_float(bits, E4M3)
    want = _e4m3_reference(bits)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    # bit patterns, so +0/-0 and the subnormals (m * 2^-9) are compared exactly
    assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])
    # NaN payload: the one torch's own E4M3 -> fp32 conversion produces
    torch_nan = bits.view(torch.float8_e4m3fn).float().view(torch.int32)[nan]
    assert torch.equal(got.view(torch.int32)[nan], torch_nan)


def _fp4_reference(packed: torch.Tensor, block_scale: torch.Tensor | None) -> torch.Tensor:
    """Grid value of every nibble (element 2i = low nibble) times its block scale, the
    product formed exactly in fp64 (3-bit grid x 24-bit scale) and rounded once to fp32."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    v = grid[codes & 7]
    v = torch.where(codes >= 8, -v, v)
    if block_scale is not None:
        v = v * block_scale.double().repeat_interleave(16, dim=1)
    return v.float()


def _assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])  # -0 too


@pytest.mark.parametrize("per_thread", [None, 1 << 12], ids=["default-chunks", "many-chunks"])
@pytest.mark.parametrize("shape", [(16, 8), (3, 40), (300, 1024)])
def test_fp4_int_unpack_matches_grid_reference(
        monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], per_thread: int | None) -> None:
    """(300, 1024) bytes decode in one chunk by default and in 75+ with 4096-element chunks
    per thread (the decode's chunk follows the thread count, :func:`nvfp4.decode_chunk_elems`)."""
    from lptrain.precision.tensors.nvfp4 import unpack_fp4_values

    if per_thread is not None:
        monkeypatch.setattr(fp4_decode_mod, "_DECODE_ELEMS_PER_THREAD", per_thread)

    g = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    packed.view(-1)[: min(256, packed.numel())] = torch.arange(min(256, packed.numel()), dtype=torch.uint8)
    packed[-1] = 0x88  # -0 / -0: a zero block with negative-zero codes
    _assert_same_values(unpack_fp4_values(packed), _fp4_reference(packed, None))
    scale = torch.rand(shape[0], shape[1] * 2 // 16, generator=g) * 1000
    flat = scale.view(-1)
    specials = [float("inf"), float("nan"), 0.0, 1e-42, 2.0**-126, 3e38, 1e-45]
    flat[: len(specials)] = torch.tensor(specials)[: flat.numel()]
    # finite path (2^14 folded into the scale) and the fallback (scale * 2^14 overflows)
    for s in (scale, torch.full_like(scale, 3e38), scale.clamp(max=1e3)):
        _assert_same_values(unpack_fp4_values(packed, s), _fp4_reference(packed, s))


@pytest.mark.parametrize("shape", [(64, 48), (1040, 512)])
def test_fused_rht_columnwise_dequantize_equals_decode_then_inverse_rht(shape: tuple[int, int]) -> None:
    """NVFP4 columnwise dequantize with RHT decodes chunks straight into the inverse-RHT GEMMs;
    it must give the bits of the two-step path (full decode, then ``apply_rht``). (1040, 512)
    spans two 2^19-element GEMM chunks, the second one partial."""
    from lptrain.precision.recipes import NVFP4Scaling

    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    x.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, float("-inf"), 0.0])
    x[16:32] = 0.0  # zero blocks
    for role in ("input", "grad"):
        t = NVFP4Scaling(seed=1).make_quantizer(role).quantize(x)
        want = apply_rht(t.columnwise_rht_operand(), inverse=True, round_to_bf16=False).t()
        got = t.dequantize("columnwise")
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), role


@pytest.mark.parametrize("rowwise", [True, False])
def test_chunked_rht_columnwise_quantize_equals_quantizing_the_rotated_tensor(rowwise: bool) -> None:
    """The quantizer rotates each row chunk into a scratch buffer twice (block amaxes, then
    codes) instead of materialising the rotated tensor; over several chunks (1056 rows of 512:
    two 2^19-element chunks, the last partial) the columnwise bytes, scales and amax must equal
    quantizing the fully rotated tensor without RHT."""
    from lptrain.precision.api import quantize

    g = torch.Generator().manual_seed(8)
    shape = (1056, 512)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    x[32:48] = 0.0  # a zero block group
    x[100, 7] = float("nan")
    q = quantize(x, "nvfp4", role="input", rht=True, rowwise=rowwise)
    plain = quantize(rotate_token_groups(x), "nvfp4", role="input", rht=False, rowwise=False)
    v, p = q.storage_views(), plain.storage_views()
    for k in ("columnwise_data", "columnwise_scale_inv", "amax_columnwise"):
        assert torch.equal(v[k].view(torch.uint8), p[k].view(torch.uint8)), k
    assert ("rowwise_data" in v) == rowwise


def test_mxfp8_block_scales_equal_the_generic_e8m0_functions() -> None:
    """The MXFP8 quantizer's six-op block scales give the bits of ``e8m0_from_amax`` and
    ``e8m0_to_quant_multiplier`` on their domain (block amaxes: >= +0, never NaN): every
    exponent with edge mantissas (0, 1, the 2^-127 subnormal boundary 0x400000 and its
    neighbours, all ones), inf, +0 and random finite patterns, for both element formats."""
    e = torch.arange(0, 255, dtype=torch.int64)
    m = torch.tensor([0, 1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF])
    bits = ((e[:, None] << 23) | m[None, :]).reshape(-1).to(torch.int32)
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(0, 0x7F800000, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    v = torch.cat([bits.view(torch.float32), rnd.view(torch.float32), torch.tensor([float("inf"), 0.0])])
    for fmt in (E4M3, E5M2):
        codes, mult = scaling.mxfp8_block_scales(v.clone(), fmt.max)
        want = scaling.e8m0_from_amax(v, fmt.max)
        assert torch.equal(codes, want)
        assert torch.equal(mult.view(torch.int32), scaling.e8m0_to_quant_multiplier(want).view(torch.int32))


@pytest.mark.parametrize("options", [dict(rht=True, sr=True), dict(rht=False, sr=False), dict(use_2d=True)],
                         ids=["rht+sr", "plain", "2d"])
def test_nvfp4_bytes_do_not_depend_on_the_row_chunk_or_the_thread_count(
        monkeypatch: pytest.MonkeyPatch, options: dict) -> None:
    """The quantize passes run over row chunks whose size follows the intra-op thread count
    (:func:`nvfp4.row_chunk_elems`); every field, and the generator's state after the SR
    draws, must be the same whatever the chunk (one chunk for the whole tensor, partial last
    chunks, chunks smaller than one 16-row group's worth are rounded up to it) and the thread
    count (1 and 2). 544 x 512 with specials, a zero block group and a spread of magnitudes."""
    from lptrain.precision.tensors.nvfp4 import NVFP4Quantizer

    g = torch.Generator().manual_seed(11)
    shape = (544, 512)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    x[32:48] = 0.0
    x.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, float("-inf")])

    def fields(per_thread: int, threads: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        monkeypatch.setattr(nvfp4_mod, "_ROW_CHUNK_ELEMS_PER_THREAD", per_thread)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            gen = torch.Generator().manual_seed(5)
            q = NVFP4Quantizer("grad", with_rht=options.get("rht", False),
                               stochastic_rounding=options.get("sr", False), use_2d=options.get("use_2d", False),
                               generator=gen)
            t = q.quantize(x)
        finally:
            torch.set_num_threads(before)
        return {k: v.view(torch.uint8).clone() for k, v in t.storage_views().items()}, gen.get_state()

    want, want_state = fields(1 << 18, 1)
    assert nvfp4_mod.row_chunk_elems() == (1 << 18) * min(torch.get_num_threads(), 8)
    for per_thread, threads in [(1 << 13, 1), (3 * 512 * 16 + 512, 1), (1 << 18, 2), (1 << 20, 2), (1 << 12, 2)]:
        got, state = fields(per_thread, threads)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (per_thread, threads, k)
        assert torch.equal(state, want_state), (per_thread, threads)
