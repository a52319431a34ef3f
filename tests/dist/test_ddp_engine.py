"""The data-parallel engine on real gloo ranks: parity, overlap, FP8 param gather, eval,
forced syncs, NaN handling, and the regression tests of the upstream bug classes.

Tolerances: runs that differ only in *how* grads travel (overlap on/off, FP8 param gather
on/off, single-grouped vs discrete experts, eval or forced syncs in between) apply the same
fp32 operations to the same values in the same order, so they must agree bitwise
(``torch.equal`` through ``first_difference``). Runs at different DP sizes sum the same
gradients in a different order (per-rank partial sums, then the collective): fp32 rounding
differs in the last bits and is amplified by the bf16 rounding of the params after each
step, so they are compared within a relative tolerance (below).
"""

from __future__ import annotations

import _engine_cases as C
import pytest

from lptrain.testing.dist import RankFailedError, run_distributed
from lptrain.testing.parity import first_difference, max_rel_diff, train_steps

pytestmark = pytest.mark.dist

# DP=2/4 vs DP=1: losses to 2e-3 relative and fp32 masters to 2e-2 normwise after 3 steps at
# lr 1e-2 (bf16 params: one bf16 ulp is 4e-3 relative; a flipped rounding early in training
# moves later steps by a few ulps).
LOSS_RTOL = 2e-3
MASTER_RTOL = 2e-2


def _assert_same(a, b, what: str, keys=("losses", "masters", "main_grads", "logits")) -> None:
    """Bitwise on ``keys``; the global grad norm to 1e-12 relative: it is an fp64 sum of
    squares over this rank's pieces, and buffers cut differently (e.g. FP8 params in their
    own buffer) sum them in another order. Bitwise masters show the clip factor matched."""
    for k in keys:
        d = first_difference(a[k], b[k])
        assert d is None, f"{what}: {k} differ: {d}"
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-12, abs=0), what


def _assert_ranks_agree(per_rank: list[dict], case: str) -> None:
    for r in per_rank[1:]:
        d = first_difference(per_rank[0][case]["raw"], r[case]["raw"])
        assert d is None, f"{case}: ranks hold different params: {d}"


def test_dp2_and_dp4_match_dp1() -> None:
    """Same global batch (8) at DP=1, 2 and 4 with micro-batches of 2 (4, 2 and 1 per rank,
    so no_sync accumulation is exercised too): plain DDP and the distributed optimizer."""
    mbs = ["train.micro_batch_size=2"]
    base = train_steps(C.TINY, [*C.BASE, *mbs], steps=3)
    cases = {
        "ddp": mbs,
        "distopt": [*mbs, *C.DISTOPT],
        "distopt_overlap": [*mbs, *C.DISTOPT, *C.OVERLAP],
        "distopt_avg": [*mbs, *C.DISTOPT, "ddp.average_in_collective=true"],
    }
    two = run_distributed(C.run_cases, 2, args=(cases,), timeout_s=240)
    for name in cases:
        _assert_ranks_agree(two, name)
        got = two[0][name]
        for x, y in zip(got["losses"], base["losses"], strict=True):
            assert abs(x - y) <= LOSS_RTOL * abs(y), (name, got["losses"], base["losses"])
        assert max_rel_diff(got["masters"], base["masters"]) < MASTER_RTOL, name
    # averaging after the SUM instead of pre-scaling by 1/2: exact for a power-of-two DP size
    _assert_same(two[0]["distopt"], two[0]["distopt_avg"], "average_in_collective")
    four_cases = {
        "distopt": [*mbs, *C.DISTOPT],
        # partial sharding: reduce-scatter inside 2-rank instances, all-reduce across them
        "instances2": [*mbs, *C.DISTOPT, "ddp.num_distributed_optimizer_instances=2"],
    }
    four = run_distributed(C.run_cases, 4, args=(four_cases,), timeout_s=240)
    for name in four_cases:
        _assert_ranks_agree(four, name)
        assert max_rel_diff(four[0][name]["masters"], base["masters"]) < MASTER_RTOL, name


def test_grad_accumulation_matches_one_large_batch() -> None:
    """4 micro-batches of 2 vs 1 micro-batch of 8 (DP=1): the same mean gradient, summed in a
    different order (fp32 accumulation in main_grad) from GEMMs of other shapes (other fp32
    blocking). Step 1 agrees to 1e-6; afterwards a bf16 param whose rounding flips moves the
    next losses by up to ~1e-4 at lr 1e-2: 1e-3 relative, masters as for DP sizes."""
    many = train_steps(C.TINY, [*C.BASE, "train.micro_batch_size=2"], steps=3)
    one = train_steps(C.TINY, [*C.BASE, "train.micro_batch_size=8"], steps=3)
    assert many["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6)
    for x, y in zip(many["losses"], one["losses"], strict=True):
        assert abs(x - y) <= 1e-3 * abs(y)
    assert max_rel_diff(many["masters"], one["masters"]) < MASTER_RTOL


def _fp8_gather_matrix() -> dict[str, list[str]]:
    cases: dict[str, list[str]] = {}
    for rname, rec, pg in (
        ("tensorwise", C.TENSORWISE, C.FP8_PG),
        ("blockwise", C.BLOCKWISE, C.FP8_PG),
        ("mxfp8", C.MXFP8, [*C.FP8_PG, *C.REUSE]),
    ):
        for oname, ov in (("overlap", C.OVERLAP), ("sync", C.NO_OVERLAP)):
            for moe in ((), tuple(C.MOE)):
                base = [*C.DISTOPT, *ov, *rec, *moe]
                key = f"{rname}-{oname}-{'moe' if moe else 'dense'}"
                cases[f"{key}|off"] = base
                cases[f"{key}|on"] = [*base, *pg]
    return cases


def test_fp8_param_gather_on_equals_off_bitwise() -> None:
    """FP8 primary weights gathered (bytes for tensorwise/blockwise, bf16 through the reused
    grad buffer for MXFP8) == bf16 params quantized in the forward, bitwise: per-step loss,
    grad norm, forward output, per-param main_grad and fp32 master; every rank holds the
    same bytes. Overlap on == overlap off, bitwise."""
    cases = _fp8_gather_matrix()
    res = run_distributed(C.run_cases, 2, args=(cases,), timeout_s=400)
    r = res[0]
    for name in cases:
        _assert_ranks_agree(res, name)
        if name.endswith("|off"):
            key = name[:-4]
            _assert_same(r[name], r[key + "|on"], f"{key}: param gather on vs off")
            if "-overlap-" in key:
                _assert_same(r[name], r[key.replace("-overlap-", "-sync-") + "|off"], f"{key}: overlap")
                _assert_same(
                    r[key + "|on"], r[key.replace("-overlap-", "-sync-") + "|on"], f"{key}: overlap (on)"
                )


def test_train_eval_train_and_forced_sync_equal_train_only() -> None:
    """Eval after every step and checkpoint-style forced syncs leave training bitwise
    unchanged: MXFP8 with grad-buffer reuse and overlap (dense and single-grouped MoE), FP8
    delayed scaling (eval forwards must not record amaxes), NVFP4 (stochastic rounding)."""
    configs = {
        "mxfp8-reuse-dense": [*C.DISTOPT, *C.OVERLAP, *C.MXFP8, *C.FP8_PG, *C.REUSE],
        "mxfp8-reuse-sgw": [*C.DISTOPT, *C.OVERLAP, *C.MXFP8, *C.FP8_PG, *C.REUSE, *C.MOE,
                            "model.moe.single_grouped_weight=true"],
        "delayed": [*C.DISTOPT, *C.DELAYED],
        "nvfp4": [*C.DISTOPT, *C.OVERLAP, *C.NVFP4],
    }
    variants = {"train": {}, "eval": {"eval_every": 1}, "sync": {"sync_after": (1, 2)}}
    res = run_distributed(C.run_config_variants, 2, args=(configs, variants), timeout_s=400)
    for cfg in configs:
        for v in ("eval", "sync"):
            _assert_same(res[0][cfg]["train"], res[0][cfg][v], f"{cfg}: {v}")
    single = train_steps(C.TINY, [*C.BASE, *C.DELAYED], steps=3)
    single_eval = train_steps(C.TINY, [*C.BASE, *C.DELAYED], steps=3, eval_every=1)
    _assert_same(single, single_eval, "delayed DP=1: eval")


def test_stale_dispatch_state_after_forced_sync() -> None:
    """With the grad buffer reused for the MXFP8 param gather and
    overlapped gathers, a forced sync (eval) left the bucket marked as gathered; the next
    step's restaged bf16 masters were never gathered, stayed in the shared buffer, and the
    backward accumulated on top of them: a grad-norm spike. The fix: restaging always resets
    the dispatch state (``Bucket.mark_staged``). Removing it must reproduce the spike."""
    ov = [*C.DISTOPT, *C.OVERLAP, *C.MXFP8, *C.FP8_PG, *C.REUSE]
    fixed = run_distributed(C.run_stale_dispatch, 2, args=(ov, False), timeout_s=240)[0]
    broken = run_distributed(C.run_stale_dispatch, 2, args=(ov, True), timeout_s=240)[0]
    _assert_same(fixed["train"], fixed["eval"], "with the fix")
    spike = max(b / a for a, b in zip(fixed["train"]["grad_norms"], broken["eval"]["grad_norms"], strict=True))
    assert spike > 1.5, (fixed["train"]["grad_norms"], broken["eval"]["grad_norms"])


def test_chained_optimizer_defers_param_sync() -> None:
    """MXFP8 reuse, overlap off, dense + expert optimizers on
    one model: syncing params right after the dense optimizer staged would gather the expert
    buckets' unstaged slices (zeros) into the expert weights. With the fix (every child stages
    before one sync) experts train; with it removed, expert weights are zeroed -- and the
    bucket state machine refuses such a sync outright."""
    ov = [*C.DISTOPT, *C.NO_OVERLAP, *C.MXFP8, *C.FP8_PG, *C.REUSE, *C.MOE]
    out = run_distributed(C.run_deferred_param_sync, 2, args=(ov,), timeout_s=240)[0]
    assert out["fixed_expert_zero_fraction"] == 0.0
    assert "IllegalTransition" in out["strict_error"] and "has not staged this bucket" in out["strict_error"]
    assert out["unchecked_expert_zero_fraction"] == 1.0


def test_single_grouped_equals_discrete_matrix() -> None:
    """Single grouped expert weights in the buffers train exactly like
    discrete ones at DP=2 with the distributed optimizer, across bf16 / mxfp8 / nvfp4 x
    primary-weight gather on/off x gradient-accumulation fusion on/off."""
    cases: dict[str, list[str]] = {}
    for prec, rec, pg in (
        ("bf16", [*C.EMU], []),
        ("mxfp8", C.MXFP8, [*C.FP8_PG, *C.REUSE]),
        ("nvfp4", C.NVFP4, C.FP4_PG),
    ):
        for gather in (False, True):
            if gather and not pg:
                continue
            for fusion in ("true", "false"):
                base = [*C.DISTOPT, *rec, *C.MOE, *(pg if gather else []),
                        f"train.gradient_accumulation_fusion={fusion}"]
                key = f"{prec}-pg{int(gather)}-fusion_{fusion}"
                cases[f"{key}|single"] = [*base, "model.moe.single_grouped_weight=true"]
                cases[f"{key}|discrete"] = base
    res = run_distributed(C.run_cases, 2, args=(cases, 2), timeout_s=400)
    r = res[0]
    for name in cases:
        if name.endswith("|single"):
            key = name[: -len("|single")]
            for k in ("losses", "grad_norms", "logits"):
                d = first_difference(r[name][k], r[key + "|discrete"][k])
                assert d is None, f"{key}: {k} differ: {d}"
            d = first_difference(r[name]["canonical"], r[key + "|discrete"]["canonical"])
            assert d is None, f"{key}: canonical params differ: {d}"


def test_nonfinite_grad_on_one_rank_stops_every_rank() -> None:
    """NaN injected into rank 1's gradient at step 2: every rank stops with the step, the
    rank and the parameter (no hang: the run has a 60 s deadline)."""
    ov = [*C.DISTOPT, "train.gradient_accumulation_fusion=false"]  # the NaN rides p.grad
    with pytest.raises(RankFailedError) as info:
        run_distributed(C.run_nan_injection, 2, args=(ov,), timeout_s=60)
    msg = str(info.value)
    assert "step 2, rank 1: gradient of 'layers.1.mlp.linear_fc2.weight' is not finite" in msg
    skipped = run_distributed(
        C.run_nan_injection, 2, args=([*ov, "train.on_nonfinite=skip"],), timeout_s=60
    )
    assert skipped[0]["skipped"] == [False, True, False]


def test_nonfinite_grad_is_located_before_sharded_grads_are_released() -> None:
    """ZeRO-2 (``optim_grads``): the full grads are freed right after their reduce-scatter, so
    the bad element is located from the full bucket before that (only when its sum is not
    finite, on the CPU). The message still names the parameter."""
    ov = [*C.DISTOPT, "train.gradient_accumulation_fusion=false",
          "ddp.data_parallel_sharding_strategy=optim_grads", "ddp.overlap_grad_reduce=true"]
    with pytest.raises(RankFailedError) as info:
        run_distributed(C.run_nan_injection, 2, args=(ov,), timeout_s=60)
    assert "step 2, rank 1: gradient of 'layers.1.mlp.linear_fc2.weight' is not finite" in str(info.value)
