"""The statistics read from Transformer Engine's quantized tensors equal the emulated ones.

Two sources per family: TE's own quantizers and tensors (TE's Python, newest release, its
cast kernels emulated), and objects laid out as TE 2.x lays them out on a GPU -- MXFP8
and NVFP4 scale bytes padded to multiples of [128, 4], blockwise 1x128 scales stored
transposed ``[K/128, M]`` with M padded to 4, 128x128 tiles with the inner dimension padded,
``_fp8_dtype`` as TE's ``tex.DType`` enum. The reader must give bitwise the emulated vector
for both (``torch.equal``).
"""

from __future__ import annotations

import enum

import pytest
import torch

from lptrain.precision import operand_stats as S
from lptrain.precision.formats import E4M3, E5M2
from lptrain.precision.te_numerics import te_stat_blocks
from lptrain.precision.tensors import (
    BlockwiseQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)


class DType(enum.Enum):  # TE's tex.DType members lptrain reads
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


def _x(m: int = 96, k: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 2, k)  # blocks of many scales
    x[:32, :128] = 0.0  # zero blocks
    x[5, 7] = 2.0**-30  # underflows
    return x


QUANTIZERS = {
    "tensorwise": lambda: Float8Quantizer("input", True, False, fp8_format=E4M3),
    "mxfp8": lambda: MXFP8Quantizer("input", True, False, fp8_format=E4M3),
    "blockwise-1d": lambda: BlockwiseQuantizer("grad", True, False, fp8_format=E5M2, block_dim=1),
    "blockwise-2d": lambda: BlockwiseQuantizer("weight", True, False, fp8_format=E4M3, block_dim=2),
    "nvfp4": lambda: NVFP4Quantizer("input", True, False),
}


def _emulated(x: torch.Tensor, qt: object) -> torch.Tensor:
    return S.quantized_stats(x, qt)


def _te_quantizer(name: str) -> object:
    """TE's own quantizer (newest release) that quantizes as ``QUANTIZERS[name]``."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex

    e4m3, e5m2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2
    return {
        "tensorwise": lambda: te.Float8CurrentScalingQuantizer(e4m3, "cuda", rowwise=True, columnwise=False),
        "mxfp8": lambda: te.MXFP8Quantizer(e4m3, rowwise=True, columnwise=False),
        "blockwise-1d": lambda: te.Float8BlockQuantizer(e5m2, rowwise=True, columnwise=False, block_scaling_dim=1),
        "blockwise-2d": lambda: te.Float8BlockQuantizer(e4m3, rowwise=True, columnwise=False, block_scaling_dim=2),
        "nvfp4": lambda: te.NVFP4Quantizer(rowwise=True, columnwise=False),
    }[name]()


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_te_tensors_read_like_the_emulated_ones(name: str) -> None:
    """TE's own quantizer and tensor class (its Python on the virtual GPU, the cast kernels
    emulated), so TE's GPU layouts: padded MXFP8 / NVFP4 scales, GEMM-ready blockwise scales,
    ``tex.DType``; M not a multiple of 4 or 128 where the format allows it."""
    from lptrain.testing.fake_gpu import virtual_gpu

    x = _x(m=96 if name in ("mxfp8", "nvfp4") else 90)
    emu = QUANTIZERS[name]().quantize(x)
    with virtual_gpu("sm100", te=True):
        xc = x.cuda()
        te = _te_quantizer(name)(xc)
        assert type(te).__name__ == type(_gpu_layout(name, emu)).__name__  # the class the reader dispatches on
        vec = S.blocks_stats(te_stat_blocks(te, xc), x.numel()).cpu()
    assert torch.equal(vec, _emulated(x, emu))


class _GpuLayout:
    """A TE tensor as TE 2.x holds it on a GPU (only what the reader touches)."""

    def __init__(self, emu: object, **attrs: object) -> None:
        self.shape = emu.shape  # type: ignore[attr-defined]
        self._emu = emu
        for k, v in attrs.items():
            setattr(self, k, v)

    def dequantize(self, *, dtype: torch.dtype) -> torch.Tensor:
        return self._emu.dequantize().to(dtype)  # type: ignore[attr-defined]


def _padded(t: torch.Tensor, rows: int, cols: int, fill: int = 0) -> torch.Tensor:
    out = torch.full((rows, cols), fill, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _gpu_layout(name: str, emu: object) -> object:
    f = emu._fields  # type: ignore[attr-defined]
    m, k = emu.shape  # type: ignore[attr-defined]
    if name == "tensorwise":
        cls = type("Float8Tensor", (_GpuLayout,), {})
        return cls(emu, _scale_inv=f["scale_inv"], _fp8_dtype=DType.kFloat8E4M3)
    if name == "mxfp8":
        cls = type("MXFP8Tensor", (_GpuLayout,), {})
        s = _padded(f["rowwise_scale_inv"], _round_up(m, 128), _round_up(k // 32, 4), fill=127)
        return cls(emu, _rowwise_scale_inv=s, _fp8_dtype=DType.kFloat8E4M3,
                   _with_gemm_swizzled_scales=False)
    if name == "nvfp4":
        cls = type("NVFP4Tensor", (_GpuLayout,), {})
        s = _padded(f["rowwise_scale_inv"], _round_up(m, 128), _round_up(k // 16, 4), fill=0x38)
        return cls(emu, _rowwise_scale_inv=s, _amax_rowwise=f["amax_rowwise"])
    cls = type("Float8BlockwiseQTensor", (_GpuLayout,), {})
    sinv = f["rowwise_scale_inv"]
    if name == "blockwise-2d":  # [M/128, K/128], the inner dimension padded to 4
        s = _padded(sinv, sinv.shape[0], _round_up(sinv.shape[1], 4))
        return cls(emu, _rowwise_scale_inv=s, _is_2D_scaled=True, _fp8_dtype=DType.kFloat8E4M3)
    s = _padded(sinv.t(), sinv.shape[1], _round_up(m, 4))  # GEMM-ready: [K/128, M padded]
    return cls(emu, _rowwise_scale_inv=s, _is_2D_scaled=False, _fp8_dtype=DType.kFloat8E5M2)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_te_gpu_layouts_read_like_the_emulated_ones(name: str) -> None:
    x = _x(m=90)  # M not a multiple of 4 or 128: the padding is there to be cut off
    q = QUANTIZERS[name]()
    if name in ("mxfp8", "nvfp4"):
        x = _x(m=96)  # these need M divisible by 32 / 16
    emu = q.quantize(x)
    vec = S.blocks_stats(te_stat_blocks(_gpu_layout(name, emu), x), x.numel())
    assert torch.equal(vec, _emulated(x, emu))


def test_swizzled_scales_are_not_read_as_compact() -> None:
    emu = MXFP8Quantizer("input", True, False, fp8_format=E4M3).quantize(_x())
    t = _gpu_layout("mxfp8", emu)
    t._with_gemm_swizzled_scales = True  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no statistics layout"):
        te_stat_blocks(t, None)
