"""Checkpoint state of a byte-sharded optimizer child (:class:`lptrain.optim.distributed.
ShardedMasterOptimizer`): full tensors per parameter name, gathered over the shard group, and
back for any shard layout.

``full_state()`` is ``{param name: {"master": fp32, <state>: ...}}``: the fp32 master (the
model's high-precision weights) and every optimizer state -- torch's AdamW / Lion / Muon
state as fp32, or the precision-aware optimizer's as :func:`lptrain.optim.precision_aware.
piece_states` gives it (bf16 moments stay bf16; fp16 and fp8 ones as their fp32 values).
``load_full_state`` stores each value in this run's form (a saved bf16 moment loaded into an
fp32 run is widened, an fp32 one loaded into a bf16 run rounded: the engine says so).

``raw_state()`` / ``load_raw_state()`` (precision-aware only) are the stored bits of every
piece -- FP8 codes, fp16 values, scales, remainders, the bf16 param a TE-held master wrote --
keyed by the piece's parameter and element range, for a bitwise resume at the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lptrain.optim.precision_aware import (
    load_piece_states,
    load_raw_states,
    master_value,
    piece_states,
    raw_states,
)

if TYPE_CHECKING:
    from lptrain.distributed.buffers import ParamAndGradBuffer
    from lptrain.distributed.groups import Group
    from lptrain.optim.precision_aware import StatePrecision


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.rsplit(".", 1)[-1])


class ShardedStateMixin:
    """``full_state`` / ``load_full_state`` / ``raw_state`` / ``load_raw_state`` of a child
    with ``pieces`` (name, param, p_lo, p_hi, master), ``optimizers``, ``buffers``, ``group``,
    ``device`` and ``state_precision``."""

    pieces: Sequence[Any]
    optimizers: list[torch.optim.Optimizer]
    buffers: list[ParamAndGradBuffer]
    group: Group
    device: torch.device
    state_precision: Optional[StatePrecision]

    def _owner(self, t: torch.Tensor) -> torch.optim.Optimizer:
        for opt in self.optimizers:
            for g in opt.param_groups:
                if any(x is t for x in g["params"]):
                    return opt
        raise KeyError("tensor not in any optimizer")

    def _piece_values(self, pc: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The piece's fp32 master and its optimizer state as a checkpoint keeps them."""
        opt = self._owner(pc.master)
        sp = self.state_precision
        if sp is None or opt is getattr(self, "muon", None):
            return pc.master, dict(opt.state.get(pc.master, {}))
        return master_value(opt, pc.master), piece_states(opt, pc.master, sp)

    def _param(self, name: str) -> torch.nn.Parameter:
        for buf in self.buffers:
            if name in buf.params:
                return buf.params[name]
        raise KeyError(name)

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{param name: {"master": ..., <optimizer state>: ...}}`` with full tensors (pieces
        of sharded params gathered), identical on every rank of ``self.group``. Collective."""
        values = [self._piece_values(pc) for pc in self.pieces]
        vector: dict[str, str] = {}  # state name -> dtype
        scalar: set[str] = set()
        for pc, (_, st) in zip(self.pieces, values, strict=True):
            for k, v in st.items():
                if torch.is_tensor(v) and v.numel() == pc.master.numel() and v.dim() > 0:
                    vector[k] = str(v.dtype)
                else:
                    scalar.add(k)
        sharded = self.group.active and any(b.sharded for b in self.buffers)
        if sharded:
            found: list[Any] = [None] * self.group.size
            dist.all_gather_object(found, (sorted(vector.items()), sorted(scalar)), group=self.group.pg)
            for vk, sk in found:
                vector.update(dict(vk))
                scalar.update(sk)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for buf in self.buffers:
            for name, p in buf.params.items():
                entry = {"master": torch.zeros(p.numel(), dtype=torch.float32, device=self.device)}
                entry.update({k: torch.zeros(p.numel(), dtype=_dtype(vector[k]), device=self.device)
                              for k in sorted(vector)})
                entry.update({k: torch.zeros((), dtype=torch.float64, device=self.device)
                              for k in sorted(scalar)})
                out[name] = entry
        for pc, (master, st) in zip(self.pieces, values, strict=True):
            entry = out[pc.name]
            entry["master"][pc.p_lo : pc.p_hi] = master.reshape(-1)
            for k, v in st.items():
                if k in vector:
                    entry[k][pc.p_lo : pc.p_hi] = v.reshape(-1)
                elif torch.is_tensor(v):
                    entry[k].copy_(v)  # a 0-dim state (AdamW's step): no host round trip
                else:
                    entry[k].fill_(v)
        if sharded:
            for buf in self.buffers:
                if not buf.sharded:
                    continue  # replicated: already identical everywhere
                for name in buf.params:
                    for v in out[name].values():
                        op = dist.ReduceOp.SUM if v.dim() else dist.ReduceOp.MAX
                        dist.all_reduce(v, op=op, group=self.group.pg)  # disjoint pieces
        for name, entry in out.items():
            shape = self._param(name).shape
            for k in ("master", *vector):
                entry[k] = entry[k].view(shape)
        return out

    def load_full_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`full_state`, for any shard layout (resharding)."""
        sp = self.state_precision
        with torch.no_grad():
            for opt in self.optimizers:
                for g in opt.param_groups:
                    for t in g["params"]:
                        opt.state.pop(t, None)
            for pc in self.pieces:
                entry = state[pc.name]
                master = entry["master"].reshape(-1)[pc.p_lo : pc.p_hi].view(pc.master.shape)
                opt = self._owner(pc.master)
                st: dict[str, Any] = {}
                for k, v in entry.items():
                    if k == "master":
                        continue
                    if v.dim() > 0:  # (a moment saved in another dtype is converted here)
                        st[k] = v.reshape(-1)[pc.p_lo : pc.p_hi].view(pc.master.shape)
                    else:
                        st[k] = v.to(torch.float32).clone()
                if sp is not None and opt is not getattr(self, "muon", None):
                    load_piece_states(opt, pc.master, master, st)
                    continue
                pc.master.copy_(master)
                st = {k: v.float().clone() if v.dim() else v for k, v in st.items()}
                if st:
                    opt.state[pc.master] = st

    # ---- the stored bits, for a bitwise resume at the same layout ------------------------------

    def _raw_key(self, pc: Any) -> str:
        return f"{pc.name}[{pc.p_lo}:{pc.p_hi}]"

    def raw_state(self) -> dict[str, Any]:
        """Every piece's stored state (and, TE holding its master, its param slice)."""
        if self.state_precision is None:
            return {}
        out: dict[str, Any] = {}
        for pc in self.pieces:
            opt = self._owner(pc.master)
            if opt is getattr(self, "muon", None):
                continue
            raw = raw_states(opt, pc.master)
            if getattr(opt, "master_weights", False):
                raw["param"] = pc.master.detach().clone()
            out[self._raw_key(pc)] = raw
        return out

    def load_raw_state(self, raw: dict[str, Any]) -> bool:
        """Restore :meth:`raw_state` of the same layout; False when any piece is not in it (a
        layout change: those pieces keep what :meth:`load_full_state` stored)."""
        if self.state_precision is None:
            return True
        complete = True
        with torch.no_grad():
            for pc in self.pieces:
                opt = self._owner(pc.master)
                if opt is getattr(self, "muon", None):
                    continue
                entry = raw.get(self._raw_key(pc))
                if entry is None:
                    complete = False
                    continue
                entry = dict(entry)
                param = entry.pop("param", None)
                if not load_raw_states(opt, pc.master, entry):
                    complete = False
                    continue
                if param is not None:
                    pc.master.copy_(param.view(pc.master.shape))
        return complete
