"""MoE: router math against hand computations, dispatch/combine, expert layouts, zero-token
experts, aux-loss-free bias."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import hp_model, moe_overrides, tiny_cfg, tokens

from lptrain.config.schema import MoEConfig
from lptrain.model import to_canonical
from lptrain.model.moe.layer import combine, dispatch
from lptrain.model.moe.router import TopKRouter, topk_routing

LOGITS = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.0], [1.0, 1.5, 2.0, 0.0]]
# top-2 per token: {0,1}, {1,2}, {2,1} -> tokens per expert [1, 3, 2, 0]
COUNTS = [1, 3, 2, 0]


def _router(**kw) -> TopKRouter:
    moe = MoEConfig(num_experts=4, router_topk=2, **kw)
    r = TopKRouter(4, moe, torch.float32, lambda w: w.copy_(torch.eye(4)))  # logits == input
    return r


def _softmax(row: list[float]) -> list[float]:
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def test_softmax_topk_probs_and_losses_hand_computed() -> None:
    r = _router(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    out = r(torch.tensor(LOGITS))
    assert [sorted(row) for row in out.indices.tolist()] == [[0, 1], [1, 2], [1, 2]]
    assert out.indices[:, 0].tolist() == [0, 1, 2]  # highest score first
    assert out.tokens_per_expert.tolist() == COUNTS
    # probs = softmax over the two chosen logits; they sum to 1.
    want = [_softmax([2.0, 1.0]), _softmax([3.0, 1.0]), _softmax([2.0, 1.5])]
    torch.testing.assert_close(out.probs, torch.tensor(want), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(3), rtol=1e-6, atol=0)
    # Switch aux loss: E*c/(k*T^2) * sum_i (sum_x p_xi) * n_i with p = softmax over all experts.
    p = [_softmax(row) for row in LOGITS]
    agg = [sum(p[x][i] for x in range(3)) for i in range(4)]
    aux = 4 * 0.1 / (2 * 3 * 3) * sum(a * n for a, n in zip(agg, COUNTS, strict=True))
    # fp32 vs float64 hand value: 1e-6 relative.
    assert out.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    z = 0.01 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS) / 3
    assert out.z_loss.item() == pytest.approx(z, rel=1e-6)


def test_seq_aux_loss_hand_computed() -> None:
    r = _router(aux_loss_coeff=0.1, load_balancing_type="seq_aux_loss")
    logits = [*LOGITS, [0.0, 0.0, 1.0, 2.0], [3.0, 0.0, 0.0, 1.0], [0.5, 2.0, 0.0, 1.0]]
    out = r(torch.tensor(logits).view(2, 3, 4))  # batch 2, seq 3
    total = 0.0
    for b in range(2):
        rows = logits[3 * b : 3 * b + 3]
        idx = out.indices[3 * b : 3 * b + 3].tolist()
        counts = [sum(i in t for t in idx) for i in range(4)]
        p = [_softmax(row) for row in rows]
        agg = [sum(px[i] for px in p) for i in range(4)]
        total += 4 * 0.1 / (2 * 9) * sum(a * n for a, n in zip(agg, counts, strict=True))
    assert out.aux_loss.item() == pytest.approx(total / 2, rel=1e-6)


def test_no_balancing_loss_when_none() -> None:
    out = _router(aux_loss_coeff=0.1, load_balancing_type="none")(torch.tensor(LOGITS))
    assert out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0


def test_sigmoid_expert_bias_changes_selection_not_probs() -> None:
    logits = torch.tensor(LOGITS)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # force expert 3 into every top-2
    probs, idx = topk_routing(logits, 2, "sigmoid", bias)
    assert (idx == 3).any(dim=1).all()
    s = torch.sigmoid(logits).gather(1, idx)
    torch.testing.assert_close(probs, s / s.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3), rtol=1e-6, atol=0)


def _sqrt_softplus(v: float) -> float:
    return math.sqrt(math.log1p(math.exp(v)))


def test_sqrtsoftplus_scores_probs_and_aux_loss_hand_computed() -> None:
    """``sqrtsoftplus`` scores each expert with sqrt(log(1 + e^logit)) and renormalises the
    chosen k (Megatron-LM ``moe_utils.py`` ``topk_routing_with_score_function``; the balancing
    loss uses the scores normalised over all experts, as its
    ``compute_routing_scores_for_aux_loss``). Checked against float64 math on the logits;
    fp32 routing agrees to 1e-6 relative (a few fp32 roundings per value)."""
    r = _router(score_function="sqrtsoftplus", aux_loss_coeff=0.1)
    out = r(torch.tensor(LOGITS))
    scores = [[_sqrt_softplus(v) for v in row] for row in LOGITS]
    want_idx = [sorted(range(4), key=lambda e, row=row: -row[e])[:2] for row in scores]
    assert out.indices.tolist() == want_idx
    want = [[row[e] / (row[i] + row[j]) for e in (i, j)] for row, (i, j) in zip(scores, want_idx, strict=True)]
    torch.testing.assert_close(out.probs, torch.tensor(want), rtol=1e-6, atol=0)
    counts = [sum(e in t for t in want_idx) for e in range(4)]
    assert out.tokens_per_expert.tolist() == counts
    p = [[v / sum(row) for v in row] for row in scores]
    agg = [sum(p[x][e] for x in range(3)) for e in range(4)]
    aux = 4 * 0.1 / (2 * 3 * 3) * sum(a * n for a, n in zip(agg, counts, strict=True))
    assert out.aux_loss.item() == pytest.approx(aux, rel=1e-6)


def test_router_score_functions_are_the_rule_catalog_s() -> None:
    from lptrain.config import rules, schema
    from lptrain.model.moe import router

    assert router.SCORE_FUNCTIONS == schema.SCORE_FUNCTIONS
    assert tuple(router.INDEPENDENT_SCORES) == rules.INDEPENDENT_SCORE_FUNCTIONS


def test_sqrtsoftplus_expert_bias_changes_selection_not_probs() -> None:
    """With sqrtsoftplus the aux-loss-free bias works as with sigmoid: it picks the experts,
    the probabilities stay the unbiased scores (Megatron pairs the bias with both)."""
    logits = torch.tensor(LOGITS)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    probs, idx = topk_routing(logits, 2, "sqrtsoftplus", bias)
    assert (idx == 3).any(dim=1).all()
    s = torch.tensor([[_sqrt_softplus(v) for v in row] for row in LOGITS]).gather(1, idx)
    torch.testing.assert_close(probs, s / s.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    r = _router(score_function="sqrtsoftplus", enable_expert_bias=True)
    assert r.expert_bias.shape == (4,)


@pytest.mark.parametrize(("score", "router_grad_zero"),
                         [("softmax", True), ("sigmoid", False), ("sqrtsoftplus", False)])
def test_top1_router_gradient(score: str, router_grad_zero: bool) -> None:
    """Why MOE-TOPK1-SOFTMAX refuses top-1 softmax routing: the softmax over one chosen logit
    is exactly 1, so the LM loss sends the router weight an exactly-zero gradient; sigmoid and
    sqrtsoftplus scale the expert output by its own score and do train the router."""
    cfg = tiny_cfg(**moe_overrides(router_topk=1, score_function=score))
    model = hp_model(cfg)
    loss, _ = model(tokens(), tokens(seed=1))
    loss.backward()
    grads = [r.weight.grad for r in model.routers()]
    assert grads and all(g is not None for g in grads)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads) is router_grad_zero


def test_expert_bias_update_from_counts() -> None:
    r = _router(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.5)
    r.train()
    out = r(torch.tensor(LOGITS))
    counts = out.tokens_per_expert.float()
    assert torch.equal(r.local_tokens_per_expert, counts)
    r.update_expert_bias()
    # bias += rate * sign(mean - count): overloaded experts go down, idle ones up.
    assert torch.equal(r.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
    assert torch.equal(r.local_tokens_per_expert, torch.zeros(4))
    assert "expert_bias" in r.state_dict() and "local_tokens_per_expert" not in r.state_dict()


@pytest.mark.parametrize("alignment", [1, 4])
def test_dispatch_combine_is_weighted_sum(alignment: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=g)
    idx = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [1, 2]])
    probs = torch.rand(5, 2, generator=g)
    rows, state = dispatch(x, idx, num_experts=4, alignment=alignment)
    assert state.tokens_per_expert == [3, 3, 4, 0]
    assert state.m_splits == [-(-c // alignment) * alignment for c in [3, 3, 4, 0]]
    assert rows.shape[0] == sum(state.m_splits)
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # "expert e" multiplies its rows by e+1
    expert_of_row = torch.repeat_interleave(torch.arange(4), torch.tensor(state.m_splits))
    out = combine(rows * scale[expert_of_row].unsqueeze(1), probs, state, 5)
    want = torch.stack([sum(probs[t, j] * scale[idx[t, j]] * x[t] for j in range(2)) for t in range(5)])
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)  # fp32, 2-term sums


def _canonical_grads(model) -> dict[str, torch.Tensor]:
    return to_canonical({n: p.grad for n, p in model.named_parameters()})


LAYOUTS = {
    "single": {"grouped_gemm": True, "single_grouped_weight": True},
    "discrete": {"grouped_gemm": True, "single_grouped_weight": False},
    "sequential": {"grouped_gemm": False, "single_grouped_weight": False},
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_expert_layouts_bitwise_identical(dtype: str) -> None:
    results = {}
    for name, layout in LAYOUTS.items():
        cfg = tiny_cfg(precision__params_dtype=dtype, **moe_overrides(aux_loss_coeff=1e-2, **layout))
        model = hp_model(cfg)
        loss, _aux = model(tokens(), tokens(seed=1))
        loss.backward()
        results[name] = (to_canonical(model.state_dict()), loss.detach(), _canonical_grads(model))
    ref_sd, ref_loss, ref_grads = results["single"]
    assert any(k.endswith("experts.linear_fc1.weight.3") for k in ref_sd)
    for name in ("discrete", "sequential"):
        sd, loss, grads = results[name]
        assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd), name
        assert torch.equal(loss, ref_loss), name
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            assert torch.equal(grads[k], ref_grads[k]), (name, k)


def _starved_moe(layout: dict, dtype: str = "fp32"):
    """An MoE layer whose expert 3 gets no token: inputs > 0 and router row 3 < 0."""
    model = hp_model(tiny_cfg(precision__params_dtype=dtype, **moe_overrides(**layout)))
    moe = model.layers[0].mlp
    with torch.no_grad():
        moe.router.weight[3] = -1.0
    x = torch.rand(2, 32, 64, generator=torch.Generator().manual_seed(0)) + 0.1
    return moe, x.to(torch.float32)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_token_expert_gets_zero_grad(layout: str) -> None:
    moe, x = _starved_moe(LAYOUTS[layout])
    x.requires_grad_(True)
    out, losses = moe(x)
    (out.square().mean() + losses["load_balancing_loss"]).backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    grads = to_canonical({n: p.grad for n, p in moe.named_parameters()})
    for k, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), k
        if k.startswith("experts.") and k.endswith(".3"):
            assert torch.equal(g, torch.zeros_like(g)), k
        elif k.startswith("experts."):
            assert g.abs().sum() > 0, k


class _AlignedFactory:
    """The high-precision factory plus a grouped alignment (as quantized factories have)."""

    def __init__(self, alignment: int) -> None:
        from lptrain.precision.layers import LayerFactory

        self._f = LayerFactory()
        self.grouped_alignment = alignment

    def grouped_alignment_for(self, single_grouped_weight: bool) -> int:
        return self.grouped_alignment

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("layout", ["single", "sequential"])
def test_padding_to_alignment_does_not_change_results(layout: str) -> None:
    from lptrain.model import build_model

    cfg = tiny_cfg(**moe_overrides(**LAYOUTS[layout]))
    outs = []
    for align in (1, 16):
        model = build_model(cfg, _AlignedFactory(align))
        assert model.layers[0].mlp.alignment == align
        loss, _ = model(tokens(), tokens(seed=1))
        loss.backward()
        outs.append((loss.detach(), _canonical_grads(model)))
    (l1, g1), (l2, g2) = outs
    # Zero pad rows only append rows to each expert's GEMM: fp32 results agree to 1e-6
    # (bitwise where BLAS keeps its row blocking, not guaranteed across M).
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=0)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-5, atol=1e-7)
