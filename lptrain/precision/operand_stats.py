"""Per-layer quantization statistics of the GEMM operands (``logging.numerics_interval``).

For every operand a quantized GEMM reads (the input, the weight and the output grad of each
linear, per member of a grouped one) a step's statistics are accumulated on the operand's
device as one fp64 vector (:data:`WIDTH` numbers): counts and sums that add over the step's
micro-batches and over ranks, a histogram of the block-scale exponents, and two maxima. The
vectors stay on the device until :meth:`OperandRecorder.read` moves all of them to the host
in one copy; nothing here reads a device value on the host (no ``.item()``, no boolean
indexing, no ``bincount``: each would be a host sync on a GPU).

What :func:`finish` reports per operand (``None`` where a figure does not apply):

* ``amax``: the largest finite magnitude of the high-precision operand;
* ``scale``: per-tensor formats, ``1 / scale_inv`` (the largest ``scale_inv`` of the step's
  quantizations: the smallest scale);
* ``scale_exp_min`` / ``scale_exp_median`` / ``scale_exp_max``: ``floor(log2)`` of the blocks'
  dequantization scales (the lower median), over blocks that hold a nonzero value -- an
  all-zero block's scale is a convention (1, 2^-127 or 0 by format), not information; a
  block whose scale underflowed to 0 (NVFP4) counts as the lowest exponent, -150;
* ``zero_blocks``: the fraction of blocks whose values are all exactly zero (the all-zero
  gradient blocks of MoE experts and padding show here, never as NaN);
* ``underflow``: the fraction of the nonzero finite values that dequantize to zero;
* ``saturation``: the fraction of the values that were clamped at the format's largest
  code: their magnitude is beyond ``limit * scale``, the block's dequantization scale times
  the format's max plus half its last step (E4M3 464, E5M2 61440, E2M1 7), which
  round-to-nearest cannot reach (a value just above the max that rounds to it is not
  counted: its error is an ordinary rounding error);
* ``snr_db``: ``10 log10(sum x^2 / sum (q(x) - x)^2)`` over the finite values, the relative
  quantization error ``||q(x) - x|| / ||x||`` as a signal-to-noise ratio; ``None`` when there
  is no error (an exact quantization, an all-zero operand);
* ``nonfinite``: how many values were NaN or infinite.

A quantized primary weight has no high-precision value at its GEMM: only its ``amax`` (of the
dequantized values), scales and zero blocks are reported. An unquantized GEMM's operands
(bf16 runs, the layers a recipe keeps in bf16) report ``amax`` and ``nonfinite`` only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Optional

import torch

# fp64 vector layout: summed fields, the exponent histogram (summed), then two maxima
SUMS = ("quantized", "referenced", "per_tensor", "elements", "nonzero", "underflow",
        "saturated", "nonfinite", "sum_x2", "sum_err2", "blocks", "zero_blocks")
EXP_LO, EXP_BINS = -150, 300  # histogram of floor(log2(scale)) over [-150, 150)
MAXES = ("amax", "scale_inv")
_I = {name: i for i, name in enumerate(SUMS)}
N_SUMMED = len(SUMS) + EXP_BINS
WIDTH = N_SUMMED + len(MAXES)

STATS = ("amax", "scale", "scale_exp_min", "scale_exp_median", "scale_exp_max", "zero_blocks",
         "underflow", "saturation", "snr_db", "nonfinite")


def _vector(device: torch.device, sums: dict[str, torch.Tensor | float],
            hist: Optional[torch.Tensor], amax: torch.Tensor, scale_inv: Optional[torch.Tensor]) -> torch.Tensor:
    """One operand's fp64 vector from device scalars (one ``stack``: no host read)."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    parts = [torch.as_tensor(sums.get(name, zero), dtype=torch.float64, device=device).reshape(())
             for name in SUMS]
    head = torch.stack(parts)
    h = hist if hist is not None else torch.zeros(EXP_BINS, dtype=torch.float64, device=device)
    s_inv = (scale_inv.double().amax().reshape(1) if scale_inv is not None
             else torch.full((1,), -math.inf, dtype=torch.float64, device=device))
    return torch.cat((head, h, amax.double().reshape(1), s_inv))


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    """``sum(t^2)`` accumulated in fp64 (each fp32 square is exact in fp64)."""
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def plain_stats(x: torch.Tensor) -> torch.Tensor:
    """The vector of an unquantized operand: amax, element and non-finite counts."""
    xf = x.detach()
    if not xf.numel():
        return _vector(xf.device, {}, None, torch.zeros((), device=xf.device), None)
    a = xf.abs().float().nan_to_num_(0.0, 0.0, 0.0)  # non-finite values out of the amax
    nonfinite = xf.numel() - torch.count_nonzero(torch.isfinite(xf))
    return _vector(xf.device, {"elements": float(xf.numel()), "nonfinite": nonfinite}, None, a.amax(), None)


def quantized_stats(x: Optional[torch.Tensor], q: Any,
                    rowwise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The vector of an operand ``x`` (None: no high-precision reference) quantized to ``q``
    (a quantized tensor of :mod:`lptrain.precision.tensors`); ``rowwise``: its row-wise
    dequantized values when the caller has them; see :func:`blocks_stats`."""
    try:
        blocks = q.stat_blocks(x, rowwise)
    except ValueError:  # no blocks of the operand's values to compare with (see stat_layout)
        return plain_stats(x if x is not None else q.dequantize())
    return blocks_stats(blocks, q.numel())


def blocks_stats(b: Any, numel: int) -> torch.Tensor:
    """The vector of an operand cut into its scaling blocks (a ``StatBlocks``): the module
    doc's figures as device scalars, in about fifteen elementwise passes and reductions over
    the operand (no fp64 copy of it: squares are summed in fp64 by the norm)."""
    deq, scales = b.dequantized, b.scales
    device = deq.device
    ref = b.values if b.values is not None else deq
    # |x| with the non-finite values set to 0: the amax, saturation and norms exclude them
    a = ref.abs().nan_to_num_(0.0, 0.0, 0.0)
    nonfinite = ref.numel() - torch.count_nonzero(torch.isfinite(ref))
    zero_block = (ref == 0).all(dim=1)
    # exponent histogram over blocks holding a nonzero value (index_add_: no host read)
    counted = (~zero_block & torch.isfinite(scales)).double()
    exp = torch.frexp(scales)[1] - 1
    exp = torch.where(scales == 0, EXP_LO, exp).clamp_(EXP_LO, EXP_LO + EXP_BINS - 1) - EXP_LO
    hist = torch.zeros(EXP_BINS, dtype=torch.float64, device=device)
    hist.index_add_(0, exp.reshape(-1).long(), counted)
    sums: dict[str, Any] = {
        "quantized": 1.0, "per_tensor": 1.0 if b.per_tensor else 0.0, "elements": float(numel),
        "nonfinite": nonfinite, "blocks": float(scales.numel()), "zero_blocks": torch.count_nonzero(zero_block),
    }
    if b.values is not None:
        # beyond clamp_limit * scale rounding cannot reach the largest code: clamped; a zero
        # scale (an NVFP4 block scale that underflowed) clamps nothing: its values flush to 0
        bound = torch.where(scales > 0, scales * b.clamp_limit, torch.inf)[:, None]
        nonzero = a != 0
        err = (deq - b.values).nan_to_num_(0.0, 0.0, 0.0)
        sums.update({
            "referenced": 1.0, "nonzero": torch.count_nonzero(nonzero),
            "underflow": torch.count_nonzero(nonzero & (deq == 0)),
            "saturated": torch.count_nonzero(a > bound), "sum_x2": _sq_norm(a), "sum_err2": _sq_norm(err),
        })
    return _vector(device, sums, hist, a.amax().float(), scales if b.per_tensor else None)


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two vectors of the same operand combined (counts and sums add, maxima max), in ``a``."""
    a[:N_SUMMED] += b[:N_SUMMED]
    torch.maximum(a[N_SUMMED:], b[N_SUMMED:], out=a[N_SUMMED:])
    return a


def finish(v: list[float]) -> dict[str, Optional[float]]:
    """The reported figures of one operand's (host) vector; see the module doc."""
    s = {name: v[i] for i, name in enumerate(SUMS)}
    hist = v[len(SUMS):N_SUMMED]
    amax, scale_inv = v[N_SUMMED], v[N_SUMMED + 1]
    out: dict[str, Optional[float]] = dict.fromkeys(STATS)
    out["amax"] = amax
    out["nonfinite"] = s["nonfinite"]
    if not s["quantized"]:
        return out
    if s["per_tensor"] and scale_inv > 0 and math.isfinite(scale_inv):
        out["scale"] = 1.0 / scale_inv
    total = sum(hist)
    if total:
        seen = [i for i, c in enumerate(hist) if c]
        out["scale_exp_min"] = float(seen[0] + EXP_LO)
        out["scale_exp_max"] = float(seen[-1] + EXP_LO)
        half, acc = (total + 1) // 2, 0.0
        for i, c in enumerate(hist):
            acc += c
            if acc >= half:
                out["scale_exp_median"] = float(i + EXP_LO)
                break
    out["zero_blocks"] = s["zero_blocks"] / s["blocks"] if s["blocks"] else None
    if s["referenced"]:
        out["underflow"] = s["underflow"] / s["nonzero"] if s["nonzero"] else 0.0
        out["saturation"] = s["saturated"] / s["elements"] if s["elements"] else 0.0
        if s["sum_err2"] > 0 and s["sum_x2"] > 0:
            out["snr_db"] = 10.0 * math.log10(s["sum_x2"] / s["sum_err2"])
    return out


ROLES = ("input", "weight", "grad")


class OperandRecorder:
    """One step's (or interval's) statistics per operand, on the device until :meth:`read`.

    Operands are keyed ``<module>.<role>`` (``<module>.<role><i>`` for member ``i`` of a
    grouped GEMM: ``i`` the global expert index), the module named as in the state dict.
    """

    def __init__(self) -> None:
        self.acc: dict[str, torch.Tensor] = {}
        self._module_order: dict[str, int] = {}
        self.open = True

    def add(self, module: str, role: str, member: Optional[int], vec: torch.Tensor) -> None:
        self._module_order.setdefault(module, len(self._module_order))
        key = f"{module}.{role}" if member is None else f"{module}.{role}{member}"
        held = self.acc.get(key)
        if held is None:
            self.acc[key] = vec
        else:
            merge(held, vec)

    def _sort_key(self, key: str) -> tuple[int, int, int]:
        module, _, tail = key.rpartition(".")
        role = tail.rstrip("0123456789")
        member = int(tail[len(role):]) if tail != role else -1
        return self._module_order.get(module, 1 << 30), ROLES.index(role) if role in ROLES else 9, member

    def read(self) -> dict[str, list[float]]:
        """Every operand's vector on the host, in module order (forward order of first use),
        then role (input, weight, grad) and member: one stack and one device-to-host copy."""
        self.open = False
        if not self.acc:
            return {}
        keys = sorted(self.acc, key=self._sort_key)
        host = torch.stack([self.acc[k] for k in keys]).cpu().tolist()
        return dict(zip(keys, host, strict=True))


_ACTIVE: list[OperandRecorder] = []


def active() -> Optional[OperandRecorder]:
    """The recorder collecting this step's statistics, or None (no cost beyond this check)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(recorder: OperandRecorder) -> Iterator[OperandRecorder]:
    """Collect the statistics of the GEMMs run inside (their backwards included) into
    ``recorder``."""
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)


def record(module: Optional[str], role: str, member: Optional[int], x: Optional[torch.Tensor],
           q: Any = None, rowwise: Optional[torch.Tensor] = None) -> None:
    """Add one operand's statistics to the active recorder (nothing without one, or for an
    unnamed module); ``q`` None: an unquantized operand; ``rowwise``: ``q``'s row-wise
    dequantized values, when already computed."""
    rec = active()
    if rec is None or module is None or not rec.open:
        return
    with torch.no_grad():
        if q is None:
            assert x is not None
            vec = plain_stats(x)
        else:
            vec = quantized_stats(x, q, rowwise)
    rec.add(module, role, member, vec)
