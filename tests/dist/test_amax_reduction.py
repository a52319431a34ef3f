"""Delayed-scaling amax reduction across real ranks, through the layer factory and autocast.

Two quantized Linears (built by ``build_factory`` from a composed config, delayed recipe,
history 4, algo max, margin 1) run forward under ``factory.autocast(amax_reduction_group=
WORLD)`` and backward outside it, for 3 steps. Every rank feeds different data (rank r's
inputs are scaled by r+1, its output grads by world_size-r, from per-rank seeds). The test
records each rank's *local* amaxes from the tensors themselves (x, W, the grads arriving at
each module, via a retained grad) and recomputes numerics.md 2.1 from their global max in
plain Python/fp32, independently of ``lptrain.precision``. Expected: after the autocast exits
the forward roles (input, weight) match, after the backward the grad roles match, on every
rank bitwise. With no group named, the world group is used (TE's semantics), giving the
same bits. Negative control: a single-rank group per rank gives rank-dependent scales.
Also: ``TensorwiseScaling``'s ``amax_reduction`` quantizer hook with a process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lptrain.testing.dist import run_distributed

pytestmark = pytest.mark.dist

WORLD = 2
STEPS = 3
HIST = 4
MARGIN = 1
FLT_MAX = torch.finfo(torch.float32).max
FMT_MAX = {"input": 448.0, "weight": 448.0, "grad": 57344.0}  # HYBRID: E4M3 fwd, E5M2 bwd
ROLES = ("input", "weight", "grad")
FWD_ROLES = ("input", "weight")


def _states(lin: torch.nn.Module, recipe: object) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    (member,) = lin.delayed_scaling_states(recipe)
    return {r: (member[r].scale.clone(), member[r].amax_history.clone()) for r in ROLES}


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().float().abs().amax())


def _delayed_rank(rank: int, world_size: int) -> dict[str, object]:
    from lptrain.config import compose
    from lptrain.precision.factory import build_factory
    from lptrain.precision.recipes import TensorwiseScaling

    cfg = compose(
        "tiny_cpu.yaml",
        [
            "precision.params_dtype=fp32",
            "precision.backend=emulated",
            "precision.fp8_format=hybrid",
            "precision.fp8_recipe=delayed",
            f"precision.fp8_amax_history_len={HIST}",
            "precision.fp8_amax_compute_algo=max",
            f"precision.fp8_margin={MARGIN}",
        ],
    )
    factory = build_factory(cfg.precision, num_layers=1)
    recipe = factory.recipe
    assert recipe is not None and recipe.name == "delayed"
    out: dict[str, object] = {}
    # new_group is collective: every rank creates every single-rank group, in the same order.
    own_group = [dist.new_group([r]) for r in range(world_size)][rank]
    for mode in ("group", "default", "self"):
        group = {"group": dist.group.WORLD, "default": None, "self": own_group}[mode]
        torch.manual_seed(1234)  # same weights on every rank
        lin1, lin2 = factory.linear(32, 64), factory.linear(64, 32)
        steps = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(32, 32, generator=g) * (rank + 1)
            gy = torch.randn(32, 32, generator=g) * (world_size - rank)
            with factory.autocast(amax_reduction_group=group):
                h = lin1(x)
                h.retain_grad()
                y = lin2(h)
            after_fwd = {"lin1": _states(lin1, recipe), "lin2": _states(lin2, recipe)}
            (y * gy).sum().backward()
            after_bwd = {"lin1": _states(lin1, recipe), "lin2": _states(lin2, recipe)}
            assert h.grad is not None
            local = {
                "lin1": {"input": _amax(x), "weight": _amax(lin1.weight), "grad": _amax(h.grad)},
                "lin2": {"input": _amax(h), "weight": _amax(lin2.weight), "grad": _amax(gy)},
            }
            steps.append({"after_fwd": after_fwd, "after_bwd": after_bwd, "local": local})
        out[mode] = steps

    # Current scaling's amax_reduction hook: a per-rank slice quantized with the group equals
    # the slice of the whole (gathered) tensor quantized in one process.
    tw = TensorwiseScaling()
    g = torch.Generator().manual_seed(77 + rank)
    xr = torch.randn(16, 32, generator=g) * (rank + 1)
    parts = [torch.empty_like(xr) for _ in range(world_size)]
    dist.all_gather(parts, xr)
    whole = tw.make_quantizer("input").quantize(torch.cat(parts)).storage_views()
    red = tw.make_quantizer("input", amax_reduction=dist.group.WORLD).quantize(xr).storage_views()
    loc = tw.make_quantizer("input").quantize(xr).storage_views()
    rows = slice(16 * rank, 16 * rank + 16)
    out["tensorwise"] = {
        "red_scale_inv": red["scale_inv"].clone(),
        "loc_scale_inv": loc["scale_inv"].clone(),
        "whole_scale_inv": whole["scale_inv"].clone(),
        "rows_equal": torch.equal(red["rowwise_data"], whole["rowwise_data"][rows]),
        "cols_equal": torch.equal(red["columnwise_data"], whole["columnwise_data"][:, rows]),
    }
    return out


# --------------------------------------------------------------------------------------------
# Independent reference of numerics.md 2.1 (plain Python lists, fp32 division via torch)


def _ref_update(hist: list[float], scale: float, last: float, fmt_max: float) -> tuple[list[float], float]:
    if last == 0.0:
        return hist, scale  # fused path: nothing rolls, scale kept
    if len(hist) == 1:
        window, hist = last, [0.0]
    else:
        window = max(max(hist[1:]), last)
        hist = [0.0, *hist[2:], last]  # roll(-1), slot 0 cleared, newest amax last
    a = window  # amax_compute_algo == "max"
    if not (a > 0.0 and a != float("inf")):
        return hist, scale
    scaled_max = torch.tensor(fmt_max, dtype=torch.float32) * torch.tensor(2.0**-MARGIN, dtype=torch.float32)
    s = float(scaled_max / torch.tensor(a, dtype=torch.float32))
    return hist, (FLT_MAX if s == float("inf") else s)


def _expected(local_per_rank: list[list[dict]], reduce: bool, rank: int) -> list[dict]:
    """Per step: {module: {role: (scale, hist)}} after that step's update."""
    state = {m: {r: ([0.0] * HIST, 1.0) for r in ROLES} for m in ("lin1", "lin2")}
    out = []
    for step in range(STEPS):
        for m in state:
            for role in ROLES:
                amaxes = [local_per_rank[q][step][m][role] for q in range(WORLD)]
                last = max(amaxes) if reduce else amaxes[rank]
                hist, scale = state[m][role]
                state[m][role] = _ref_update(hist, scale, last, FMT_MAX[role])
        out.append({m: dict(v) for m, v in state.items()})
    return out


def _as_tensors(hist: list[float], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([scale], dtype=torch.float32), torch.tensor(hist, dtype=torch.float32)


@pytest.fixture(scope="module")
def delayed_results() -> list[dict[str, object]]:
    return run_distributed(_delayed_rank, WORLD)


def test_reduced_scales_identical_and_equal_global_reference(delayed_results: list[dict]) -> None:
    local = [[s["local"] for s in res["group"]] for res in delayed_results]
    # The data really differ per rank (otherwise the test could not fail).
    assert local[0][0]["lin1"]["input"] != local[1][0]["lin1"]["input"]
    assert local[0][0]["lin2"]["grad"] != local[1][0]["lin2"]["grad"]
    for rank, res in enumerate(delayed_results):
        exp = _expected(local, reduce=True, rank=rank)
        prev = {m: {r: _as_tensors([0.0] * HIST, 1.0) for r in ROLES} for m in ("lin1", "lin2")}
        for step, got in enumerate(res["group"]):
            for m in ("lin1", "lin2"):
                for role in ROLES:
                    want = _as_tensors(*exp[step][m][role])
                    # Forward roles are updated when the autocast exits; the grad role only
                    # after the backward (first module's backward), so it still holds the
                    # previous step's state right after the forward.
                    at_fwd = want if role in FWD_ROLES else prev[m][role]
                    for when, w in (("after_fwd", at_fwd), ("after_bwd", want)):
                        scale, hist = got[when][m][role]
                        assert torch.equal(scale, w[0]), (rank, step, m, role, when, scale, w[0])
                        assert torch.equal(hist, w[1]), (rank, step, m, role, when, hist, w[1])
                    prev[m][role] = want
    # Bitwise identical across ranks (implied by the above; stated directly for clarity).
    a, b = delayed_results[0]["group"][-1]["after_bwd"], delayed_results[1]["group"][-1]["after_bwd"]
    for m in a:
        for role in ROLES:
            assert all(torch.equal(u, v) for u, v in zip(a[m][role], b[m][role], strict=True)), (m, role)


def test_no_group_named_reduces_over_world_like_te(delayed_results: list[dict]) -> None:
    """``amax_reduction_group=None`` under torch.distributed means the world group (as TE)."""
    for res in delayed_results:
        for got, want in zip(res["default"], res["group"], strict=True):
            for when in ("after_fwd", "after_bwd"):
                for m in ("lin1", "lin2"):
                    for role in ROLES:
                        g, w = got[when][m][role], want[when][m][role]
                        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]), (when, m, role)


def test_single_rank_group_scales_differ_across_ranks(delayed_results: list[dict]) -> None:
    """Negative control: a one-rank group -> each rank follows its own amaxes."""
    local = [[s["local"] for s in res["self"]] for res in delayed_results]
    for rank, res in enumerate(delayed_results):
        exp = _expected(local, reduce=False, rank=rank)
        for m in ("lin1", "lin2"):
            for role in ROLES:
                want = _as_tensors(*exp[-1][m][role])
                scale, hist = res["self"][-1]["after_bwd"][m][role]
                assert torch.equal(scale, want[0]) and torch.equal(hist, want[1]), (rank, m, role)
    s0 = delayed_results[0]["self"][-1]["after_bwd"]
    s1 = delayed_results[1]["self"][-1]["after_bwd"]
    for m in ("lin1", "lin2"):
        for role in ("input", "grad"):
            assert not torch.equal(s0[m][role][0], s1[m][role][0]), (m, role)
    # Weights are the same on every rank, so their scales agree even without the group.
    assert torch.equal(s0["lin1"]["weight"][0], s1["lin1"]["weight"][0])


def test_tensorwise_amax_reduction_hook(delayed_results: list[dict]) -> None:
    tw = [res["tensorwise"] for res in delayed_results]
    for r in tw:
        assert torch.equal(r["red_scale_inv"], r["whole_scale_inv"])
        assert r["rows_equal"] and r["cols_equal"]
    assert torch.equal(tw[0]["red_scale_inv"], tw[1]["red_scale_inv"])
    assert not torch.equal(tw[0]["loc_scale_inv"], tw[1]["loc_scale_inv"])  # control
