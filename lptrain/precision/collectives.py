"""The flat-tensor collectives, under the name the installed torch prefers.

torch 2.13 added ``all_gather_single`` / ``reduce_scatter_single`` and deprecated
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (same arguments, same semantics); GPU
installs commonly run an older torch (NVIDIA's containers), which has only the old names.
Every flat all-gather and reduce-scatter of lptrain goes through these two functions, which
pick the new name when it exists. They live in the lowest package that runs collectives (the
tensor-parallel layers of :mod:`lptrain.precision.tensor_parallel`; the data-parallel engine
and the optimizers above it import them from here). The name is looked up at each call, so a test can wrap
``torch.distributed``'s functions (the virtual CUDA device checks every collective's tensors).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False
) -> Any:
    """``output`` (``size x input.numel()``) = every rank's ``input``, in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False
) -> Any:
    """``output`` = this rank's equal slice of the SUM of every rank's ``input``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def all_gather_uneven(values: torch.Tensor, group: Optional[Any] = None) -> list[torch.Tensor]:
    """Every rank's 1-D ``values`` (of any lengths, same dtype), in rank order. Two
    collectives: the lengths, then the values padded to the longest (the padding is cut off
    again, so each entry holds exactly that rank's elements)."""
    size = dist.get_world_size(group)
    n = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    counts = torch.zeros(size, dtype=torch.int64, device=values.device)
    all_gather_flat(counts, n, group=group)
    lengths = [int(c) for c in counts.tolist()]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    out = torch.empty(size * longest, dtype=values.dtype, device=values.device)
    all_gather_flat(out, padded, group=group)
    return [out[r * longest : r * longest + k] for r, k in enumerate(lengths)]
