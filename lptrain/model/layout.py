"""How hidden states are stored: batch-first ``[b, s, h]``, or sequence-first.

Model code indexes activations as ``[b, s, h]`` everywhere. Under sequence parallelism on
Transformer Engine the layer stack *stores* them sequence-first (memory ``[s, b, h]``, seen
through a ``transpose(0, 1)`` view): TE's ``Linear`` all-gathers and reduce-scatters its
sequence-parallel operands along the first dimension of a contiguous ``[s, b, h]`` tensor
(Megatron-LM's layout), so a layer stack stored that way hands TE its input, takes its output
and passes the gradients back without a copy. Elementwise ops, norms and residual adds keep
the storage of their input; the places that split or assemble an activation (the attention's
QKV split and head merge, the SwiGLU halves, the MoE layer) work in storage order with these
helpers, so their backward builds gradients stored the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def sequence_first(x: torch.Tensor) -> bool:
    """Whether ``x`` (``[b, s, ...]``, more than one sequence) is stored sequence-first:
    ``x.transpose(0, 1)`` is contiguous and ``x`` is not."""
    return x.dim() >= 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous()


def merge_last_dims_like(o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``o [b, s, *rest]`` with its trailing dimensions merged (``[b, s, prod(rest)]``), stored
    as ``x`` is: one copy either way (the attention's ``[b, s, heads, d]`` output)."""
    b, s = o.shape[:2]
    if sequence_first(x):
        return o.transpose(0, 1).reshape(s, b, -1).transpose(0, 1)
    return o.reshape(b, s, -1)


def stored_like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` (``x``'s shape, batch-first) stored as ``x`` is: one copy where ``x`` is stored
    sequence-first and ``y`` is not, else ``y`` itself."""
    if sequence_first(x) and not sequence_first(y):
        return y.transpose(0, 1).contiguous().transpose(0, 1)
    return y


def rowwise_in_storage_order(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (each ``[..., h]`` row on its own), run on ``x`` in
    storage order: the same values, and a backward whose gradient (assembled by ``fn``'s
    splits) is stored as ``x`` is."""
    if sequence_first(x):
        return fn(x.transpose(0, 1)).transpose(0, 1)
    return fn(x)
