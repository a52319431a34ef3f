"""NVFP4 decode: packed E2M1 bytes (and their two-level scales) back to fp32, chunk by chunk.

Split from :mod:`lptrain.precision.tensors.nvfp4` (the quantizer and the tensor), which
re-exports these: the decode is what dequantization, the statistics and the reference GEMMs
use; the scaled-GEMM path (``precision.quantized_gemm=scaled_mm``) never decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from .. import scaling as _scaling
from ..formats import GATHER_DECODE_ELEMS
from ..scratch import Workspace, operand

NV_BLOCK = 16
_MAX_CHUNK_THREADS = 8  # past this the per-thread shares are large enough by themselves


def chunk_threads() -> int:
    """The intra-op thread count the chunks are sized for (1 to _MAX_CHUNK_THREADS)."""
    return min(max(torch.get_num_threads(), 1), _MAX_CHUNK_THREADS)


# Decoded elements per pass and intra-op thread (2 MiB of fp32 output per thread, scaled while
# cached): the decode's own temporaries are half-size int32, so it takes larger chunks than the
# quantize passes; measured per 4096^2 decode (x a copy, interleaved): at 2 threads 256K / 512K
# / 1M elements per chunk 1.63 / 1.50 / 1.40x, at 1 thread 1.24 / 1.18 / 1.20x.
_DECODE_ELEMS_PER_THREAD = 1 << 19


def decode_chunk_elems() -> int:
    """Elements per pass of :func:`decode_fp4_chunks` for this process's intra-op threads."""
    return _DECODE_ELEMS_PER_THREAD * chunk_threads()


_F16_TO_E2M1 = 16384.0  # fp16 built from an E2M1 code is the E2M1 value times 2^-14 (bias 15 vs 1)
_LO_HI_MAG = 0x00070007  # magnitude bits of both nibbles once spread to bits 0-3 and 16-19
_LO_HI_SIGN = 0x00080008


def _e2m1_bytes_to_f16_pairs(packed: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [n] -> int32 [n] whose halves are the fp16 patterns of the two
    codes (low nibble in the low half, i.e. element 2i first when viewed as fp16).

    Code ``s ee m`` becomes fp16 ``s 000ee m 000000000``: exponent bias 15 instead of 1, so the
    fp16 value is the E2M1 value times 2^-14 (the subnormal 0.5 included: fp16 subnormals are
    mantissa * 2^-24). Both nibbles are handled in one int32 lane: t * 4097 = t | t << 12 puts
    the low nibble at bits 0-3 and the high one at 16-19. Pure elementwise int32 ops, which
    torch runs on every thread (the per-byte table gather this replaces is single-threaded).
    """
    w.copy_(packed)
    w.mul_(operand(4097, w)).bitwise_and_(operand(_LO_HI_MAG | _LO_HI_SIGN, w))
    torch.bitwise_and(w, operand(_LO_HI_SIGN, w), out=s)
    w.bitwise_and_(operand(_LO_HI_MAG, w)).bitwise_left_shift_(operand(9, w))
    return w.bitwise_or_(s.bitwise_left_shift_(operand(12, s)))


def _decode_scale(block_scale: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], bool]:
    """(flat fp32 per-16 factor, whether it already includes 2^14). The factor 2^14 is folded
    into the block scale when that product is finite: (v * 2^-14) * (b * 2^14) is the same
    real number as v * b, rounded once, so the result is bit-identical to grid value * b."""
    if block_scale is None:
        return None, False
    b = block_scale.to(torch.float32).reshape(-1)
    folded = b * _F16_TO_E2M1
    if bool(torch.isfinite(folded).all()):
        return folded, True
    return b, False


def decode_fp4_chunks(
    packed: torch.Tensor,
    block_scale: Optional[torch.Tensor],
    sink: Optional[Callable[[torch.Tensor, int, int], None]] = None,
    chunk_elems: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    *,
    scale_bits: Optional[torch.Tensor] = None,
    gamax: Optional[torch.Tensor] = None,
) -> None:
    """Decode the packed bytes (row-major, element 2i = low nibble of byte i) chunk by chunk:
    ``sink(values, e0, e1)`` gets the fp32 values of flat elements [e0, e1) (times their block
    scale, ``block_scale`` holding one factor per 16 consecutive elements). Chunks are
    ``chunk_elems`` elements (a multiple of 16; default :func:`decode_chunk_elems`: elementwise
    math, so any chunking gives the same values) and the buffer handed over is reused, unless
    ``out`` (contiguous fp32, one element per code) is given: then each chunk is decoded in
    place into ``out`` and ``sink`` (optional) sees that slice.

    ``scale_bits`` (E4M3 bytes, one per 16 elements) with ``gamax`` instead of
    ``block_scale``: the factors are :func:`scaling.nvfp4_dequant_block_scale` of them
    (:func:`_nvfp4_decode_scale`: the same ops, in place on one buffer).
    """
    if chunk_elems is None:
        chunk_elems = decode_chunk_elems()
    if chunk_elems % NV_BLOCK:
        raise ValueError(f"chunk_elems must be a multiple of 16, got {chunk_elems}")
    flat = packed.reshape(-1)
    n = flat.numel()
    if n == 0:
        return
    ws = Workspace.shared(packed.device)
    if scale_bits is not None:
        assert gamax is not None
        scale, folded = _nvfp4_decode_scale(scale_bits, gamax, ws)
    else:
        scale, folded = _decode_scale(block_scale)
    cb = chunk_elems // 2
    m = min(n, cb)
    w = ws.get("dq_w", (m,), torch.int32)
    s = ws.get("dq_s", (m,), torch.int32)
    dst = out.view(-1) if out is not None else None
    vals = ws.get("dq_vals", (2 * m if dst is None else 0,), torch.float32)
    for b0 in range(0, n, cb):
        b1 = min(n, b0 + cb)
        k = b1 - b0
        o = vals[: 2 * k] if dst is None else dst[2 * b0 : 2 * b1]
        o.copy_(_e2m1_bytes_to_f16_pairs(flat[b0:b1], w[:k], s[:k]).view(torch.float16))
        if not folded:
            o.mul_(operand(_F16_TO_E2M1, o))
        if scale is not None:
            o.view(-1, NV_BLOCK).mul_(scale[b0 // 8 : b1 // 8, None])
        if sink is not None:
            sink(o, 2 * b0, 2 * b1)


def _nvfp4_decode_scale(
    scale_bits: torch.Tensor, gamax: torch.Tensor, ws: Optional[Workspace] = None
) -> tuple[torch.Tensor, bool]:
    """:func:`_decode_scale` of ``scaling.nvfp4_dequant_block_scale(scale_bits, gamax)``, bit
    for bit, with one buffer instead of eight (``ws``'s reused "dq_scale" slot when given).

    Why: the factors are a sixteenth of the output's size, and the composed version made a
    fresh temporary per op (widen, two multiplies, the 2^14 fold, and ``isfinite``'s four),
    which on the CPU cost about a fifth of the decode. Here the same multiplies run in place
    and the finiteness check is one ``aminmax`` (NaN propagates into both ends); the rare
    non-finite case falls back to the unfolded factors."""
    n = scale_bits.numel()
    f = (torch.empty(n, dtype=torch.float32, device=scale_bits.device) if ws is None
         else ws.get("dq_scale", (n,), torch.float32))
    _scaling.nvfp4_dequant_block_scale_into(scale_bits.reshape(-1), gamax, f).mul_(_F16_TO_E2M1)
    lo, hi = torch.aminmax(f)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return f, True
    return _scaling.nvfp4_dequant_block_scale(scale_bits, gamax).reshape(-1), False


def unpack_fp4_values(
    packed: torch.Tensor, block_scale: Optional[torch.Tensor] = None, *,
    scale_bits: Optional[torch.Tensor] = None, gamax: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[R, C/2] packed bytes -> [R, C] fp32 E2M1 values, times ``block_scale`` [R, C/16] if given
    (or the NVFP4 factors of ``scale_bits`` and ``gamax``, see :func:`decode_fp4_chunks`).

    Flat chunks (:func:`decode_fp4_chunks`): the int32 temporaries stay cache-sized and each
    chunk is scaled while cached; the scaled values are elementwise, so chunking is exact.
    """
    r, half = packed.shape
    if packed.device.type == "cpu" and 2 * packed.numel() * torch.get_num_threads() <= GATHER_DECODE_ELEMS:
        # small operand: one gather of the byte's two values (no per-call scale check: v * b
        # is what both int paths compute), one multiply by the block scales
        out = torch.index_select(_FP4_PAIR_LUT, 0, packed.reshape(-1).to(torch.int32)).view(r, half * 2)
        if scale_bits is not None:  # the NVFP4 factors, as the chunked path computes them
            assert gamax is not None
            block_scale = _scaling.nvfp4_dequant_block_scale(scale_bits, gamax)
        if block_scale is not None:
            out.view(-1, NV_BLOCK).mul_(block_scale.to(torch.float32).reshape(-1, 1))
        return out
    out = torch.empty(r, half * 2, dtype=torch.float32, device=packed.device)
    decode_fp4_chunks(packed, block_scale, out=out, scale_bits=scale_bits, gamax=gamax)
    return out


# the two E2M1 values of every packed byte (low nibble first), by the int decode itself
_FP4_PAIR_LUT = torch.empty(256, 2, device="cpu")
decode_fp4_chunks(torch.arange(256, dtype=torch.int32, device="cpu").to(torch.uint8), None, out=_FP4_PAIR_LUT)
