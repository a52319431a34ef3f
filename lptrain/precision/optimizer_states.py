"""Optimizer tensors stored in a lower-precision dtype, as Transformer Engine's FusedAdam stores
them (``transformer_engine/pytorch/optimizers/fused_adam.py``: ``_initialize_state``,
``get_unscaled_state``, ``_apply_scale``; the split of ``multi_tensor_adam_param_remainder``).

A stored state is a plain tensor (fp32, bf16, fp16) or a :class:`ScaledFp8State` (TE's
``Float8Tensor`` with a ``Float8Quantizer``, E4M3); fp16 and fp8 states have one fp32 scale per
optimizer tensor, kept beside them (TE's ``self._scales[param][name]``). The optimizer reads a
state with :func:`unscale` (an fp32 tensor to compute on) and writes its new fp32 value back
with :func:`store_scaled`; both dispatch on the stored type, so the optimizer never knows a
format:

* fp32: the state itself (no copy);
* bf16: the fp32 value; stored back round to nearest even;
* fp16: the fp16 value times its scale; stored back after a new scale ``absmax / 32752``
  (fp16's max / 2) and a multiply by its reciprocal (0 for an all-zero tensor), fp16 round to
  nearest even;
* fp8 (E4M3): the codes times ``scale_inv``; stored back after a new scale ``absmax / 448``:
  the quantizer scale is its reciprocal, the codes ``e4m3_satfinite(x * quantizer scale)``
  and ``scale_inv`` the reciprocal of the quantizer scale (TE's cast kernel).

One deliberate difference from TE: an all-zero fp8 state. TE sets the quantizer scale to
``1 / 0 = inf`` and casts ``0 * inf = NaN``, so the moment -- and from the next step the
parameter -- becomes NaN (a piece of a parameter whose gradient is all zero, an expert that got
no tokens). lptrain stores zeros with quantizer scale 1 instead: the codes any finite scale
gives (the TE backend applies the same guard, :func:`lptrain.precision.te_adapter.te_fused_adam`).

:func:`split_remainders` / :func:`join_remainders` are TE's fp32 master <-> (bf16 parameter,
int16 remainder) pair: the high 16 bits rounded half away from zero (the remainder's sign bit
says whether it was rounded up), the low 16 bits kept, so the join is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import singledispatch

import torch

from lptrain.catalog.optimizer_state import SCALED_RANGE
from lptrain.precision.formats import E4M3, cast_to_fp8, fp8_to_float

# TE's dtype names for the state dtypes (Megatron maps fp8 to torch.uint8).
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}
NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass
class ScaledFp8State:
    """An E4M3 state: ``data`` codes (uint8), the quantizer's ``scale`` and ``scale_inv``
    (fp32, shape ``[1]``): TE's ``Float8Tensor`` as FusedAdam keeps one."""

    data: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor

    @classmethod
    def zeros(cls, shape: torch.Size, device: torch.device) -> ScaledFp8State:
        """TE's ``quantizer.make_empty(shape)`` then ``quantize_(zeros)`` (scale 1)."""
        one = torch.ones(1, dtype=torch.float32, device=device)
        return cls(torch.zeros(shape, dtype=torch.uint8, device=device), one, one.clone())

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def numel(self) -> int:
        return self.data.numel()

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4 + self.scale_inv.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """``codes * scale_inv`` in fp32 (TE's dequantize kernel)."""
        return fp8_to_float(self.data, E4M3, scale=self.scale_inv).view(self.data.shape)

    def quantize_(self, x: torch.Tensor) -> None:
        """Codes ``e4m3_satfinite(x * scale)``, ``scale_inv = 1 / scale`` (TE's cast kernel)."""
        self.data.copy_(cast_to_fp8(x.float().mul(self.scale).reshape(self.data.shape), E4M3, inplace=True))
        torch.reciprocal(self.scale, out=self.scale_inv)


def make_state(dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor | ScaledFp8State:
    """A zero state of ``dtype`` (torch.uint8 = fp8) shaped like ``like`` (TE's
    ``_initialize_state(..., zero_buffer=True)``)."""
    if dtype == torch.uint8:
        return ScaledFp8State.zeros(like.shape, like.device)
    return torch.zeros(like.shape, dtype=dtype, device=like.device)


@singledispatch
def unscale(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The fp32 value of a stored state (``scale``: its fp32 scale, None for fp32/bf16)."""
    if stored.dtype == torch.float32:
        return stored
    if stored.dtype == torch.bfloat16:
        return stored.float()
    if stored.dtype == torch.float16:
        assert scale is not None
        return stored.float().mul_(scale)
    raise TypeError(f"no optimizer state is stored as {stored.dtype}")


@unscale.register
def _(stored: ScaledFp8State, scale: torch.Tensor | None) -> torch.Tensor:
    return stored.dequantize()


def absmax(x: torch.Tensor) -> torch.Tensor:
    """``max(-min, max)`` as TE computes it (``torch.aminmax``), shape ``[1]``."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).reshape(1).to(torch.float32)


@singledispatch
def store_scaled(stored: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Write fp32 ``x`` into ``stored`` (and its new ``scale``, in place): TE's
    ``_apply_scale``, or a copy for fp32."""
    if stored.dtype == torch.float32:
        if stored is not x:
            stored.copy_(x)
        return
    if stored.dtype == torch.bfloat16:
        stored.copy_(x.to(torch.bfloat16))
        return
    if stored.dtype == torch.float16:
        assert scale is not None
        torch.div(absmax(x), SCALED_RANGE["fp16"], out=scale)
        rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
        stored.copy_(x.mul(rscale).reshape(stored.shape))
        return
    raise TypeError(f"no optimizer state is stored as {stored.dtype}")


@store_scaled.register
def _(stored: ScaledFp8State, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    assert scale is not None
    torch.div(absmax(x), SCALED_RANGE["fp8"], out=scale)
    if bool(scale > 0):
        torch.reciprocal(scale, out=stored.scale)
    else:  # TE: 1 / 0 = inf, 0 * inf = NaN (module doc); any finite scale stores zeros
        stored.scale.fill_(1.0)
    stored.quantize_(x)


@singledispatch
def stored_bytes(stored: torch.Tensor) -> int:
    """Bytes a stored state holds (codes and its own scales; not the optimizer's scale)."""
    return stored.numel() * stored.element_size()


@stored_bytes.register
def _(stored: ScaledFp8State) -> int:
    return stored.nbytes


@singledispatch
def stored_tensors(stored: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors that make up a stored state, by name (for a checkpoint: bitwise)."""
    return {"data": stored}


@stored_tensors.register
def _(stored: ScaledFp8State) -> dict[str, torch.Tensor]:
    return {"data": stored.data, "scale": stored.scale, "scale_inv": stored.scale_inv}


def load_stored_(stored: torch.Tensor | ScaledFp8State, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`stored_tensors`: copy saved tensors into ``stored`` (same type)."""
    for name, t in stored_tensors(stored).items():
        t.copy_(tensors[name].view(t.shape))


# ---- fp32 masters as (bf16 parameter, int16 remainder) --------------------------------------


def split_remainders(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 high half rounded half away from zero, int16 low half): the
    kernel's split (``if (rem < 0) p++``, int16 arithmetic that wraps)."""
    bits = master.contiguous().view(torch.int32)
    lo = bits.to(torch.int16)  # the low 16 bits, two's complement
    hi = (bits >> 16) + (lo < 0).to(torch.int32)
    return hi.to(torch.int16).view(torch.bfloat16), lo


def join_remainders(param: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16 ``param``, int16 ``rem``) -> the fp32 master (``if (rem < 0) p--``)."""
    hi = (param.contiguous().view(torch.int16).to(torch.int32) - (rem < 0).to(torch.int32)).to(torch.int16)
    bits = ((hi.to(torch.int64) & 0xFFFF) << 16) | (rem.to(torch.int64) & 0xFFFF)
    bits = bits - ((bits >> 31) << 32)  # to the int32 range, two's complement
    return bits.to(torch.int32).view(torch.float32)
