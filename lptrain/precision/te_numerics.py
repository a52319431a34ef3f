"""The quantization statistics on the Transformer Engine backend, from TE's quantized tensors.

TE quantizes inside its modules' compiled paths, so the operands its GEMMs read are not
visible from Python. At an armed step (:func:`probing`) every TE linear is hooked: after its
forward, the input it received and its weight, and when the backward reaches its output, the
output grad, are quantized with a copy of the module's own quantizer -- TE's
``quantizers["scaling_fwd"]`` / ``["scaling_bwd"]`` lists, three forward entries (input,
weight, output) and two backward ones (output grad, input grad) per GEMM -- into TE's tensor
classes, and the statistics are read through TE's attribute names (:func:`te_stat_blocks`).
A quantized primary weight is read as it is stored. The copies quantize row-wise only, with
compact (not GEMM-swizzled) scales.

The probe leaves the run bitwise as it was: every copy quantizes with amax and scale buffers
of its own (a delayed-scaling quantizer's amax is a view of the module's ``amax_history[0]``,
into which TE's cast max-reduces); a forward TE recomputes (its recompute phase) is not probed
again; the backward hook keeps only the splits, not the layer's input; NVFP4 copies round to
nearest and so draw no stochastic-rounding bits from the CUDA generator -- the NVFP4
output-grad statistics on TE are of round-to-nearest quantization.

TE's layouts, as its sources (2.x) define them and :func:`te_stat_blocks` reads them:
``Float8Tensor._scale_inv`` (one fp32); ``MXFP8Tensor._rowwise_scale_inv`` E8M0 bytes
``[M, K/32]`` padded to ``[128k, 4k]``; ``NVFP4Tensor._rowwise_scale_inv`` E4M3 bytes
``[M, K/16]`` padded likewise, with ``_amax_rowwise``; ``Float8BlockwiseQTensor``
``_rowwise_scale_inv`` fp32, 128x128 tiles ``[M/128, K/128]`` (inner dim padded to 4) when
``_is_2D_scaled``, else 1x128 blocks stored transposed, ``[K/128, M]`` (M padded to 4) --
the compact ``[M, K/128]`` layout is read too. Swizzled scales are not read (plain amax).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn

from lptrain.precision import operand_stats as _stats
from lptrain.precision import scaling as _scaling
from lptrain.precision.formats import rounding_limit
from lptrain.precision.tensors.base import StatBlocks

FWD_PER_GEMM, BWD_PER_GEMM = 3, 2  # TE: (input, weight, output) / (grad output, grad input)
# the clamp limits (lptrain.precision.formats.rounding_limit) of TE's element formats
_E4M3_LIMIT, _E5M2_LIMIT, _E2M1_LIMIT = (rounding_limit(448.0, 0.125), rounding_limit(57344.0, 0.25),
                                         rounding_limit(6.0, 0.5))


def _fp8_max(fp8_dtype: Any) -> float:
    """The clamp limit of TE's ``_fp8_dtype`` (``tex.DType.kFloat8E4M3``/``E5M2``, or
    lptrain's format object)."""
    name = getattr(fp8_dtype, "name", None) or str(fp8_dtype)
    return _E5M2_LIMIT if "E5M2" in name.upper() else _E4M3_LIMIT


def _rows(block: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.reshape(-1, block)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def _float8(qt: Any, m: int, k: int) -> tuple[Callable, torch.Tensor, float, bool]:
    return (lambda t: t.reshape(1, -1)), qt._scale_inv.reshape(1), _fp8_max(qt._fp8_dtype), True


def _mxfp8(qt: Any, m: int, k: int) -> tuple[Callable, torch.Tensor, float, bool]:
    codes = qt._rowwise_scale_inv[:m, : k // 32]
    return _rows(32), _scaling.e8m0_to_dequant_scale(codes), _fp8_max(qt._fp8_dtype), False


def _nvfp4(qt: Any, m: int, k: int) -> tuple[Callable, torch.Tensor, float, bool]:
    sbytes = qt._rowwise_scale_inv[:m, : k // 16]
    return _rows(16), _scaling.nvfp4_dequant_block_scale(sbytes, qt._amax_rowwise), _E2M1_LIMIT, False


def _blockwise(qt: Any, m: int, k: int) -> tuple[Callable, torch.Tensor, float, bool]:
    b = 128
    nm, nk = -(-m // b), -(-k // b)
    sinv = qt._rowwise_scale_inv
    fmax = _fp8_max(qt._fp8_dtype)
    if qt._is_2D_scaled:

        def tiles(t: torch.Tensor) -> torch.Tensor:
            p = _pad(t, nm * b, nk * b).view(nm, b, nk, b)
            return p.permute(0, 2, 1, 3).reshape(-1, b * b)

        return tiles, sinv[:nm, :nk], fmax, False
    if sinv.shape[0] == nk and sinv.shape[1] >= m:  # TE: [K/128, M padded], GEMM-ready
        sinv = sinv[:, :m].t()
    return (lambda t: _pad(t, m, nk * b).reshape(-1, b)), sinv, fmax, False


# TE's tensor classes and their storage classes (``*TensorStorage`` from 2.9, ``*TensorBase``
# before): an internal quantizer returns the storage class
READERS: dict[str, Callable[[Any, int, int], tuple[Callable, torch.Tensor, float, bool]]] = {
    f"{name}{suffix}": reader
    for name, reader in (("Float8Tensor", _float8), ("MXFP8Tensor", _mxfp8), ("NVFP4Tensor", _nvfp4),
                         ("Float8BlockwiseQTensor", _blockwise))
    for suffix in ("", "Storage", "Base")
}


def te_stat_blocks(qt: Any, x: Optional[torch.Tensor]) -> StatBlocks:
    """A TE quantized tensor (row-wise data present) and the tensor it was quantized from
    (None: a stored primary weight) as scaling blocks; ``ValueError`` when its scales
    cannot be read (an unknown class, GEMM-swizzled scales)."""
    reader = READERS.get(type(qt).__name__)
    if reader is None or getattr(qt, "_with_gemm_swizzled_scales", False):
        raise ValueError(f"no statistics layout for {type(qt).__name__}")
    k = int(qt.shape[-1])
    m = math.prod(qt.shape) // max(k, 1)
    cut, scales, fmax, per_tensor = reader(qt, m, k)
    deq = qt.dequantize(dtype=torch.float32).reshape(-1, k)
    ref = cut(x.detach().float().reshape(-1, k)) if x is not None else None
    return StatBlocks(ref, cut(deq), scales.float().reshape(-1), fmax, per_tensor)


def _vector(qt: Any, x: Optional[torch.Tensor]) -> torch.Tensor:
    try:
        return _stats.blocks_stats(te_stat_blocks(qt, x), int(math.prod(qt.shape)))
    except ValueError:
        return _stats.plain_stats(x if x is not None else qt.dequantize(dtype=torch.float32))


def _probe_copy(q: Any) -> Any:
    """A copy of a TE quantizer that quantizes row-wise, compact scales, round to nearest,
    into a tensor (not internal: TE's modules set ``internal=True`` on their quantizers in
    forward, and a copy keeps it, returning a storage object that has no ``.shape`` before
    2.19), with amax/scale buffers of its own: a delayed-scaling quantizer's ``amax`` is a
    view of the module's ``amax_history[0]``, which TE's cast max-reduces into, so a shared
    one would let the probe change the run's scales (under recompute it records the
    recomputed input, under PP 1F1B into another micro-batch's slot)."""
    c = q.copy()
    c.set_usage(rowwise=True, columnwise=False)
    if hasattr(c, "internal"):
        c.internal = False
    for attr in ("amax", "scale"):
        buf = getattr(c, attr, None)
        if isinstance(buf, torch.Tensor):
            setattr(c, attr, buf.detach().clone())
    if hasattr(c, "optimize_for_gemm"):
        c.optimize_for_gemm = False
    if getattr(c, "stochastic_rounding", False):
        c.stochastic_rounding = False
    return c


def _quantized_weight(w: Any) -> bool:
    return type(w).__name__ in READERS


def _te_linear_classes() -> tuple[type, ...]:
    import transformer_engine.pytorch as te

    return tuple(c for c in (getattr(te, "Linear", None), getattr(te, "GroupedLinear", None)) if c)


def _in_te_recompute() -> bool:
    """Whether TE is recomputing a checkpointed region's forward (its recompute phase)."""
    try:
        from transformer_engine.pytorch.distributed import in_fp8_activation_recompute_phase
    except ImportError:
        return False
    return bool(in_fp8_activation_recompute_phase())


class _Probe:
    """The hooks of one TE linear for one armed step."""

    def __init__(self, module: nn.Module, name: str, grouped: bool) -> None:
        self.module, self.name, self.grouped = module, name, grouped

    def member(self, i: int) -> Optional[int]:
        return int(getattr(self.module, "member_offset", 0)) + i if self.grouped else None

    def sizes(self, args: Sequence[Any]) -> Optional[list[int]]:
        """The grouped linear's ``m_splits`` (None: a plain linear)."""
        if not self.grouped:
            return None
        m = args[1]
        return m.tolist() if isinstance(m, torch.Tensor) else [int(v) for v in m]

    @staticmethod
    def splits(x2d: torch.Tensor, sizes: Optional[list[int]]) -> list[torch.Tensor]:
        return [x2d] if sizes is None else list(torch.split(x2d, sizes, dim=0))

    def weight(self, i: int) -> torch.Tensor:
        if self.grouped:
            return self.module.member_weight(i)  # type: ignore[operator]
        return self.module.weight  # type: ignore[return-value]

    def forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled() or not args or _in_te_recompute():
            return  # (a recomputed forward was recorded when it first ran)
        x = args[0].detach()
        k = x.shape[-1]
        sizes = self.sizes(args)
        parts = self.splits(x.reshape(-1, k), sizes)
        quantizers = getattr(module, "quantizers", {}) or {}
        fwd, bwd = quantizers.get("scaling_fwd") or [], quantizers.get("scaling_bwd") or []
        if not getattr(module, "fp8", True):  # TE ran this forward unquantized (a bf16 layer)
            fwd, bwd = [], []
        rec = _stats.active()
        if rec is None:
            return
        with torch.no_grad():
            for i, xi in enumerate(parts):
                if xi.shape[0] == 0:
                    continue
                qin = fwd[FWD_PER_GEMM * i] if len(fwd) > FWD_PER_GEMM * i else None
                vec = _vector(_probe_copy(qin)(xi), xi) if qin is not None else _stats.plain_stats(xi)
                rec.add(self.name, "input", self.member(i), vec)
                w = self.weight(i)
                qw = fwd[FWD_PER_GEMM * i + 1] if len(fwd) > FWD_PER_GEMM * i + 1 else None
                if _quantized_weight(w):
                    vec = _vector(w, None)
                elif qw is not None:
                    wd = w.detach().to(x.dtype)  # TE casts the weight to the activation dtype first
                    vec = _vector(_probe_copy(qw)(wd), wd)
                else:
                    vec = _stats.plain_stats(w.detach())
                rec.add(self.name, "weight", self.member(i), vec)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            # the hook keeps only the splits: capturing ``args`` would keep the layer's bf16
            # input alive until backward (and defeat recompute)
            output.register_hook(lambda g: self.backward(g, sizes, bwd))

    def backward(self, g: torch.Tensor, sizes: Optional[list[int]], bwd: list[Any]) -> None:
        rec = _stats.active()
        if rec is None or not rec.open:
            return
        with torch.no_grad():
            for i, gi in enumerate(self.splits(g.detach().reshape(-1, g.shape[-1]), sizes)):
                if gi.shape[0] == 0:
                    continue
                q = bwd[BWD_PER_GEMM * i] if len(bwd) > BWD_PER_GEMM * i else None
                vec = _vector(_probe_copy(q)(gi), gi) if q is not None else _stats.plain_stats(gi)
                rec.add(self.name, "grad", self.member(i), vec)


@contextlib.contextmanager
def probing(model: nn.Module, recorder: _stats.OperandRecorder) -> Iterator[_stats.OperandRecorder]:
    """Collect the statistics of the TE linears' operands run inside into ``recorder``."""
    classes = _te_linear_classes()
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, classes):
            grouped = hasattr(m, "num_gemms")
            handles.append(m.register_forward_hook(_Probe(m, name, grouped).forward))
    try:
        with _stats.recording(recorder):
            yield recorder
    finally:
        for h in handles:
            h.remove()
