"""Rank-side functions for the expert-parallel tests (module-level: they are pickled).

Everything for one world size runs inside ONE spawned world (spawning costs seconds, a tiny
step milliseconds); results come back as small numbers and flags the parent asserts on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from _engine_cases import BASE, DISTOPT, MOE, MXFP8, NVFP4, OVERLAP, TINY

from lptrain.testing.parity import max_rel_diff, patched, train_steps

EP2 = ["model.moe.expert_model_parallel_size=2"]
SGW = ["model.moe.single_grouped_weight=true"]
LOOP = ["model.moe.grouped_gemm=false"]

AUX = ["model.moe.aux_loss_coeff=1e-2", "model.moe.z_loss_coeff=1e-3"]
BIAS = ["model.moe.score_function=sigmoid", "model.moe.enable_expert_bias=true", "model.moe.bias_update_rate=0.05"]
LR_SMALL = ["optimizer.lr=1e-3"]  # NVFP4: see the tolerance note in test_expert_parallel.py
MB2 = ["train.micro_batch_size=2"]  # 4 ranks x 2 sequences = the global batch of 8

# Every precision, grouped and loop experts, single-grouped and discrete weights, replicated
# and sharded (distributed optimizer, overlapped) expert buffers, router losses and bias.
PARITY_2 = {
    "bf16_loop_aux_z": [*MOE, *LOOP, *AUX],
    "bf16_grouped_discrete_distopt_overlap": [*MOE, *DISTOPT, *OVERLAP],
    "bf16_expert_bias": [*MOE, *BIAS],
    "mxfp8_grouped_single": [*MOE, *SGW, *MXFP8],
    "nvfp4_grouped_discrete": [*MOE, *NVFP4, *LR_SMALL],
}
# EP=2 x expert-DP=2 on 4 ranks (with 2 optimizer instances: expert_intra 1, expert_inter 2).
PARITY_4 = {
    "mxfp8_grouped_single_distopt_2inst": [*MB2, *MOE, *SGW, *MXFP8, *DISTOPT,
                                           "ddp.num_distributed_optimizer_instances=2"],
}
PARITY_EP4 = {"bf16_loop": [*MB2, *MOE, *LOOP]}


def _cfg(overrides: Sequence[str]) -> Any:
    from lptrain.config import World, derive
    from lptrain.config.compose import load

    return derive(load(TINY, [*BASE, *overrides]).cfg, World.detect())


def _compare(ref: dict[str, Any], ep: dict[str, Any]) -> dict[str, float]:
    losses = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], ep["losses"], strict=True))
    assert ref["masters"].keys() == ep["masters"].keys(), set(ref["masters"]) ^ set(ep["masters"])
    return {"loss_rel": losses, "master_rel": max_rel_diff(ep["masters"], ref["masters"]),
            "steps": len(ep["losses"])}


def parity(cases: dict[str, list[str]], ep: int, steps: int = 3) -> dict[str, dict[str, float]]:
    """EP=``ep`` against EP=1 on the same world (same global batch)."""
    out = {}
    for name, ov in cases.items():
        ref = train_steps(TINY, [*BASE, *ov], steps=steps)
        got = train_steps(TINY, [*BASE, *ov, f"model.moe.expert_model_parallel_size={ep}"], steps=steps)
        out[name] = _compare(ref, got)
    return out


@contextlib.contextmanager
def all_to_expert_zero() -> Iterator[None]:
    """Every token to expert 0 (the router's top-k replaced; probabilities stay trainable)."""
    import lptrain.model.moe.router as router

    real = router.topk_routing

    def forced(logits: torch.Tensor, topk: int, score_function: str, expert_bias: Any = None) -> Any:
        _, indices = real(logits, topk, score_function, expert_bias)
        forced_idx = torch.arange(topk, device=indices.device).expand_as(indices).contiguous()
        return torch.softmax(logits.gather(1, forced_idx), dim=-1), forced_idx

    with patched(router, "topk_routing", forced):
        yield


# ---- layer-level checks ---------------------------------------------------------------------------


def dispatcher_checks(rank: int) -> dict[str, Any]:
    from lptrain.distributed.groups import build_groups
    from lptrain.model.moe.dispatcher import combine, dispatch

    groups = build_groups(1, ep=2)
    g = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {}
    # Identity experts, k=1, prob 1: the round trip gives every token back, bitwise.
    x = torch.randn(7 + 3 * rank, 8, generator=g)
    idx = torch.randint(0, 4, (x.shape[0], 1), generator=g)
    rows, st = dispatch(x, idx, 4, alignment=4, group=groups.ep)
    back = combine(rows, torch.ones(x.shape[0], 1), st, x.shape[0])
    out["round_trip_equal"] = torch.equal(back, x)
    out["padded_splits"] = all(m % 4 == 0 for m in st.m_splits)
    # Expert e multiplies its rows by 2**e (exact), k=2: combine == the hand sum, bitwise.
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(x.shape[0])])
    probs = torch.rand(x.shape[0], 2, generator=g)
    rows, st = dispatch(x, idx, 4, alignment=1, group=groups.ep)
    local = torch.repeat_interleave(torch.arange(2), torch.tensor(st.m_splits))
    scale = 2.0 ** (local + 2 * groups.ep.rank).float()
    got = combine(rows * scale.unsqueeze(1), probs, st, x.shape[0])
    want = sum((x * 2.0 ** idx[:, j].float().unsqueeze(1)) * probs[:, j : j + 1] for j in range(2))
    out["weighted_equal"] = torch.equal(got, want)
    # A rank sending nothing at all, and a rank whose experts receive nothing.
    empty = x[:0] if rank == 1 else x
    idx0 = torch.zeros(empty.shape[0], 1, dtype=torch.long)
    rows, st = dispatch(empty.requires_grad_(), idx0, 4, alignment=32, group=groups.ep)
    back = combine(rows, torch.ones(empty.shape[0], 1), st, empty.shape[0])
    back.sum().backward()
    out["empty_ok"] = torch.equal(back.detach(), empty.detach()) and empty.grad is not None
    out["zero_rank_splits"] = st.tokens_per_expert
    return out


def layer_checks(rank: int, extra: Sequence[str] = ()) -> dict[str, Any]:
    """The MoE layer at EP=2 against the full layer at EP=1 on this rank's tokens, all
    tokens routed to expert 0 (so rank 1's experts and expert 1 receive nothing)."""
    import torch.distributed as dist

    from lptrain.distributed.groups import build_groups
    from lptrain.model import build_model
    from lptrain.model.state_dict_adapter import to_canonical

    ov = [*MOE, "model.moe.router_topk=1", *extra]
    groups = build_groups(1, ep=2)
    m2 = build_model(_cfg([*ov, *EP2]), expert_model_parallel_rank=groups.ep.rank,
                     expert_parallel_group=groups.ep, device="cpu")
    m1 = build_model(_cfg(ov), device="cpu")
    x = torch.randn(2, 8, m1.cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    res = {}
    with all_to_expert_zero():
        for tag, m in (("ep1", m1), ("ep2", m2)):
            layer = m.layers[0].mlp
            xi = x.clone().requires_grad_()
            with m.autocast():
                y, _ = layer(xi)
            y.float().square().sum().backward()
            grads = {n: p.grad for n, p in layer.named_parameters() if n.startswith("experts.")}
            if tag == "ep1":  # the data-parallel sum EP=2 computes in one place
                for v in grads.values():
                    dist.all_reduce(v)
            res[tag] = (y.detach(), xi.grad, to_canonical(grads, expert_offset=layer.experts.expert_offset))
    (y1, dx1, g1), (y2, dx2, g2) = res["ep1"], res["ep2"]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    return {
        "out_rel": rel(y2, y1),
        "dgrad_rel": rel(dx2, dx1),
        "wgrad_rel": max([rel(g2[k], g1[k]) for k in g2 if g1[k].any()], default=0.0),
        "zero_grad_experts": sorted(k for k, v in g2.items() if v is not None and not v.any()),
        "none_grads": sorted(k for k, v in g2.items() if v is None),
    }


# ---- engine: checkpoints and metrics --------------------------------------------------------------


def _engine_run(
    overrides: Sequence[str], steps: int, start: int = 0, state: Any = None, save_at: int = -1
) -> dict[str, Any]:
    """Steps ``start+1 .. start+steps`` (data skipped to ``start``), optionally from ``state``;
    the checkpoint state after ``save_at`` steps (default: at the end)."""
    from lptrain.data import build_train_valid_loaders
    from lptrain.train.engine import TrainEngine

    cfg = _cfg(overrides)
    engine = TrainEngine(cfg)
    if state is not None:
        engine.load_checkpoint_state(state)
    t = cfg.train
    it, _ = build_train_valid_loaders(
        cfg.data, seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=engine.dp_rank, dp_size=engine.dp_size,
        vocab_size=cfg.model.vocab_size,
    )
    n = t.global_batch_size // (t.micro_batch_size * engine.dp_size)
    for _ in range(start * n):
        next(it)
    results, saved = [], None
    for s in range(steps):
        if s == save_at:
            saved = engine.checkpoint_state()
        results.append(engine.train_step([next(it) for _ in range(n)], start + s + 1))
    return {"losses": [r.loss for r in results], "extras": [r.extra for r in results],
            "state": saved if saved is not None else engine.checkpoint_state()}


def checkpoint_checks(rank: int) -> dict[str, Any]:
    base = [*MOE, *SGW, *DISTOPT]
    full = _engine_run([*base, *EP2], 3, save_at=2)  # uninterrupted; saved after step 2
    saved = full["state"]
    # EP=2 -> EP=1 (discrete layout): resume at step 3; the loaded state is the saved one.
    at1 = _engine_run(MOE + DISTOPT, 1, start=2, state=saved, save_at=0)
    again = at1["state"]["global"]
    # EP=1 -> EP=2 (single grouped): round trip back.
    back = _engine_run([*base, *EP2], 0, state={"global": again})["state"]["global"]

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        from lptrain.testing.parity import first_difference

        return first_difference(a["model"], b["model"]) is None and first_difference(
            a["optimizer"], b["optimizer"]) is None

    experts = sorted(k for k in saved["global"]["model"] if ".experts." in k)
    return {
        "expert_keys": experts,
        "ep2_to_ep1_exact": same(saved["global"], again),
        "ep1_to_ep2_exact": same(saved["global"], back),
        "resumed_loss": at1["losses"][0],
        "uninterrupted_loss": full["losses"][2],
        "metrics_ep1": _engine_run(base, 1)["extras"][0],
        "metrics_ep2": full["extras"][0],
    }


def world2(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"dispatcher": dispatcher_checks(rank)}
    out["layer_bf16"] = layer_checks(rank)
    out["layer_mxfp8"] = layer_checks(rank, MXFP8)
    out["layer_nvfp4"] = layer_checks(rank, NVFP4)
    out["checkpoint"] = checkpoint_checks(rank)
    out["parity"] = parity(PARITY_2, 2)
    with all_to_expert_zero():  # uneven: rank 1's experts idle, expert 0 (top-1) gets everything
        out["parity_all_to_one"] = parity({"mxfp8_loop_topk1": [*MOE, *LOOP, *MXFP8, "model.moe.router_topk=1"]}, 2)
    return out


def world4(rank: int, world: int) -> dict[str, Any]:
    return {"ep2xdp2": parity(PARITY_4, 2, steps=2), "ep4": parity(PARITY_EP4, 4, steps=2)}
