"""Stand-in ``transformer_engine.pytorch`` modules and contexts that compute like TE.

``Linear`` and ``GroupedLinear`` take TE's constructor arguments (per release, see
``lptrain.testing.te_standin.make``), create their parameters on ``device`` (``"cuda"``: the
real or the virtual GPU), and run their GEMMs through lptrain's emulated quantized ops, so a
model built on the TE backend trains for real on a CPU. What TE does and lptrain must cope
with is kept:

* quantized primary weights under ``quantized_model_init`` are TE tensor classes (the
  stand-ins of :mod:`.tensors`), with the bf16 init value kept on the CPU and bound
  ``get_high_precision_init_val`` / ``clear_high_precision_init_val`` methods;
* a single grouped weight (2.14+) is a ``GroupedTensor`` parameter named ``weight`` (members
  ``weight0..N-1`` are gone) that refuses ``select``; see :class:`GroupedLinear` for what
  changes per release;
* fused wgrad accumulation adds into ``weight.main_grad`` and sets
  ``grad_added_to_main_grad`` when the attribute exists;
* delayed-scaling state (scales and amax histories) lives in the module and is saved only
  through ``get_extra_state()`` (a CPU ``uint8`` tensor of pickled state with the recipe,
  for every module that ran FP8, as TE's), i.e. under the ``_extra_state`` key of
  ``state_dict()``; the module exposes ``fp8_meta``;
* NVFP4 stochastic rounding draws from the CUDA default generator (TE's kernels use its
  Philox state), not from a per-quantizer one;
* under activation recompute (``checkpoint``), a module stashes its forward delayed-scaling
  state and its recompute quantizes with it, outside the scale update, restoring its own
  state afterwards -- in a ``finally`` only from 2.12 (:mod:`.recompute`);
* fused wgrad reads ``weight.main_grad`` in the backward (the engine installs it).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from lptrain.precision import autocast as _ac
from lptrain.precision import linear_ops as _ops
from lptrain.precision import tensor_parallel as TP

from . import recompute as RC
from . import tensors as T

# quantized_model_init state: [(recipe, preserve_high_precision_init_val)]
_MODEL_INIT: list[tuple[Any, bool]] = []


def _device(device: Any) -> torch.device:
    """TE builds on ``device``; ``cuda`` on a machine without one (no virtual GPU) stays on
    the CPU, so the version tests can construct modules anywhere."""
    d = torch.device(device) if device is not None else torch.device("cuda")
    if d.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return d


class _AsEmulated(torch.autograd.Function):
    """A TE quantized parameter -> the lptrain emulated tensor holding its bytes, for the
    emulated ops (which use a quantized primary weight's bytes as stored). The gradient
    flows back to the TE parameter; fused-wgrad bookkeeping is mirrored onto it."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = T._shallow(w._emu)
        main_grad = getattr(w, "main_grad", None)
        if main_grad is not None:
            out.main_grad = main_grad
        ctx.pair = (w, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w, out = ctx.pair
        if getattr(out, "grad_added_to_main_grad", False) and hasattr(w, "grad_added_to_main_grad"):
            w.grad_added_to_main_grad = True
        return grad


def _operand(w: torch.Tensor) -> torch.Tensor:
    return _AsEmulated.apply(w) if isinstance(w, (T.QuantizedTensor, T.GroupedTensor)) else w


class _TEModule(nn.Module):
    """What every stand-in TE module shares: quantizer state per recipe, primary weights,
    ``fp8_meta`` and the extra state. ``_te_version`` is set on the per-release subclasses
    ``lptrain.testing.te_standin.make`` builds."""

    _te_version: tuple[int, ...] = (99, 0)

    def __init__(self, *, num_members: int, fuse_wgrad_accumulation: bool, name: Optional[str],
                 device: Any, record: dict[str, Any]) -> None:
        super().__init__()
        self._lptrain_kw = record  # constructor arguments, for the version tests
        self._lptrain_device = device
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        if name is not None or self._te_version >= (2, 3):  # TE sets ``name`` from 2.3
            self.name = name
        self._members = num_members
        self._states: dict[int, _ops.QuantState] = {}
        self._hp_state: Optional[_ops.QuantState] = None
        self._pending_extra: Optional[dict[str, Any]] = None
        self._lptrain_te_recipe: Any = None  # the TE recipe of the last FP8 forward
        self._recompute_meta: dict[int, dict[str, Any]] = {}  # per QuantState (see .recompute)
        self.primary_weights_in_fp8 = bool(_MODEL_INIT)

    # ---- quantizer state --------------------------------------------------------------------

    def _state(self, emu_recipe: Any) -> _ops.QuantState:
        st = self._states.get(id(emu_recipe))
        if st is None:
            st = _ops.QuantState(emu_recipe, self._members, _sp_amax_reduction(self))
            self._states[id(emu_recipe)] = st
            if self._pending_extra is not None:
                self._load_scaling(st, self._pending_extra)
                self._pending_extra = None
        return st

    def _forward_state(self) -> _ops.QuantState:
        recipe = _ac.active_recipe()
        if recipe is None:
            if self._hp_state is None:
                self._hp_state = _ops.high_precision_state(self._members)
            return self._hp_state
        return self._state(recipe)

    def _prepare_forward(self) -> _ops.QuantState:
        """TE's ``prepare_forward`` for delayed scaling under activation recompute (see
        :mod:`.recompute`): the state this forward quantizes with."""
        st = self._forward_state()
        if RC.FP8GlobalStateManager.is_fp8_enabled():  # TE's fp8_meta["recipe"], for the extra state
            self._lptrain_te_recipe = RC.FP8GlobalStateManager.get_fp8_recipe()
        fwd = [ds for _, ds in st.slots(("input", "weight"))]
        if not fwd:  # no delayed-scaling state: nothing to stash or swap
            return st
        meta = self._recompute_meta.setdefault(id(st), {})
        meta["scaling_fwd"] = fwd
        if RC.in_fp8_activation_recompute_phase():
            if "twin" not in meta:
                meta["twin"] = _ops.QuantState(st.recipe, self._members)
            return RC.FP8GlobalStateManager.get_old_fp8_meta_tensors_for_recompute(meta)
        if self.training and RC.is_fp8_activation_recompute_enabled():
            RC.FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute(meta)
        return st

    def _end_forward(self) -> None:
        """TE's ``end_forward``: after a recompute, the module's updated state again."""
        if RC.in_fp8_activation_recompute_phase():
            for meta in self._recompute_meta.values():
                if "updated_fwd" in meta:
                    RC.FP8GlobalStateManager.restore_fp8_meta_tensors(meta)

    @contextlib.contextmanager
    def _forward_phase(self) -> Iterator[_ops.QuantState]:
        """A forward between TE's ``prepare_forward`` and ``end_forward``: from 2.12 the
        restore runs in a ``finally``; up to 2.11 ``prepare_forward`` is a generator context
        manager that restores after its ``yield`` with no ``finally``, so an exception raised
        inside the forward (torch's checkpoint early stop, in a recompute) skips it and the
        module keeps the stashed forward state."""
        st = self._prepare_forward()
        if self._te_version >= (2, 12):
            try:
                yield st
            finally:
                self._end_forward()
        else:
            yield st
            self._end_forward()

    def _primary(self, w: torch.Tensor, member_quantizer: Any) -> torch.Tensor:
        """Under ``quantized_model_init``: the quantized primary weight made from ``w``."""
        preserve = _MODEL_INIT[-1][1]
        q = T.quantizer_for(member_quantizer)
        with torch.no_grad():
            qw = q.quantize(w)
        param = nn.Parameter(qw)
        if preserve:
            attach_high_precision_init_val(param, w.detach().cpu())
        return param

    @property
    def quantizers(self) -> dict[str, list[Any]]:
        """TE's ``quantizers`` lists of the active recipe: forward [input, weight, output]
        and backward [grad_output, grad_input] per member (the outputs' ``None``: lptrain
        asks no quantized outputs); empty outside a quantized autocast, as before TE's
        first quantized forward."""
        recipe = _ac.active_recipe()
        if recipe is None:
            return {"scaling_fwd": [], "scaling_bwd": []}
        fwd: list[Any] = []
        bwd: list[Any] = []
        for m in self._state(recipe).members:
            fwd += [T.quantizer_for(m.input), T.quantizer_for(m.weight), None]
            bwd += [T.quantizer_for(m.grad), None]
        return {"scaling_fwd": fwd, "scaling_bwd": bwd}

    @property
    def fp8_meta(self) -> dict[str, Any]:
        """TE's slots: forward [input, weight, output] (one triple per member), backward
        [grad_output, grad_input]; scale and amax_history per slot."""
        fwd, bwd = [], []
        for st in self._states.values():
            for m in st.members:
                if m.states:
                    fwd += [m.states["input"], m.states["weight"]]
                    bwd += [m.states["grad"]]
        return {"scaling_fwd": _Meta(fwd), "scaling_bwd": _Meta(bwd), "recipe": None}

    # ---- extra state (TE's checkpoint channel for scaling state) ------------------------------

    def get_extra_state(self) -> torch.Tensor:
        """TE's extra state: empty until the module has run FP8; then the pickled
        ``{"recipe": <TE recipe>, "extra_fp8_variables": {...}}`` for *every* recipe, plus the
        delayed-scaling scales and amax histories (``scale_fwd``, ``amax_history_fwd``,
        ``scale_bwd``, ``amax_history_bwd``) for a delayed one -- a CPU uint8 tensor."""
        recipe = self._lptrain_te_recipe
        if recipe is None:
            return torch.empty(0, dtype=torch.uint8)
        state: dict[str, Any] = {"recipe": recipe,
                                 "extra_fp8_variables": {"num_gemms": self._members}}
        stateful = [st for st in self._states.values() if any(m.states for m in st.members)]
        if recipe.delayed() and stateful:
            for direction, roles in (("fwd", ("input", "weight")), ("bwd", ("grad",))):
                slots = [m.states[r] for st in stateful for m in st.members for r in roles]
                state[f"scale_{direction}"] = torch.stack([d.scale.detach().cpu().reshape(()) for d in slots])
                state[f"amax_history_{direction}"] = torch.stack(
                    [d.amax_history.detach().cpu() for d in slots], dim=1)
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """TE's: an empty tensor is nothing; else the recipe is taken as the module's, and a
        delayed one's scales and histories are copied in (held until its state exists)."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        payload = pickle.loads(state.detach().cpu().numpy().tobytes())
        self._lptrain_te_recipe = payload["recipe"]
        if "scale_fwd" not in payload:
            return
        stateful = [st for st in self._states.values() if any(m.states for m in st.members)]
        if not stateful:
            self._pending_extra = payload
        for st in stateful:
            self._load_scaling(st, payload)

    @staticmethod
    def _load_scaling(st: _ops.QuantState, payload: dict[str, Any]) -> None:
        for direction, roles in (("fwd", ("input", "weight")), ("bwd", ("grad",))):
            slots = [m.states[r] for m in st.members for r in roles if r in m.states]
            for k, ds in enumerate(slots):
                ds.scale.copy_(payload[f"scale_{direction}"][k].reshape(ds.scale.shape))
                ds.amax_history.copy_(payload[f"amax_history_{direction}"][:, k])


class _Meta:
    def __init__(self, states: list[Any]) -> None:
        self.scale = torch.cat([s.scale.reshape(1) for s in states]) if states else torch.empty(0)
        self.amax_history = (torch.stack([s.amax_history for s in states], 1)
                             if states else torch.empty(0))


def _sp_amax_reduction(module: Any) -> dict[str, Any]:
    """TE's current-scaling amax reductions of a sequence-parallel layer: the gathered input of
    a column-parallel one, the output grad of a row-parallel one (not the weight: TE quantizes
    a weight shard with its own amax); none for any other module."""
    if not getattr(module, "sequence_parallel", False):
        return {}
    return {"input" if module.parallel_mode == "column" else "grad": module.tp_group}


def _group_size(pg: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(pg)


def _tp_view(pg: Any) -> Any:
    """lptrain's group object (``pg``, ``size``, ``rank``) of a torch process group."""
    import torch.distributed as dist

    from lptrain.distributed.groups import Group

    return Group(pg, dist.get_world_size(pg), dist.get_rank(pg))


def attach_high_precision_init_val(param: torch.Tensor, value: torch.Tensor) -> None:
    """TE's ``_high_precision_init_val`` plus the bound get/clear methods."""
    import types

    def get(self: torch.Tensor) -> Optional[torch.Tensor]:
        return getattr(self, "_high_precision_init_val", None)

    def clear(self: torch.Tensor) -> None:
        if hasattr(self, "_high_precision_init_val"):
            del self._high_precision_init_val

    param._high_precision_init_val = value
    param.get_high_precision_init_val = types.MethodType(get, param)
    param.clear_high_precision_init_val = types.MethodType(clear, param)


class Linear(_TEModule):
    """``te.pytorch.Linear`` (bias-free use in lptrain)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 init_method: Any = None, params_dtype: Any = None,
                 fuse_wgrad_accumulation: bool = False, device: Any = "cuda",
                 name: Optional[str] = None, *, sequence_parallel: bool = False,
                 tp_group: Any = None, tp_size: int = 1, parallel_mode: Optional[str] = None) -> None:
        super().__init__(num_members=1, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                         name=name, device=device,
                         record={"init_method": init_method, "params_dtype": params_dtype,
                                 "fuse_wgrad_accumulation": fuse_wgrad_accumulation, "name": name,
                                 "tp_group": tp_group, "tp_size": tp_size,
                                 "parallel_mode": parallel_mode, "sequence_parallel": sequence_parallel})
        # TE's tensor parallelism: the group's size (or tp_size without a group: shapes only),
        # the shard's features, SP only with more than one rank
        self.tp_group, self.parallel_mode = tp_group, parallel_mode
        self.tp_size = _group_size(tp_group) if tp_group is not None else tp_size
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        if parallel_mode == "column":
            out_features //= self.tp_size
        elif parallel_mode == "row":
            in_features //= self.tp_size
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.float32
        w = torch.empty(out_features, in_features, dtype=dtype, device=_device(device))
        if init_method is not None:
            init_method(w)
        else:
            nn.init.zeros_(w)
        if _MODEL_INIT:
            self.weight = self._primary(w, self._state(_emulated(_MODEL_INIT[-1][0])).members[0].weight)
        else:
            self.weight = nn.Parameter(w)
        self.register_parameter(
            "bias", nn.Parameter(torch.zeros(out_features, dtype=dtype, device=w.device)) if bias else None)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        group = _tp_view(self.tp_group) if self.tp_group is not None and self.tp_size > 1 else None
        if group is not None and self.parallel_mode == "column":  # TE: SP along dim 0
            inp = TP.gather_sequence(inp, group, 0) if self.sequence_parallel else TP.copy_to_tp(inp, group)
        with self._forward_phase() as st:
            y = _ops.quantized_grouped_linear(
                inp.reshape(-1, inp.shape[-1]), [inp.numel() // inp.shape[-1]], [_operand(self.weight)],
                st, single=False, out_features=self.out_features,
                fuse_wgrad=self.fuse_wgrad_accumulation,
            ).reshape(*inp.shape[:-1], self.out_features).to(inp.dtype)
        if group is not None and self.parallel_mode == "row":
            y = TP.reduce_scatter_sequence(y, group, 0) if self.sequence_parallel else TP.reduce_from_tp(y, group)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


# ---- contexts ------------------------------------------------------------------------------

_EMULATED: dict[int, tuple[Any, Any]] = {}


def _emulated(te_recipe: Any) -> Any:
    """The lptrain emulated recipe equal to a stand-in TE recipe (one object per TE recipe,
    so delayed-scaling state is shared across modules like TE's global buffers)."""
    hit = _EMULATED.get(id(te_recipe))
    if hit is not None and hit[0] is te_recipe:
        return hit[1]
    emu = te_recipe._to_emulated()
    _EMULATED[id(te_recipe)] = (te_recipe, emu)
    return emu


@contextlib.contextmanager
def _autocast(enabled: bool, recipe: Any, group: Any, calls: list, name: str) -> Iterator[None]:
    calls.append((name, {"enabled": enabled, "recipe": recipe, "group": group}))
    stack = RC.FP8GlobalStateManager._autocast_stack
    stack.append((enabled, recipe))  # what FP8GlobalStateManager.is_fp8_enabled() reads
    try:
        if recipe is None or not hasattr(recipe, "_to_emulated"):
            with _ac.autocast(enabled=False) if not enabled else contextlib.nullcontext():
                yield
            return
        with _ac.autocast(_emulated(recipe), enabled=enabled, amax_reduction_group=group):
            yield
    finally:
        stack.pop()


@contextlib.contextmanager
def _model_init(enabled: bool, recipe: Any, preserve: bool, calls: list, name: str) -> Iterator[None]:
    calls.append((name, {"recipe": recipe, "preserve": preserve}))
    if not enabled or recipe is None or not hasattr(recipe, "_to_emulated"):
        yield
        return
    _MODEL_INIT.append((recipe, preserve))
    try:
        yield
    finally:
        _MODEL_INIT.pop()


def contexts(calls: list, new_api: bool) -> dict[str, Any]:
    """``fp8_autocast`` / ``fp8_model_init`` (always) and ``autocast`` /
    ``quantized_model_init`` (2.9+), recording their calls in ``calls``."""

    def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Any = None,
                     fp8_group: Any = None) -> Any:
        return _autocast(enabled, fp8_recipe, fp8_group, calls, "fp8_autocast")

    def fp8_model_init(enabled: bool = True, recipe: Any = None,
                       preserve_high_precision_init_val: bool = False) -> Any:
        return _model_init(enabled, recipe, preserve_high_precision_init_val, calls, "fp8_model_init")

    out: dict[str, Any] = {"fp8_autocast": fp8_autocast, "fp8_model_init": fp8_model_init}
    if new_api:

        def autocast(enabled: bool = True, calibrating: bool = False, recipe: Any = None,
                     amax_reduction_group: Any = None) -> Any:
            return _autocast(enabled, recipe, amax_reduction_group, calls, "autocast")

        def quantized_model_init(enabled: bool = True, recipe: Any = None,
                                 preserve_high_precision_init_val: bool = False) -> Any:
            return _model_init(enabled, recipe, preserve_high_precision_init_val, calls,
                               "quantized_model_init")

        out.update(autocast=autocast, quantized_model_init=quantized_model_init)
    return out


def cuda_generator() -> torch.Generator:
    """CUDA's default generator (the virtual GPU's under ``VirtualCuda``)."""
    return torch.cuda.default_generators[0]

