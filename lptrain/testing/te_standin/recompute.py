"""Stand-in ``transformer_engine.pytorch.distributed`` activation recompute and the part of
``FP8GlobalStateManager`` it uses (read from TE's sources, 2.2-2.18: the same API throughout).

TE keeps delayed scaling right in a recomputed forward with a *recompute phase*:

* ``checkpoint(function, *args, use_reentrant=..., context_fn=...)`` runs ``function``
  under ``activation_recompute_forward(activation_recompute=True, recompute_phase=False)``
  and its recompute (inside the backward) under ``recompute_phase=True`` plus an
  ``autocast(enabled=fp8, recipe=fp8_recipe)`` with the FP8 state the checkpoint was
  called under; :func:`get_activation_recompute_contexts` hands out the two contexts.
  The non-reentrant path is :func:`torch.utils.checkpoint.checkpoint` with those contexts;
  the stand-in implements that one (``use_reentrant=True``, TE's default, raises here).
* A module's ``prepare_forward``: in the first phase, while training in a recompute region
  with FP8 on (:func:`is_fp8_activation_recompute_enabled`), it stashes its forward
  delayed-scaling state (amax history and scale, before quantizing:
  ``copy_forward_fp8_meta_tensors_for_recompute``, a FIFO per module); in the recompute
  phase (:func:`in_fp8_activation_recompute_phase`) it does *not* join the amax reduction
  and scale update of the autocast region, and quantizes with the stashed state
  (``get_old_fp8_meta_tensors_for_recompute``); ``end_forward`` puts the updated state
  back (``restore_fp8_meta_tensors``). Net effect: the recompute quantizes with the
  forward's scales and leaves the scaling state as if it had not run. All three are no-ops
  for recipes without delayed-scaling state.

Without the phase handling a recomputed module records its amaxes a second time and takes
part in a second scale update in the backward, with the scales already updated by the
forward region's exit: delayed scaling then drifts from the run without recompute.

One difference in mechanics, not in effect: the stand-in's GEMMs are lptrain's emulated
ops, which register the delayed-scaling state they quantize with for the enclosing
region's update (TE's modules join its global amax buffer in ``prepare_forward``
instead). So, while the stashed values are copied into the module's own tensors and back
as in TE (a skipped restore leaves them there, as it does in TE up to 2.11), the recompute
quantizes with a *twin* state holding the same values, which the recompute region's exit
updates and nobody reads. (TE's ``is_first_fp8_module`` hand-over only concerns the recomputed graph's
backward bookkeeping, which a non-reentrant checkpoint discards.)
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

_IN_ACTIVATION_RECOMPUTE_REGION = False
_ACTIVATION_RECOMPUTE_PHASE = False
POSITION_KEY = "global_fp8_buffer_pos_fwd_recompute"  # TE's fp8_meta key


class FP8GlobalStateManager:
    """The FP8 state queries and the three recompute helpers of TE's manager.

    ``fp8_meta`` here: ``{"scaling_fwd": [DelayedScalingState, ...], "twin": QuantState}``
    (the module's forward slots and its recompute twin, see the module doc), plus TE's
    buffer-position key once the module has stashed.
    """

    # TE's recompute buffer (a FIFO per module) and autocast state, kept private here: the
    # stand-in's public surface is a subset of TE's at every release.
    _recompute_buffer: ClassVar[list[deque]] = []
    _autocast_stack: ClassVar[list[tuple[bool, Any]]] = []  # (enabled, TE recipe), innermost last

    @classmethod
    def reset(cls) -> None:
        cls._recompute_buffer = []
        cls._autocast_stack = []

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return bool(cls._autocast_stack) and cls._autocast_stack[-1][0] and cls._autocast_stack[-1][1] is not None

    @classmethod
    def get_fp8_recipe(cls) -> Any:
        return cls._autocast_stack[-1][1] if cls._autocast_stack else None

    @classmethod
    def copy_forward_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict[str, Any]) -> None:
        """Stash the forward's amax histories and scales for the recompute phase."""
        states = fp8_meta["scaling_fwd"]
        if not states:
            return
        to_copy = [(s.amax_history.clone(), s.scale.clone()) for s in states]
        buf = cls._recompute_buffer
        if POSITION_KEY not in fp8_meta:
            buf.append(deque())
            fp8_meta[POSITION_KEY] = len(buf) - 1
        buf[fp8_meta[POSITION_KEY]].append(to_copy)

    @classmethod
    def get_old_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict[str, Any]) -> Any:
        """Quantize the recompute with the stashed state (oldest first). As TE, the stashed
        amax histories and scales are copied into the module's own tensors (its updated ones
        kept in ``fp8_meta["updated_fwd"]`` for :meth:`restore_fp8_meta_tensors`); the
        quantization itself runs on the twin state holding the same values (see the module
        doc), which is returned."""
        states, twin = fp8_meta["scaling_fwd"], fp8_meta["twin"]
        if not states:
            return twin
        fp8_meta["updated_fwd"] = [(s.amax_history.clone(), s.scale.clone()) for s in states]
        stashed = cls._recompute_buffer[fp8_meta[POSITION_KEY]].popleft()
        for s, (_, ts), (hist, scale) in zip(states, twin.slots(("input", "weight")), stashed, strict=True):
            s.amax_history.copy_(hist)
            s.scale.copy_(scale)
            ts.amax_history, ts.scale = hist.clone(), scale.clone()
        return twin

    @staticmethod
    def restore_fp8_meta_tensors(fp8_meta: dict[str, Any]) -> None:
        """The updated state again after the recompute (the module's own tensors)."""
        for s, (hist, scale) in zip(fp8_meta["scaling_fwd"], fp8_meta.pop("updated_fwd", []), strict=False):
            s.amax_history.copy_(hist)
            s.scale.copy_(scale)


class activation_recompute_forward(AbstractContextManager):  # (TE's name)
    """TE's phase context: ``recompute_phase=False`` around a checkpointed forward, ``True``
    around its recompute."""

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False) -> None:
        self.activation_recompute = activation_recompute
        self.recompute_phase = recompute_phase

    def __enter__(self) -> activation_recompute_forward:
        global _IN_ACTIVATION_RECOMPUTE_REGION, _ACTIVATION_RECOMPUTE_PHASE
        _IN_ACTIVATION_RECOMPUTE_REGION = self.activation_recompute
        _ACTIVATION_RECOMPUTE_PHASE = self.recompute_phase
        return self

    def __exit__(self, *exc: Any) -> None:
        global _IN_ACTIVATION_RECOMPUTE_REGION, _ACTIVATION_RECOMPUTE_PHASE
        _IN_ACTIVATION_RECOMPUTE_REGION = False
        _ACTIVATION_RECOMPUTE_PHASE = False


def is_fp8_activation_recompute_enabled() -> bool:
    """In a checkpointed region with FP8 on."""
    return _IN_ACTIVATION_RECOMPUTE_REGION and FP8GlobalStateManager.is_fp8_enabled()


def in_fp8_activation_recompute_phase() -> bool:
    return _ACTIVATION_RECOMPUTE_PHASE


def get_activation_recompute_contexts() -> tuple[activation_recompute_forward, activation_recompute_forward]:
    """The contexts for the checkpointed forward and for its recompute."""
    return (activation_recompute_forward(activation_recompute=True, recompute_phase=False),
            activation_recompute_forward(activation_recompute=True, recompute_phase=True))


def make_checkpoint(autocast: Callable[..., Any]) -> Callable[..., Any]:
    """TE's ``checkpoint`` over this stand-in's ``autocast(enabled, recipe)`` (the
    non-reentrant path only)."""

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs.pop("use_reentrant", True):
            raise NotImplementedError("the stand-in TE implements checkpoint(use_reentrant=False) only")
        kwargs.pop("distribute_saved_activations", None)
        kwargs.pop("tp_group", None)
        kwargs.pop("get_rng_state_tracker", None)
        user_context_fn = kwargs.pop("context_fn", None)
        fp8 = FP8GlobalStateManager.is_fp8_enabled()
        recipe = FP8GlobalStateManager.get_fp8_recipe() if fp8 else None

        def context_fn() -> tuple[Any, Any]:
            user_fwd, user_rec = user_context_fn() if user_context_fn else (
                contextlib.nullcontext(), contextlib.nullcontext())
            te_fwd, te_rec = get_activation_recompute_contexts()

            @contextlib.contextmanager
            def forward() -> Iterator[None]:
                with te_fwd, user_fwd:
                    yield

            @contextlib.contextmanager
            def recompute() -> Iterator[None]:
                with te_rec, user_rec, autocast(fp8, recipe):
                    yield

            return forward(), recompute()

        # TE's non-reentrant checkpoint is its own (saved-tensor hooks on a checkpoint frame)
        # and recomputes the whole function: no early stop, unlike torch's default.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                     context_fn=context_fn, **kwargs)

    return checkpoint
