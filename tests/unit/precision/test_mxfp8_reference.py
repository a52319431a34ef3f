"""Independent slow MXFP8 reference (per block, Python floats + struct bit logic) vs the
vectorised quantizer: must agree bit for bit (numerics.md P2, P4, P5, P1)."""

from __future__ import annotations

import math

import pytest
import torch
from _quant_refs import E4M3_TABLE, E5M2_TABLE, FP8Table, e8m0_rceil, exp2f_rcp, fl32

from lptrain.precision import quantize


def ref_block(vals: list[float], table: FP8Table) -> tuple[int, list[int]]:
    finite_or_inf = [abs(v) for v in vals if not math.isnan(v)]
    amax = max(finite_or_inf, default=0.0)  # NaN-ignoring (P2)
    v = fl32(amax * fl32(1.0 / table.max))  # exact product in fp64, then fp32 RNE
    code = e8m0_rceil(v)
    mult = exp2f_rcp(code)
    return code, [table.cast(fl32(x * mult)) for x in vals]


def ref_mxfp8(x: torch.Tensor, table: FP8Table, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    xs = (x.t() if columnwise else x).tolist()
    codes, data = [], []
    for row in xs:
        rc, rd = [], []
        for b in range(0, len(row), 32):
            c, d = ref_block(row[b : b + 32], table)
            rc.append(c)
            rd.extend(d)
        codes.append(rc)
        data.append(rd)
    c_t, d_t = torch.tensor(codes), torch.tensor(data)
    return (c_t.t(), d_t.t()) if columnwise else (c_t, d_t)


def make_input(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    x[0, :32] = 0.0  # all-zero block
    x[1, :32] = 1e-40  # fp32-subnormal block (code 0)
    x[2, 5] = float("nan")  # NaN ignored by amax, stays NaN
    x[3, 7] = float("inf")  # code 0xFE, saturates
    x[4, :32] = 448.0 * 2.0**5  # exact power: code 132
    x[5, 0] = 3e38  # huge amax
    return x


@pytest.mark.parametrize(("seed", "fmt"), [(0, "e4m3"), (1, "e4m3"), (2, "e5m2")])
def test_mxfp8_matches_slow_reference(seed: int, fmt: str) -> None:
    x = make_input(seed)
    table = E5M2_TABLE if fmt == "e5m2" else E4M3_TABLE
    kw = {"role": "grad", "fp8_format": "hybrid"} if fmt == "e5m2" else {}
    qt = quantize(x, "mxfp8", **kw)
    v = qt.storage_views()
    for o in ("rowwise", "columnwise"):
        codes, data = ref_mxfp8(x, table, columnwise=(o == "columnwise"))
        assert torch.equal(v[f"{o}_scale_inv"].long(), codes), o
        got = v[f"{o}_data"].long()
        nan = data == -1
        assert torch.equal(got[~nan], data[~nan]), o
        assert ((got[nan] & 0x7F) >= (0x7D if fmt == "e5m2" else 0x7F)).all()  # NaN codes


@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp8_both_orientations_in_one_pass_equal_each_alone(seed: int) -> None:
    """The two-orientation quantize (one |x| pass, one NaN check, one scale computation)
    writes the bytes and codes each single-orientation quantize writes, NaN block included."""
    from lptrain.precision.recipes import MXFP8Scaling

    x = make_input(seed)
    both = MXFP8Scaling().make_quantizer("input", True, True).quantize(x).storage_views()
    for o, usage in (("rowwise", (True, False)), ("columnwise", (False, True))):
        alone = MXFP8Scaling().make_quantizer("input", *usage).quantize(x).storage_views()
        for f in (f"{o}_data", f"{o}_scale_inv"):
            assert torch.equal(both[f], alone[f]), f
