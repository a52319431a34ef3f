"""A stand-in ``transformer_engine`` package of a chosen release, for CPUs.

It reproduces, per release, the part of TE's Python surface that lptrain touches, and it
*computes*: its modules run their GEMMs through lptrain's emulated quantized ops (bit-faithful
to TE's formats), so whole training steps run on the TE backend of lptrain on a CPU -- on the
virtual GPU of :mod:`lptrain.testing.virtual_cuda` when the code under test needs CUDA.
Where lptrain depends on TE's behaviour, the stand-in behaves like TE, including the parts
that bite (see :mod:`.tensors`, :mod:`.modules`, :mod:`.utils`): wrapper-subclass tensors
with ``data_ptr() == 0``, ``.data`` assignment that requantizes into new storage, reshapes
refused per class, ``GroupedTensor`` refusing ``select``, high-precision init values kept on
the CPU, scaling state only in ``_extra_state``, stochastic rounding on the CUDA generator.

Per release (read from TE's tagged sources 2.2-2.19): the recipe classes (:mod:`.recipe`);
``Linear(name=...)`` 2.3+; ``GroupedLinear(single_grouped_weight=...)`` 2.14+, honoured from
2.15 only with ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` > 0 at construction and from 2.19 only
with ``use_grouped_tensor=True`` (whose native path rejects host ``m_splits``);
``autocast`` / ``quantized_model_init`` 2.9+ (``fp8_*`` spellings always);
``Float8BlockwiseQTensor`` refusing inner-dimension reshapes up to 2.13;
``replace_raw_data`` / ``cast_master_weights_to_fp8`` as in :mod:`.utils`;
``post_all_gather_processing`` 2.13+, ``quantize_master_weights`` 2.14+; ``GroupedTensor``
2.18+; ``checkpoint`` and the delayed-scaling recompute phase (all, :mod:`.recompute`).

Used by the tests and by ``lptrain pretrain --dry-run`` on a GPU target where TE is not
installed; never imported by ``import lptrain``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any, Optional

from . import modules as M
from . import recipe as R
from . import recompute as RC
from . import tensors as T
from . import utils as U

VERSIONS = ("2.2", "2.3", "2.7", "2.8", "2.9", "2.13", "2.14", "2.15", "2.18", "2.19")
LATEST = VERSIONS[-1]

_TENSOR_MODULES = {
    "float8_tensor": ("Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer"),
    "mxfp8_tensor": ("MXFP8Tensor", "MXFP8Quantizer"),
    "float8_blockwise_tensor": ("Float8BlockwiseQTensor", "Float8BlockQuantizer"),
    "nvfp4_tensor": ("NVFP4Tensor", "NVFP4Quantizer"),
    "grouped_tensor": ("GroupedTensor",),
}
_FIRST = {"float8_blockwise_tensor": (2, 3), "nvfp4_tensor": (2, 8), "grouped_tensor": (2, 18)}


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def _linear_cls(v: tuple[int, ...]) -> type:
    if v >= (2, 3):
        return M.Linear

    class Linear(M.Linear):  # ``name`` arrived in 2.3
        def __init__(self, in_features: int, out_features: int, bias: bool = True,
                     init_method: Any = None, params_dtype: Any = None,
                     fuse_wgrad_accumulation: bool = False, device: Any = "cuda",
                     **tensor_parallel: Any) -> None:  # (TE's tp_group, tp_size, ... : every release)
            super().__init__(in_features, out_features, bias, init_method, params_dtype,
                             fuse_wgrad_accumulation, device, **tensor_parallel)

    return Linear


def _grouped_cls(v: tuple[int, ...]) -> type:
    gated = {"single_param_env_gated": v >= (2, 15), "needs_grouped_tensor": v >= (2, 19)}
    if v >= (2, 19):
        return type("GroupedLinear", (M.GroupedLinear,), gated)
    if v >= (2, 14):

        class GroupedLinear(M.GroupedLinear):
            def __init__(self, num_gemms: int, in_features: int, out_features: int,
                         bias: bool = True, init_method: Any = None, params_dtype: Any = None,
                         fuse_wgrad_accumulation: bool = False, device: Any = "cuda",
                         single_grouped_weight: bool = False, name: Optional[str] = None) -> None:
                super().__init__(num_gemms, in_features, out_features, bias, init_method,
                                 params_dtype, fuse_wgrad_accumulation, device,
                                 single_grouped_weight, name)
    else:

        class GroupedLinear(M.GroupedLinear):  # type: ignore[no-redef]
            def __init__(self, num_gemms: int, in_features: int, out_features: int,
                         bias: bool = True, init_method: Any = None, params_dtype: Any = None,
                         fuse_wgrad_accumulation: bool = False, device: Any = "cuda") -> None:
                super().__init__(num_gemms, in_features, out_features, bias, init_method,
                                 params_dtype, fuse_wgrad_accumulation, device)

    for k, val in gated.items():
        setattr(GroupedLinear, k, val)
    return GroupedLinear


def make(version: str) -> dict[str, types.ModuleType]:
    """The ``sys.modules`` entries of a stand-in TE ``version``."""
    v = _v(version)
    te = _module("transformer_engine")
    te.__version__ = f"{version}.0"
    common = _module("transformer_engine.common")
    common.recipe = R.make(v)
    common.recipe.__spec__ = importlib.machinery.ModuleSpec(common.recipe.__name__, None)
    pt = _module("transformer_engine.pytorch")
    tensor = _module("transformer_engine.pytorch.tensor")
    mods = {"transformer_engine": te, "transformer_engine.common": common,
            "transformer_engine.common.recipe": common.recipe, "transformer_engine.pytorch": pt,
            "transformer_engine.pytorch.tensor": tensor}
    for short, names in _TENSOR_MODULES.items():
        if v < _FIRST.get(short, (0,)):
            continue
        mod = _module(f"transformer_engine.pytorch.tensor.{short}")
        for n in names:
            cls = getattr(T, n)
            cls.__module__ = mod.__name__
            setattr(mod, n, cls)
            setattr(tensor, n, cls)
        setattr(tensor, short, mod)
        mods[mod.__name__] = mod
    utils = _module("transformer_engine.pytorch.tensor.utils")
    utils.replace_raw_data = U.make_replace_raw_data(v)
    utils.cast_master_weights_to_fp8 = U.make_cast(v)
    if v >= (2, 13):
        utils.post_all_gather_processing = U.post_all_gather_processing
    if v >= (2, 14):
        utils.quantize_master_weights = utils.cast_master_weights_to_fp8
    tensor.utils, tensor.QuantizedTensor, tensor.Quantizer = utils, T.QuantizedTensor, T.Quantizer
    mods[utils.__name__] = utils
    calls: list[tuple[str, dict[str, Any]]] = []
    pt.Linear, pt.GroupedLinear, pt.calls = _linear_cls(v), _grouped_cls(v), calls
    for name, fn in M.contexts(calls, new_api=v >= (2, 9)).items():
        setattr(pt, name, fn)
    RC.FP8GlobalStateManager.reset()
    distributed = _module("transformer_engine.pytorch.distributed")
    for name in ("FP8GlobalStateManager", "activation_recompute_forward", "get_activation_recompute_contexts",
                 "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase"):
        setattr(distributed, name, getattr(RC, name))
    distributed.checkpoint = RC.make_checkpoint(
        (lambda enabled, recipe: pt.fp8_autocast(enabled=enabled, fp8_recipe=recipe)) if v < (2, 9)
        else (lambda enabled, recipe: pt.autocast(enabled=enabled, recipe=recipe)))
    # the manager's home: transformer_engine.pytorch.fp8, .quantization from 2.9 (fp8 kept)
    managers = [_module("transformer_engine.pytorch.fp8")]
    if v >= (2, 9):
        managers.append(_module("transformer_engine.pytorch.quantization"))
    for mod in managers:
        mod.FP8GlobalStateManager = RC.FP8GlobalStateManager
        mods[mod.__name__] = mod
    pt.checkpoint, pt.distributed = distributed.checkpoint, distributed
    mods[distributed.__name__] = distributed
    for cls in (M.Linear, M.GroupedLinear):
        cls.__module__ = "transformer_engine.pytorch"
    pt.tensor, te.common, te.pytorch = tensor, common, pt
    te.fake_version = v
    return mods


@contextlib.contextmanager
def installed(version: str = LATEST) -> Iterator[dict[str, types.ModuleType]]:
    """Make the stand-in TE ``version`` importable for the duration of the block."""
    from lptrain.precision import te_adapter

    mods = make(version)
    saved = {k: sys.modules.get(k) for k in mods}
    saved_refuse = T.Float8BlockwiseQTensor.refuses_inner_reshape
    T.Float8BlockwiseQTensor.refuses_inner_reshape = _v(version) < (2, 14)
    sys.modules.update(mods)
    te_adapter.forget_te_classes()
    try:
        yield mods
    finally:
        te_adapter.forget_te_classes()
        T.Float8BlockwiseQTensor.refuses_inner_reshape = saved_refuse
        M._EMULATED.clear()
        for k, old in saved.items():
            if old is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = old


__all__ = ["LATEST", "VERSIONS", "installed", "make"]
