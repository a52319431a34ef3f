"""The precision-aware layer factory: the only way model code creates a GEMM layer.

Model code calls ``factory.linear(...)`` / ``factory.grouped_linear(...)`` and wraps each
transformer layer's forward in ``factory.layer_context(layer_number)``. It never imports a
backend and never branches on the format: which recipe runs (bf16, an FP8 recipe, NVFP4)
and on which backend (emulated or Transformer Engine) is decided here from the
``PrecisionConfig``.

This module holds the emulated modules: each forward asks ``autocast.active_recipe()``
and runs either the high-precision path (plain fp32 GEMMs with optional
gradient-accumulation fusion into ``main_grad``) or the quantized op of
``lptrain.precision.linear_ops``. Under ``quantized_model_init`` the weights are created as
quantized primary weights. ``lptrain.precision.factory.build_factory`` builds the factory
from the config; the TE backend lives in ``te_adapter``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

import torch
from torch import nn

from lptrain.precision import autocast as _ac
from lptrain.precision import linear_ops as _ops
from lptrain.precision import operand_stats as _stats
from lptrain.precision.wgrad import _HighPrecisionLinearFn

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float) -> InitMethod:
    """Normal(0, std) initialisation, in place."""

    def init(t: torch.Tensor) -> None:
        nn.init.normal_(t, mean=0.0, std=std)

    return init


class _QuantizedModuleMixin:
    """Per-recipe quantizer/delayed-scaling state and primary-weight creation."""

    _num_members: int
    # a fused-wgrad backward returns fused_wgrad_placeholder: None under the data-parallel
    # engine (lptrain.precision.params.hook_free_wgrad_weights)
    hands_autograd_no_fused_wgrad = True

    def _init_layer(
        self,
        in_features: int,
        out_features: int,
        *,
        num_members: int,
        fuse_wgrad_accumulation: bool,
        name: str,
        init_method: Optional[InitMethod],
    ) -> InitMethod:
        """Attributes every quantized layer shares, plus its quantization state; returns the
        weight init (``init_method`` or N(0, 1/in_features))."""
        self.in_features = in_features
        self.out_features = out_features
        self.name = name
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self._num_members = num_members
        self._init_quant()
        return init_method or normal_init(1.0 / math.sqrt(in_features))

    # per role, the group a sharded operand's per-tensor amax is MAX-reduced over (a
    # tensor-parallel shard: lptrain.precision.tensor_parallel); empty for whole tensors
    _amax_reduction: Mapping[str, Any] = MappingProxyType({})

    def _init_quant(self) -> None:
        self._qstates: dict[int, _ops.QuantState] = {}
        self._hp_state: Optional[_ops.QuantState] = None
        self._pending_scaling_state: Optional[dict[str, torch.Tensor]] = None

    def _label(self, st: _ops.QuantState) -> _ops.QuantState:
        """Name ``st``'s operands for the statistics: this module's name, and for a grouped
        layer the global index of its member 0 (``member_offset``, set by an expert layer)."""
        st.label = self.name or None
        if isinstance(self, GroupedLinear):
            st.member_offset = self.member_offset
        return st

    def quant_state(self, recipe: Any) -> _ops.QuantState:
        """This module's quantizers for ``recipe`` (delayed scaling: its scales/histories)."""
        st = self._qstates.get(id(recipe))
        if st is None or st.recipe is not recipe:
            st = self._label(_ops.QuantState(recipe, self._num_members, self._amax_reduction))
            self._qstates[id(recipe)] = st
            if self._pending_scaling_state is not None and any(m.states for m in st.members):
                self._load_states(st, self._pending_scaling_state)
                self._pending_scaling_state = None
        return st

    def scaling_state_dict(self) -> dict[str, torch.Tensor]:
        """Delayed-scaling state (scale, amax_history per member and role) for checkpoints.

        Kept out of ``state_dict()`` on purpose (no ``_extra_state`` key appears in the
        parameter namespace); checkpoint code saves it next to the model state and restores
        it with :meth:`load_scaling_state_dict` so a resumed delayed-scaling run continues
        with the same scales. Empty for stateless recipes.
        """
        out: dict[str, torch.Tensor] = {}
        for st in self._qstates.values():
            for i, m in enumerate(st.members):
                for role, ds in m.states.items():
                    out[f"{i}.{role}.scale"] = ds.scale.clone()
                    out[f"{i}.{role}.amax_history"] = ds.amax_history.clone()
        return out

    def load_scaling_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`scaling_state_dict` now, or when the recipe's state is created."""
        stateful = [st for st in self._qstates.values() if any(m.states for m in st.members)]
        if not sd:
            return
        if not stateful:
            self._pending_scaling_state = {k: v.clone() for k, v in sd.items()}
            return
        for st in stateful:
            self._load_states(st, sd)

    @staticmethod
    def _load_states(st: _ops.QuantState, sd: dict[str, torch.Tensor]) -> None:
        for i, m in enumerate(st.members):
            for role, ds in m.states.items():
                ds.scale.copy_(sd[f"{i}.{role}.scale"])
                ds.amax_history.copy_(sd[f"{i}.{role}.amax_history"])

    def delayed_scaling_states(self, recipe: Any) -> list[dict[str, Any]]:
        """Per member: ``{role: DelayedScalingState}`` (empty dicts for stateless recipes)."""
        return [m.states for m in self.quant_state(recipe).members]

    def _shape_error(self, recipe: Any, err: ValueError) -> ValueError:
        """Name the layer and the recipe's alignment when an operand cannot be quantized."""
        name = getattr(self, "name", "") or type(self).__name__
        return ValueError(
            f"{name}: cannot run the {getattr(recipe, 'name', recipe)} recipe on this GEMM "
            f"({err}); token counts and feature sizes must be multiples of "
            f"{getattr(recipe, 'alignment', '?')} (factory.alignment; grouped token splits: "
            f"factory.grouped_alignment)"
        )

    def _hp(self) -> _ops.QuantState:
        if self._hp_state is None:
            self._hp_state = self._label(_ops.high_precision_state(self._num_members))
        return self._hp_state

    def _maybe_quantize_primary(self, w: torch.Tensor, grouped: bool) -> torch.Tensor:
        """Under ``quantized_model_init``: the quantized primary weight made from ``w``."""
        recipe, preserve = _ac.model_init_recipe()
        if recipe is None:
            return w
        qz = self.quant_state(recipe).members[0].weight
        with torch.no_grad():
            if grouped:
                # Each member quantized on its own (own amax / blocks), keeping its init value.
                qw = qz.quantize_grouped(w, preserve_high_precision_init_val=preserve)
            else:
                qw = qz.quantize(w, preserve_high_precision_init_val=preserve)
        return qw


class Linear(_QuantizedModuleMixin, nn.Module):
    """A bias-free (optionally biased) linear layer whose GEMM precision is chosen by the factory.

    Inside an enabled ``autocast(recipe)`` its GEMMs run quantized; otherwise in fp32. The
    weight is a quantized primary weight when built under ``quantized_model_init``.
    """

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
        amax_reduction: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        if amax_reduction:  # before the quantizers (and a quantized primary weight) exist
            self._amax_reduction = dict(amax_reduction)
        init = self._init_layer(
            in_features, out_features, num_members=1, name=name, init_method=init_method,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        )
        w = torch.empty(out_features, in_features, dtype=params_dtype)
        init(w)
        self.weight = nn.Parameter(self._maybe_quantize_primary(w, grouped=False))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = _ac.active_recipe()
        if recipe is None:
            y = _HighPrecisionLinearFn.apply(x, self.weight, self.fuse_wgrad_accumulation)
            if _stats.active() is not None and torch.is_grad_enabled():
                self._record_high_precision(x, y)
        else:
            try:
                y = _ops.quantized_linear(
                    x, self.weight, self.quant_state(recipe), fuse_wgrad=self.fuse_wgrad_accumulation
                )
            except ValueError as err:
                raise self._shape_error(recipe, err) from err
        return y + self.bias.to(y.dtype) if self.bias is not None else y


    def _record_high_precision(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The statistics of an unquantized GEMM's operands (amax, non-finite count): input
        and weight now, the output grad when the backward reaches it."""
        name = self.name or None
        _stats.record(name, "input", None, x)
        _stats.record(name, "weight", None, self.weight)
        if y.requires_grad:
            y.register_hook(lambda g: _stats.record(name, "grad", None, g))


class GroupedLinear(_QuantizedModuleMixin, nn.Module):
    """``num_gemms`` linears applied to consecutive token splits (MoE experts).

    ``single_grouped_weight=True`` stores all members in one parameter ``weight`` of shape
    ``[num_gemms, out, in]`` (contiguous, per-member views via ``member_weight(i)``);
    otherwise members are discrete parameters ``weight0 .. weight{N-1}``. Both layouts give
    bitwise identical results for the same values, quantized or not: each member is
    quantized on its own, exactly as a separate ``Linear`` would be. With
    ``fuse_wgrad_accumulation`` member gradients go into ``main_grad`` (the grouped
    parameter's ``[N, out, in]`` buffer, or each discrete weight's own).
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
        self._member_offset = 0
        self.num_gemms = num_gemms
        self.single_grouped_weight = single_grouped_weight
        init = self._init_layer(
            in_features, out_features, num_members=num_gemms, name=name, init_method=init_method,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        )
        if single_grouped_weight:
            w = torch.empty(num_gemms, out_features, in_features, dtype=params_dtype)
            for i in range(num_gemms):
                init(w[i])
            self.weight = nn.Parameter(self._maybe_quantize_primary(w, grouped=True))
        else:
            for i in range(num_gemms):
                w = torch.empty(out_features, in_features, dtype=params_dtype)
                init(w)
                self.register_parameter(
                    f"weight{i}", nn.Parameter(self._maybe_quantize_primary(w, grouped=False))
                )

    @property
    def member_offset(self) -> int:
        """The global index of member 0 (an expert layer's first local expert under expert
        parallelism), which names the members' operands in the statistics."""
        return self._member_offset

    @member_offset.setter
    def member_offset(self, offset: int) -> None:
        self._member_offset = int(offset)
        for st in [*self._qstates.values(), self._hp_state]:
            if st is not None:
                st.member_offset = self._member_offset

    def member_weight(self, i: int) -> torch.Tensor:
        """Expert ``i``'s weight ``[out, in]`` (a view into the grouped parameter if single)."""
        return self.weight[i] if self.single_grouped_weight else getattr(self, f"weight{i}")

    def weights(self) -> list[torch.Tensor]:
        """The parameters in op order: ``[weight]`` if single, else ``[weight0, ...]``."""
        if self.single_grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def forward(self, x: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        assert len(m_splits) == self.num_gemms, (len(m_splits), self.num_gemms)
        recipe = _ac.active_recipe()
        qstate = self._hp() if recipe is None else self.quant_state(recipe)
        try:
            return _ops.quantized_grouped_linear(
                x,
                list(m_splits),
                self.weights(),
                qstate,
                single=self.single_grouped_weight,
                out_features=self.out_features,
                fuse_wgrad=self.fuse_wgrad_accumulation,
            )
        except ValueError as err:
            raise self._shape_error(recipe, err) from err


@dataclass
class LayerFactory:
    """Builds GEMM layers for one run; created from the precision config by ``build_factory``.

    The defaults (no recipe, emulated backend) give the high-precision factory, so
    ``LayerFactory()`` / ``LayerFactory(params_dtype=...)`` keep working as before.

    - ``recipe``: the emulated ``Recipe`` (``None`` = unquantized run);
      ``te_recipe``: the matching TE recipe object when ``backend == "te"``.
    - ``bf16_layers_at_start`` / ``bf16_layers_at_end`` of ``num_layers``: transformer layers
      whose GEMMs stay high precision (``layer_context``; layer numbers are 1-based, as in
      Megatron).
    - ``quantized_params``: build weights as quantized primary weights (``model_init``).
    """

    params_dtype: torch.dtype = torch.float32
    fuse_wgrad_accumulation: bool = False
    recipe: Any = None
    backend: str = "emulated"
    te_recipe: Any = None
    num_layers: int = 0
    bf16_layers_at_start: int = 0
    bf16_layers_at_end: int = 0
    quantized_params: bool = False
    # how the emulated backend's quantized GEMMs run: dequantized or scaled_mm (resolved
    # precision.quantized_gemm; lptrain.precision.scaled_gemm)
    quantized_gemm: str = "dequantized"

    def linear(self, in_features: int, out_features: int, **kw) -> nn.Module:
        """A GEMM layer ``in_features -> out_features``. With Transformer Engine's tensor-
        parallel arguments (``parallel_mode`` "column" / "row", ``tp_group``, ``tp_size``,
        ``sequence_parallel``; the features are the whole layer's) it holds this rank's shard:
        TE's own ``Linear``, or the emulated one of :mod:`lptrain.precision.tensor_parallel`."""
        kw.setdefault("params_dtype", self.params_dtype)
        kw.setdefault("fuse_wgrad_accumulation", self.fuse_wgrad_accumulation)
        if self.backend == "te":
            from lptrain.precision import te_adapter

            return te_adapter.te_linear(in_features, out_features, **kw)
        mode = kw.pop("parallel_mode", None)
        if mode is not None:
            from lptrain.precision.tensor_parallel import PARALLEL_LINEARS

            return PARALLEL_LINEARS[mode](in_features, out_features, **kw)
        return Linear(in_features, out_features, **kw)

    def grouped_linear(self, num_gemms: int, in_features: int, out_features: int, **kw) -> nn.Module:
        kw.setdefault("params_dtype", self.params_dtype)
        kw.setdefault("fuse_wgrad_accumulation", self.fuse_wgrad_accumulation)
        if self.backend == "te":
            from lptrain.precision import te_adapter

            return te_adapter.te_grouped_linear(num_gemms, in_features, out_features, **kw)
        return GroupedLinear(num_gemms, in_features, out_features, **kw)

    @property
    def quantized(self) -> bool:
        """Whether this run has quantized GEMMs at all."""
        return self.recipe is not None

    @property
    def alignment(self) -> int:
        """GEMM-dimension multiple the recipe needs (1 when unquantized)."""
        return int(getattr(self.recipe, "alignment", 1)) if self.recipe is not None else 1

    @property
    def grouped_alignment(self) -> int:
        """Per-expert token padding multiple for grouped GEMMs (1 when unquantized)."""
        return int(getattr(self.recipe, "grouped_alignment", 1)) if self.recipe is not None else 1

    def grouped_alignment_for(self, single_grouped_weight: bool) -> int:
        """Per-expert token padding for this run's grouped GEMMs. On Transformer Engine,
        experts stored as one grouped weight run (2.19+) only on TE's native grouped-tensor
        path, whose grouped MXFP8 quantization needs every group's rows to be a multiple of
        128 (a device-side error otherwise), so they are padded to that. The emulated backend
        keeps the recipe's block padding: zero rows change no value, but a different row
        count may change the fp32 GEMM's blocking, and its single-grouped and discrete expert
        layouts stay bitwise equal this way."""
        align = self.grouped_alignment
        if single_grouped_weight and self.backend == "te" and self.recipe is not None:
            align = max(align, int(getattr(self.recipe, "grouped_tensor_alignment", None) or 1))
        return align

    @property
    def sequence_first_activations(self) -> bool:
        """Whether the layer stack stores its activations sequence-first under sequence
        parallelism (:mod:`lptrain.model.layout`): on TE, whose ``Linear`` gathers and
        scatters the sequence along the first dimension of a contiguous ``[s, b, h]`` -- no
        copy around it then. The emulated layers compute batch-major (their block casts'
        bits depend on the row order) and stay batch-first."""
        return self.backend == "te"

    @property
    def recompute_early_stop(self) -> bool:
        """Whether ``torch.utils.checkpoint`` may stop a recompute once the backward's tensors
        are rebuilt (torch's default). Not on Transformer Engine: up to TE 2.11 a module's
        ``prepare_forward`` puts its delayed-scaling state back after its ``yield`` with no
        ``finally``, so the early-stop exception raised inside the region's last TE module
        would leave the stashed (one step old) scale and amax history in it; TE's own
        ``checkpoint`` never stops early either."""
        return self.backend != "te"

    def is_bf16_layer(self, layer_number: int) -> bool:
        """Whether 1-based transformer layer ``layer_number`` runs without quantized GEMMs."""
        if self.recipe is None:
            return True
        if layer_number <= self.bf16_layers_at_start:
            return True
        return layer_number > self.num_layers - self.bf16_layers_at_end

    def autocast(self, amax_reduction_group: Any = None) -> contextlib.AbstractContextManager:
        """The run's quantization context: the trainer wraps each forward in it."""
        if self.recipe is None:
            return contextlib.nullcontext()
        if self.backend == "te":
            from lptrain.precision import te_adapter

            return te_adapter.te_autocast(self.te_recipe, True, amax_reduction_group)
        return _ac.autocast(self.recipe, enabled=True, amax_reduction_group=amax_reduction_group,
                            gemm=self.quantized_gemm)

    def micro_batch(self, first: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward in a step (TE: ``is_first_microbatch``)."""
        if self.backend == "te" and self.recipe is not None:
            from lptrain.precision import te_adapter

            return te_adapter.micro_batch(first)
        return contextlib.nullcontext()

    def evaluation_guard(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around a no-grad evaluation: TE's casts record amaxes even then (te_adapter)."""
        if self.backend == "te" and self.recipe is not None:
            from lptrain.precision import te_adapter

            return te_adapter.forward_amax_slots_kept(model)
        return contextlib.nullcontext()

    def recompute_context_fn(self) -> tuple[Any, Any]:
        """``torch.utils.checkpoint``'s ``context_fn`` (a forward and a recompute context).

        Emulated backend: the forward records what its quantized GEMMs used (delayed-scaling
        scales, quantized weights) and the recompute replays it without recording amaxes
        (:func:`lptrain.precision.autocast.recompute_context_fn`). TE backend: TE's own
        recompute phase, the contexts ``te.pytorch.checkpoint`` uses
        (:func:`lptrain.precision.te_adapter.te_recompute_contexts`)."""
        if self.backend == "te":
            if self.recipe is None:
                return contextlib.nullcontext(), contextlib.nullcontext()
            from lptrain.precision import te_adapter

            return te_adapter.te_recompute_contexts()
        return _ac.recompute_context_fn()

    @contextlib.contextmanager
    def layer_context(self, layer_number: int) -> Iterator[None]:
        """Context around transformer layer ``layer_number``'s forward (bf16 layers opt out).

        ``layer_number`` is 1-based. Layers in the first ``bf16_layers_at_start`` or last
        ``bf16_layers_at_end`` run their GEMMs in high precision (a nested disabled autocast).
        """
        if self.recipe is None or not self.is_bf16_layer(layer_number):
            yield
            return
        if self.backend == "te":
            from lptrain.precision import te_adapter

            with te_adapter.te_autocast(self.te_recipe, enabled=False):
                yield
            return
        with _ac.autocast(enabled=False):
            yield

    @contextlib.contextmanager
    def model_init(self) -> Iterator[None]:
        """Context around model construction (quantized primary weights are created here)."""
        if not (self.quantized_params and self.recipe is not None):
            yield
            return
        if self.backend == "te":
            from lptrain.precision import te_adapter

            with te_adapter.te_model_init(self.te_recipe, preserve_high_precision_init_val=True):
                yield
            return
        with _ac.quantized_model_init(self.recipe, preserve_high_precision_init_val=True):
            yield
