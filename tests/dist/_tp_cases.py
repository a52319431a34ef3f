"""Rank-side functions for the tensor-parallel tests (module-level: they are pickled).

Everything a test compares comes back in the single-rank (canonical) form: a tensor-parallel
shard is all-gathered over the TP group and joined (:func:`canonical`), so the parent compares
it name by name with a single-rank model it builds itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

TINY = "tiny_cpu.yaml"
FP32 = ["precision.params_dtype=fp32", "precision.backend=emulated"]
# dense: GQA (2 kv heads), q/k norms, tied embedding -- every swapped module of a dense model
DENSE = [*FP32, "model.num_query_groups=2", "model.qk_layernorm=true", "model.tie_embeddings=true"]
# MoE with both balancing losses (their sequence-shard parts must add up to the single-rank ones)
MOE = [*FP32, "model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=64",
       "model.moe.grouped_gemm=true", "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001"]
BATCH, SEQ = 2, 128


def batch(vocab: int = 259) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[0, :5] = -100  # ignored positions
    return tokens, labels


def model_cfg(overrides: Sequence[str]) -> Any:
    from lptrain.config import World, compose, derive

    return derive(compose(TINY, list(overrides)), World.detect())


def canonical(p: torch.Tensor, t: torch.Tensor, tp: Any) -> torch.Tensor:
    """``t`` (a tensor of ``p``'s local shape) in its single-rank form: a tensor-parallel
    shard gathered over ``tp`` and joined; anything else as it is."""
    import torch.distributed as dist

    from lptrain.precision.tensor_parallel import join_shards

    shard = getattr(p, "tp_shard", None)
    if shard is None or not tp.active:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=tp.pg)
    return shard.canonical(join_shards(parts, shard.layout))


def forward_backward(overrides: Sequence[str]) -> dict[str, Any]:
    """One fp32 forward + backward of a fixed batch: the loss (LM loss + the TP group's summed
    auxiliary losses), the canonical initial weights and grads (expert grads summed over the
    sequence shards, as the expert buffers' reduction does), the whole logits, and the
    tensor-parallel traffic of the step."""
    import torch.distributed as dist

    from lptrain.distributed.groups import build_groups
    from lptrain.model import build_model
    from lptrain.precision.tensor_parallel import count_tp_traffic

    cfg = model_cfg(overrides)
    tp = cfg.model.tensor_model_parallel_size
    groups = build_groups(1, tp=tp, sequence_parallel=cfg.model.sequence_parallel)
    model = build_model(cfg, tensor_parallel_group=groups.tp, device="cpu")
    weights = {n: canonical(p, p.data, groups.tp) for n, p in model.named_parameters()}
    tokens, labels = batch()
    with count_tp_traffic() as traffic:
        loss, aux = model(tokens, labels)
        loss.backward()
    extra = (loss - aux["lm_loss"]).detach().clone()
    if groups.tp.active:
        dist.all_reduce(extra, group=groups.tp.pg)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "is_expert", False) and groups.tp.active:
            dist.all_reduce(g, group=groups.tp.pg)
        grads[n] = canonical(p, g, groups.tp)
    with torch.no_grad():
        logits = model(tokens)
    return {"loss": float(aux["lm_loss"] + extra), "lm_loss": float(aux["lm_loss"]),
            "weights": weights, "grads": grads, "logits": logits.clone(),
            "traffic": (traffic.activation_calls, traffic.activation_bytes)}


def run_forward_backward(rank: int, world: int, cases: dict[str, Sequence[str]]) -> dict[str, Any]:
    return {name: forward_backward(ov) for name, ov in cases.items()}
