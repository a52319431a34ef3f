"""Optimizer/buffer metadata on parameters, set in one place from the module structure.

``tag_parameters(model)`` walks the modules by type (never by parameter name) and sets on
every parameter:

* ``is_embedding_or_output`` -- token embedding / output head (AdamW, own LR overrides);
* ``shared_embedding`` -- True on the embedding when the head is tied to it;
* ``is_expert`` -- routed-expert weights (own DDP buffers, expert optimizer);
* ``is_qkv`` + ``qkv_split_shapes`` -- fused QKV weight and its per-group Q/K/V row split;
* ``num_grouped_members`` -- for a single grouped expert weight ``[E_local, out, in]``:
  it is logically ``E_local`` matrices; Muon must orthogonalise each member so that the
  single-grouped and discrete layouts get identical updates (upstream would route this 3-D
  tensor to Adam; lptrain keeps the optimizer layout-independent instead);
* ``use_muon`` -- True for hidden matrices: QKV, projections, fc1/fc2, expert weights and
  the router weight (2-D; upstream's ``_is_muon_excluded`` sends it to Muon too); False for
  embeddings, the output head, norm weights and biases.
"""

from __future__ import annotations

import torch
from torch import nn

from lptrain.model.attention import SelfAttention
from lptrain.model.moe.experts import GroupedMLP, SequentialMLP
from lptrain.model.norm import RMSNorm


def tag_parameters(model: nn.Module) -> None:
    """Set the metadata attributes documented above on every parameter of ``model``."""
    for p in model.parameters():
        p.is_embedding_or_output = False
        p.shared_embedding = False
        p.is_expert = False
        p.is_qkv = False
        p.use_muon = p.dim() >= 2
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.use_muon = False
        elif isinstance(m, SelfAttention):
            m.linear_qkv.weight.is_qkv = True
            m.linear_qkv.weight.qkv_split_shapes = m.qkv_split_shapes
        elif isinstance(m, (GroupedMLP, SequentialMLP)):
            for p in m.parameters():
                p.is_expert = True
                if p.dim() == 3:
                    p.num_grouped_members = p.shape[0]
        bias = getattr(m, "bias", None)
        if isinstance(bias, nn.Parameter):
            bias.use_muon = False
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        embedding.weight.is_embedding_or_output = True
        embedding.weight.use_muon = False
        embedding.weight.shared_embedding = bool(getattr(model, "tie_embeddings", False))
    head = getattr(model, "output_layer", None)
    if head is not None:
        head.weight.is_embedding_or_output = True
        head.weight.use_muon = False


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Routed-expert parameters (``is_expert``), in ``model.parameters()`` order."""
    return [p for p in model.parameters() if getattr(p, "is_expert", False)]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (attention, dense MLPs, norms, router, embeddings, head)."""
    return [p for p in model.parameters() if not getattr(p, "is_expert", False)]


def named_expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if getattr(p, "is_expert", False)]


def named_dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if not getattr(p, "is_expert", False)]


def is_muon_param(p: torch.Tensor) -> bool:
    """The routing rule the optimizer and the buffer layout share (upstream semantics)."""
    return bool(getattr(p, "use_muon", False)) and not getattr(p, "is_embedding_or_output", False)
