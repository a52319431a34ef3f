"""The emulated FusedAdam against a reference written independently from Transformer Engine's
stated math (``fused_adam.py``'s ``_apply_scale`` / ``get_unscaled_state``, the
``multi_tensor_adam`` kernels): numpy fp32 arithmetic one operation at a time, E4M3 rounding
from the format's definition (not torch's float8 cast), fp16 by numpy's cast, bf16 by the bit
rounding rule, the remainder split by the kernel's union of two int16s (``struct``).

Every comparison is bitwise (``torch.equal`` on the bits): the emulation claims TE's formats
and TE's operation order exactly (what it cannot claim -- TE's fast-math kernel -- is not a
property of these formats).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from lptrain.precision import optimizer_states as S
from lptrain.precision.fused_adam import EmulatedFusedAdam

F32 = np.float32

# ---- the reference -----------------------------------------------------------------------------


def _e4m3_table() -> np.ndarray:
    """Every finite non-negative E4M3 value, by code 0..126 (bias 7, subnormals, 0x7F NaN)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3 = _e4m3_table()


def ref_e4m3(y: np.ndarray) -> np.ndarray:
    """fp32 values -> E4M3 codes: round to nearest, ties to the even code, saturate to 448."""
    out = np.zeros(y.shape, dtype=np.uint8)
    for i, v in np.ndenumerate(y.astype(np.float64)):
        if np.isnan(v):
            out[i] = 0x7F
            continue
        a = min(abs(v), 448.0)
        k = int(np.searchsorted(E4M3, a))
        if k < len(E4M3) and E4M3[k] == a:
            c = k
        else:
            lo, hi = k - 1, k
            d_lo, d_hi = a - E4M3[lo], E4M3[hi] - a
            c = lo if d_lo < d_hi else hi if d_hi < d_lo else (lo if lo % 2 == 0 else hi)
        out[i] = c | (0x80 if v < 0 or (v == 0 and np.signbit(v)) else 0)
    return out


def ref_e4m3_value(codes: np.ndarray) -> np.ndarray:
    mag = E4M3[np.minimum(codes & 0x7F, 126)]
    mag = np.where((codes & 0x7F) == 0x7F, np.nan, mag)
    return np.where(codes & 0x80, -mag, mag).astype(F32)


def ref_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 round to nearest even, returned as fp32 values (finite inputs)."""
    b = x.astype(F32).view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (r << 16).astype(np.uint32).view(F32)


class RefState:
    """One state as TE stores it: ``kind`` fp32 / bf16 / fp16 / fp8, its value(s) and scale."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind = kind
        self.data = np.zeros(n, dtype=np.uint8 if kind == "fp8" else F32)
        self.scale = F32(1.0)  # _scales[p][name]
        self.qscale = F32(1.0)  # fp8: the quantizer's scale
        self.scale_inv = F32(1.0)

    def value(self) -> np.ndarray:
        if self.kind == "fp8":
            return ref_e4m3_value(self.data) * self.scale_inv
        if self.kind == "fp16":
            return self.data.astype(np.float16).astype(F32) * self.scale
        return self.data.copy()

    def store(self, x: np.ndarray) -> None:
        x = x.astype(F32)
        if self.kind == "fp32":
            self.data = x.copy()
        elif self.kind == "bf16":
            self.data = ref_bf16(x)
        else:
            top = F32(65504.0 / 2.0) if self.kind == "fp16" else F32(448.0)
            amax = F32(np.max(np.abs(x)))
            self.scale = F32(amax / top)
            if self.kind == "fp16":
                r = F32(F32(1.0) / self.scale) if self.scale > 0 else F32(0.0)
                self.data = (x * r).astype(np.float16).astype(F32)
            else:
                self.qscale = F32(F32(1.0) / self.scale) if self.scale > 0 else F32(1.0)
                self.data = ref_e4m3(x * self.qscale)
                self.scale_inv = F32(F32(1.0) / self.qscale)

    def bits(self) -> np.ndarray:
        return self.data if self.kind == "fp8" else self.data.astype(F32)


def ref_kernel(g, p, m, v, *, lr, b1, b2, eps, step, wd):
    """multi_tensor_adam's AdamW mode, numpy fp32, one rounding per operation."""
    b1, b2, lr, eps, wd = F32(b1), F32(b2), F32(lr), F32(eps), F32(wd)
    bc1 = F32(1.0 - float(b1) ** step)
    bc2 = F32(1.0 - float(b2) ** step)
    m = b1 * m + (F32(1) - b1) * g
    v = b2 * v + (F32(1) - b2) * g * g
    denom = np.sqrt(v / bc2) + eps
    update = (m / bc1) / denom + wd * p
    return p - lr * update, m, v


def ref_split(master: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's split through its union of two int16s (little-endian: [low, high])."""
    hi, lo = [], []
    for x in master.astype(F32):
        low, high = struct.unpack("<hh", struct.pack("<f", float(x)))
        if low < 0:
            high = (high + 1 + 2**15) % 2**16 - 2**15  # int16 ++, wrapping
        hi.append(high)
        lo.append(low)
    return np.array(hi, dtype=np.int16), np.array(lo, dtype=np.int16)


def ref_join(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    out = []
    for h, low in zip(hi.tolist(), lo.tolist(), strict=True):
        if low < 0:
            h = (h - 1 + 2**15) % 2**16 - 2**15
        out.append(struct.unpack("<f", struct.pack("<hh", low, h))[0])
    return np.array(out, dtype=F32)


# ---- the comparisons -----------------------------------------------------------------------------

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
KINDS = ("fp32", "bf16", "fp16", "fp8")


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy().view(np.uint32)


def _grads(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        g = torch.randn(n, generator=gen) * (10.0 ** -(k % 3))
        g[:5] = 0.0  # exact zeros and a tiny value ride along
        g[5] = 1e-30
        out.append(g.to(torch.bfloat16))
    return out


@pytest.mark.parametrize("exp_avg", KINDS)
@pytest.mark.parametrize("exp_avg_sq", KINDS)
def test_moment_formats_match_te_math(exp_avg: str, exp_avg_sq: str) -> None:
    """fp32 masters held by the caller (Megatron's path for MXFP8 and friends): three steps,
    every stored state bit and the master equal to the reference's."""
    n = 67
    master = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.05
    p = master.clone()
    opt = EmulatedFusedAdam([{"params": [p]}], exp_avg_dtype=S.TORCH_DTYPES[exp_avg],
                            exp_avg_sq_dtype=S.TORCH_DTYPES[exp_avg_sq], **HP)
    rp, rm, rv = master.numpy().astype(F32), RefState(exp_avg, n), RefState(exp_avg_sq, n)
    for step, g in enumerate(_grads(n, 3, 2), start=1):
        p.grad = g.float()
        opt.step()
        rp, m, v = ref_kernel(g.float().numpy(), rp, rm.value(), rv.value(), lr=HP["lr"],
                              b1=0.9, b2=0.95, eps=1e-8, step=step, wd=0.1)
        rm.store(m)
        rv.store(v)
        assert np.array_equal(_bits(p), rp.view(np.uint32)), f"master, step {step}"
        for name, ref in (("exp_avg", rm), ("exp_avg_sq", rv)):
            stored = opt.state[p][name]
            got = stored.data.numpy() if ref.kind == "fp8" else stored.float().numpy()
            assert np.array_equal(got.view(np.uint8 if ref.kind == "fp8" else np.uint32),
                                  ref.bits().view(np.uint8 if ref.kind == "fp8" else np.uint32)), (name, step)
            if ref.kind in ("fp16", "fp8"):
                assert opt._scales[p][name].item() == float(ref.scale)
            if ref.kind == "fp8":
                assert stored.scale_inv.item() == float(ref.scale_inv)


@pytest.mark.parametrize("master_kind", ["fp32", "fp16", "remainders"])
def test_te_held_masters_match_te_math(master_kind: str) -> None:
    """TE holding the masters of a bf16 param (bf16 decoupled grads): the bf16 param the kernel
    writes (round to nearest even from an fp32 or fp16 master; the remainder split's high
    half), the stored master, bitwise, over three steps."""
    n = 61
    init = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    p = init.clone()
    opt = EmulatedFusedAdam(
        [{"params": [p]}], master_weights=True, use_decoupled_grad=True,
        master_weight_dtype=torch.float16 if master_kind == "fp16" else torch.float32,
        store_param_remainders=master_kind == "remainders", exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16, **HP)
    ref_master = RefState("fp16" if master_kind == "fp16" else "fp32", n)
    ref_master.store(init.float().numpy())
    rm, rv = RefState("bf16", n), RefState("bf16", n)
    hi, lo = ref_split(init.float().numpy())  # a zero remainder: the master is the param
    for step, g in enumerate(_grads(n, 3, 4), start=1):
        p.decoupled_grad = g
        opt.step()
        master = ref_join(hi, lo) if master_kind == "remainders" else ref_master.value()
        new, m, v = ref_kernel(g.float().numpy(), master, rm.value(), rv.value(), lr=HP["lr"],
                               b1=0.9, b2=0.95, eps=1e-8, step=step, wd=0.1)
        rm.store(m)
        rv.store(v)
        if master_kind == "remainders":
            hi, lo = ref_split(new)
            want_param = np.asarray(hi).view(np.uint16)
            assert np.array_equal(opt.state[p]["master_param"].numpy(), lo), step
            assert np.array_equal(_bits(opt.master_value(p)), new.view(np.uint32)), step
        else:
            want_param = (ref_bf16(new).view(np.uint32) >> 16).astype(np.uint16)
            ref_master.store(new)
            assert np.array_equal(_bits(opt.get_unscaled_state(p, "master_param")),
                                  ref_master.value().view(np.uint32)), step
        assert np.array_equal(p.view(torch.int16).numpy().view(np.uint16), want_param), step


def test_remainder_split_is_exact_and_rounds_half_away() -> None:
    """Every high half with low halves around the rounding point: join(split(x)) is x, the
    bf16 half is the kernel's (struct reference), and it differs from round-to-nearest-even
    exactly at ties with an even high half (the kernel rounds them away from zero)."""
    highs = np.arange(-2**15, 2**15, dtype=np.int64)
    highs = highs[(highs & 0x7F80) != 0x7F80]  # finite values (NaN/inf payloads excluded)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.int64)
    bits = ((highs[:, None] & 0xFFFF) << 16 | lows[None, :]).reshape(-1).astype(np.uint32)
    x = torch.from_numpy(bits.view(np.int32).copy()).view(torch.float32)
    hi, rem = S.split_remainders(x)
    assert torch.equal(S.join_remainders(hi, rem).view(torch.int32), x.view(torch.int32))
    sample = np.random.default_rng(0).choice(len(bits), 4000, replace=False)
    r_hi, r_lo = ref_split(bits[sample].view(F32))
    assert np.array_equal(hi.view(torch.int16).numpy()[sample], r_hi)
    assert np.array_equal(rem.numpy()[sample], r_lo)
    rne = x.to(torch.bfloat16).view(torch.int16)
    differs = (hi.view(torch.int16) != rne).numpy()
    low16 = bits & 0xFFFF
    tie_even = (low16 == 0x8000) & (((bits >> 16) & 1) == 0)
    finite_result = np.abs(x.numpy()) < 3.3e38  # (RNE may round the largest ties to inf too)
    assert np.array_equal(differs[finite_result], tie_even[finite_result])


def test_all_zero_fp8_state_stays_zero() -> None:
    """Regression: TE stores an all-zero FP8 state with quantizer scale 1/0 = inf, so 0 * inf
    makes it NaN; lptrain stores zeros (what any finite scale gives)."""
    st = S.ScaledFp8State.zeros(torch.Size([8]), torch.device("cpu"))
    scale = torch.ones(1)
    S.store_scaled(st, torch.zeros(8), scale)
    assert scale.item() == 0.0 and torch.equal(S.unscale(st, scale), torch.zeros(8))
    # TE's formula, without the guard: NaN
    te = S.ScaledFp8State.zeros(torch.Size([8]), torch.device("cpu"))
    te.scale.copy_(1 / torch.zeros(1))
    te.quantize_(torch.zeros(8))
    assert torch.isnan(te.dequantize()).all()
