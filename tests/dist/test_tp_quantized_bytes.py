"""Quantized bytes under tensor parallelism: each TP rank's quantized operands are the matching
slice of the single-rank operands, for every recipe (2 gloo ranks, with and without sequence
parallelism).

A column-parallel linear (weight split by output rows) and a row-parallel one (by input
columns) run two steps of forward and backward under each recipe -- bf16, delayed and
tensorwise FP8, blockwise FP8, MXFP8, NVFP4 with RHT and stochastic rounding -- plus
tensorwise FP8 primary weights; the parent runs the same layers at one rank. Every operand the
linear ops quantize is recorded as raw storage (data bytes, scales, per-tensor amaxes) and
compared with ``torch.equal``: a field the split cuts against the rank's slice of the
single-rank field, every other field (a per-tensor scale or amax, a replicated operand)
against the whole. Weights and inputs for every recipe; output gradients too except NVFP4's
(stochastic rounding draws from each rank's own stream).

What makes them equal: per-tensor amaxes reduced over the TP group (delayed scaling through
the autocast region's reduction, tensorwise and NVFP4 through their quantizers), and shard
boundaries on block boundaries (the rule TP-BLOCK-BOUNDARY) for blockwise, MXFP8 and NVFP4.
The regression cases monkeypatch the reduction away and show the bytes then differ
(delayed from step 2, tensorwise at once, primary weights included).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.testing.dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _tp_bytes_cases import CASES, STEPS, run_all, run_recipes  # noqa: E402

pytestmark = pytest.mark.dist

TP = 2
# which operand a split cuts, per (layer, role): the rest are whole on every rank
SPLIT = {("col", "weight"), ("col", "grad"), ("row", "weight"), ("row", "input")}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    plan = {
        "tp": (CASES, False, ""),
        "sp": (CASES, True, ""),
        "no_delayed_fix": (["delayed"], False, "delayed"),
        "no_tensorwise_fix": (["tensorwise", "tensorwise+primary"], False, "tensorwise"),
    }
    ranks = run_distributed(run_all, TP, args=(plan,), timeout_s=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = run_recipes(0, 1, CASES, False)
    finally:
        torch.set_num_threads(threads)
    return {"ref": ref, **{name: [r[name] for r in ranks] for name in plan}}


def _slice_differences(whole: dict[str, torch.Tensor], shard: dict[str, torch.Tensor], rank: int) -> list[str]:
    """The fields of ``shard`` that are not ``rank``'s slice of ``whole`` (a field cut by the
    split is the one axis whose size is 1/TP of the whole's; any other field must be equal)."""
    assert whole.keys() == shard.keys()
    bad = []
    for k, w in whole.items():
        s = shard[k]
        if w.shape == s.shape:
            if not torch.equal(w, s):
                bad.append(k)
            continue
        axes = [a for a in range(w.dim()) if w.shape[a] != s.shape[a]]
        assert len(axes) == 1 and w.shape[axes[0]] == TP * s.shape[axes[0]], (k, w.shape, s.shape)
        n = s.shape[axes[0]]
        if not torch.equal(w.narrow(axes[0], rank * n, n), s):
            bad.append(k)
    return bad


def _mismatches(ref: dict[str, Any], got: dict[str, Any], rank: int, recipe: str) -> list[tuple]:
    ops_ref, ops = ref["ops"], got["ops"]
    assert [(layer, role) for layer, role, _ in ops] == [(layer, role) for layer, role, _ in ops_ref]
    out = []
    per_step = len(ops_ref) // STEPS
    for i, ((layer, role, w), (_, _, s)) in enumerate(zip(ops_ref, ops, strict=True)):
        if role == "grad" and recipe.startswith("nvfp4"):
            continue  # stochastic rounding: each rank draws its own bits
        bad = _slice_differences(w, s, rank if (layer, role) in SPLIT else 0)
        if bad:
            out.append((i // per_step + 1, layer, role, bad))
    for layer in ("col", "row"):
        bad = _slice_differences(ref["weights"][layer], got["weights"][layer], rank)
        if bad:
            out.append(("final", layer, "weight", bad))
    return out


@pytest.mark.parametrize("mode", ["tp", "sp"])
@pytest.mark.parametrize("case", CASES)
def test_quantized_operands_are_the_single_rank_slices(runs: dict[str, Any], case: str, mode: str) -> None:
    ref = runs["ref"][case]
    if case != "bf16" and not case.endswith("+primary"):
        roles = {(layer, role) for layer, role, _ in ref["ops"]}
        assert {("col", "weight"), ("col", "input"), ("row", "weight"), ("row", "input")} <= roles
    for rank, got in enumerate(runs[mode]):
        assert _mismatches(ref, got[case], rank, case) == [], (case, mode, rank)


@pytest.mark.parametrize(("fix", "cases"), [("delayed", ["delayed"]),
                                            ("tensorwise", ["tensorwise", "tensorwise+primary"])])
def test_without_the_tp_amax_reduction_the_bytes_differ(runs: dict[str, Any], fix: str, cases: list[str]) -> None:
    """The regression: the same runs with the reduction monkeypatched away. Delayed scaling
    still matches at step 1 (every scale starts at 1) and differs from step 2; tensorwise
    differs at once; only sharded operands differ (on a rank, the one whose shard holds the
    tensor's amax may still match)."""
    for case in cases:
        ref = runs["ref"][case]
        for rank, got in enumerate(runs[f"no_{fix}_fix"]):
            bad = _mismatches(ref, got[case], rank, case)
            assert bad, (case, rank)
            # only operands the split cuts (the column-parallel input is whole everywhere)
            assert all((layer, role) in SPLIT or step == "final" for step, layer, role, _ in bad), bad
            if fix == "delayed":  # step 1 quantizes with the initial scales, identical everywhere
                assert 2 in {step for step, *_ in bad} and 1 not in {step for step, *_ in bad}, bad
