"""GPT decoder: shapes/dtypes, causality, GQA vs full attention, overfitting, metadata."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from model_helpers import hp_model, moe_overrides, tiny_cfg, tokens

from lptrain.model import dense_parameters, expert_parameters
from lptrain.model.attention import SelfAttention
from lptrain.model.rope import apply_rotary


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True])
def test_shapes_and_dtypes(dtype: str, moe: bool) -> None:
    over = moe_overrides(aux_loss_coeff=1e-2, z_loss_coeff=1e-3) if moe else {}
    model = hp_model(tiny_cfg(precision__params_dtype=dtype, **over))
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {want}
    t = tokens()
    logits = model(t)
    assert logits.shape == (2, 32, 259) and logits.dtype == torch.float32
    loss, aux = model(t, t)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert set(aux) == {"lm_loss", "load_balancing_loss", "z_loss"}
    # Loss = LM loss + the coefficient-weighted MoE losses reported beside it.
    assert torch.allclose(loss.detach(), aux["lm_loss"] + aux["load_balancing_loss"] + aux["z_loss"])
    if moe:
        assert aux["load_balancing_loss"] > 0 and aux["z_loss"] > 0
    else:
        assert aux["load_balancing_loss"] == 0 and aux["z_loss"] == 0
    # Fresh model: LM loss near ln(vocab) (init std 0.02 gives near-uniform logits).
    assert abs(aux["lm_loss"].item() - math.log(259)) < 0.1
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == want and torch.isfinite(p.grad).all(), n


def test_padded_vocab_and_tied_embeddings() -> None:
    model = hp_model(tiny_cfg(model__make_vocab_size_divisible_by=128, model__tie_embeddings=True))
    assert model.embedding.weight.shape == (384, 64) and model.output_layer is None
    assert model(tokens()).shape == (2, 32, 259)
    assert model.embedding.weight.shared_embedding and model.embedding.weight.is_embedding_or_output
    names = [n for n, _ in model.named_parameters()]
    assert "output_layer.weight" not in names


@pytest.mark.parametrize("groups", [None, 2])
def test_causality(groups: int | None) -> None:
    model = hp_model(tiny_cfg(model__num_query_groups=groups, **moe_overrides(moe_layer_freq=2)))
    a = tokens()
    b = a.clone()
    t = 17
    b[:, t] = (b[:, t] + 1) % 259
    la, lb = model(a), model(b)
    # Positions before t never see token t: bitwise equal (masked scores are exactly 0).
    assert torch.equal(la[:, :t], lb[:, :t])
    assert not torch.allclose(la[:, t:], lb[:, t:])


def _reference_attention(attn: SelfAttention, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Explicit per-head softmax(QK^T/sqrt(d) + causal mask) V from the same weights."""
    _b, s, _ = x.shape
    g, qpg, d = attn.num_groups, attn.q_per_group, attn.head_dim
    w = attn.linear_qkv.weight.float().view(g, qpg + 2, d, -1)
    outs = []
    for h in range(attn.num_heads):
        gi, j = divmod(h, qpg)
        q = apply_rotary(x @ w[gi, j].t(), cos, sin)
        k = apply_rotary(x @ w[gi, qpg].t(), cos, sin)
        v = x @ w[gi, qpg + 1].t()
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        outs.append(torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v)
    return torch.cat(outs, dim=-1) @ attn.linear_proj.weight.float().t()


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_attention_matches_explicit_reference(groups: int) -> None:
    model = hp_model(tiny_cfg(model__num_query_groups=groups))
    attn = model.layers[0].self_attention
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rotary(32)
    got = attn(x, cos, sin)
    want = _reference_attention(attn, x, cos, sin)
    # fp32, different summation orders (SDPA kernel vs explicit): agree to ~1e-6 absolute.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gqa_equals_full_attention_with_repeated_kv() -> None:
    """GQA (2 groups) == full MHA whose K/V heads repeat each group's K/V weights."""
    gqa = hp_model(tiny_cfg(model__num_query_groups=2))
    mha = hp_model(tiny_cfg(model__num_query_groups=None))
    sd = gqa.state_dict()
    for i in range(2):
        key = f"layers.{i}.self_attention.linear_qkv.weight"
        w = sd[key].view(2, 4, 16, 64)  # [group, (q0, q1, k, v), head_dim, hidden]
        heads = [torch.stack([w[h // 2, h % 2], w[h // 2, 2], w[h // 2, 3]]) for h in range(4)]
        sd[key] = torch.stack(heads).reshape(4 * 3 * 16, 64)
    mha.load_state_dict(sd)
    t = tokens()
    # fp32; repeat_interleave'd KV vs recomputed identical KV rows: tolerance 1e-5 rel.
    torch.testing.assert_close(gqa(t), mha(t), rtol=1e-5, atol=1e-5)


def test_qkv_metadata_and_param_groups() -> None:
    model = hp_model(tiny_cfg(model__num_query_groups=2, **moe_overrides(moe_layer_freq=2)))
    qkv = model.layers[0].self_attention.linear_qkv.weight
    assert qkv.is_qkv and qkv.qkv_split_shapes == [32, 16, 16]
    assert qkv.shape[0] % sum(qkv.qkv_split_shapes) == 0
    assert not model.layers[0].self_attention.linear_proj.weight.is_qkv
    assert model.embedding.weight.is_embedding_or_output and not model.embedding.weight.use_muon
    assert model.output_layer.weight.is_embedding_or_output and not model.output_layer.weight.use_muon
    assert not model.final_norm.weight.use_muon
    assert model.layers[0].mlp.router.weight.use_muon  # upstream: router is a Muon matrix
    experts = expert_parameters(model)
    assert len(experts) == 4 * 2 and all(p.is_expert and p.use_muon for p in experts)
    ids = {id(p) for p in experts}
    dense = dense_parameters(model)
    assert not ids & {id(p) for p in dense}
    assert len(experts) + len(dense) == len(list(model.parameters()))
    # Layer 1 is dense (moe_layer_freq=2): its MLP weights are not experts.
    assert not model.layers[1].mlp.linear_fc1.weight.is_expert


def _overfit(model: torch.nn.Module, steps: int, lr: float) -> list[float]:
    t = tokens(batch=2, seq=32, seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, aux = model(t[:, :-1], t[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(aux["lm_loss"].item())
    return losses


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_overfits_one_batch(dtype: str) -> None:
    torch.manual_seed(0)
    model = hp_model(tiny_cfg(precision__params_dtype=dtype, **moe_overrides(moe_layer_freq=2)))
    losses = _overfit(model, steps=120, lr=1e-2)
    # 62 random tokens memorised: from ln(259)=5.56 to below 0.05 within 120 Adam steps.
    assert losses[0] > 5.0 and min(losses[-5:]) < 0.05, losses[::10]


def test_cross_entropy_matches_torch() -> None:
    model = hp_model(tiny_cfg())
    t = tokens()
    labels = t.clone()
    labels[0, :5] = -100  # ignored positions
    _loss, aux = model(t, labels)
    want = F.cross_entropy(model(t).reshape(-1, 259), labels.reshape(-1), ignore_index=-100)
    assert torch.equal(aux["lm_loss"], want.detach())


def test_build_model_default_factory_follows_precision_config() -> None:
    """Without an explicit factory, ``build_model`` asks ``build_factory`` (emulated here)."""
    from lptrain.model import build_model

    cfg = tiny_cfg(precision__params_dtype="bf16", precision__backend="emulated",
                   precision__fp8_format="e4m3", precision__fp8_recipe="mxfp8")
    model = build_model(cfg)
    assert model.factory.grouped_alignment == 32
    assert model.layers[0].self_attention.linear_qkv.weight.dtype == torch.bfloat16
    t = tokens()
    with model.autocast():
        q = model(t)
    assert not torch.equal(q, model(t))  # quantized inside the factory's autocast only


def test_model_level_expert_bias_update() -> None:
    cfg = tiny_cfg(**moe_overrides(score_function="sigmoid", enable_expert_bias=True,
                                   bias_update_rate=0.1))
    model = hp_model(cfg)
    model.train()
    model(tokens())
    counts = [r.local_tokens_per_expert.clone() for r in model.routers()]
    assert len(counts) == 2 and all(c.sum() == 2 * 32 * 2 for c in counts)  # T * k each
    model.update_expert_bias()
    for r, c in zip(model.routers(), counts, strict=True):
        assert torch.equal(r.expert_bias, 0.1 * torch.sign(c.mean() - c))
