"""Quantized-GEMM autocast and quantized primary-weight initialisation (emulated backend).

``autocast(recipe)`` turns quantized GEMMs on for the layers the factory builds, the way
``transformer_engine.pytorch.autocast`` does for TE modules. A nested
``autocast(enabled=False)`` turns them off again (bf16 first/last layers). Delayed-scaling
bookkeeping follows numerics.md 2.1: every module whose forward ran inside the region
records its forward amaxes; the scales are updated when the *outermost* region exits
(forward roles), and after the backward of the first module that ran in the region
(grad roles) -- with a MAX all-reduce of the amaxes over ``amax_reduction_group`` when
that group has more than one rank (``None``: the world group when torch.distributed is
running, as in TE; see :func:`default_amax_reduction_group`).

``quantized_model_init(recipe)`` makes the factory create weights as quantized tensors
(primary weights), keeping their high-precision init value so fp32 master weights can be
seeded exactly.

State is process-global (a stack), like TE's ``FP8GlobalStateManager``: the layers consult
it at forward time, so model code never passes the recipe around.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

# A delayed-scaling slot: (recipe, DelayedScalingState). States are the core's
# ``lptrain.precision.recipes.DelayedScalingState`` (one per tensor role and member).
Slot = tuple[Any, Any]


def reduce_and_update(slots: list[Slot], group: Any) -> None:
    """Apply each recipe's delayed-scaling update to its slots (one MAX all-reduce per recipe).

    ``recipe.update`` packs the current amaxes, MAX-reduces them over ``group`` when it has
    more than one rank (and the recipe's ``reduce_amax`` is set), then applies numerics.md
    2.1's fused update.
    """
    by_recipe: dict[int, tuple[Any, list[Any]]] = {}
    for recipe, state in slots:
        entry = by_recipe.setdefault(id(recipe), (recipe, []))
        if not any(state is s for s in entry[1]):
            entry[1].append(state)
    for recipe, states in by_recipe.values():
        recipe.update(states, amax_reduction=group)


@dataclass
class _Region:
    """The outermost enabled-or-not autocast region: owns the delayed-scaling work lists."""

    recipe: Any
    group: Any
    fwd_states: list[Slot] = field(default_factory=list)
    # Grad-role states of the current forward; handed to the first module's backward.
    bwd_states: list[Slot] = field(default_factory=list)
    first_module_seen: bool = False


@dataclass
class _Frame:
    enabled: bool
    recipe: Any
    group: Any
    region: _Region
    gemm: str = "dequantized"  # how the quantized GEMMs run (precision.quantized_gemm)


_AUTOCAST_STACK: list[_Frame] = []
_MODEL_INIT_STACK: list[tuple[Any, bool]] = []


def default_amax_reduction_group() -> Any:
    """The group amaxes are reduced over when the caller names none: like TE's autocast,
    the default (world) group whenever torch.distributed runs with more than one rank.

    Why: both backends must treat ``amax_reduction_group=None`` the same way; otherwise the
    same multi-rank run keeps ranks' delayed-scaling scales in sync on TE and lets them
    drift apart on the emulated backend. Pass a single-rank group to opt out explicitly.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


@contextlib.contextmanager
def autocast(
    recipe: Any = None,
    enabled: bool = True,
    amax_reduction_group: Any = None,
    gemm: Optional[str] = None,
) -> Iterator[None]:
    """Run the factory's GEMM layers quantized with ``recipe`` inside this context.

    ``enabled=False`` (nested or not) runs them in high precision; a nested region without
    a recipe inherits the enclosing one. ``recipe=None`` with ``enabled=True`` and no
    enclosing recipe also means high precision (the unquantized run). ``gemm``: how the
    quantized GEMMs run, ``dequantized`` (fp32 GEMMs of the dequantized operands, the
    default) or ``scaled_mm`` (torch's scaled GEMM on the stored codes and scales,
    :mod:`lptrain.precision.scaled_gemm`); a nested region without one inherits it.
    """
    outer = _AUTOCAST_STACK[-1] if _AUTOCAST_STACK else None
    if recipe is None and outer is not None:
        recipe = outer.recipe
    if gemm is None:
        gemm = outer.gemm if outer is not None else "dequantized"
    group = amax_reduction_group
    if group is None and outer is not None:
        group = outer.group
    if group is None and outer is None:
        group = default_amax_reduction_group()
    region = outer.region if outer is not None else _Region(recipe=recipe, group=group)
    frame = _Frame(enabled=enabled, recipe=recipe, group=group, region=region, gemm=gemm)
    _AUTOCAST_STACK.append(frame)
    try:
        yield
    finally:
        popped = _AUTOCAST_STACK.pop()
        assert popped is frame, "autocast regions exited out of order"
        if outer is None:
            # Outermost exit: forward-role delayed-scaling update (numerics.md 2.1).
            slots, region.fwd_states = region.fwd_states, []
            reduce_and_update(slots, region.group)


def active_recipe() -> Optional[Any]:
    """The recipe quantized GEMMs should use right now, or ``None`` for high precision."""
    if not _AUTOCAST_STACK:
        return None
    frame = _AUTOCAST_STACK[-1]
    return frame.recipe if frame.enabled else None


def active_gemm() -> str:
    """How the quantized GEMMs run right now: ``dequantized`` or ``scaled_mm``."""
    return _AUTOCAST_STACK[-1].gemm if _AUTOCAST_STACK else "dequantized"


def register_forward(fwd_slots: list[Slot], bwd_slots: list[Slot]) -> Optional[list[Slot]]:
    """Record the delayed-scaling slots a module's forward (and later backward) fills.

    Returns the region's grad-state list if the caller is the first module of the region
    (its backward runs last and performs the grad-role update), else ``None``. Outside any
    region the caller updates its own grad state after its backward.
    """
    if not _AUTOCAST_STACK:
        return None
    region = _AUTOCAST_STACK[-1].region
    region.fwd_states.extend(fwd_slots)
    region.bwd_states.extend(bwd_slots)
    if not region.first_module_seen:
        region.first_module_seen = True
        return region.bwd_states
    return None


def finish_backward(bwd_states: Optional[list[Slot]], group: Any) -> None:
    """Grad-role delayed-scaling update, run by the first module's backward (2.1)."""
    if bwd_states is None:
        return
    slots = list(bwd_states)
    bwd_states.clear()
    reduce_and_update(slots, group)


def current_group() -> Any:
    """The amax-reduction group of the innermost region (``None`` outside)."""
    return _AUTOCAST_STACK[-1].group if _AUTOCAST_STACK else None


# ---- activation recompute: the "recompute phase" the quantized ops consult ----------------------


@dataclass
class RecomputeEntry:
    """What one quantized op call of a checkpointed forward leaves for its recompute: the
    forward-role delayed-scaling scales it quantized with (the region's exit updates them
    before the backward recomputes) and the quantized weights it made this step."""

    scales: list[Any] = field(default_factory=list)
    weights: list[Any] = field(default_factory=list)


@dataclass
class RecomputeTape:
    """One checkpointed region: the autocast stack its forward ran under and one entry per
    quantized op call, in call order (a recompute replays the same calls in the same order)."""

    frames: list[tuple[bool, Any, Any, str]] = field(default_factory=list)
    entries: list[RecomputeEntry] = field(default_factory=list)
    cursor: int = 0
    replaying: bool = False

    def record(self) -> RecomputeEntry:
        entry = RecomputeEntry()
        self.entries.append(entry)
        return entry

    def replay(self) -> RecomputeEntry:
        entry = self.entries[self.cursor]
        self.cursor += 1
        return entry


_RECOMPUTE: list[RecomputeTape] = []


def recompute_tape() -> Optional[RecomputeTape]:
    """The innermost checkpointed region's tape (``replaying`` during its recompute), or None."""
    return _RECOMPUTE[-1] if _RECOMPUTE else None


@contextlib.contextmanager
def recording_for_recompute(tape: RecomputeTape) -> Iterator[None]:
    """Around a checkpointed region's forward: remember the autocast stack and let the
    quantized ops record what their recompute must reuse."""
    tape.frames = [(f.enabled, f.recipe, f.group, f.gemm) for f in _AUTOCAST_STACK]
    tape.entries = []
    tape.replaying = False
    _RECOMPUTE.append(tape)
    try:
        yield
    finally:
        _RECOMPUTE.pop()


@contextlib.contextmanager
def recomputing(tape: RecomputeTape) -> Iterator[None]:
    """Around the region's recompute (inside the backward): the forward's autocast stack
    again, under a region of its own that never updates delayed scaling, with the quantized
    ops in replay mode (see ``lptrain.precision.linear_ops``)."""
    region = _Region(recipe=None, group=None)
    frames = [_Frame(enabled=e, recipe=r, group=g, region=region, gemm=m) for e, r, g, m in tape.frames]
    _AUTOCAST_STACK.extend(frames)
    tape.cursor = 0
    tape.replaying = True
    _RECOMPUTE.append(tape)
    try:
        yield
    finally:
        _RECOMPUTE.pop()
        tape.replaying = False
        for f in reversed(frames):
            popped = _AUTOCAST_STACK.pop()
            assert popped is f, "autocast regions exited out of order in a recompute"
        tape.entries = []  # each region is recomputed once: free the kept weights


def recompute_context_fn() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` for the emulated backend: a fresh tape
    shared by the forward context and the recompute context."""
    tape = RecomputeTape()
    return recording_for_recompute(tape), recomputing(tape)


@contextlib.contextmanager
def amax_untouched(slots: list[Slot]) -> Iterator[None]:
    """Restore the current-step amax of ``slots`` afterwards: a recomputed (or no-grad)
    forward must not record amaxes a second time (TE's recompute phase does the same).
    Delayed scaling's amax slot is a running max that the region exit rolls into the
    history, so a recompute in the backward would leak this step's amaxes into the next."""
    saved = [(st, st.amax_history[0].clone()) for _, st in slots]
    try:
        yield
    finally:
        for st, first in saved:
            st.amax_history[0] = first


@contextlib.contextmanager
def forward_scales(slots: list[Slot], scales: list[Any]) -> Iterator[None]:
    """Quantize with the scales the original forward used (the region exit has updated
    them since), then put the current ones back."""
    current = [st.scale.clone() for _, st in slots]
    for (_, st), s in zip(slots, scales, strict=True):
        st.scale.copy_(s)
    try:
        yield
    finally:
        for (_, st), s in zip(slots, current, strict=True):
            st.scale.copy_(s)


@contextlib.contextmanager
def quantized_model_init(
    recipe: Any,
    preserve_high_precision_init_val: bool = True,
    enabled: bool = True,
) -> Iterator[None]:
    """Create the factory's GEMM weights as quantized primary weights inside this context."""
    _MODEL_INIT_STACK.append((recipe if enabled else None, preserve_high_precision_init_val))
    try:
        yield
    finally:
        _MODEL_INIT_STACK.pop()


def model_init_recipe() -> tuple[Optional[Any], bool]:
    """``(recipe, preserve_high_precision_init_val)`` of the innermost quantized_model_init."""
    if not _MODEL_INIT_STACK:
        return None, False
    return _MODEL_INIT_STACK[-1]
