"""Transformer Engine backend: TE modules, TE recipe objects and TE contexts from lptrain config.

Everything here imports ``transformer_engine`` lazily, inside functions, so ``import lptrain``
and every emulated path work on machines without TE or CUDA. The factory calls
:func:`resolve_backend` once, with ``te`` or ``emulated`` (``auto`` is decided by
``lptrain.config.derive``, see ``lptrain.precision.factory``); only when it answers ``"te"``
does any other function here run.

Recipe construction follows docs/numerics.md 2.3: some TE recipes declare their ``QParams``
(``fp8_quant_fwd_inp`` / ``_fwd_weight`` / ``_bwd_grad``) as un-annotated class attributes,
so constructor arguments do not set them; ``amax_epsilon`` (and the blockwise pow2 choice)
is applied by assigning the attributes after construction.

Which TE class a recipe uses, the fields it takes and the minimum TE releases are the recipe
catalog's (``lptrain.catalog.recipes``), which the config rules read too. Version differences
handled here (TE 2.2 to 2.19, as ``tests/data/te_api.json`` records them from TE's source):
``Float8CurrentScaling.use_power_2_scales`` only exists from 2.8 (earlier releases keep the
choice in the QParams); ``NVFP4BlockScaling`` from 2.8; ``GroupedLinear(single_grouped_weight=
True)`` from 2.14, honoured from 2.15 only with ``NVTE_GROUPED_LINEAR_SINGLE_PARAM=1`` at
construction and from 2.19 only with ``use_grouped_tensor=True`` (whose native path takes
``m_splits`` as a CUDA int64 tensor; lptrain requires 2.19 for it:
``lptrain.catalog.recipes.SINGLE_GROUPED_WEIGHT_MIN_TE``); ``te.pytorch.autocast`` /
``quantized_model_init`` from 2.9 (``fp8_*`` spellings before). Every TE member called here
is declared in :mod:`lptrain.precision.te_api`, with the releases it is needed on.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, TypedDict

import torch
from torch import nn
from typing_extensions import Unpack

from lptrain.catalog.recipes import SINGLE_GROUPED_WEIGHT_MIN_TE, RecipeSpec
from lptrain.config.schema import BACKENDS, one_of
from lptrain.errors import DeviceError

INSTALL_HINT = (
    "install Transformer Engine on a CUDA machine with `pip install 'lptrain[te]'` "
    "(or `pip install --no-build-isolation transformer_engine[pytorch]`), or set "
    "precision.backend=emulated (or auto) to run the bit-faithful CPU emulation"
)
SINGLE_PARAM_ENV = "NVTE_GROUPED_LINEAR_SINGLE_PARAM"


class BackendUnavailableError(DeviceError):
    """``precision.backend=te`` was requested where TE, CUDA or a TE feature is missing."""


def te_importable() -> bool:
    """Whether ``transformer_engine.pytorch`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def te_available() -> bool:
    """CUDA present and ``transformer_engine.pytorch`` importable."""
    if not torch.cuda.is_available() or not te_importable():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def te_version() -> Optional[tuple[int, ...]]:
    """The imported TE's version as a tuple ((2, 19, 0)), or None when TE is not importable."""
    from lptrain.config.world import installed_te_version, parse_version

    try:
        import transformer_engine

        text = getattr(transformer_engine, "__version__", None) or installed_te_version()
    except Exception:
        return None
    return parse_version(text) if text else None


def resolve_backend(backend: str) -> str:
    """Check that ``backend`` (``te`` or ``emulated``) can run here and return it.

    ``te`` without CUDA or TE raises :class:`BackendUnavailableError` naming the setting and
    the install hint. ``auto`` is not decided here: ``lptrain.config.derive`` resolves it (and
    ``lptrain.precision.factory.runtime_backend`` for a config that skipped ``derive``).
    """
    if backend == "emulated":
        return "emulated"
    if backend == "te":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "precision.backend=te needs a CUDA device, but torch.cuda.is_available() is "
                f"False; {INSTALL_HINT}"
            )
        if not te_available():
            raise BackendUnavailableError(
                "precision.backend=te needs Transformer Engine, but transformer_engine.pytorch "
                f"cannot be imported; {INSTALL_HINT}"
            )
        return "te"
    if backend == "auto":
        raise ValueError("precision.backend=auto is resolved by lptrain.config.derive (or "
                         "lptrain.precision.factory.runtime_backend); resolve_backend takes te "
                         "or emulated")
    raise ValueError(f"precision.backend must be {one_of(BACKENDS)}, got {backend!r}")


def _recipe_class(ter: Any, spec: RecipeSpec) -> Any:
    """TE's recipe class for ``spec``; a TE too old to have it raises
    :class:`BackendUnavailableError` with the catalog's minimum."""
    cls = getattr(ter, spec.te_recipe_class, None)
    if cls is None:
        raise BackendUnavailableError(
            f"{spec.keys.selected_by}: the {spec.name} recipe needs Transformer Engine >= "
            f"{spec.min_te} ({spec.te_recipe_class}); installed: {_version_text()}. Upgrade TE "
            "or set precision.backend=emulated"
        )
    return cls


def te_recipe(cfg: Any) -> Optional[Any]:
    """The TE recipe object for a ``PrecisionConfig`` (``None`` when unquantized): the class
    the recipe's catalog entry names, built with the fields it shares with the emulated recipe
    and, for current-amax recipes, ``amax_epsilon`` assigned through the QParams."""
    from transformer_engine.common import recipe as ter

    from lptrain.precision import recipes as _R

    spec = _R.selected_recipe(cfg)
    if spec is None:
        return None
    fields = _R.config_fields(spec, cfg)
    kw = {f: fields[f] for f in spec.te_fields}
    if spec.family == "fp8":
        kw["fp8_format"] = ter.Format.HYBRID if cfg.fp8_format == "hybrid" else ter.Format.E4M3
    r = _recipe_class(ter, spec)(**kw)
    if spec.current_amax:
        # The class QParams hold the pow2 choice (blockwise: on by default, env
        # NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset); from TE 2.8 Float8CurrentScaling keeps it in
        # ``use_power_2_scales`` (env NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES). Keep it and add
        # the epsilon (assigning the QParams is what takes effect).
        pow2 = r.fp8_quant_fwd_inp.power_2_scale
        if spec.te_power_2_attr is not None:
            pow2 = getattr(r, spec.te_power_2_attr, pow2)
        _set_qparams(r, ter, power_2=bool(pow2), eps=cfg.amax_epsilon)
    return r


def _version_text() -> str:
    v = te_version()
    return ".".join(map(str, v)) if v else "none"


def _set_qparams(r: Any, ter: Any, *, power_2: bool, eps: float) -> None:
    """Assign the three fp8 QParams after construction (docs/numerics.md 2.3 pitfall)."""
    for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        setattr(r, attr, ter.QParams(power_2_scale=power_2, amax_epsilon=float(eps)))


@contextlib.contextmanager
def te_autocast(recipe: Any, enabled: bool = True, amax_reduction_group: Any = None) -> Iterator[None]:
    """``te.pytorch.autocast`` (``fp8_autocast`` on older TE)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        ctx = te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)
    else:  # older TE: only the deprecated spelling exists
        ctx = te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=amax_reduction_group)
    with ctx:
        yield


def _fp8_state_manager() -> Any:
    """TE's ``FP8GlobalStateManager`` (``transformer_engine.pytorch.quantization`` from 2.9,
    ``.fp8`` before; ``.fp8`` stays as a deprecated alias)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def te_recompute_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` pair for a region of TE layers: the
    contexts ``te.pytorch.checkpoint(use_reentrant=False)`` runs its region's forward and
    recompute under -- TE's recompute-phase contexts (``get_activation_recompute_contexts``:
    the forward stashes each delayed-scaling module's amax history and scale, the
    recompute quantizes with them and joins no amax reduction or scale update), and for the
    recompute TE's autocast with the FP8 state the region was entered under (the backward
    runs outside the forward's autocast). TE's own non-reentrant checkpoint is not torch's
    (it keeps its own checkpoint frame and saved-tensor hooks) and never stops the
    recompute early; lptrain runs torch's with these contexts and with the early stop off
    (``LayerFactory.recompute_early_stop``). Call it where the checkpoint is taken, inside
    the forward."""
    import transformer_engine.pytorch.distributed as ted

    manager = _fp8_state_manager()
    forward_ctx, recompute_ctx = ted.get_activation_recompute_contexts()
    fp8 = bool(manager.is_fp8_enabled())
    recipe = manager.get_fp8_recipe() if fp8 else None

    first = _FIRST_MICROBATCH.get()  # the recompute sees the forward's is_first_microbatch

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        with recompute_ctx, te_autocast(recipe, enabled=fp8), micro_batch(first):
            yield

    return forward_ctx, recompute()


def _forward_amax_histories(model: nn.Module) -> list[torch.Tensor]:
    """Every TE module's forward amax history (``fp8_meta["scaling_fwd"].amax_history``)."""
    out = []
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        state = meta.get("scaling_fwd") if isinstance(meta, dict) else None
        hist = getattr(state, "amax_history", None)
        if isinstance(hist, torch.Tensor) and hist.dim() >= 1 and hist.numel():
            out.append(hist)
    return out


@contextlib.contextmanager
def forward_amax_slots_kept(model: nn.Module) -> Iterator[None]:
    """Leave TE's delayed scaling as it was across a no-grad pass (evaluation).

    TE's delayed-scaling cast max-reduces each input's amax into ``amax_history[0]`` whatever
    the autograd mode, and only an autocast exit with grad enabled consumes and resets that
    slot: an evaluation's amaxes would otherwise be folded into the next training step's
    update (max(eval, train)). The slot of every forward history is saved and restored in
    place (TE's global amax buffer holds views of it); a history TE creates during the pass
    (a module's first forward) gets the zero slot it was created with."""
    saved = {id(h): (h, h[0].clone()) for h in _forward_amax_histories(model)}
    try:
        yield
    finally:
        with torch.no_grad():
            for h in _forward_amax_histories(model):
                kept = saved.get(id(h))
                if kept is not None:
                    h[0].copy_(kept[1])
                else:
                    h[0].zero_()


@contextlib.contextmanager
def te_model_init(recipe: Any, preserve_high_precision_init_val: bool = True) -> Iterator[None]:
    """``te.pytorch.quantized_model_init`` (``fp8_model_init`` on older TE)."""
    import transformer_engine.pytorch as te

    fn = getattr(te, "quantized_model_init", None) or te.fp8_model_init
    with fn(enabled=True, recipe=recipe,
            preserve_high_precision_init_val=preserve_high_precision_init_val):
        yield


# Optional TE constructor kwargs that may be dropped when this TE's signature lacks them:
# ``name`` is cosmetic (debug names, 2.5+), ``use_grouped_tensor`` only exists (and is only
# needed) from 2.19. Anything else, ``single_grouped_weight`` included, must reach TE or fail.
_DROPPABLE = ("name", "use_grouped_tensor")


def _accepts(cls: Any, kwarg: str) -> bool:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return kwarg in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _call(cls: Any, *args: Any, **kw: Any) -> Any:
    """Construct a TE module, dropping the optional kwargs this TE version does not know."""
    for opt in _DROPPABLE:
        if opt in kw and not _accepts(cls, opt):
            kw.pop(opt)
    return cls(*args, **kw)


class LayerArgs(TypedDict, total=False):
    """The arguments every lptrain TE layer takes (the factory fills them from the run)."""

    params_dtype: torch.dtype
    init_method: Optional[Callable[[torch.Tensor], None]]
    fuse_wgrad_accumulation: bool
    name: str


def _te_module(cls: Any, *args: Any, layer: LayerArgs, **kw: Any) -> nn.Module:
    """One TE module on the current CUDA device with the arguments every lptrain TE layer
    shares (dtype -- bf16 by default --, init, fused wgrad accumulation, optional name);
    ``kw`` adds the rest. Under a caller's ``with torch.device("meta")`` (a dry run) TE
    builds it on meta."""
    device = "meta" if torch.get_default_device().type == "meta" else "cuda"
    return _call(
        cls,
        *args,
        init_method=layer.get("init_method"),
        params_dtype=layer.get("params_dtype", torch.bfloat16),
        fuse_wgrad_accumulation=layer.get("fuse_wgrad_accumulation", False),
        device=device,
        name=layer.get("name") or None,
        **kw,
    )


def te_linear(in_features: int, out_features: int, *, bias: bool = False,
              parallel_mode: Optional[str] = None, tp_group: Any = None, tp_size: int = 1,
              sequence_parallel: bool = False, **layer: Unpack[LayerArgs]) -> nn.Module:
    """A ``te.pytorch.Linear`` on the current CUDA device. Tensor parallel (``parallel_mode``
    "column" / "row"): TE's own ``tp_group`` (the torch process group of lptrain's group
    object; None builds shapes only, as TE does), ``tp_size``, ``parallel_mode`` and
    ``sequence_parallel`` -- TE holds the shard and runs the layer's collectives."""
    if parallel_mode is None:
        return _te_module(_te_parallel_linear_cls(), in_features, out_features, bias=bias, layer=layer)
    return _te_module(_te_parallel_linear_cls(), in_features, out_features, bias=bias, layer=layer,
                      parallel_mode=parallel_mode, tp_group=getattr(tp_group, "pg", tp_group),
                      tp_size=tp_size, sequence_parallel=sequence_parallel)


# Megatron's ``is_first_microbatch`` for the TE modules' forwards (:func:`micro_batch`).
_FIRST_MICROBATCH: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("lptrain_first_microbatch",
                                                                                 default=None)


@contextlib.contextmanager
def micro_batch(first: Optional[bool]) -> Iterator[None]:
    """Forwards of one micro-batch of a step: TE's modules get ``is_first_microbatch=first``
    (as Megatron passes it). With ``None`` TE casts every bf16 weight (and its transpose on
    Hopper) on every micro-batch; ``True`` casts and caches it, ``False`` reuses the cache --
    so each weight is quantized once per step. The first micro-batch of every step re-casts:
    no cached quantized weight survives an optimizer step or a param gather (both happen
    between steps), and passes outside a step (evaluation, recompute in backward) run with
    ``None`` and never touch the cache's use."""
    outer = _FIRST_MICROBATCH.get()
    _FIRST_MICROBATCH.set(first)
    try:
        yield
    finally:
        _FIRST_MICROBATCH.set(outer)


@functools.cache
def _te_parallel_linear_cls() -> type:
    """``te.pytorch.Linear`` taking lptrain's ``[b, s, h]`` activations: TE's sequence-parallel
    gather and scatter run along the first dimension of a contiguous ``[s, b, h]`` input
    (Megatron-LM's layout), which is how the layer stack stores its activations under
    sequence parallelism on TE (:mod:`lptrain.model.layout`): the input's ``transpose(0, 1)``
    is TE's contiguous ``[s, b, h]`` and TE's ``[s, b, h]`` output goes back as a view, no
    copy either way (a batch-first input, which the model never gives it, is copied).
    Also passes Megatron's ``is_first_microbatch`` (:func:`micro_batch`). Made once."""
    import transformer_engine.pytorch as te

    class TEParallelLinear(te.Linear):
        def forward(self, inp: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if not args and "is_first_microbatch" not in kw:
                kw["is_first_microbatch"] = _FIRST_MICROBATCH.get()
            if not (getattr(self, "sequence_parallel", False) and inp.dim() == 3):
                return super().forward(inp, *args, **kw)
            return super().forward(inp.transpose(0, 1).contiguous(), *args, **kw).transpose(0, 1)

    return TEParallelLinear


@functools.cache
def _te_grouped_linear_cls() -> type:
    """``te.pytorch.GroupedLinear`` plus lptrain's ``member_weight`` accessor and ``m_splits``
    handling (made once)."""
    import transformer_engine.pytorch as te

    class TEGroupedLinear(te.GroupedLinear):
        def make_grouped_weights(self, defer_init: bool = False) -> None:
            """TE's, plus the members' kept high-precision init values stacked onto the
            grouped parameter where TE drops them with the members (up to 2.18): the fp32
            masters of a single grouped weight then start from the true init, as discrete
            expert weights do, not from the quantized bytes."""
            inits = [_kept_init(getattr(self, f"weight{i}", None)) for i in range(self.num_gemms)]
            super().make_grouped_weights(defer_init=defer_init)
            grouped = getattr(self, "weight", None)
            if (not defer_init and grouped is not None and _kept_init(grouped) is None
                    and all(v is not None for v in inits)):
                keep_init(grouped, torch.stack(inits))

        def member_weight(self, i: int) -> torch.Tensor:
            """Expert ``i``'s weight: a per-member tensor viewing the single grouped weight
            (TE's ``GroupedTensor`` refuses ``weight[i]``), or the discrete ``weight<i>``."""
            if getattr(self, "single_grouped_weight", False):
                from lptrain.precision.param_storage import grouped_members

                return grouped_members(self.weight)[i]
            return getattr(self, f"weight{i}")

        def forward(self, inp: torch.Tensor, m_splits: Sequence[int], *args: Any, **kw: Any) -> Any:
            if not args and "is_first_microbatch" not in kw:
                kw["is_first_microbatch"] = _FIRST_MICROBATCH.get()
            # TE >= 2.19's native grouped-tensor path takes the splits as a CUDA int64 tensor
            # (a host list raises there); older TE wants the host list.
            if getattr(self, "use_grouped_tensor", False) and not isinstance(m_splits, torch.Tensor):
                m_splits = torch.tensor(list(m_splits), dtype=torch.int64, device=inp.device)
            return super().forward(inp, m_splits, *args, **kw)

    return TEGroupedLinear


def _kept_init(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The high-precision init value TE keeps on a parameter (``quantized_model_init(...,
    preserve_high_precision_init_val=True)``), or None."""
    get = getattr(p, "get_high_precision_init_val", None)
    return get() if callable(get) else None


def keep_init(param: torch.Tensor, value: torch.Tensor) -> None:
    """Attach ``value`` as ``param``'s kept init value, the way TE's modules do: the
    ``_high_precision_init_val`` attribute and bound ``get_`` / ``clear_high_precision_init_val``."""
    import types

    def get(self: torch.Tensor) -> Optional[torch.Tensor]:
        return getattr(self, "_high_precision_init_val", None)

    def clear(self: torch.Tensor) -> None:
        if hasattr(self, "_high_precision_init_val"):
            del self._high_precision_init_val

    param._high_precision_init_val = value  # type: ignore[attr-defined]
    param.get_high_precision_init_val = types.MethodType(get, param)  # type: ignore[attr-defined]
    param.clear_high_precision_init_val = types.MethodType(clear, param)  # type: ignore[attr-defined]


def forget_te_classes() -> None:
    """Drop the classes built on the imported TE's modules (the GroupedLinear and parallel
    Linear subclasses), so the next use builds them on whatever ``transformer_engine`` imports
    then (``lptrain.testing.te_python.installed`` clears them around a run)."""
    _te_grouped_linear_cls.cache_clear()
    _te_parallel_linear_cls.cache_clear()


@contextlib.contextmanager
def _single_param_env(enabled: bool) -> Iterator[None]:
    """Set ``NVTE_GROUPED_LINEAR_SINGLE_PARAM=1`` while a GroupedLinear is constructed.

    From TE 2.15 ``GroupedLinear.__init__`` reads it and otherwise turns
    ``single_grouped_weight`` off with only a warning; it is read nowhere else, so the
    variable is restored afterwards and the rest of the process is unaffected.
    """
    old = os.environ.get(SINGLE_PARAM_ENV)
    if not enabled or (old is not None and old.strip().isdigit() and int(old) > 0):
        yield
        return
    os.environ[SINGLE_PARAM_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SINGLE_PARAM_ENV, None)
        else:
            os.environ[SINGLE_PARAM_ENV] = old


def te_grouped_linear(num_gemms: int, in_features: int, out_features: int, *,
                      single_grouped_weight: bool = False, **layer: Unpack[LayerArgs]) -> nn.Module:
    """A ``te.pytorch.GroupedLinear`` (bias-free) with lptrain's ``member_weight`` accessor.

    ``single_grouped_weight`` is passed with what each TE release needs to honour it (the
    environment variable from 2.15, ``use_grouped_tensor=True`` from 2.19) and checked on
    the built module: a TE that would fall back to per-expert weights raises instead.
    """
    cls = _te_grouped_linear_cls()
    kw: dict[str, Any] = {}
    if single_grouped_weight:
        if not _accepts(cls, "single_grouped_weight"):
            raise BackendUnavailableError(
                "model.moe.single_grouped_weight=true needs Transformer Engine >= "
                f"{SINGLE_GROUPED_WEIGHT_MIN_TE} (installed: {_version_text()}); upgrade TE or set "
                "model.moe.single_grouped_weight=false"
            )
        kw["single_grouped_weight"] = True
        kw["use_grouped_tensor"] = True
    with _single_param_env(single_grouped_weight):
        module = _te_module(cls, num_gemms, in_features, out_features, bias=False, layer=layer, **kw)
    if single_grouped_weight and not getattr(module, "single_grouped_weight", False):
        raise BackendUnavailableError(
            f"{layer.get('name') or 'GroupedLinear'}: Transformer Engine {_version_text()} built per-expert "
            "weights although single_grouped_weight=True was requested; set "
            "model.moe.single_grouped_weight=false"
        )
    return module


# ---- the precision-aware optimizer: TE's FusedAdam (lptrain.optim.precision_aware) ----------


@functools.cache
def _guarded_fused_adam_cls() -> type:
    """TE's FusedAdam with one change: an all-zero FP8 state keeps quantizer scale 1 (TE sets
    ``1 / 0 = inf`` and stores ``0 * inf = NaN``; :mod:`lptrain.precision.optimizer_states`)."""
    from transformer_engine.pytorch.optimizers import FusedAdam
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    from lptrain.catalog.optimizer_state import SCALED_RANGE
    from lptrain.precision import optimizer_states as states

    states.stored_tensors.register(Float8Tensor)(  # its bits, for a bitwise checkpoint
        lambda st: {"data": st._data, "scale_inv": st._scale_inv, "scale": st._quantizer.scale})
    states.stored_bytes.register(Float8Tensor)(lambda st: st._data.numel() + 12)

    class GuardedFusedAdam(FusedAdam):  # type: ignore[misc, valid-type]
        def _apply_scale(self, state_name: str, unscaled_state: torch.Tensor, scaled_state: Any,
                         scale: torch.Tensor) -> None:
            if self.name_to_dtype_map[state_name] != torch.uint8:
                super()._apply_scale(state_name, unscaled_state, scaled_state, scale)
                return
            torch.div(states.absmax(unscaled_state), SCALED_RANGE["fp8"], out=scale)
            scaled_state._quantizer.scale.copy_(torch.where(scale > 0, 1 / scale, torch.ones_like(scale)))
            scaled_state.copy_(unscaled_state)

    return GuardedFusedAdam


def te_fused_adam(groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
    """TE's FusedAdam over ``groups`` with Megatron's keyword arguments (``lptrain.optim.
    precision_aware.fused_adam``), guarded against the all-zero FP8 state."""
    return _guarded_fused_adam_cls()(groups, **kwargs)


def te_master_value(opt: Any, p: torch.Tensor) -> torch.Tensor:
    """The fp32 master FusedAdam holds for bf16 param ``p`` (rebuilt from its remainder)."""
    from lptrain.precision.optimizer_states import join_remainders
    if opt.store_param_remainders and p.dtype == torch.bfloat16:
        return join_remainders(p.detach(), opt.state[p]["master_param"])
    return opt.get_unscaled_state(p, "master_param").float()


def te_load_master(opt: Any, p: torch.Tensor, master: torch.Tensor) -> None:
    """Make FusedAdam hold ``master`` for ``p``, and ``p`` the value its kernel writes for it."""
    from lptrain.precision.optimizer_states import split_remainders
    remainders = bool(opt.store_param_remainders and p.dtype == torch.bfloat16)
    if not opt.state[p]:
        opt.initialize_state(p, remainders)
    if remainders:
        hi, rem = split_remainders(master.float().reshape(p.shape))
        p.data.copy_(hi)
        opt.state[p]["master_param"].copy_(rem)
        return
    opt.set_scaled_state(p, "master_param", master.float().reshape(p.shape).clone())
    p.data.copy_(master.reshape(p.shape))
