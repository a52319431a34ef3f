"""Independent slow NVFP4 reference (TE's pseudocode, numerics.md 2.5, scalar numpy fp32 math)
vs the vectorised quantizer: bytes, scale bytes and amax must agree bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _quant_refs import E4M3_TABLE

from lptrain.precision import quantize
from lptrain.precision.formats import unpack_fp4

F = np.float32
FLT_MAX = F(np.finfo(np.float32).max)


def e2m1_ref(v: float) -> int:
    """TE reference ``cast_to_fp4x2`` thresholds, plus satfinite NaN -> +6."""
    if math.isnan(v):
        return 7
    a = abs(v)
    mags = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    code = sum(1 for t, inclusive in mags if (a >= t if inclusive else a > t))
    return code | (8 if v < 0 else 0)


def e4m3_value(v: np.float32) -> tuple[int, float]:
    code = E4M3_TABLE.cast(float(v))
    return code, float(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def ref_nvfp4(x: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Codes [M, K], scale bytes [M, K/16] (tile scale repeated per row), amax; blocks of
    ``tile_rows`` x 16 (1 for 1x16, 16 for the 16x16 weight tiles)."""
    rows = x.tolist()
    m, k = len(rows), len(rows[0])
    amax = max((abs(v) for r in rows for v in r if not math.isnan(v)), default=0.0)
    with np.errstate(all="ignore"):
        s_enc = F(2688.0) / F(amax)
        s_enc = min(s_enc, FLT_MAX)
        if amax == 0.0 or s_enc == 0.0:
            s_enc = F(1.0)
        s_dec = F(1.0) / s_enc
        kf = s_enc * F(1.0 / 6.0)
        codes = [[0] * k for _ in range(m)]
        sbytes = [[0] * (k // 16) for _ in range(m)]
        for r0 in range(0, m, tile_rows):
            for c0 in range(0, k, 16):
                blk = [rows[r][c] for r in range(r0, r0 + tile_rows) for c in range(c0, c0 + 16)]
                vmax = max((abs(v) for v in blk if not math.isnan(v)), default=0.0)
                sb, sdec = e4m3_value(min(F(vmax) * kf, FLT_MAX))
                enc = min(F(1.0) / (F(sdec) * s_dec), FLT_MAX)
                for r in range(r0, r0 + tile_rows):
                    sbytes[r][c0 // 16] = sb
                    for c in range(c0, c0 + 16):
                        codes[r][c] = e2m1_ref(float(F(rows[r][c]) * enc))
    return torch.tensor(codes), torch.tensor(sbytes), amax


def make_input(seed: int, with_inf: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 48, generator=g) * torch.exp2(torch.randint(-12, 12, (32, 1), generator=g).float())
    x = x.bfloat16().float()  # TE quantizes bf16 activations
    x[0, :16] = 0.0  # zero block: scale byte 0, codes 0
    x[1, 16:32] = 1e-30  # tiny block: E4M3 scale underflows to 0 -> enc = FLT_MAX -> codes 6
    x[2, 3] = float("nan")
    if with_inf:
        x[5, 5] = float("inf")  # global amax inf -> S_enc = 1
    return x


@pytest.mark.parametrize(("seed", "with_inf"), [(0, False), (1, False), (2, True)])
def test_nvfp4_1x16_matches_reference(seed: int, with_inf: bool) -> None:
    x = make_input(seed, with_inf)
    qt = quantize(x, "nvfp4", role="input")  # API defaults: no RHT, no SR
    v = qt.storage_views()
    for o, src in (("rowwise", x), ("columnwise", x.t().contiguous())):
        codes, sbytes, amax = ref_nvfp4(src, tile_rows=1)
        assert torch.equal(unpack_fp4(v[f"{o}_data"]).long(), codes), o
        assert torch.equal(v[f"{o}_scale_inv"].long(), sbytes), o
        assert v[f"amax_{o}"].item() == amax


def test_nvfp4_16x16_weight_matches_reference() -> None:
    x = make_input(3, with_inf=False)
    qt = quantize(x, "nvfp4", role="weight")
    v = qt.storage_views()
    codes, sbytes, amax = ref_nvfp4(x, tile_rows=16)
    assert torch.equal(unpack_fp4(v["rowwise_data"]).long(), codes)
    assert torch.equal(v["rowwise_scale_inv"].long(), sbytes)
    assert v["amax_rowwise"].item() == amax
