"""Quantized bytes under context parallelism: each CP rank's quantized operands are its chunks
of the single-rank operands, byte for byte, for every quantized recipe (2 gloo ranks).

One linear runs two steps of forward and backward on a 512-token sequence under delayed and
tensorwise FP8, blockwise FP8, MXFP8 and NVFP4 (RHT, stochastic rounding); the parent runs
the same layer on the whole sequence. A CP rank holds chunks i and 3 - i of 4 (128 tokens
each). Every operand the linear ops quantize is recorded as raw storage (data, scales,
per-tensor amaxes) and compared with ``torch.equal``: a field with a token axis against the
rank's two chunks of the single-rank field along it, every other field (the weight, a
per-tensor scale or amax) against the whole. NVFP4's output gradients are left out
(stochastic rounding draws each rank's own bits).

What makes them equal -- each CP rank computes "the CP = 1 computation on fewer tokens":

* **per-tensor amaxes reduced over CP**: delayed scaling's at the autocast region's update (its
  group holds the CP ranks: Megatron's amax-reduction group), the current-scaling ones --
  tensorwise, and NVFP4's global amax -- in the quantizers of the sequence-split operands (the
  input and the output gradient), which the context-parallel factory gives the CP group;
* **per-block scales**: blockwise (128), MXFP8 (32) and NVFP4 (16) scale blocks along the
  token dimension of the weight gradient's operands; a chunk holding whole blocks (rule
  CP-BLOCK-BOUNDARY) makes every block of a CP rank a block of the single-rank tensor.

The regressions monkeypatch each reduction away and show the bytes then differ: delayed from
step 2 (step 1 quantizes with the initial scales), tensorwise and NVFP4 at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.testing.dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _cp_bytes_cases import CASES, STEPS, run_all, run_cases  # noqa: E402

pytestmark = pytest.mark.dist

CP = 2
SPLIT_ROLES = {"input", "grad"}  # the sequence-split operands; the weight is whole on every rank


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    plan = {"cp": (CASES, ""), "no_delayed_fix": (["delayed"], "delayed"),
            "no_current_fix": (["tensorwise", "nvfp4"], "current")}
    ranks = run_distributed(run_all, CP, args=(plan,), timeout_s=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = run_cases(0, 1, CASES)
    finally:
        torch.set_num_threads(threads)
    return {"ref": ref, **{name: [r[name] for r in ranks] for name in plan}}


def _chunks(whole: torch.Tensor, axis: int, rank: int) -> torch.Tensor:
    """Parts ``rank`` and ``2 CP - 1 - rank`` of ``2 CP`` along ``axis``, side by side."""
    n = whole.shape[axis] // (2 * CP)
    return torch.cat([whole.narrow(axis, i * n, n) for i in (rank, 2 * CP - 1 - rank)], dim=axis)


def _differences(whole: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], rank: int) -> list[str]:
    assert whole.keys() == mine.keys()
    bad = []
    for k, w in whole.items():
        s = mine[k]
        if w.shape == s.shape:
            if not torch.equal(w, s):
                bad.append(k)
            continue
        axes = [a for a in range(w.dim()) if w.shape[a] != s.shape[a]]
        assert len(axes) == 1 and w.shape[axes[0]] == CP * s.shape[axes[0]], (k, w.shape, s.shape)
        if not torch.equal(_chunks(w, axes[0], rank), s):
            bad.append(k)
    return bad


def _mismatches(ref: list[tuple], got: list[tuple], rank: int, recipe: str) -> list[tuple]:
    assert [role for _, role, _ in got] == [role for _, role, _ in ref]
    per_step = len(ref) // STEPS
    out = []
    for i, ((_, role, w), (_, _, s)) in enumerate(zip(ref, got, strict=True)):
        if role == "grad" and recipe == "nvfp4":
            continue  # stochastic rounding: each rank draws its own bits
        bad = _differences(w, s, rank if role in SPLIT_ROLES else 0)
        if bad:
            out.append((i // per_step + 1, role, bad))
    return out


@pytest.mark.parametrize("case", CASES)
def test_quantized_operands_are_the_chunks_of_the_single_rank_operands(runs: dict[str, Any], case: str) -> None:
    ref = runs["ref"][case]
    assert {"input", "weight", "grad"} <= {role for _, role, _ in ref}
    for rank, got in enumerate(runs["cp"]):
        assert _mismatches(ref, got[case], rank, case) == [], (case, rank)


@pytest.mark.parametrize(("fix", "cases"), [("delayed", ["delayed"]), ("current", ["tensorwise", "nvfp4"])])
def test_without_the_cp_amax_reduction_the_bytes_differ(runs: dict[str, Any], fix: str, cases: list[str]) -> None:
    """The regression: the same runs with the CP amax reduction monkeypatched away. Only the
    sequence-split operands differ; delayed scaling from step 2 (step 1 uses the initial
    scales everywhere); the current scalings at once, on the rank whose chunks lack the
    tensor's largest value at least."""
    for case in cases:
        ref = runs["ref"][case]
        bad = [m for rank, got in enumerate(runs[f"no_{fix}_fix"]) for m in _mismatches(ref, got[case], rank, case)]
        assert bad, case
        assert all(role in SPLIT_ROLES for _, role, _ in bad), bad
        steps = {step for step, *_ in bad}
        assert steps == ({2} if fix == "delayed" else {1, 2}), (case, bad)
