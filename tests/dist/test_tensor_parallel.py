"""Tensor and sequence parallelism of the model (2 gloo ranks) against the single-rank model.

One spawned 2-rank world runs every case (a dense model with GQA, q/k norms and a tied
embedding, with and without sequence parallelism; an MoE model with both balancing losses,
with sequence parallelism) through one fp32 forward and backward of a fixed batch; the parent
builds the same configs at one rank. Compared in the single-rank form (shards gathered):

* the initial weights, bitwise (each shard is the single-rank values of its slice);
* the loss, the whole logits and every gradient, within a stated fp32 tolerance;
* the tensor-parallel traffic of the step against the analytic count.

**Tolerance.** Tensor parallelism changes the order of fp32 sums and nothing else: a
row-parallel GEMM adds two partial sums over halves of its inner dimension (one sum over the
whole dimension at one rank), the vocab-parallel softmax adds the ranks' exponential sums, a
replicated weight's gradient adds the ranks' partial gradients. Reordering an fp32 sum of n
terms moves it by at most ~n * 2^-24 of the sum of the terms' magnitudes (n <= 256 here:
~1.5e-5), and these errors pass through two layers; measured, the largest difference is below
1e-6 of a tensor's largest entry. ``RTOL = 2e-5`` of the largest entry bounds the reordering
and is orders of magnitude below what a sharding bug does (a missing, doubled or misplaced
shard changes a value by O(1) of itself).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lptrain.testing.dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _tp_cases import DENSE, MOE, forward_backward, run_forward_backward  # noqa: E402

pytestmark = pytest.mark.dist

RTOL = 2e-5
TP2 = "model.tensor_model_parallel_size=2"
SP = "model.sequence_parallel=true"
CASES = {"dense_tp": [*DENSE, TP2], "dense_sp": [*DENSE, TP2, SP], "moe_sp": [*MOE, TP2, SP]}
REFERENCE = {"dense_tp": DENSE, "dense_sp": DENSE, "moe_sp": MOE}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    ranks = run_distributed(run_forward_backward, 2, args=(CASES,), timeout_s=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: tiny GEMMs
    try:
        ref = {name: forward_backward(REFERENCE[name]) for name in CASES}
    finally:
        torch.set_num_threads(threads)
    return {"ranks": ranks, "ref": ref}


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest entry of ``want``."""
    scale = float(want.abs().max()) or 1.0
    return float((got.double() - want.double()).abs().max()) / scale


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_forward_backward_matches_tp1(results: dict[str, Any], case: str) -> None:
    ref = results["ref"][case]
    for got in results["ranks"]:
        r = got[case]
        assert r["loss"] == pytest.approx(ref["loss"], rel=RTOL)
        assert r["lm_loss"] == pytest.approx(ref["lm_loss"], rel=RTOL)
        assert _close(r["logits"], ref["logits"]) < RTOL
        assert r["grads"].keys() == ref["grads"].keys()
        worst = {n: _close(r["grads"][n], ref["grads"][n]) for n in ref["grads"]}
        assert max(worst.values()) < RTOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("case", list(CASES))
def test_shards_are_the_single_rank_init(results: dict[str, Any], case: str) -> None:
    ref = results["ref"][case]["weights"]
    for got in results["ranks"]:
        w = got[case]["weights"]
        assert w.keys() == ref.keys()
        for n in ref:
            assert torch.equal(w[n], ref[n]), n


def test_both_ranks_hold_the_same_whole(results: dict[str, Any]) -> None:
    """After gathering, the two ranks' gradients and logits agree bitwise (the collectives
    leave every rank the same sums)."""
    a, b = results["ranks"]
    for case in CASES:
        assert torch.equal(a[case]["logits"], b[case]["logits"])
        for n in a[case]["grads"]:
            assert torch.equal(a[case]["grads"][n], b[case]["grads"][n]), (case, n)


@pytest.mark.parametrize(("case", "layers", "sp"), [("dense_tp", (2, 0), False), ("dense_sp", (2, 0), True),
                                                    ("moe_sp", (0, 2), True)])
def test_tp_traffic_matches_the_analytic_count(results: dict[str, Any], case: str, layers: tuple[int, int],
                                               sp: bool) -> None:
    """Sequence parallel: 4 all-gathers / reduce-scatters of b*s*h per dense layer per pass
    (2 per MoE layer), plus the embedding and the head; without it all-reduces (2 per layer
    per pass, plus one)."""
    from lptrain.precision.tensor_parallel import tp_activation_traffic

    from _tp_cases import BATCH, SEQ  # noqa: PLC0415

    want = tp_activation_traffic(tokens=BATCH * SEQ, hidden=64, itemsize=4, dense_layers=layers[0],
                                 moe_layers=layers[1], sequence_parallel=sp)
    for got in results["ranks"]:
        assert got[case]["traffic"] == want
