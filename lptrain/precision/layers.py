"""The precision-aware layer factory: the only way model code creates a GEMM layer.

Model code calls ``factory.linear(...)`` / ``factory.grouped_linear(...)`` and wraps each
transformer layer's forward in ``factory.layer_context(layer_number)``. It never imports a
backend and never branches on the format: which recipe runs (bf16, an FP8 recipe, NVFP4)
and on which backend (emulated or Transformer Engine) is decided here from the
``PrecisionConfig``.

This module holds the high-precision path (plain fp32 GEMMs with optional
gradient-accumulation fusion into ``main_grad``); quantized execution plugs in through
``lptrain.precision.linear_ops`` and the TE adapter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float) -> InitMethod:
    """Normal(0, std) initialisation, in place."""

    def init(t: torch.Tensor) -> None:
        nn.init.normal_(t, mean=0.0, std=std)

    return init


class _HighPrecisionLinearFn(torch.autograd.Function):
    """y = x W^T in fp32; wgrad optionally accumulated straight into ``weight.main_grad``.

    When the weight carries a ``main_grad`` buffer and fusion is on, the weight gradient is
    added into it and ``weight.grad_added_to_main_grad`` is set, so the data-parallel hook
    does not add it a second time (the Megatron gradient-accumulation-fusion contract).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fuse_wgrad: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.fuse_wgrad = fuse_wgrad
        out = x.float() @ weight.float().t()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dyf = dy.float().reshape(-1, dy.shape[-1])
        dx = (dyf @ weight.float()).reshape(*dy.shape[:-1], weight.shape[1]).to(x.dtype)
        dw = dyf.t() @ x.float().reshape(-1, x.shape[-1])
        return dx, accumulate_wgrad(weight, dw, ctx.fuse_wgrad), None


def accumulate_wgrad(weight: torch.Tensor, dw: torch.Tensor, fuse: bool) -> Optional[torch.Tensor]:
    """Return ``dw`` as the autograd grad, or add it into ``weight.main_grad`` (fusion).

    With fusion, autograd still needs a gradient of the weight's shape; a zero tensor is
    returned the way TE does (``grad_added_to_main_grad`` tells the DDP hook to skip it).
    """
    main_grad = getattr(weight, "main_grad", None)
    if fuse and main_grad is not None:
        main_grad.add_(dw.view_as(main_grad).to(main_grad.dtype))
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return dw.to(weight.dtype)


class Linear(nn.Module):
    """A bias-free (optionally biased) linear layer whose GEMM precision is chosen by the factory."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        params_dtype: torch.dtype = torch.float32,
        init_method: Optional[InitMethod] = None,
        fuse_wgrad_accumulation: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.name = name
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype)) if bias else None
        (init_method or normal_init(1.0 / math.sqrt(in_features)))(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _HighPrecisionLinearFn.apply(x, self.weight, self.fuse_wgrad_accumulation)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


class GroupedLinear(nn.Module):
    """``num_gemms`` linears applied to consecutive token splits (MoE experts).

    ``single_grouped_weight=True`` stores all members in one parameter ``weight`` of shape
    ``[num_gemms, out, in]`` (contiguous, per-member views via ``member_weight(i)``);
    otherwise members are discrete parameters ``weight0 .. weight{N-1}``. Both layouts give
    bitwise identical results for the same values.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        single_grouped_weight: bool = False,
        params_dtype: torch.dtype = torch.float32,
        init_method: Optional[InitMethod] = None,
        fuse_wgrad_accumulation: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.single_grouped_weight = single_grouped_weight
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.name = name
        init = init_method or normal_init(1.0 / math.sqrt(in_features))
        if single_grouped_weight:
            self.weight = nn.Parameter(
                torch.empty(num_gemms, out_features, in_features, dtype=params_dtype)
            )
            for i in range(num_gemms):
                init(self.weight.data[i])
        else:
            for i in range(num_gemms):
                w = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
                init(w.data)
                self.register_parameter(f"weight{i}", w)

    def member_weight(self, i: int) -> torch.Tensor:
        """Expert ``i``'s weight ``[out, in]`` (a view into the grouped parameter if single)."""
        return self.weight[i] if self.single_grouped_weight else getattr(self, f"weight{i}")

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        assert len(m_splits) == self.num_gemms, (len(m_splits), self.num_gemms)
        outs = []
        for i, xi in enumerate(torch.split(x, list(m_splits), dim=0)):
            outs.append(_HighPrecisionLinearFn.apply(xi, self.member_weight(i), False))
        return torch.cat(outs, dim=0) if outs else x.new_zeros(0, self.out_features)


@dataclass
class LayerFactory:
    """Builds GEMM layers for one run; created from the precision config by ``build_factory``."""

    params_dtype: torch.dtype = torch.float32
    fuse_wgrad_accumulation: bool = False

    def linear(self, in_features: int, out_features: int, **kw) -> nn.Module:
        kw.setdefault("params_dtype", self.params_dtype)
        kw.setdefault("fuse_wgrad_accumulation", self.fuse_wgrad_accumulation)
        return Linear(in_features, out_features, **kw)

    def grouped_linear(self, num_gemms: int, in_features: int, out_features: int, **kw) -> nn.Module:
        kw.setdefault("params_dtype", self.params_dtype)
        kw.setdefault("fuse_wgrad_accumulation", self.fuse_wgrad_accumulation)
        return GroupedLinear(num_gemms, in_features, out_features, **kw)

    @contextlib.contextmanager
    def layer_context(self, layer_number: int) -> Iterator[None]:
        """Context around transformer layer ``layer_number``'s forward (bf16 layers opt out)."""
        yield

    @contextlib.contextmanager
    def model_init(self) -> Iterator[None]:
        """Context around model construction (quantized primary weights are created here)."""
        yield
