"""``quantize`` / ``dequantize`` / ``create_empty_quantized_tensor`` with the C++ semantics.

TE's C++ ``quantize(tensor, quantizer, output=None, noop=None)`` reads the Python quantizer's
attributes, either creates the output (``create_tensor``: the Python class of the quantizer's
kind -- the ``*Storage`` / ``*Base`` class when ``quantizer.internal``, the tensor class
otherwise -- constructed with keyword arguments) or refills the given one in place
(``convert_and_update_tensor``: its buffers kept, missing ones allocated, unused ones
dropped), and runs the cast kernel. Here the kernel is lptrain's bit-exact emulation
(:mod:`lptrain.precision.tensors`); the layouts are TE's (:mod:`.layouts`).

The parts that bite, reproduced:

* delayed scaling (``Float8Quantizer``): the cast quantizes with ``quantizer.scale`` and does
  an atomic max of the input's amax into ``quantizer.amax`` -- a view of the module's
  ``amax_history[0]`` -- whatever the autograd mode (evaluation under ``no_grad`` included);
  ``scale_inv`` is ``1 / scale``;
* current scaling: the amax (MAX all-reduced over ``amax_reduction_group`` when
  ``with_amax_reduction``) and the scale are written into the quantizer's ``amax`` / ``scale``;
* an ``internal`` quantizer returns a storage object (no ``torch.Tensor``, no ``.shape``
  before 2.19), a non-internal one a ``QuantizedTensor``;
* per-tensor FP8 keeps a byte transpose for column-wise use unless the GPU runs non-TN FP8
  GEMMs (compute capability 10.x), where the row-wise bytes serve both.

The keyword arguments are the ones TE's C++ passes at the release: the union over releases
(:data:`_KWARGS`), filtered by the names the release's Python constructor takes (its
``__new__`` chain) -- the two sides ship together, so the constructor's parameters are the
C++ call's keywords.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import torch

from lptrain.precision import formats as F

from . import layouts as L


def _kind(quantizer: Any) -> str:
    for cls in type(quantizer).__mro__:
        if cls.__name__ in L.KINDS:
            return cls.__name__
    raise L.not_emulated(f"quantize with {type(quantizer).__name__}")


def _accepted(cls: type) -> Optional[set[str]]:
    """Keyword names ``cls(...)`` takes through its ``__new__``/``__init__`` chain, or None
    when some ``__new__`` forwards ``**kwargs`` to torch (then the wrapper's own names)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        for meth in ("__new__", "__init__"):
            fn = klass.__dict__.get(meth)
            if fn is None or not callable(getattr(fn, "__func__", fn)):
                continue
            try:
                params = inspect.signature(getattr(fn, "__func__", fn)).parameters
            except (TypeError, ValueError):
                continue
            names |= {p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)}
    return names


def _construct(cls: type, kwargs: dict[str, Any]) -> Any:
    allowed = _accepted(cls)
    return cls(**{k: v for k, v in kwargs.items() if allowed is None or k in allowed})


def _noop(noop: Optional[torch.Tensor]) -> bool:
    """TE's kernels skip their work when the no-op flag holds 1 (read on the device)."""
    return noop is not None and noop.numel() > 0 and bool(noop.reshape(-1)[0].item() == 1)


def quantize(tensor: torch.Tensor, quantizer: Any, output: Any = None, noop: Optional[torch.Tensor] = None) -> Any:
    """``tex.quantize``."""
    kind = _kind(quantizer)
    if output is not None and _noop(noop):
        return output
    x = tensor.detach()
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise L.not_emulated(f"quantize of a {x.dtype} input")
    shape = tuple(x.shape)
    fields = L.compute(kind, quantizer, x.reshape(-1, shape[-1]) if x.dim() else x.reshape(1, 1), shape)
    if output is None:
        return _create(kind, quantizer, shape, x.dtype, x.device, fields)
    L.fill(kind, output, fields, shape)
    return output


def _create(kind: str, quantizer: Any, shape: tuple[int, ...], dtype: torch.dtype, device: Any,
            fields: dict[str, Any]) -> Any:
    cls = L.python_class(kind, bool(getattr(quantizer, "internal", False)))
    stride = [int(math.prod(shape[i + 1:])) for i in range(len(shape))]
    kwargs = {"shape": list(shape), "stride": stride, "dtype": dtype, "fake_dtype": dtype,
              "device": device, "quantizer": quantizer, "requires_grad": False, **fields}
    return _construct(cls, kwargs)


def create_empty_quantized_tensor(quantizer: Any, shape: Any, dtype: torch.dtype, device: Any = None,
                                  pin_memory: bool = False) -> Any:
    """``tex.create_empty_quantized_tensor`` (and ``quantizer.make_empty``'s C++ side)."""
    kind = _kind(quantizer)
    shape = tuple(int(s) for s in shape)
    dev = torch.device("cuda") if device is None else device
    fields = L.empty(kind, quantizer, shape, dev)
    return _create(kind, quantizer, shape, dtype, dev, fields)


def dequantize(input: Any, otype: Any) -> torch.Tensor:
    """``tex.dequantize``: the row-wise data if present, else the column-wise."""
    dtype = L.torch_dtype(otype)
    return L.dequantize(input, prefer_rowwise=True).to(dtype)


def bgrad_quantize(input: torch.Tensor, quantizer: Any) -> list[Any]:
    """``tex.bgrad_quantize``: the bias gradient (column sums, fp32 accumulation, in the
    input's dtype) and the quantized input (or the input itself with no quantizer)."""
    x = input.detach()
    grad_bias = x.reshape(-1, x.shape[-1]).float().sum(0).to(x.dtype)
    return [grad_bias, x if quantizer is None else quantize(x, quantizer)]


def split_quantize(tensor: torch.Tensor, split_sections: Any, quantizer_list: Any,
                   disable_bulk_allocation: bool = False) -> list[Any]:
    """``tex.split_quantize``: the rows split by ``split_sections``, each part quantized by
    its own quantizer (a grouped linear's discrete experts); an empty part still gets its
    (empty) quantized tensor."""
    parts = torch.split(tensor.detach(), [int(s) for s in split_sections], dim=0)
    return [quantize(part, q) for part, q in zip(parts, quantizer_list, strict=True)]


def functions() -> dict[str, Any]:
    return {"quantize": quantize, "dequantize": dequantize, "bgrad_quantize": bgrad_quantize,
            "split_quantize": split_quantize,
            "create_empty_quantized_tensor": create_empty_quantized_tensor}


__all__ = ["F", "functions"]
