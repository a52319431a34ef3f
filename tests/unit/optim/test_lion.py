"""Lion: the update rule against the paper's, and Lion as Muon's optimizer for the params
Muon does not take (the engine's groups and state, the memory plan, the reference trainer)."""

from __future__ import annotations

import pytest
import torch

from lptrain.config import World, derive, load
from lptrain.config.schema import OptimizerConfig
from lptrain.optim.lion import Lion, scalar_optimizer, scalar_optimizer_name
from lptrain.optim.muon import MuonWithAdamW


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the tiny model's GEMMs gain nothing from a second thread

def _paper_lion(p: list[float], grads: list[list[float]], lr: float, beta1: float, beta2: float,
                wd: float) -> list[float]:
    """Lion as written in Chen et al., "Symbolic Discovery of Optimization Algorithms"
    (arXiv 2302.06675, Program 1), in float64 Python scalars, one element at a time:
    ``update = sign(beta1*m + (1-beta1)*g) + wd*p; p -= lr*update; m = beta2*m + (1-beta2)*g``
    (Megatron-LM's ``lion_beta1``/``lion_beta2`` are these two betas)."""
    p = list(p)
    m = [0.0] * len(p)
    for g in grads:
        for i, gi in enumerate(g):
            c = beta1 * m[i] + (1 - beta1) * gi
            update = (c > 0) - (c < 0) + wd * p[i]
            p[i] -= lr * update
            m[i] = beta2 * m[i] + (1 - beta2) * gi
    return p


def test_lion_matches_the_paper() -> None:
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(257, generator=g)
    grads = [torch.randn(257, generator=g) for _ in range(4)]
    lr, betas, wd = 0.01, (0.95, 0.98), 0.1
    p = p0.clone().requires_grad_(True)
    opt = Lion([p], lr=lr, betas=betas, weight_decay=wd)
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    want = _paper_lion(p0.tolist(), [x.tolist() for x in grads], lr, *betas, wd)
    # fp32 params and momentum against float64 scalars: four steps of lr-sized moves round to
    # ~1e-7 relative each; no element's sign flips (random data, no interpolation near 0).
    torch.testing.assert_close(p.detach(), torch.tensor(want, dtype=torch.float32), rtol=0, atol=2e-6)
    assert set(opt.state[p]) == {"exp_avg"}
    # Without decay every element moves by exactly lr per step (the sign update).
    q = torch.zeros(64, dtype=torch.float64, requires_grad=True)
    opt = Lion([q], lr=0.125, betas=betas)
    q.grad = torch.randn(64, generator=g, dtype=torch.float64)
    opt.step()
    assert torch.equal(q.detach().abs(), torch.full((64,), 0.125, dtype=torch.float64))


def _muon_lion_cfg(*extra: str):
    return derive(load("tiny_cpu.yaml", ["optimizer.name=muon", "optimizer.muon.scalar_optimizer=lion",
                                         "optimizer.lion_beta1=0.9", "optimizer.lion_beta2=0.99",
                                         *extra]).cfg, World(dp=1))


def test_scalar_optimizer_choice() -> None:
    cfg = OptimizerConfig()
    assert scalar_optimizer_name(cfg) == "adamw"
    cfg.muon.scalar_optimizer = "lion"
    assert scalar_optimizer_name(cfg) == "adamw"  # a Muon key: only with optimizer.name=muon
    cfg.name = "muon"
    assert scalar_optimizer_name(cfg) == "lion"
    opt = scalar_optimizer([torch.zeros(2, 2)], [torch.zeros(2)], cfg)
    assert isinstance(opt, Lion)
    assert [(g["name"], g["weight_decay"], g["betas"]) for g in opt.param_groups] == [
        ("lion_decay", cfg.weight_decay, (0.95, 0.98)), ("lion_no_decay", 0.0, (0.95, 0.98))]


@pytest.mark.parametrize("distributed", [False, True])
def test_engine_runs_lion_for_the_non_muon_params(distributed: bool) -> None:
    from lptrain.train.engine import TrainEngine

    extra = ["ddp.use_distributed_optimizer=true"] if distributed else []
    engine = TrainEngine(_muon_lion_cfg(*extra))
    tokens = torch.randint(0, 250, (2, 128), generator=torch.Generator().manual_seed(1))
    res = engine.train_step([{"tokens": tokens, "labels": tokens}], 1)
    assert set(res.lrs) == {"muon", "lion_decay", "lion_no_decay"}
    lions = [o for c in engine.optimizer.children for o in getattr(c, "optimizers", []) if isinstance(o, Lion)]
    (lion,) = lions
    assert all(g["betas"] == (0.9, 0.99) for g in lion.param_groups)
    names = {n for n, p in engine.model.named_parameters() if not getattr(p, "use_muon", True)
             or getattr(p, "is_embedding_or_output", False)}
    assert names and sum(len(g["params"]) for g in lion.param_groups) == len(names)
    assert all(set(st) == {"exp_avg"} for st in lion.state.values())
    # Checkpoint state carries Lion's one moment per param, under the param's name (and no
    # AdamW second moment; a child holding Muon too lists Muon's key, zero for these params).
    state = engine.checkpoint_state()["global"]["optimizer"]["embedding.weight"]
    assert "exp_avg" in state and "exp_avg_sq" not in state and "step" not in state
    # The memory plan counts one fp32 moment per Lion element (AdamW: two, plus a step).
    from lptrain.memory.plan import estimate_memory

    cfg = engine.cfg
    lion_bytes = estimate_memory(cfg, 1).ranks[0].bytes["optimizer_states"]
    adamw_cfg = _muon_lion_cfg(*extra, "optimizer.muon.scalar_optimizer=adamw")
    adam_bytes = estimate_memory(adamw_cfg, 1).ranks[0].bytes["optimizer_states"]
    non_muon = sum(p.numel() for n, p in engine.model.named_parameters() if n in names)
    assert adam_bytes - lion_bytes >= 4 * non_muon


def test_muon_with_adamw_takes_lion() -> None:
    cfg = _muon_lion_cfg().optimizer
    w = torch.nn.Parameter(torch.randn(8, 8))
    w.use_muon = True
    e = torch.nn.Parameter(torch.randn(16, 8))
    b = torch.nn.Parameter(torch.randn(8))
    opt = MuonWithAdamW([w], [e, b], cfg)
    assert [(g["name"], g["optimizer"]) for g in opt.param_groups] == [
        ("muon", "muon"), ("lion_decay", "lion"), ("lion_no_decay", "lion")]
    e0 = e.detach().clone()
    for p in (w, e, b):
        p.grad = torch.randn_like(p)
    opt.step()
    ref = e0.clone().requires_grad_(True)
    ref.grad = e.grad.clone()
    Lion([ref], lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay).step()
    assert torch.equal(e.detach(), ref.detach())
    assert set(opt.state[e]) == {"exp_avg"}
