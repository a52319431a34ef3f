"""Top-k router: fp32 gating GEMM, score function, top-k, load-balancing and z-losses.

Follows Megatron's ``TopKRouter`` / ``topk_routing_with_score_function`` defaults:

* ``softmax``: top-k on the logits, then softmax over the k chosen logits (Megatron's
  ``moe_router_pre_softmax=False``), so the k probabilities sum to 1. This equals softmax over
  all experts, top-k, renormalise.
* ``sigmoid`` and ``sqrtsoftplus`` (independent per-expert scores ``sigmoid(logits)`` or
  ``sqrt(softplus(logits))``, as Megatron): with ``enable_expert_bias`` the selection uses
  ``scores + expert_bias`` (aux-loss-free balancing) but the probabilities use the unbiased
  scores, renormalised over the top-k when ``k > 1`` (with ``k = 1`` the one score is the
  probability, so the router still gets a gradient; softmax over one logit would not).

The gating weight ``[num_experts, hidden]`` is a plain high-precision parameter (stored in
``params_dtype``, never quantized, not built by the layer factory); the GEMM runs in fp32.
Like upstream, it is a 2-D matrix and therefore goes to Muon (``use_muon`` stays True).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lptrain.config.schema import MoEConfig
from lptrain.model.init import InitMethod
from lptrain.model.process_group import SINGLE_RANK, ProcessGroup


def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits).sqrt()


# Score functions that score each expert on its own (the ones the expert bias pairs with).
INDEPENDENT_SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": _sqrt_softplus,
}
SCORE_FUNCTIONS = ("softmax", *INDEPENDENT_SCORES)


def _independent_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    try:
        return INDEPENDENT_SCORES[score_function](logits)
    except KeyError:
        raise ValueError(f"unknown score_function {score_function!r}") from None


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    expert_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [T, k] fp32, indices [T, k] int64)`` from fp32 ``logits [T, E]``."""
    if score_function == "softmax":
        if expert_bias is not None:
            raise ValueError("the expert bias needs score_function=sigmoid or sqrtsoftplus")
        _, indices = torch.topk(logits, topk, dim=-1)
        probs = torch.softmax(logits.gather(1, indices), dim=-1)
        return probs, indices
    scores = _independent_scores(logits, score_function)
    select = scores + expert_bias if expert_bias is not None else scores
    _, indices = torch.topk(select, topk, dim=-1)
    probs = scores.gather(1, indices)
    if topk > 1:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    return probs, indices


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Dense per-expert scores the balancing loss is taken over (Megatron's
    ``compute_routing_scores_for_aux_loss``): softmax, or the independent scores normalised
    over experts."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = _independent_scores(logits, score_function)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_load_balancing_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, topk: int, coeff: float
) -> torch.Tensor:
    """``E * coeff / (k * T^2) * sum_i (sum_x p_xi) * tokens_i`` (Switch / Megatron)."""
    num_experts = scores.shape[-1]
    aggregated = scores.sum(dim=0)
    scale = num_experts * coeff / (topk * num_tokens * num_tokens)
    return torch.sum(aggregated * tokens_per_expert.to(scores.dtype)) * scale


def seq_load_balancing_loss(
    scores: torch.Tensor, indices: torch.Tensor, batch: int, topk: int, coeff: float,
    sequence_group: ProcessGroup = SINGLE_RANK,
) -> torch.Tensor:
    """Per-sequence Switch loss (DeepSeek-V2), averaged over the ``batch`` sequences.

    ``scores [B*S, E]`` and ``indices [B*S, k]`` are in ``[batch, seq]`` token order. Under
    sequence parallelism (``sequence_group``: the ranks holding the other parts of each
    sequence) each sequence's expert counts are summed over the group and ``S`` is the whole
    length, so the ranks' losses sum to the single-rank loss.
    """
    num_experts = scores.shape[-1]
    seq = scores.shape[0] // batch
    s = scores.view(batch, seq, num_experts)
    counts = torch.zeros(batch, num_experts, dtype=scores.dtype, device=scores.device)
    idx = indices.reshape(batch, seq * topk)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=scores.dtype))
    if sequence_group.active:
        import torch.distributed as dist

        dist.all_reduce(counts, group=sequence_group.pg)
        seq *= sequence_group.size
    scale = num_experts * coeff / (topk * seq * seq)
    return torch.sum(s.sum(dim=1) * counts) * scale / batch


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss ``coeff * mean(logsumexp(logits)^2)`` (ST-MoE)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


@dataclass
class Routing:
    """One router call: what dispatch needs plus the coefficient-weighted losses."""

    probs: torch.Tensor  # [T, k] fp32
    indices: torch.Tensor  # [T, k] int64, global expert ids
    tokens_per_expert: torch.Tensor  # [E] int64
    aux_loss: torch.Tensor  # scalar fp32, already times aux_loss_coeff
    z_loss: torch.Tensor  # scalar fp32, already times z_loss_coeff


class TopKRouter(nn.Module):
    """Gating linear + top-k selection + balancing losses for one MoE layer.

    ``sequence_parallel_group`` (set by the parallelize step under sequence parallelism: the
    tensor-parallel group, whose ranks route different parts of the same sequences): the
    weight's gradient is summed over it. ``token_group`` (None: the same group; under context
    parallelism tensor x context parallel, or context parallel without sequence parallelism):
    the ranks holding other parts of the same sequences -- the balancing losses use its summed
    expert counts and token totals and the z-loss is divided by its size, so the ranks' losses
    add up to the single-rank ones (Megatron-LM reduces the router statistics over TP x CP).
    Under context parallelism the weight's gradient is summed by the data x context parallel
    reduction instead.
    """

    sequence_parallel_group: ProcessGroup = SINGLE_RANK
    token_group: Optional[ProcessGroup] = None

    def __init__(
        self, hidden_size: int, moe: MoEConfig, params_dtype: torch.dtype, init_method: InitMethod
    ) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.topk = moe.router_topk
        self.score_function = moe.score_function
        self.load_balancing_type = moe.load_balancing_type
        self.aux_loss_coeff = moe.aux_loss_coeff
        self.z_loss_coeff = moe.z_loss_coeff
        self.bias_update_rate = moe.bias_update_rate
        if self.load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise ValueError(f"unknown load_balancing_type {self.load_balancing_type!r}")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"router_topk {self.topk} not in [1, {self.num_experts}]")
        self.weight = nn.Parameter(torch.empty(self.num_experts, hidden_size, dtype=params_dtype))
        init_method(self.weight.data)
        self.enable_expert_bias = moe.enable_expert_bias
        if self.enable_expert_bias:
            if self.score_function not in INDEPENDENT_SCORES:
                raise ValueError("enable_expert_bias needs score_function=sigmoid or sqrtsoftplus")
            # fp32 buffers: the bias is checkpointed; the counts are per-step scratch.
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x [..., hidden]`` (flattened to ``T`` tokens, batch-major)."""
        batch = x.shape[0] if x.dim() == 3 else 1
        flat = x.reshape(-1, x.shape[-1]).float()
        weight = self.weight
        if self.sequence_parallel_group.active:
            from lptrain.precision.tensor_parallel import reduce_grad

            weight = reduce_grad(weight, self.sequence_parallel_group)
        sp = self.token_group if self.token_group is not None else self.sequence_parallel_group
        logits = flat @ weight.float().t()  # fp32 router GEMM
        bias = self.expert_bias if self.enable_expert_bias else None
        probs, indices = topk_routing(logits, self.topk, self.score_function, bias)
        tokens_per_expert = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        zero = logits.new_zeros(())
        aux = zero
        if self.aux_loss_coeff > 0 and self.load_balancing_type != "none":
            scores = scores_for_aux_loss(logits, self.score_function)
            if self.load_balancing_type == "aux_loss":
                counts, tokens = tokens_per_expert, flat.shape[0]
                if sp.active:
                    import torch.distributed as dist

                    counts = tokens_per_expert.clone()
                    dist.all_reduce(counts, group=sp.pg)
                    tokens *= sp.size
                aux = switch_load_balancing_loss(scores, counts, tokens, self.topk, self.aux_loss_coeff)
            else:
                aux = seq_load_balancing_loss(scores, indices, batch, self.topk, self.aux_loss_coeff, sp)
        zl = z_loss(logits, self.z_loss_coeff) if self.z_loss_coeff > 0 else zero
        if sp.active and self.z_loss_coeff > 0:
            zl = zl / sp.size
        if self.enable_expert_bias and self.training:
            with torch.no_grad():
                self.local_tokens_per_expert += tokens_per_expert.float()
        return Routing(probs, indices, tokens_per_expert, aux, zl)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Optional[torch.Tensor] = None) -> None:
        """Aux-loss-free update ``bias += rate * sign(mean(count) - count)``, then reset counts.

        ``tokens_per_expert`` defaults to the counts accumulated since the last update; the
        distributed caller passes them summed over its data-parallel group instead.
        """
        if not self.enable_expert_bias:
            return
        counts = self.local_tokens_per_expert if tokens_per_expert is None else tokens_per_expert.float()
        self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        self.local_tokens_per_expert.zero_()
