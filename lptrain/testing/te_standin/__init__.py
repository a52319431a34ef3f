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

Per release (as ``tests/data/te_api.json`` records TE's tagged sources 2.2-2.19, which the
tests hold the stand-in to: no public member TE lacks at the release, and each switch below
where TE's source switches): the recipe classes (:mod:`.recipe`); ``Linear(name=...)`` 2.3+;
``GroupedLinear(name=...)`` 2.11+; ``GroupedLinear(single_grouped_weight=...)`` 2.14+,
honoured from 2.15 only with ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` > 0 at construction, its
GEMMs on the grouped weight's members (no weight gradient) up to 2.18 and on the grouped
parameter from 2.19, only with ``use_grouped_tensor=True`` and TE's grouped-tensor path checks
(cuBLASLt, GPU, recipe, 128-row MXFP8 groups, CUDA ``m_splits``); the members' kept init
values moved to the grouped parameter from 2.19 (dropped before); ``autocast`` /
``quantized_model_init`` 2.9+ (``fp8_*`` spellings always); ``Float8BlockwiseQTensor``
refusing inner-dimension reshapes up to 2.13; ``replace_raw_data`` /
``cast_master_weights_to_fp8`` as in :mod:`.utils` (blockwise 2.4+);
``post_all_gather_processing`` 2.10+, ``quantize_master_weights`` 2.14+; ``GroupedTensor``
2.14+; quantized tensors traceable (``__tensor_flatten__``) from 2.19; ``checkpoint`` (no
early stop) and the delayed-scaling recompute phase, whose restore runs in a ``finally``
only from 2.12 (:mod:`.recompute`); extra state pickling the recipe of every FP8 module.

Used by the tests and by ``lptrain pretrain --dry-run`` on a GPU target where TE is not
installed; never imported by ``import lptrain``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

from . import grouped as G
from . import modules as M
from . import recipe as R
from . import recompute as RC
from . import tensors as T
from . import utils as U

VERSIONS = ("2.2", "2.3", "2.7", "2.8", "2.9", "2.11", "2.12", "2.13", "2.14", "2.15", "2.18", "2.19")
LATEST = VERSIONS[-1]

_TENSOR_MODULES = {
    "float8_tensor": ("Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer"),
    "mxfp8_tensor": ("MXFP8Tensor", "MXFP8Quantizer"),
    "float8_blockwise_tensor": ("Float8BlockwiseQTensor", "Float8BlockQuantizer"),
    "nvfp4_tensor": ("NVFP4Tensor", "NVFP4Quantizer"),
    "grouped_tensor": ("GroupedTensor",),
}
# First release of each module (TE's tags; tests/data/te_api.json holds them to TE's source).
_FIRST = {"float8_blockwise_tensor": (2, 3), "nvfp4_tensor": (2, 8), "grouped_tensor": (2, 14)}
TRACEABLE_FROM = (2, 19)  # quantized tensors define __tensor_flatten__ (traceable wrapper subclasses)


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def _restrict_init(cls: type, v: tuple[int, ...], since: dict[str, tuple[int, ...]],
                   attrs: dict[str, Any]) -> type:
    """A per-release subclass of stand-in module ``cls`` whose constructor takes only the
    keywords that release's TE takes (``since``: keyword -> first release), as
    ``inspect.signature`` shows and as a call checks."""
    sig = inspect.signature(cls.__init__)
    params = [p for p in sig.parameters.values() if v >= since.get(p.name, (0,))]
    allowed = {p.name for p in params}

    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        bad = sorted(set(kw) - allowed)
        if bad:
            raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {bad[0]!r}")
        cls.__init__(self, *args, **kw)

    __init__.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return type(cls.__name__, (cls,), {"__init__": __init__, "_te_version": v, **attrs})


def _linear_cls(v: tuple[int, ...]) -> type:
    return _restrict_init(M.Linear, v, {"name": (2, 3)}, {})


def _grouped_cls(v: tuple[int, ...]) -> type:
    since = {"name": (2, 11), "single_grouped_weight": (2, 14), "use_grouped_tensor": (2, 19)}
    attrs: dict[str, Any] = {"_env_gated": v >= (2, 15), "_gemm_on_param": v >= (2, 19)}
    if v >= (2, 13):
        attrs["make_grouped_weights"] = G.GroupedLinear._make_grouped_weights
    return _restrict_init(G.GroupedLinear, v, since, attrs)


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
            if v >= (2, 9):  # TE's tensor package re-exports its classes from 2.9
                setattr(tensor, n, cls)
        setattr(tensor, short, mod)
        mods[mod.__name__] = mod
    utils = _module("transformer_engine.pytorch.tensor.utils")
    utils.replace_raw_data = U.make_replace_raw_data(v)
    utils.cast_master_weights_to_fp8 = U.make_cast(v)
    if v >= (2, 10):
        utils.post_all_gather_processing = U.post_all_gather_processing
    if v >= (2, 14):
        utils.quantize_master_weights = U.make_cast(v, name="quantize_master_weights")
    tensor.utils, tensor.QuantizedTensor, tensor.Quantizer = utils, T.QuantizedTensor, T.Quantizer
    mods[utils.__name__] = utils
    calls: list[tuple[str, dict[str, Any]]] = []
    pt.Linear, pt.GroupedLinear, pt._lptrain_calls = _linear_cls(v), _grouped_cls(v), calls
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
    for cls in (M.Linear, G.GroupedLinear):
        cls.__module__ = "transformer_engine.pytorch"
    pt.tensor, te.common, te.pytorch = tensor, common, pt
    te._lptrain_version = v
    return mods


@contextlib.contextmanager
def installed(version: str = LATEST) -> Iterator[dict[str, types.ModuleType]]:
    """Make the stand-in TE ``version`` importable for the duration of the block."""
    from lptrain.precision import te_adapter

    mods = make(version)
    # Hide every other TE module too (TE's own Python imported earlier in this process): a
    # leftover ``transformer_engine.pytorch.optimizers`` would be found beside the stand-in.
    others = [k for k in sys.modules if k.split(".")[0] == "transformer_engine" and k not in mods]
    saved = {k: sys.modules.get(k) for k in [*mods, *others]}
    for k in others:
        del sys.modules[k]
    saved_refuse = T.Float8BlockwiseQTensor._refuses_inner_reshape
    T.Float8BlockwiseQTensor._refuses_inner_reshape = _v(version) < (2, 14)
    T.set_traceable(_v(version) >= TRACEABLE_FROM)
    sys.modules.update(mods)
    te_adapter.forget_te_classes()
    try:
        yield mods
    finally:
        te_adapter.forget_te_classes()
        T.Float8BlockwiseQTensor._refuses_inner_reshape = saved_refuse
        T.set_traceable(False)
        M._EMULATED.clear()
        for k, old in saved.items():
            if old is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = old


__all__ = ["LATEST", "VERSIONS", "installed", "make"]
