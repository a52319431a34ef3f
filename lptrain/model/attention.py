"""Causal self-attention with grouped-query attention and a per-group fused QKV projection.

The QKV weight ``[groups * (q_per_group + 2) * head_dim, hidden]`` is laid out per query
group: for each KV group, its ``q_per_group`` query heads, then its key head, then its
value head (Megatron's layout). Viewed as ``[groups, (q_per_group + 2) * head_dim, hidden]``
it splits into Q, K and V blocks of ``qkv_split_shapes = [q_per_group*head_dim, head_dim,
head_dim]`` rows, which is what Muon's ``split_qkv`` orthogonalises separately.

With ``model.qk_layernorm`` every query and key head is RMS-normalised over its ``head_dim``
(one weight per norm, shared by the heads) before RoPE, as Qwen3 and Megatron's
``qk_layernorm`` do; the norms are plain fp32-math modules, never quantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lptrain.model.build_context import BuildContext
from lptrain.model.layout import merge_last_dims_like, sequence_first
from lptrain.model.norm import RMSNorm
from lptrain.model.recompute import RecomputePlan, run_checkpointed
from lptrain.model.rope import apply_rotary


class CausalAttention(nn.Module):
    """The attention core (what selective recompute's ``core_attn`` recomputes): causal SDPA of
    ``q [b, heads, s, d]`` over ``k``, ``v [b, kv heads, s, d]`` (query head ``h`` reads kv
    head ``h // q_per_group``). Context parallelism swaps it for an attention that exchanges
    keys and values between the ranks holding the sequence's chunks
    (:mod:`lptrain.model.context_parallel`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        per = q.shape[1] // k.shape[1]
        if per > 1:
            k = k.repeat_interleave(per, dim=1)
            v = v.repeat_interleave(per, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_shape(hidden: int, heads: int, groups: int | None) -> tuple[int, int, int]:
    """``(num_query_groups, q_per_group, head_dim)`` with validation."""
    g = groups or heads
    if hidden % heads or heads % g:
        raise ValueError(f"hidden {hidden}, heads {heads}, groups {g} do not divide")
    return g, heads // g, hidden // heads


class SelfAttention(nn.Module):
    """Pre-projected causal attention on ``F.scaled_dot_product_attention``.

    RoPE is applied in fp32; the attention itself runs in the activation dtype (fp32 on the
    CPU, bf16 on CUDA, where SDPA picks its flash kernel)."""

    def __init__(self, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.cfg
        self.factory = ctx.factory
        self.recompute_core = RecomputePlan.of(cfg).selects("core_attn")
        self.num_heads = cfg.num_attention_heads
        self.num_groups, self.q_per_group, self.head_dim = attention_shape(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups
        )
        qkv_out = self.num_groups * (self.q_per_group + 2) * self.head_dim
        self.linear_qkv = ctx.factory.linear(
            cfg.hidden_size,
            qkv_out,
            bias=False,
            init_method=ctx.init(f"{prefix}linear_qkv.weight", ctx.std),
            name=f"{prefix}linear_qkv",
        )
        self.linear_proj = ctx.factory.linear(
            self.num_heads * self.head_dim,
            cfg.hidden_size,
            bias=False,
            init_method=ctx.init(f"{prefix}linear_proj.weight", ctx.output_std),
            name=f"{prefix}linear_proj",
        )

        self.core_attention: nn.Module = CausalAttention()
        self.q_layernorm: RMSNorm | None = None
        self.k_layernorm: RMSNorm | None = None
        if cfg.qk_layernorm:
            self.q_layernorm = RMSNorm(self.head_dim, cfg.norm_epsilon, ctx.params_dtype)
            self.k_layernorm = RMSNorm(self.head_dim, cfg.norm_epsilon, ctx.params_dtype)

    @property
    def qkv_split_shapes(self) -> list[int]:
        """Rows of Q, K and V inside one query group of the QKV weight."""
        return [self.q_per_group * self.head_dim, self.head_dim, self.head_dim]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        g, qpg, hd = self.num_groups, self.q_per_group, self.head_dim
        qkv = self.linear_qkv(x).to(x.dtype)
        # split in storage order (sequence-first under TE's sequence parallelism: lptrain.model.
        # layout), so the backward assembles the QKV gradient stored as TE's output is
        stored = sequence_first(x)
        t = qkv.transpose(0, 1) if stored else qkv  # (the whole sequence also when x is a shard)
        d0, d1 = t.shape[:2]
        t = t.view(d0, d1, g, qpg + 2, hd)
        q = t[:, :, :, :qpg].reshape(d0, d1, g * qpg, hd)  # head = g*qpg + j
        k = t[:, :, :, qpg]  # [b, s, g, hd] (or [s, b, ...] as stored)
        v = t[:, :, :, qpg + 1]
        if stored:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, hd]
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        o = run_checkpointed(self.recompute_core, self.factory, self.core_attention, q, k, v)
        # [b, s, heads * hd], stored as x is (sequence-first under TE's sequence parallelism)
        o = merge_last_dims_like(o.transpose(1, 2), x).to(x.dtype)
        return self.linear_proj(o)
