"""The precision-aware optimizer everywhere the optimizer goes, on real gloo ranks: one 2-rank
world runs every case (three steps each, tiny shapes), this process the single-rank runs they
are compared with.

* ZeRO-1, ZeRO-2 and ZeRO-3 (``ddp.data_parallel_sharding_strategy``) with TE holding the
  masters (fp32 masters kept as remainders of the bf16 params, an FP8 first moment, a bf16
  second moment, bf16 main grads, overlapped reduce and gather) train **bitwise alike**: the
  strategies move bytes, never the values, the pieces or their per-tensor scales.
* Chained dense and expert optimizers under expert parallelism (EP 2), MXFP8 with FP8 primary
  weights gathered through the reused grad buffer, bf16 main grads, FP8 / fp16 moments
  (lptrain holding fp32 masters); layer-wise Muon (compact, MXFP8 param gather, its momentum
  in FP8); tensor parallelism (TP 2 + SP) and pipeline parallelism (PP 2) with TE's fp16
  masters, a bf16 first and an FP8 second moment.
* The ZeRO-1, expert-parallel and Muon cases checkpoint after step 1 and a fresh engine
  resumes from it: step 2 and the final masters are **bitwise** the uninterrupted run's, with
  no conversion note (the stored bits and scales of each rank's pieces come back).
* PP 2 against one rank: **bitwise** (the stages hold whole params at DP 1: the same pieces,
  the same scales). TP 2 against one rank: losses within ``TP_RTOL`` (a TP run sums its fp32
  partial products in another order; tests/dist/test_tp_training.py measures the drift).
* The ZeRO-1 state saved at DP 2 resumed in one process: the FP8 moment is re-scaled for the
  new pieces and the load says so; the step stays within ``RESUME_RTOL`` of the DP 2 one.
"""

from __future__ import annotations

import _engine_cases as C
import _pao_cases as P
import pytest

from lptrain.testing.dist import run_distributed
from lptrain.testing.parity import first_difference

pytestmark = pytest.mark.dist

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
EP2 = ["model.moe.expert_model_parallel_size=2"]
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
PP2 = ["model.pipeline_model_parallel_size=2"]
FP16_MASTERS = [*P.PAO, "optimizer.main_params_dtype=fp16", "optimizer.exp_avg_dtype=bf16",
                "optimizer.exp_avg_sq_dtype=fp8"]
CASES: dict[str, tuple[list[str], bool]] = {
    **{f"te-held|{s}": ([*P.TE_HELD, *C.OVERLAP, f"ddp.data_parallel_sharding_strategy={s}"], s == "optim")
       for s in STRATEGIES},
    "mxfp8-pg-moe-ep2": ([*P.PAO, *P.MXFP8_PG, *C.MOE, *EP2, *C.OVERLAP, "optimizer.exp_avg_dtype=fp8",
                          "optimizer.exp_avg_sq_dtype=fp16", "optimizer.main_grads_dtype=bf16"], True),
    "muon-compact-mxfp8-pg": ([*P.PAO, *P.MXFP8_PG, "optimizer.name=muon", "optimizer.exp_avg_dtype=fp8",
                               "optimizer.exp_avg_sq_dtype=bf16", "optimizer.main_grads_dtype=bf16"], True),
    "tp2-fp16-masters": ([*FP16_MASTERS, *TP2], False),
    "pp2-fp16-masters": ([*FP16_MASTERS, *PP2], False),
}
# A TP run sums fp32 partial products in another order (~1e-6 after a step); 2 steps here.
TP_RTOL = 2e-3
# DP 2 -> DP 1: bf16 grads reduced over 2 ranks vs summed on one, and FP8 moments re-scaled.
RESUME_RTOL = 2e-3


@pytest.fixture(scope="module")
def runs() -> dict:
    world = run_distributed(P.run_battery, 2, args=(CASES,), timeout_s=600)
    single = {
        "one-rank": P.run_single(FP16_MASTERS),
        "dp1-resume": P.run_single([*P.TE_HELD, *C.OVERLAP], world[0]["te-held|optim"]["state"]),
    }
    return {"ranks": world, "single": single}


def test_zero_strategies_train_bitwise_alike(runs: dict) -> None:
    for rank, out in enumerate(runs["ranks"]):
        base = out["te-held|optim"]
        for s in STRATEGIES[1:]:
            other = out[f"te-held|{s}"]
            assert first_difference(base["steps"], other["steps"]) is None, (rank, s)
            assert first_difference(base["masters"], other["masters"]) is None, (rank, s)


@pytest.mark.parametrize("case", [c for c, (_, resume) in CASES.items() if resume])
def test_resume_is_bitwise_and_finite(runs: dict, case: str) -> None:
    for rank, out in enumerate(runs["ranks"]):
        r = out[case]
        assert r["finite"], (rank, case)
        assert r["notes"] == [], (rank, case, r["notes"])
        assert r["resumed"] == r["steps"][1], (rank, case, r["resumed"], r["steps"][1])
        assert first_difference(r["masters"], r["resumed_masters"]) is None, (rank, case)


def test_states_are_saved_in_their_dtypes(runs: dict) -> None:
    out = runs["ranks"][0]
    assert out["te-held|optim"]["dtypes"] == {"master": "remainders", "exp_avg": "fp8", "exp_avg_sq": "bf16"}
    assert out["mxfp8-pg-moe-ep2"]["dtypes"] == {"master": "fp32", "exp_avg": "fp8", "exp_avg_sq": "fp16"}
    # a bf16 moment stays bf16 (gathered from both ranks' pieces); FP8 and fp16 moments are saved
    # as their fp32 values (the codes and scales are each rank's local state)
    assert out["te-held|optim"]["moment_dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert out["mxfp8-pg-moe-ep2"]["moment_dtypes"] == ["torch.float32"]
    assert out["muon-compact-mxfp8-pg"]["moment_dtypes"] == ["torch.bfloat16", "torch.float32"]


def test_pipeline_is_bitwise_and_tensor_parallel_close(runs: dict) -> None:
    one = runs["single"]["one-rank"]
    for out in runs["ranks"]:
        assert out["pp2-fp16-masters"]["steps"] == one["steps"]
        tp2 = [loss for loss, _ in out["tp2-fp16-masters"]["steps"]]
        assert tp2 == pytest.approx([loss for loss, _ in one["steps"]], rel=TP_RTOL)
    # the two stages' masters together
    masters = {**runs["ranks"][0]["pp2-fp16-masters"]["masters"], **runs["ranks"][1]["pp2-fp16-masters"]["masters"]}
    assert first_difference(masters, one["masters"]) is None


def test_resume_at_another_layout_rescales_and_says_so(runs: dict) -> None:
    dp1 = runs["single"]["dp1-resume"]
    assert any("exp_avg (fp8) re-scaled" in n for n in dp1["notes"]), dp1["notes"]
    dp2 = runs["ranks"][0]["te-held|optim"]["steps"][1]
    assert dp1["resumed"][0] == pytest.approx(dp2[0], rel=RESUME_RTOL)
