"""``train.eval_iters`` means the same validation samples at DP=1 and DP=2 (Megatron:
``eval_iters x global_batch_size``), so the validation loss agrees across world sizes.

Tolerance 1e-5 relative: both worlds evaluate the same micro-batches of ``micro_batch_size``
samples with the same weights (trained 2 steps at one rank, evaluated there and loaded into the
2-rank world); what differs is
fp32 rounding inside the GEMMs (one process with the parent's thread count vs single-thread
ranks) and the order in which the per-batch losses are summed (float64, then one all-reduce).
The loss the old per-rank count gives (``eval_iters`` micro-batches on every rank, so twice
the samples at DP=2) is shown to differ by far more, so the check can fail.
"""

from __future__ import annotations

import pytest
from _eval_cases import evaluate, train_at_one_rank

from lptrain.testing.dist import run_distributed

pytestmark = pytest.mark.dist

RECIPES = ("tiny_cpu.yaml", "mxfp8_muon_cpu.yaml")
OVERRIDES = ("data.builtin_max_mb=1", "logging.progress=false", "train.eval_iters=2",
             "model.seq_length=32", "optimizer.warmup_iters=0", "optimizer.lr=0.01")
REL_TOL = 1e-5


def test_validation_loss_is_independent_of_world_size() -> None:
    trained = {r: train_at_one_rank(r, OVERRIDES, steps=2) for r in RECIPES}
    one = {r: measured for r, (_, measured) in trained.items()}
    weights = {r: state for r, (state, _) in trained.items()}
    two = run_distributed(evaluate, 2, args=(weights, OVERRIDES), timeout_s=240)
    for recipe in RECIPES:
        a, b0, b1 = one[recipe], two[0][recipe], two[1][recipe]
        assert b0["loss"] == b1["loss"]  # all-reduced: every rank reports the same value
        assert a["samples"] == b0["samples"] == 2 * 8  # eval_iters x global_batch_size
        rel = abs(a["loss"] - b0["loss"]) / a["loss"]
        print(f"{recipe}: val loss DP=1 {a['loss']:.8f} DP=2 {b0['loss']:.8f} rel diff {rel:.2e}")
        assert rel <= REL_TOL, (recipe, a["loss"], b0["loss"])
        old_rel = abs(a["per_rank_count"] - b0["per_rank_count"]) / a["loss"]
        print(f"  with eval_iters micro-batches per rank (before): rel diff {old_rel:.2e}")
        assert old_rel > 100 * REL_TOL, (recipe, old_rel)  # the world-size dependence is gone
