"""FLOPs per token against a hand count."""

from __future__ import annotations

import pytest
from model_helpers import moe_overrides, tiny_cfg

from lptrain.model import active_gemm_params, flops_per_token


def test_dense_hand_count() -> None:
    cfg = tiny_cfg(model__num_query_groups=2, model__seq_length=32).model
    # h=64, heads=4, groups=2, d=16, F=128, L=2, V=259
    qkv = 64 * (4 + 2 * 2) * 16  # 8192
    proj = 64 * 64  # 4096
    mlp = 3 * 64 * 128  # 24576
    head = 64 * 259  # 16576
    n = 2 * (qkv + proj + mlp) + head
    assert active_gemm_params(cfg) == n == 90304
    f = flops_per_token(cfg)
    # attention: 2 layers x (QK^T + AV = 4*s*a fwd) x 3 (train) x 1/2 (causal), a = 64
    assert f.attention_flops == 2 * 4 * 32 * 64 * 3 * 0.5
    assert f.total == 6 * n + 2 * 4 * 32 * 64 * 3 * 0.5
    assert flops_per_token(cfg, causal=False).attention_flops == 2 * f.attention_flops


def test_moe_counts_only_topk_experts() -> None:
    cfg = tiny_cfg(**moe_overrides(moe_layer_freq=2, ffn_hidden_size=32), model__make_vocab_size_divisible_by=128).model
    attn = 64 * 3 * 64 + 64 * 64
    moe_layer = attn + 64 * 4 + 2 * 3 * 64 * 32  # router + top-2 of 4 experts (F_e=32)
    dense_layer = attn + 3 * 64 * 128
    head = 64 * 384  # padded vocab
    assert active_gemm_params(cfg) == moe_layer + dense_layer + head
    more = tiny_cfg(**moe_overrides(moe_layer_freq=2, ffn_hidden_size=32, num_experts=64))
    more.model.make_vocab_size_divisible_by = 128
    # 16x the experts: only the router grows (h * 60 more weights).
    assert active_gemm_params(more.model) - active_gemm_params(cfg) == 64 * 60


@pytest.mark.parametrize("seq", [16, 64])
def test_attention_term_scales_with_seq(seq: int) -> None:
    cfg = tiny_cfg().model
    assert flops_per_token(cfg, seq).attention_flops == 6 * 2 * seq * 64
