"""Checkpoint state of the layer-wise Muon child (:class:`lptrain.optim.layerwise.LayerWiseMuon`):
every owned unit's fp32 master and momentum as full tensors per parameter name, and back for
any data-parallel size or ownership.

With the precision-aware optimizer the momentum is stored as Adam's ``exp_avg``
(``optimizer.exp_avg_dtype``, TE's per-tensor scaling, :mod:`lptrain.precision.optimizer_states`):
a checkpoint keeps a bf16 momentum as bf16 and an fp16 or fp8 one as its fp32 value, and the
rank's local state keeps the stored bits and scale (``raw_state``) for a bitwise resume with
the same owners.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lptrain.precision.optimizer_states import (
    load_stored_,
    make_state,
    store_scaled,
    stored_tensors,
    unscale,
)

if TYPE_CHECKING:
    from lptrain.distributed.buffers import ParamAndGradBuffer
    from lptrain.optim.layerwise import MuonUnit, OwnedUnit
    from lptrain.optim.muon import Muon
    from lptrain.optim.precision_aware import StatePrecision


class LayerWiseStateMixin:
    """Needs ``pieces`` (owned units), ``optimizer`` (Muon), ``buffers``, ``_stepped`` and
    ``state_precision``."""

    pieces: Sequence[OwnedUnit]
    optimizer: Muon
    buffers: list[ParamAndGradBuffer]
    _stepped: bool
    state_precision: Optional[StatePrecision]

    def _momentum(self, pc: OwnedUnit) -> torch.Tensor:
        """The unit's momentum as a checkpoint keeps it: fp32 and bf16 as stored, fp16 and fp8
        (the precision-aware optimizer's) as their fp32 values."""
        st = self.optimizer.state[pc.master]
        stored = st["momentum_buffer"]
        if torch.is_tensor(stored) and stored.dtype in (torch.float32, torch.bfloat16):
            return stored
        return unscale(stored, st.get("momentum_scale"))

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{name: {"master", "momentum_buffer"}}`` full tensors (fp32; the momentum bf16 when
        the precision-aware optimizer stores it so), identical on every rank (owners fill their
        units, one SUM all-reduce per buffer group). Collective."""
        sp = self.state_precision
        mom_dtype = torch.bfloat16 if sp is not None and sp.exp_avg == "bf16" else torch.float32
        dtypes = {"master": torch.float32, **({"momentum_buffer": mom_dtype} if self._stepped else {})}
        out = {
            name: {k: torch.zeros(p.shape, dtype=dt, device=p.device) for k, dt in dtypes.items()}
            for buf in self.buffers for name, p in buf.params.items()
        }
        for pc in self.pieces:
            u = pc.unit
            vals = {"master": pc.master}
            if self._stepped:
                vals["momentum_buffer"] = self._momentum(pc)
            for k, v in vals.items():
                dst = out[u.name][k]
                (dst[u.member] if u.member >= 0 else dst).copy_(v)
        for buf in self.buffers:
            g = buf.groups.intra
            if g.active:
                for name in buf.params:
                    for v in out[name].values():
                        dist.all_reduce(v, group=g.pg)
        return out

    def load_full_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`full_state` (any DP size or layout wrote it; a momentum saved in
        another dtype is stored in this run's)."""
        dtype = self.optimizer.param_groups[0].get("momentum_dtype", torch.float32)
        with torch.no_grad():
            self.optimizer.state.clear()
            for pc in self.pieces:
                u = pc.unit
                entry = state[u.name]

                def part(t: torch.Tensor, u: MuonUnit = u) -> torch.Tensor:
                    return t[u.member] if u.member >= 0 else t

                pc.master.copy_(part(entry["master"]).view(pc.master.shape))
                if "momentum_buffer" in entry:
                    mom = part(entry["momentum_buffer"]).to(torch.float32).clone().view(pc.master.shape)
                    st: dict[str, Any] = {"momentum_buffer": make_state(dtype, pc.master)}
                    if dtype != torch.float32:
                        st["momentum_scale"] = torch.ones(1, dtype=torch.float32, device=mom.device)
                    store_scaled(st["momentum_buffer"], mom, st.get("momentum_scale"))
                    self.optimizer.state[pc.master] = st
            self._stepped = "momentum_buffer" in next(iter(state.values()), {})

    def raw_state(self) -> dict[str, Any]:
        """The stored momentum bits and scale of every owned unit (precision-aware only)."""
        if self.state_precision is None:
            return {}
        return {f"{pc.unit.name}[{pc.unit.member}]": {
                    k: ({n: t.clone() for n, t in stored_tensors(v).items()} if k == "momentum_buffer"
                        else v.clone())
                    for k, v in self.optimizer.state[pc.master].items()}
                for pc in self.pieces if self.optimizer.state.get(pc.master)}

    def load_raw_state(self, raw: dict[str, Any]) -> bool:
        """Restore :meth:`raw_state` bitwise; False when a unit is missing (other ownership)."""
        if self.state_precision is None:
            return True
        complete = True
        with torch.no_grad():
            for pc in self.pieces:
                st = self.optimizer.state.get(pc.master)
                entry = raw.get(f"{pc.unit.name}[{pc.unit.member}]")
                if not st or entry is None or set(entry) != set(st):
                    complete = complete and not st
                    continue
                load_stored_(st["momentum_buffer"], entry["momentum_buffer"])
                if "momentum_scale" in st:
                    st["momentum_scale"].copy_(entry["momentum_scale"])
        return complete


