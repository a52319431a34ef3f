"""The engine's checkpoint state: one logical model, whatever the DP, EP, TP and PP sizes.

:class:`EngineCheckpointState` is the part of :class:`lptrain.train.engine.TrainEngine` that
turns the live optimizer children into the plain nested dict the checkpoint code writes
(``checkpoint_state``) and back (``load_checkpoint_state``): fp32 masters and optimizer state
under canonical parameter names (experts under their global index, tensor-parallel shards
joined), delayed-scaling state, and this rank's random streams.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from lptrain.optim.precision_aware import FP32_DTYPES, optimizer_state_notes, state_precision
from lptrain.precision.model_state import (
    load_rank_state,
    load_scaling_state,
    rank_state,
    scaling_state,
)

if TYPE_CHECKING:
    from lptrain.config.schema import LPTrainConfig
    from lptrain.distributed.groups import ParallelGroups
    from lptrain.model.gpt import GPTModel
    from lptrain.optim.chained import ChainedOptimizer
    from lptrain.optim.child import OptimizerChild


class EngineCheckpointState:
    """Mixin: needs ``model``, ``optimizer``, ``groups``, ``device`` and ``params_synced``."""

    cfg: LPTrainConfig
    model: GPTModel
    optimizer: ChainedOptimizer
    groups: ParallelGroups
    device: torch.device
    params_synced: Callable[[], AbstractContextManager[None]]

    def checkpoint_state(self) -> dict[str, Any]:
        """``{"global": ..., "local": ...}``. Collective (every rank must call it).

        ``global``: identical on every rank: ``model`` (fp32 masters by canonical name: the
        high-precision weights, never quantized bytes), ``optimizer`` (per param name: the
        full optimizer state, sharded pieces gathered), ``scaling`` (delayed-scaling state).
        ``local``: this rank's random streams and module extra state (torch's and CUDA's
        generators, the quantizers' stochastic-rounding generators, Transformer Engine's
        per-module scaling state: :mod:`lptrain.precision.model_state`); absent on load when
        written at another world size.
        """
        from lptrain.distributed.expert_state import global_expert_state
        from lptrain.distributed.tp_state import global_tp_state

        model: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        params = dict(self.model.named_parameters())
        for child in self.optimizer.children:
            full = child.full_state()
            if child.holds_experts:  # each expert once, under its global canonical name
                full = global_expert_state(full, self.model, self.groups.ep)
            else:  # tensor-parallel shards joined into their single-rank whole
                full = global_tp_state(full, params, self.groups.tp)
            for name, entry in full.items():
                model[name] = entry.pop("master")
                optim[name] = entry
        local = rank_state(self.model, self.model.quantizer_recipe(), self.device)
        local["tensor_model_parallel_size"] = self.groups.tp.size
        local["pipeline_model_parallel_size"] = self.groups.pp.size
        local["context_parallel_size"] = self.groups.cp.size
        sp = state_precision(self.cfg)
        if sp is not None:  # the stored bits and scales of this rank's pieces (bitwise resume)
            local["optimizer_raw"] = [child.raw_state() for child in self.optimizer.children]
        return {
            "global": {"model": model, "optimizer": optim, "scaling": scaling_state(self.model),
                       "optimizer_state_dtypes": sp.saved_dtypes() if sp else dict(FP32_DTYPES)},
            "local": local,
        }

    def _child_entries(self, child: OptimizerChild, g: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
        """``child``'s ``load_full_state`` input from a checkpoint's global part: experts
        picked out of their canonical per-expert entries (any EP size and expert layout)."""
        from lptrain.distributed.expert_state import expert_offset, local_expert_entries
        from lptrain.distributed.tp_state import local_tp_entries

        if child.holds_experts:
            names = [(n, p.shape) for buf in child.buffers for n, p in buf.params.items()]
            return local_expert_entries(names, g["model"], g["optimizer"], expert_offset(self.model))
        entries = {name: {"master": g["model"][name], **g["optimizer"].get(name, {})}
                   for buf in child.buffers for name in buf.params}
        return local_tp_entries(entries, dict(self.model.named_parameters()))

    def load_checkpoint_state(self, state: dict[str, Any]) -> list[str]:
        """Load ``state`` (from :meth:`checkpoint_state`, at any DP, EP, TP or PP size).
        Returns warnings for the log: optimizer state converted from the dtypes it was saved
        in, or re-scaled for another shard layout (:func:`optimizer_state_notes`)."""
        g = state["global"]
        for child in self.optimizer.children:
            child.load_full_state(self._child_entries(child, g))
        # absent when written at another world size: the streams start from (seed, rank); the
        # same at another tensor-, pipeline- or context-parallel size (the ranks hold other
        # shards, other modules, other tokens)
        local = dict(state.get("local") or {})
        sizes = (local.pop("tensor_model_parallel_size", 1), local.pop("pipeline_model_parallel_size", 1),
                 local.pop("context_parallel_size", 1))
        raw = local.pop("optimizer_raw", None)
        if sizes != (self.groups.tp.size, self.groups.pp.size, self.groups.cp.size):
            local, raw = {}, None
        notes = optimizer_state_notes(state_precision(self.cfg), g, self.optimizer.children, raw)
        load_scaling_state(self.model, g.get("scaling") or {})
        with self.params_synced():  # push the loaded masters into the params
            pass
        load_rank_state(self.model, local, self.model.quantizer_recipe())
        return notes
