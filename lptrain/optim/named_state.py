"""Optimizer state dicts keyed by parameter name instead of position.

torch's ``Optimizer.state_dict()`` keys state by the position of each param in the param
groups; loading it into an optimizer whose params come in another order (a different
registration order, a rank owning a different subset, a model refactor) silently pairs state
with the wrong tensors. When every param group carries ``param_names`` (torch's own convention:
pass ``(name, tensor)`` pairs), :class:`NamedStateMixin` loads by name instead:

* ``state_dict()`` stays torch's format (integer ids, groups with ``param_names``), which is
  what ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` expects and turns
  into fully-qualified-name keys;
* ``named_state_dict()`` is that same content keyed by name (the layout
  ``get_optimizer_state_dict`` produces when the names are the model's FQNs);
* ``load_state_dict()`` accepts either form and pairs state with params by name, groups by
  their ``name`` key (else by position); a param missing from, or unexpected in, the saved
  state is an error naming it.

Two more fixes over torch's loader: group dicts keep their identity across a load (holders of
``opt.param_groups[i]`` keep driving the live group), and fp32 ``momentum_buffer`` state is
restored in fp32 even for low-precision params (torch casts every floating state tensor to the
param's dtype on load, which would round a bf16 param's fp32 momentum to bf16).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

FP32_STATE_KEYS = ("momentum_buffer",)


def _group_names(group: dict[str, Any], where: str) -> list[str]:
    """The names of a saved group's params, in the order of its ``params`` entries.

    Name-keyed groups list names in ``params`` itself; those win over ``param_names``, which
    ``set_optimizer_state_dict`` copies from the saved group while listing ``params`` in the
    live optimizer's order.
    """
    params = group["params"]
    names = params if params and all(isinstance(p, str) for p in params) else None
    if names is None:
        names = group.get("param_names")
    if names is None and not params:
        names = []
    if names is None:
        raise ValueError(
            f"{where}: the saved optimizer state has no parameter names; build the optimizer "
            "without names to load it by position"
        )
    return list(names)


def _match_groups(
    live: list[dict[str, Any]], saved: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Saved groups in the order of ``live``: by ``name`` when both sides name every group."""
    if len(live) != len(saved):
        raise ValueError(
            f"optimizer state has {len(saved)} param groups, this optimizer has {len(live)}"
        )
    if all("name" in g for g in live) and all("name" in g for g in saved):
        by_name = {g["name"]: g for g in saved}
        missing = [g["name"] for g in live if g["name"] not in by_name]
        if missing:
            raise ValueError(
                f"optimizer state has no param group named {', '.join(missing)} "
                f"(it has {', '.join(by_name)})"
            )
        return [by_name[g["name"]] for g in live]
    return list(saved)


def _short(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def remap_by_name(saved: dict[str, Any], live: list[dict[str, Any]]) -> dict[str, Any]:
    """``saved`` re-keyed so torch's positional ``load_state_dict`` pairs state by name.

    ``live`` are the optimizer's param groups, each with ``param_names``. ``saved`` is a torch
    state dict whose groups carry ``param_names``, or a name-keyed one (``named_state_dict()``).
    The result lists the saved groups' hyperparameters in live order with this optimizer's
    names, and state under consecutive ids in live param order.
    """
    groups = _match_groups(live, saved["param_groups"])
    state: dict[Any, Any] = {}
    out_groups = []
    next_id = 0
    for live_g, saved_g in zip(live, groups, strict=True):
        where = f"param group {live_g.get('name', len(out_groups))!r}"
        saved_names = _group_names(saved_g, where)
        keys = saved_g["params"]
        by_name = {
            n: saved["state"][k] for n, k in zip(saved_names, keys, strict=True)
            if k in saved["state"]
        }
        live_names = list(live_g["param_names"])
        missing = sorted(set(live_names) - set(saved_names))
        extra = sorted(set(saved_names) - set(live_names))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing from the saved state: {_short(missing)}")
            if extra:
                parts.append(f"in the saved state but not in this optimizer: {_short(extra)}")
            raise ValueError(f"optimizer state, {where}: params {'; '.join(parts)}")
        ids = list(range(next_id, next_id + len(live_names)))
        next_id += len(live_names)
        for i, name in zip(ids, live_names, strict=True):
            if name in by_name:
                state[i] = by_name[name]
        g = {k: v for k, v in saved_g.items() if k not in ("params", "param_names")}
        g["params"], g["param_names"] = ids, live_names
        out_groups.append(g)
    return {"state": state, "param_groups": out_groups}


class NamedStateMixin:
    """Name-aware ``load_state_dict`` and ``named_state_dict`` for a ``torch.optim.Optimizer``.

    Mix in before ``torch.optim.Optimizer``. Without ``param_names`` on the groups, loading
    is torch's positional one (plus stable group dicts and fp32 momentum).
    """

    param_groups: list[dict[str, Any]]
    state: Any

    def has_param_names(self) -> bool:
        return bool(self.param_groups) and all("param_names" in g for g in self.param_groups)

    def named_state_dict(self) -> dict[str, Any]:
        """``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``."""
        if not self.has_param_names():
            raise ValueError("named_state_dict needs names: build the optimizer with (name, param)")
        sd = self.state_dict()  # type: ignore[misc]
        state: dict[str, Any] = {}
        groups = []
        for g in sd["param_groups"]:
            for pid, name in zip(g["params"], g["param_names"], strict=True):
                if pid in sd["state"]:
                    state[name] = sd["state"][pid]
            ng = {k: v for k, v in g.items() if k != "param_names"}
            ng["params"] = list(g["param_names"])
            groups.append(ng)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.has_param_names():
            state_dict = remap_by_name(state_dict, self.param_groups)
        elif any(isinstance(k, str) for k in state_dict["state"]):
            raise ValueError(
                "optimizer state is keyed by parameter name; build the optimizer with "
                "(name, param) pairs to load it"
            )
        # Saved fp32 buffers, by live param, before torch casts them to the param dtype.
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        fp32: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        for p, i in zip(params, saved_ids, strict=False):
            for key in FP32_STATE_KEYS:
                value = state_dict["state"].get(i, {}).get(key)
                if isinstance(value, torch.Tensor):
                    fp32.append((p, key, value))
        old_groups = list(self.param_groups)
        super().load_state_dict(state_dict)  # type: ignore[misc]
        for i, (old, new) in enumerate(zip(old_groups, self.param_groups, strict=True)):
            old.clear()
            old.update(new)
            self.param_groups[i] = old
        for p, key, value in fp32:
            self.state[p][key] = copy.deepcopy(value).to(device=p.device, dtype=torch.float32)
