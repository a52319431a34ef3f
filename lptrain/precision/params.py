"""Backend-independent facts about model parameters that the trainer and buffers need.

Why here: a parameter may be a plain tensor, an lptrain ``QuantizedTensor`` (emulated
backend) or a Transformer Engine quantized tensor (TE backend). Code outside
``lptrain.precision`` must not tell them apart by type or format name, so the two questions
it asks -- "what do the fp32 masters start from?" and "which weights take their gradient
through ``main_grad``?" -- are answered here, through each backend's own interface.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

_WEIGHT_NAME = re.compile(r"weight\d*")


def master_weight_init(p: torch.Tensor) -> torch.Tensor:
    """The fp32 values an fp32 master copy of model parameter ``p`` starts from (on ``p``'s
    device), and the model-side init copy is freed.

    A quantized primary weight starts from its high-precision init value, not from its
    dequantized bytes, so training starts from the true init: lptrain's
    ``high_precision_init_value()``, or TE's ``get_high_precision_init_val()`` (a CPU copy
    kept by ``quantized_model_init(..., preserve_high_precision_init_val=True)``); without
    one, its dequantized value. A plain tensor is copied. The data-parallel engine asks the
    same questions (:mod:`lptrain.precision.param_storage`).
    """
    from lptrain.precision.param_storage import high_precision_value, release_high_precision_init

    value = high_precision_value(p).to(device=p.device, dtype=torch.float32).clone()
    release_high_precision_init(p)
    return value


def fused_wgrad_weights(model: nn.Module) -> Iterator[nn.Parameter]:
    """The GEMM weights whose gradient a layer accumulates into ``param.main_grad``.

    Those are the ``weight`` / ``weight<i>`` parameters of every module built with
    ``fuse_wgrad_accumulation=True`` -- lptrain's emulated ``Linear``/``GroupedLinear`` and
    TE's ``Linear``/``GroupedLinear``/``LayerNormLinear`` alike (norm weights and biases
    take ordinary gradients). Each parameter is yielded once.
    """
    yield from _fused_weights(model, hook_free_only=False)


def hook_free_wgrad_weights(model: nn.Module) -> Iterator[nn.Parameter]:
    """The :func:`fused_wgrad_weights` of layers whose backward hands autograd no weight
    grad at all once the grad is in ``main_grad`` (lptrain's emulated layers, which declare
    ``hands_autograd_no_fused_wgrad``; TE's hand it a dummy tensor, which a hook must drop as
    soon as it lands). Only these can go without a per-parameter grad hook: autograd never
    gives them a ``.grad`` to move (:class:`lptrain.distributed.ddp.DataParallel`)."""
    yield from _fused_weights(model, hook_free_only=True)


def _fused_weights(model: nn.Module, *, hook_free_only: bool) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for m in model.modules():
        if not getattr(m, "fuse_wgrad_accumulation", False):
            continue
        if hook_free_only and not getattr(m, "hands_autograd_no_fused_wgrad", False):
            continue
        for name, p in m.named_parameters(recurse=False):
            if _WEIGHT_NAME.fullmatch(name) and id(p) not in seen:
                seen.add(id(p))
                yield p


def attach_main_grads(model: nn.Module) -> int:
    """Give every fused-wgrad weight without one an fp32 zero ``main_grad``; returns how many.

    Why: TE's fused wgrad reads ``weight.main_grad`` unconditionally, so a model built
    outside the trainer must carry one. It is a plain attribute (a zero tensor of the
    weight's logical shape on its device), so the data-parallel engine later simply assigns
    ``param.main_grad = <view into its grad buffer>``; existing ones are left untouched.
    Each such weight also gets ``grad_added_to_main_grad = False``: TE sets the flag to True
    after a fused wgrad only when the attribute exists (Megatron's DDP contract), so the
    gradient hook can tell fused gradients from ordinary ones on both backends.
    """
    n = 0
    for p in fused_wgrad_weights(model):
        if getattr(p, "main_grad", None) is None:
            p.main_grad = torch.zeros(tuple(p.shape), dtype=torch.float32, device=p.device)
            n += 1
        if not hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = False
    return n
