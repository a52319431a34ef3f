"""Stand-in ``te.pytorch.GroupedLinear`` (per release: see :class:`GroupedLinear`) and TE 2.19's
grouped-tensor path checks (``is_module_grouped_tensor_path_supported``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lptrain.precision import linear_ops as _ops

from . import recompute as RC
from . import tensors as T
from .modules import (
    _MODEL_INIT,
    _device,
    _emulated,
    _operand,
    _TEModule,
    attach_high_precision_init_val,
)

# TE's ``is_module_grouped_tensor_path_supported`` (2.19): the cuBLASLt minimum per GPU
# generation and which recipes the native grouped-tensor path runs.
_GROUPED_PATH_MIN_CUBLASLT = {"any": 130300, "hopper": 130400}


def cublaslt_version() -> int:
    """The cuBLASLt version TE would read (``tex.get_cublasLt_version()``, e.g. 130300): the
    virtual GPU's CUDA version, else torch's, as cuBLAS ships with the toolkit."""
    from lptrain.testing.virtual_cuda import active

    vc = active()
    text = vc.cuda_version if vc is not None else (torch.version.cuda or "0.0")
    major, minor = (int(x) for x in ([*text.split("."), "0"])[:2])
    return major * 10_000 + minor * 100


def grouped_tensor_path_supported(recipe: Any, dtype: torch.dtype) -> bool:
    """TE 2.19's ``is_module_grouped_tensor_path_supported(recipe, dtype)``."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    if not (9, 0) <= cap <= (11, 0):
        return False
    lt = cublaslt_version()
    if lt < _GROUPED_PATH_MIN_CUBLASLT["any"] or (cap < (10, 0) and lt < _GROUPED_PATH_MIN_CUBLASLT["hopper"]):
        return False
    if recipe is None:
        return True
    kind = type(recipe).__name__
    if kind == "Float8CurrentScaling":
        return cap >= (10, 0) or lt >= 130500
    if kind == "Float8BlockScaling":
        return cap < (10, 0) and lt >= 130600
    if kind == "MXFP8BlockScaling":
        return cap >= (10, 0)
    if kind == "NVFP4BlockScaling":
        return cap >= (10, 0) and not recipe.disable_rht
    return False  # delayed scaling: no grouped quantization kernels


class GroupedLinear(_TEModule):
    """``te.pytorch.GroupedLinear``, per release (see ``lptrain.testing.te_standin.make``).

    A single grouped weight (2.14+) is made by :meth:`make_grouped_weights`, called from the
    constructor as TE's ``reset_parameters`` does: one ``GroupedTensor`` parameter ``weight``,
    the members ``weight<i>`` set to ``None``; delayed scaling (and, before 2.19, current
    scaling) keeps per-member weights. The members' kept init values move to the grouped
    parameter only from 2.19 (before, they are dropped with the members). Its GEMMs run on
    the grouped parameter from 2.19 (which then needs TE's native grouped-tensor path:
    ``use_grouped_tensor=True``, a CUDA ``m_splits``, cuBLASLt 13.3+ -- 13.4+ on Hopper -- a
    recipe that path runs, and MXFP8 groups of a multiple of 128 rows), and on
    ``weight.quantized_tensors`` -- members made with ``requires_grad=False``, whose
    ``main_grad`` TE reads -- from 2.14 to 2.18.
    """

    _env_gated = False  # 2.15+: NVTE_GROUPED_LINEAR_SINGLE_PARAM must be set
    _gemm_on_param = False  # 2.19+: GEMMs on the grouped parameter (native grouped path)

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 init_method: Any = None, params_dtype: Any = None,
                 fuse_wgrad_accumulation: bool = False, device: Any = "cuda",
                 single_grouped_weight: bool = False, name: Optional[str] = None,
                 use_grouped_tensor: Optional[bool] = None) -> None:
        import os
        import warnings

        super().__init__(num_members=num_gemms, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                         name=name, device=device,
                         record={"init_method": init_method, "params_dtype": params_dtype,
                                 "fuse_wgrad_accumulation": fuse_wgrad_accumulation, "name": name})
        if (self._env_gated and single_grouped_weight
                and int(os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "0") or 0) <= 0):
            warnings.warn("NVTE_GROUPED_LINEAR_SINGLE_PARAM is not set; falling back", UserWarning,
                          stacklevel=3)
            single_grouped_weight = False
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        if self._te_version >= (2, 14):
            self.single_grouped_weight = single_grouped_weight
        if self._te_version >= (2, 19):
            self.use_grouped_tensor = bool(use_grouped_tensor or False)
        dtype = params_dtype or torch.float32
        dev = _device(device)
        emu_recipe = _emulated(_MODEL_INIT[-1][0]) if _MODEL_INIT else None
        self._lptrain_model_init_recipe = _MODEL_INIT[-1][0] if _MODEL_INIT else None
        for i in range(num_gemms):
            w = torch.empty(out_features, in_features, dtype=dtype, device=dev)
            if init_method is not None:
                init_method(w)
            else:
                nn.init.zeros_(w)
            if emu_recipe is not None:
                p = self._primary(w, self._state(emu_recipe).members[i].weight)
            else:
                p = nn.Parameter(w)
            self.register_parameter(f"weight{i}", p)
        if single_grouped_weight:
            self.make_grouped_weights()  # (2.14+ only: see ``make``)

    def _make_grouped_weights(self, defer_init: bool = False) -> None:
        """TE's ``make_grouped_weights`` (see the class doc; the public name from 2.13)."""
        if defer_init:
            return
        recipe = self._lptrain_model_init_recipe
        kind = type(recipe).__name__ if recipe is not None else None
        if kind == "DelayedScaling" or (kind == "Float8CurrentScaling" and self._te_version < (2, 19)):
            return
        from lptrain.precision.tensors import GroupedQuantizedTensor

        members = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        if recipe is None:
            grouped = T.GroupedTensor(torch.stack([m.detach() for m in members]).contiguous(), None)
        else:
            grouped = T.GroupedTensor(GroupedQuantizedTensor.from_members([m._emu for m in members]),
                                      members[0]._quantizer)
        param = nn.Parameter(grouped)
        inits = [getattr(m, "_high_precision_init_val", None) for m in members]
        if self._te_version >= (2, 19) and all(v is not None for v in inits):
            attach_high_precision_init_val(param, torch.stack(inits))  # type: ignore[arg-type]
        self.register_parameter("weight", param)
        for i in range(self.num_gemms):
            self.register_parameter(f"weight{i}", None)

    def _gemm_weights(self) -> tuple[list[torch.Tensor], bool]:
        """The GEMM operands and whether they are one grouped operand (see the class doc)."""
        grouped = getattr(self, "weight", None)
        if grouped is None:
            return [_operand(getattr(self, f"weight{i}")) for i in range(self.num_gemms)], False
        if self._gemm_on_param:
            return [_operand(grouped)], True
        return [_operand(m) for m in grouped.quantized_tensors], False

    def forward(self, inp: torch.Tensor, m_splits: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        single = getattr(self, "weight", None) is not None
        grouped_path = getattr(self, "use_grouped_tensor", False)
        if single and self._gemm_on_param and not grouped_path:
            raise RuntimeError("single_grouped_weight and single_grouped_bias require use_grouped_tensor=True")
        if grouped_path:
            self._check_grouped_tensor_path(single, m_splits, inp.dtype)
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        self._lptrain_last_m_splits = m_splits
        weights, one = self._gemm_weights()
        with self._forward_phase() as st:
            y = _ops.quantized_grouped_linear(
                inp, splits, weights, st, single=one, out_features=self.out_features,
                fuse_wgrad=self.fuse_wgrad_accumulation,
            ).to(inp.dtype)
        return y

    def _check_grouped_tensor_path(self, single: bool, m_splits: Any, dtype: torch.dtype) -> None:
        """TE 2.19's checks on the native grouped-tensor path (``use_grouped_tensor=True``),
        with the activation dtype as TE passes it. Off a (virtual) GPU -- the version tests
        build modules on the CPU -- there is no device to check, and only the ``m_splits``
        type is."""
        if not torch.cuda.is_available():
            if not isinstance(m_splits, torch.Tensor):
                raise ValueError("The native grouped_tensor path requires CUDA m_splits. Pass a "
                                 "CUDA int64 tensor, or set use_grouped_tensor=False.")
            return
        te_recipe = RC.FP8GlobalStateManager.get_fp8_recipe() if RC.FP8GlobalStateManager.is_fp8_enabled() else None
        supported = grouped_tensor_path_supported(te_recipe, dtype)
        if single and not supported:
            raise RuntimeError(
                "Single grouped parameters require the native grouped-tensor path, but the active "
                "device, cuBLASLt version, quantization recipe, or GroupedLinear feature "
                "configuration does not support it. Disable single_grouped_weight and "
                "single_grouped_bias to allow the split-quantize fallback.")
        if not supported:
            return
        if not isinstance(m_splits, torch.Tensor):
            raise ValueError("The native grouped_tensor path requires CUDA m_splits. Pass a CUDA "
                             "int64 tensor, or set use_grouped_tensor=False.")
        if type(te_recipe).__name__ == "MXFP8BlockScaling" and any(int(m) % 128 for m in m_splits.tolist()):
            raise RuntimeError("First dimension of each tensor in a group must be divisible by 128.")
