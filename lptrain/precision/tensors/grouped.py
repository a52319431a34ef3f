"""Grouped quantized tensors: N same-recipe members (MoE experts) in one storage per field.

Like TE's ``GroupedTensor``: one flat 1-D buffer per field (``rowwise_data``,
``rowwise_scale_inv``, ...), member i's buffers are views at fixed offsets into it, so the whole
group can be placed in a parameter buffer or all-gathered as one tensor while each expert is
still quantized on its own (own amax, own blocks, own global scale): member i is bitwise equal to
quantizing expert i alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from .base import Orientation, QuantizedTensor

# per field: (offset, numel, shape) of every member
_Layout = dict[str, list[tuple[int, int, tuple[int, ...]]]]


class GroupedQuantizedTensor(QuantizedTensor):
    """Logical shape [N, *member_shape]; ``member(i)`` returns a view-backed QuantizedTensor."""

    _members: list[QuantizedTensor]
    _layout: _Layout

    @classmethod
    def from_members(cls, members: Sequence[QuantizedTensor]) -> GroupedQuantizedTensor:
        """Copy separately quantized members into flat buffers and re-point them at views."""
        if not members:
            raise ValueError("a grouped tensor needs at least one member")
        first = members[0]
        for m in members:
            if type(m) is not type(first) or tuple(m.shape) != tuple(first.shape):
                raise ValueError("grouped members must share family and shape")
            if m.dtype != first.dtype:
                raise ValueError("grouped members must share dtype")
        layout: _Layout = {}
        flat: dict[str, Optional[torch.Tensor]] = {}
        for name, t0 in first._fields.items():
            if t0 is None:
                continue
            parts = [m._fields[name] for m in members]
            if any(p is None for p in parts):
                raise ValueError(f"member buffers {name!r} present in some members only")
            offs, off = [], 0
            for p in parts:
                offs.append((off, p.numel(), tuple(p.shape)))  # type: ignore[union-attr]
                off += p.numel()  # type: ignore[union-attr]
            layout[name] = offs
            flat[name] = torch.cat([p.reshape(-1) for p in parts])  # type: ignore[union-attr]
        return cls._build(first, flat, layout, len(members), [m._hp_init for m in members])

    @classmethod
    def _build(
        cls,
        template: QuantizedTensor,
        flat: dict[str, Optional[torch.Tensor]],
        layout: _Layout,
        n: int,
        hp_inits: Sequence[Optional[torch.Tensor]],
    ) -> GroupedQuantizedTensor:
        self = torch.Tensor._make_wrapper_subclass(
            cls, (n, *template.shape), dtype=template.dtype, device=template.device
        )
        self._quantizer = template._quantizer
        self._fields = dict(flat)
        self._layout = layout
        self._hp_init = None
        self._members = []
        for i in range(n):
            fields = {
                name: flat[name][off : off + numel].view(shape)  # type: ignore[index]
                for name, offs in layout.items()
                for (off, numel, shape) in [offs[i]]
            }
            member = type(template)(
                template.shape,
                template.dtype,
                quantizer=template._quantizer,
                fields=fields,
                device=template.device,
            )
            member._hp_init = hp_inits[i]
            self._members.append(member)
        return self

    # ---- member access ------------------------------------------------------------------------

    @property
    def num_members(self) -> int:
        return len(self._members)

    def member(self, i: int) -> QuantizedTensor:
        return self._members[i]

    def members(self) -> list[QuantizedTensor]:
        return list(self._members)

    # ---- interface overrides ------------------------------------------------------------------

    @property
    def staging_dtype(self) -> torch.dtype:
        return self._members[0].staging_dtype

    def has_orientation(self, orientation: str) -> bool:
        return self._members[0].has_orientation(orientation)

    def _dequantize_2d(self, orientation: Orientation) -> torch.Tensor:
        raise NotImplementedError  # dequantize() is overridden

    def dequantize(self, orientation: str = "rowwise") -> torch.Tensor:
        return torch.stack([m.dequantize(orientation) for m in self._members])

    def requantize_from(self, src: torch.Tensor | Sequence[torch.Tensor]) -> None:
        if len(src) != self.num_members:
            raise ValueError(f"expected {self.num_members} members, got {len(src)}")
        for m, x in zip(self._members, src, strict=True):
            m.requantize_from(x)

    def update_usage(self, *, rowwise: bool, columnwise: bool) -> None:
        """Drop an orientation's flat buffers (and the members' views), in place. Rebuilding an
        absent orientation is not supported for groups (requantize from high precision)."""
        want = {"rowwise": rowwise, "columnwise": columnwise}
        if any(keep and not self.has_orientation(o) for o, keep in want.items()):
            raise ValueError("a grouped tensor cannot rebuild a dropped orientation")
        for m in self._members:
            m.update_usage(rowwise=rowwise, columnwise=columnwise)
        for k in list(self._fields):
            if self._members[0]._fields.get(k) is None:
                self._fields[k] = None
                self._layout.pop(k, None)
        self._quantizer = self._members[0]._quantizer

    def storage_views(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._fields.items() if v is not None}

    def nbytes(self, orientation: Optional[str] = None) -> int:  # type: ignore[override]
        return sum(m.nbytes(orientation) for m in self._members)

    def high_precision_init_value(self) -> Optional[torch.Tensor]:
        inits = [m.high_precision_init_value() for m in self._members]
        if any(i is None for i in inits):
            return None
        return torch.stack(inits)  # type: ignore[arg-type]

    def clear_high_precision_init_value(self) -> None:
        for m in self._members:
            m.clear_high_precision_init_value()

    def _assign_fields(self, new: dict[str, Optional[torch.Tensor]]) -> None:
        for k, dst in self._fields.items():
            src = new.get(k)
            if dst is not None and src is not None:
                dst.copy_(src.reshape(dst.shape))

    def _same_layout(self, other: torch.Tensor) -> bool:
        return (
            isinstance(other, GroupedQuantizedTensor)
            and other._layout == self._layout
            and type(other._members[0]) is type(self._members[0])
        )

    def _rewrap_flat(self, flat: dict[str, Optional[torch.Tensor]]) -> GroupedQuantizedTensor:
        return self._build(
            self._members[0], flat, self._layout, self.num_members,
            [m._hp_init for m in self._members],
        )

    def _shallow_copy(self) -> QuantizedTensor:
        return self._rewrap_flat(dict(self._fields))

    def _deep_copy(self) -> QuantizedTensor:
        return self._rewrap_flat({k: None if v is None else v.clone() for k, v in self._fields.items()})
