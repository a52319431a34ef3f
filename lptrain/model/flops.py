"""Model FLOPs per token, for throughput and MFU (Megatron style).

Training FLOPs per token = ``3 x forward`` (forward, input grad, weight grad):

``flops_per_token = 6 * N_active + 6 * L * s * a * c``

* ``N_active``: weights touched by one token's GEMMs -- per layer QKV ``h * (heads + 2 *
  groups) * d``, projection ``heads * d * h``, dense SwiGLU ``3 * h * F`` or, in an MoE layer,
  the router ``h * E`` plus only the ``k`` routed experts ``k * 3 * h * F_e``; plus the
  output head ``h * V_padded``. The embedding lookup is not a GEMM and counts 0.
* Attention: per layer and token, ``Q K^T`` and ``A V`` each cost ``2 * s * a`` forward
  (``a = heads * d``), i.e. ``4 * s * a`` forward, ``12 * s * a`` for training. With a causal
  mask only half of the score matrix is needed (``c = 1/2``, the default, as current
  Megatron's ``num_floating_point_operations``); ``causal=False`` counts the full square
  (``c = 1``), the convention of the original Megatron/PaLM MFU formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lptrain.config.schema import ModelConfig
from lptrain.model.attention import attention_shape
from lptrain.model.gpt import is_moe_layer, padded_vocab_size
from lptrain.model.mlp import ffn_hidden_size


@dataclass(frozen=True)
class FlopsBreakdown:
    """Per-token training FLOPs and the active GEMM weight count behind them."""

    active_params: int
    gemm_flops: int
    attention_flops: float

    @property
    def total(self) -> float:
        return self.gemm_flops + self.attention_flops


def layer_gemm_params(cfg: ModelConfig, index: int) -> tuple[int, int]:
    """GEMM weight elements one token multiplies with in transformer layer ``index``
    (0-based): ``(linears, router)`` -- the factory's linears (QKV, projection, the dense
    MLP or the ``k`` routed experts), which run the precision recipe, and the MoE router's
    gate (``h * E``, a plain GEMM; 0 in a dense layer)."""
    h = cfg.hidden_size
    groups, _, d = attention_shape(h, cfg.num_attention_heads, cfg.num_query_groups)
    heads = cfg.num_attention_heads
    moe = cfg.moe
    linears = h * (heads + 2 * groups) * d + heads * d * h
    if is_moe_layer(index, moe.moe_layer_freq, moe.num_experts):
        ffn_e = ffn_hidden_size(h, moe.ffn_hidden_size or cfg.ffn_hidden_size)
        return linears + moe.router_topk * 3 * h * ffn_e, h * moe.num_experts
    return linears + 3 * h * ffn_hidden_size(h, cfg.ffn_hidden_size), 0


def head_gemm_params(cfg: ModelConfig) -> int:
    """The output head's GEMM weight elements (``h * V_padded``)."""
    return cfg.hidden_size * padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by)


def active_gemm_params(cfg: ModelConfig) -> int:
    """``N_active``: GEMM weight elements one token multiplies with (see module docstring)."""
    layers = sum(sum(layer_gemm_params(cfg, i)) for i in range(cfg.num_layers))
    return layers + head_gemm_params(cfg)


def flops_per_token(cfg: ModelConfig, seq_length: int | None = None, causal: bool = True) -> FlopsBreakdown:
    """Training FLOPs per token at sequence length ``seq_length`` (default ``cfg.seq_length``)."""
    s = seq_length or cfg.seq_length
    n = active_gemm_params(cfg)
    _, _, d = attention_shape(cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups)
    a = cfg.num_attention_heads * d
    attn = 12.0 * cfg.num_layers * s * a * (0.5 if causal else 1.0)
    return FlopsBreakdown(active_params=n, gemm_flops=6 * n, attention_flops=attn)


def flops_by_precision(cfg: ModelConfig, layer_precision: Callable[[int], str],
                       seq_length: int | None = None, causal: bool = True) -> dict[str, float]:
    """:func:`flops_per_token` split by the precision each GEMM runs in.

    ``layer_precision(i)`` is the precision of transformer layer ``i``'s (0-based) linears
    (``bf16``, ``fp8`` or ``fp4``: the recipe's, or ``bf16`` for the layers the precision
    config keeps unquantized). The router gate, the output head and attention's two score
    GEMMs always run in bf16 (nothing quantizes them). The values sum to the total."""
    s = seq_length or cfg.seq_length
    out: dict[str, float] = {"bf16": 0.0}
    for i in range(cfg.num_layers):
        linears, router = layer_gemm_params(cfg, i)
        p = layer_precision(i)
        out[p] = out.get(p, 0.0) + 6.0 * linears
        out["bf16"] += 6.0 * router
    out["bf16"] += 6.0 * head_gemm_params(cfg)
    out["bf16"] += flops_per_token(cfg, s, causal).attention_flops
    return out
