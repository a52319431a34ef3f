"""Quantization recipes (numerics.md section 2): upstream TE fields and defaults.

A recipe is plain configuration; ``make_quantizer(role, rowwise, columnwise)`` hands out the
quantizer for a tensor role ("input", "weight", "grad"). Dispatch is by recipe class (each
recipe knows its quantizer family). The facts about a recipe that configuration shares
(alignments, whether it keeps delayed-scaling state, which config keys it reads) come from
its entry in :mod:`lptrain.catalog.recipes`, which names the class here: ``RECIPES`` maps the
catalog's names (the ones configs and ``lptrain.precision.quantize`` use) to the classes, and
:func:`config_fields` turns a ``PrecisionConfig`` into a recipe's fields.

Unlike TE, the per-role knobs (``power_2_scale``, ``amax_epsilon``) are real constructor fields,
so the Megatron-LM #7523 workaround (``amax_epsilon`` on blockwise grads) cannot be silently
ignored here (numerics.md 2.3 pitfall).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from lptrain.catalog import recipes as catalog_recipes
from lptrain.catalog.recipes import RecipeSpec
from lptrain.config.schema import AMAX_ALGOS, one_of

from . import scaling as _scaling
from .delayed_scaling import DelayedScalingState, update_slots
from .formats import Format, FP8Format
from .tensors import (
    BlockwiseQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
    Role,
)


@dataclass
class Recipe(ABC):
    """Base: a recipe name, GEMM/grouped alignment, and quantizers per role."""

    name: ClassVar[str]
    # Filled in per subclass from its catalog entry (found by ``name``), which the config rules
    # read too (PREC-GEMM-ALIGN, the inert delayed-scaling keys), so validation and execution
    # cannot disagree: GEMM dimension alignment (whole quantization blocks), the padding of
    # each member's tokens in a grouped GEMM, and whether the recipe keeps per-tensor
    # delayed-scaling state (made by ``make_state``, passed to ``make_quantizer``).
    alignment: ClassVar[int]
    grouped_alignment: ClassVar[int]
    grouped_tensor_alignment: ClassVar[Optional[int]]
    has_delayed_state: ClassVar[bool]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = catalog_recipes.recipe(cls.name)
        if spec is None:
            raise TypeError(f"recipe class {cls.__name__}: lptrain.catalog.recipes has no entry "
                            f"named {cls.name!r}")
        cls.alignment = spec.alignment
        cls.grouped_alignment = spec.grouped_alignment
        cls.grouped_tensor_alignment = spec.grouped_tensor_alignment
        cls.has_delayed_state = spec.amax_history

    fp8_format: Any = Format.HYBRID

    def __post_init__(self) -> None:
        self.fp8_format = Format.parse(self.fp8_format)

    def fp8_format_for(self, role: Role) -> FP8Format:
        """Element format for ``role``: E4M3, or E5M2 for grads under HYBRID."""
        return self.fp8_format.for_role(role)

    @abstractmethod
    def make_quantizer(self, role: Role, rowwise: bool = True, columnwise: bool = True) -> Quantizer:
        """A quantizer for tensors of ``role`` with the given usages."""

    # Options of ``lptrain.precision.quantize`` that go to ``make_quantizer``, not the recipe.
    QUANTIZER_OPTIONS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def quantizer_from_options(
        cls, role: Role, rowwise: bool, columnwise: bool, fp8_format: Any, **options: Any
    ) -> Quantizer:
        """The quantizer ``quantize(x, cls.name, ...)`` uses: recipe fields from ``options``."""
        qkw = {k: options.pop(k) for k in cls.QUANTIZER_OPTIONS if k in options}
        recipe = cls(fp8_format=fp8_format, **options)
        return recipe.make_quantizer(role, rowwise, columnwise, **qkw)


# ---------------------------------------------------------------------------------------------
# Delayed scaling (the slot state and its update rule: lptrain.precision.delayed_scaling)


@dataclass
class DelayedScaling(Recipe):
    """TE ``DelayedScaling``: per-tensor scale from an amax history (one step late)."""

    name: ClassVar[str] = "delayed"
    QUANTIZER_OPTIONS: ClassVar[tuple[str, ...]] = ("state",)
    margin: float = 0
    fp8_format: Any = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(
                f"amax_compute_algo must be {one_of([repr(a) for a in AMAX_ALGOS])}, got "
                f"{self.amax_compute_algo!r}"
            )

    @classmethod
    def quantizer_from_options(
        cls, role: Role, rowwise: bool, columnwise: bool, fp8_format: Any, **options: Any
    ) -> Quantizer:
        if options.get("state") is None:
            raise ValueError("quantize(..., 'delayed') needs state=DelayedScalingState(...)")
        return super().quantizer_from_options(role, rowwise, columnwise, fp8_format, **options)

    def make_state(self, role: Role) -> DelayedScalingState:
        return DelayedScalingState(self.amax_history_len, self.fp8_format_for(role))

    def make_quantizer(
        self,
        role: Role,
        rowwise: bool = True,
        columnwise: bool = True,
        state: Optional[DelayedScalingState] = None,
    ) -> Float8Quantizer:
        if state is None:
            state = self.make_state(role)
        return Float8Quantizer(
            role, rowwise, columnwise, fp8_format=self.fp8_format_for(role), state=state
        )

    def update(
        self, states: Sequence[DelayedScalingState], amax_reduction: Optional[Any] = None
    ) -> None:
        """Reduce (MAX) every slot's current amax and apply the update rule to each slot.

        ``amax_reduction``: a callable taking/returning the packed fp32 amaxes, or a
        ``torch.distributed`` process group; ignored when ``reduce_amax`` is False.
        """
        if not states:
            return
        reduced: Optional[torch.Tensor] = None
        if self.reduce_amax and amax_reduction is not None:
            packed = torch.stack([s.amax_history[0] for s in states]).float()
            reduced = _scaling.maybe_reduce_amax(packed, amax_reduction)
        groups: dict[tuple[int, torch.device], list[int]] = {}
        for i, st in enumerate(states):
            groups.setdefault((st.history_len, st.amax_history.device), []).append(i)
        for idx in groups.values():
            part = reduced if reduced is None or len(idx) == len(states) else reduced[idx]
            update_slots([states[i] for i in idx], self.margin, self.amax_compute_algo, part)


# ---------------------------------------------------------------------------------------------
# Current scaling, blockwise, MXFP8, NVFP4


@dataclass
class TensorwiseScaling(Recipe):
    """TE ``Float8CurrentScaling``: per-tensor scale from this tensor's own amax."""

    name: ClassVar[str] = "tensorwise"
    QUANTIZER_OPTIONS: ClassVar[tuple[str, ...]] = ("amax_reduction",)
    fp8_format: Any = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def make_quantizer(
        self,
        role: Role,
        rowwise: bool = True,
        columnwise: bool = True,
        amax_reduction: Optional[Any] = None,
    ) -> Float8Quantizer:
        return Float8Quantizer(
            role,
            rowwise,
            columnwise,
            fp8_format=self.fp8_format_for(role),
            power_2_scale=self.power_2_scale,
            amax_epsilon=self.amax_epsilon,
            amax_reduction=amax_reduction,
        )


@dataclass
class BlockwiseScaling(Recipe):
    """TE ``Float8BlockScaling``: 1x128 (input, grad) / 128x128 (weight) fp32 block scales."""

    name: ClassVar[str] = "blockwise"
    fp8_format: Any = Format.E4M3
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        if any(d not in (1, 2) for d in dims):
            raise ValueError(f"block scaling dims must be 1 or 2, got {dims}")

    @classmethod
    def quantizer_from_options(
        cls, role: Role, rowwise: bool, columnwise: bool, fp8_format: Any, **options: Any
    ) -> Quantizer:
        """Extra option ``block_scaling_dim`` (1|2) sets the dim for ``role`` only."""
        dim = options.pop("block_scaling_dim", None)
        if dim is not None:
            key = {"input": "x", "weight": "w", "grad": "grad"}[role] + "_block_scaling_dim"
            options[key] = dim
        return super().quantizer_from_options(role, rowwise, columnwise, fp8_format, **options)

    def block_dim_for(self, role: Role) -> int:
        return {
            "input": self.x_block_scaling_dim,
            "weight": self.w_block_scaling_dim,
            "grad": self.grad_block_scaling_dim,
        }[role]

    def make_quantizer(
        self, role: Role, rowwise: bool = True, columnwise: bool = True
    ) -> BlockwiseQuantizer:
        return BlockwiseQuantizer(
            role,
            rowwise,
            columnwise,
            fp8_format=self.fp8_format_for(role),
            block_dim=self.block_dim_for(role),
            power_2_scale=self.power_2_scale,
            amax_epsilon=self.amax_epsilon,
        )


@dataclass
class MXFP8Scaling(Recipe):
    """TE ``MXFP8BlockScaling``: E8M0 scale per 32 elements (1x32 rowwise, 32x1 columnwise)."""

    name: ClassVar[str] = "mxfp8"
    margin: float = 0  # unused by every kernel, kept for parity with TE
    fp8_format: Any = Format.E4M3
    enable_2d_quantization: bool = False

    def make_quantizer(
        self, role: Role, rowwise: bool = True, columnwise: bool = True
    ) -> MXFP8Quantizer:
        return MXFP8Quantizer(
            role,
            rowwise,
            columnwise,
            fp8_format=self.fp8_format_for(role),
            use_2d=self.enable_2d_quantization and role == "weight",
        )


@dataclass
class NVFP4Scaling(Recipe):
    """TE ``NVFP4BlockScaling``: E2M1 data, E4M3 scale per 16, fp32 per-tensor amax.

    Derived per role (TE ``__post_init__``): input -> RHT (columnwise); weight -> 16x16 2D;
    grad -> RHT (columnwise) + stochastic rounding. ``seed`` seeds the SR generator (one
    generator per quantizer, seeded with seed + role index so roles draw different bits).
    """

    name: ClassVar[str] = "nvfp4"
    QUANTIZER_OPTIONS: ClassVar[tuple[str, ...]] = ("amax_reduction",)
    fp8_format: Any = Format.E4M3  # the block-scale type; elements are E2M1
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp8_format is not Format.E4M3:
            raise ValueError("NVFP4 block scales are E4M3")

    @classmethod
    def quantizer_from_options(
        cls,
        role: Role,
        rowwise: bool,
        columnwise: bool,
        fp8_format: Any,
        *,
        rht: bool = False,
        stochastic_rounding: bool = False,
        two_d: Optional[bool] = None,
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
        amax_reduction: Optional[Any] = None,
    ) -> Quantizer:
        """API defaults: RHT and SR off (any role may ask for them), 2D for weights."""
        if Format.parse(fp8_format) is not Format.E4M3:
            raise ValueError("NVFP4 block scales are E4M3")
        if generator is None and seed is not None:
            generator = torch.Generator().manual_seed(seed)
        return NVFP4Quantizer(
            role,
            rowwise,
            columnwise,
            with_rht=rht,
            stochastic_rounding=stochastic_rounding,
            use_2d=(role == "weight") if two_d is None else two_d,
            generator=generator,
            amax_reduction=amax_reduction,
        )

    def make_quantizer(
        self,
        role: Role,
        rowwise: bool = True,
        columnwise: bool = True,
        generator: Optional[torch.Generator] = None,
        amax_reduction: Optional[Any] = None,
    ) -> NVFP4Quantizer:
        sr = role == "grad" and not self.disable_stochastic_rounding
        if sr and generator is None:
            generator = torch.Generator().manual_seed(self.seed + ("input", "weight", "grad").index(role))
        return NVFP4Quantizer(
            role,
            rowwise,
            columnwise,
            with_rht=role in ("input", "grad") and not self.disable_rht,
            stochastic_rounding=sr,
            use_2d=role == "weight" and not self.disable_2d_quantization,
            generator=generator,
            amax_reduction=amax_reduction,
        )


def _catalog_classes() -> dict[str, type[Recipe]]:
    """Catalog name -> the recipe class its entry names (``emulated_recipe_class``)."""
    classes = {c.__name__: c for c in Recipe.__subclasses__()}
    missing = [s.name for s in catalog_recipes.RECIPES if s.emulated_recipe_class not in classes]
    if missing:
        raise TypeError(f"lptrain.catalog.recipes entries {missing} name recipe classes that "
                        "lptrain.precision.recipes does not define")
    return {s.name: classes[s.emulated_recipe_class] for s in catalog_recipes.RECIPES}


RECIPES: dict[str, type[Recipe]] = _catalog_classes()


def recipe_from_name(name: str, **fields: Any) -> Recipe:
    """Build a recipe from its short name ("delayed", "tensorwise", ...) and dataclass fields."""
    try:
        cls = RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}") from None
    return cls(**fields)


# ---------------------------------------------------------------------------------------------
# PrecisionConfig -> catalog entry and recipe fields, shared by the emulated factory and the TE
# adapter (TE's recipe classes take the same names for the fields they share, ``te_fields``).


def selected_recipe(cfg: Any) -> Optional[RecipeSpec]:
    """The catalog entry of the recipe ``cfg`` (a ``PrecisionConfig``) selects, or ``None``
    when no GEMM is quantized. FP4 (``fp4_format``) takes precedence over FP8, as one run has
    one GEMM recipe. A name or format the catalog does not list raises ``ValueError``."""
    if cfg.fp4_format is not None:
        spec = catalog_recipes.recipe(cfg.fp4_recipe)
        if spec is None or spec.family != "fp4" or cfg.fp4_format not in spec.formats:
            supported = ", ".join(f"{f}/{s.name}" for s in catalog_recipes.recipes_of("fp4")
                                  for f in s.formats)
            raise ValueError(
                f"precision.fp4_format/fp4_recipe: only {supported} is supported, got "
                f"{cfg.fp4_format!r}/{cfg.fp4_recipe!r}"
            )
        return spec
    if cfg.fp8_format is None:
        return None
    spec = catalog_recipes.recipe(cfg.fp8_recipe)
    if spec is None or spec.family != "fp8":
        raise ValueError(
            f"precision.fp8_recipe must be {one_of(catalog_recipes.recipe_names('fp8'))}, "
            f"got {cfg.fp8_recipe!r}"
        )
    return spec


def config_fields(spec: RecipeSpec, cfg: Any) -> dict[str, Any]:
    """The fields of ``spec``'s recipe class that a ``PrecisionConfig`` sets, by what the
    catalog says the recipe reads: the FP8 element format, the delayed-scaling history
    settings, ``amax_epsilon`` for current-amax recipes, the NVFP4 switches for FP4."""
    fields: dict[str, Any] = {}
    if spec.family == "fp8":
        fields["fp8_format"] = cfg.fp8_format
    if spec.amax_history:
        fields.update(_delayed_fields(cfg))
    if spec.current_amax:
        fields["amax_epsilon"] = cfg.amax_epsilon
    if spec.family == "fp4":
        fields.update(_nvfp4_fields(cfg))
    return fields


def _nvfp4_fields(cfg: Any) -> dict[str, bool]:
    """NVFP4 recipe fields from a ``PrecisionConfig`` (its switches are positive, TE's negative)."""
    return {
        "disable_rht": not cfg.nvfp4_rht,
        "disable_stochastic_rounding": not cfg.nvfp4_stochastic_rounding,
        "disable_2d_quantization": not cfg.nvfp4_2d_weights,
    }


def _delayed_fields(cfg: Any) -> dict[str, Any]:
    """Delayed-scaling recipe fields from a ``PrecisionConfig`` (format passed separately)."""
    return {
        "margin": cfg.fp8_margin,
        "amax_history_len": cfg.fp8_amax_history_len,
        "amax_compute_algo": cfg.fp8_amax_compute_algo,
    }
