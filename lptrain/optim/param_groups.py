"""Routing params between Muon and AdamW from the attributes the model sets on them.

The rule is :func:`lptrain.model.params.is_muon_param` (``use_muon`` and not
``is_embedding_or_output``), the same one the layer-wise buffer layout uses, so the optimizer
and the buffers can never disagree. Hidden matrices (QKV, proj, fc1/fc2, router, expert
weights incl. grouped 3-D ones) go to Muon; embeddings, the output head, norms and biases go
to AdamW. Nothing is inferred from names or ``ndim``: an untagged tensor is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch
from torch import nn

from lptrain.model.params import is_muon_param

# Attributes the optimizers read; copy them onto master copies (copy_param_attributes).
PARAM_ATTRIBUTES = (
    "use_muon",
    "is_embedding_or_output",
    "shared_embedding",
    "is_expert",
    "is_qkv",
    "qkv_split_shapes",
    "num_grouped_members",
    "tp_shard",  # a tensor-parallel shard (lptrain.precision.tensor_parallel.TPShard)
)


def copy_param_attributes(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy the optimizer-relevant attributes present on ``src`` onto ``dst``; returns ``dst``.

    For trainers that optimize fp32 master copies: ``dst = p.detach().float().clone()`` loses
    the model's tags, and Muon reads ``is_qkv``/``qkv_split_shapes``/``num_grouped_members``
    from the tensors it is given.
    """
    for name in PARAM_ATTRIBUTES:
        if hasattr(src, name):
            value = getattr(src, name)
            setattr(dst, name, list(value) if isinstance(value, (list, tuple)) else value)
    return dst


def split_params_for_muon(
    params: Union[nn.Module, Iterable[torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
) -> tuple[list[Any], list[Any]]:
    """``(muon_params, adamw_params)`` in input order; every tensor lands in exactly one list.

    ``params`` is a model (its ``parameters()`` with ``requires_grad``; tied weights once), an
    iterable of tensors (e.g. fp32 masters, taken as given; duplicates are dropped), or an
    iterable of ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``, or
    ``zip(names, masters)``), in which case both lists hold the pairs, ready for a named
    :class:`lptrain.optim.muon.MuonWithAdamW`. Raises ``ValueError`` for a tensor without a
    ``use_muon`` attribute (the model tags every param in
    ``lptrain.model.params.tag_parameters``; masters need ``copy_param_attributes``).
    """
    items: list[Any]
    if isinstance(params, nn.Module):
        items = [p for p in params.parameters() if p.requires_grad]
    else:
        items = list(params)
    muon: list[Any] = []
    adamw: list[Any] = []
    seen: set[int] = set()
    for i, item in enumerate(items):
        p = item[1] if isinstance(item, tuple) else item
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not hasattr(p, "use_muon"):
            what = f"{item[0]!r}" if isinstance(item, tuple) else f"#{i}"
            raise ValueError(
                f"split_params_for_muon: tensor {what} of shape {tuple(p.shape)} has no use_muon "
                "attribute; tag the model (tag_parameters) and copy tags onto masters "
                "(copy_param_attributes)"
            )
        (muon if is_muon_param(p) else adamw).append(item)
    return muon, adamw
