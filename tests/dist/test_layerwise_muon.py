"""The layer-wise distributed Muon optimizer on gloo (2 and 4 ranks), many configs per world.

* layer-wise (compact and padded layouts) == non-distributed Muon (every rank runs Muon on
  every matrix: ``optimizer.name=muon`` without the distributed optimizer) within tolerance,
  and all ranks hold bitwise-identical params after every step;
* ownership is identical on every rank when equal-shape matrices are registered in
  different orders;
* FP8 param gather ON == OFF bitwise on the compact layout (blockwise and mxfp8, overlap on
  and off, dense and MoE; lr 0.01, large for spectral Muon);
* the layer-wise optimizer's fixes, each monkeypatched away to show the bug it prevents
  (ownership by numel alone, ``per_rank[0][0]`` on an empty rank-0 slot, fp32 params
  gathered in bf16, FP8 and bf16 Muon grads split into two buffers), plus the forced sync
  finalizing a pending layer-wise gather;
* the memory report: measured (live buffers) == analytic (no allocation).
"""

from __future__ import annotations

import _layerwise_cases as C
import pytest

from lptrain.testing.dist import run_distributed
from lptrain.testing.parity import max_rel_diff

pytestmark = pytest.mark.dist

# layer-wise vs non-distributed Muon: the Muon matrices see bitwise the same all-reduced
# grads and the same per-matrix math; the AdamW params differ by reduce-scatter vs
# all-reduce summation order (bitwise at 2 ranks, where a+b == b+a; ~1 ulp at 4), which
# three steps at lr 0.01 amplify to at most ~1e-5 relative. 1e-4 leaves margin and still
# catches any real error (a wrong owner or a stale gather moves params by ~lr = 1e-2).
EQUIV_RTOL = 1e-4


def _dp2(rank: int, world: int) -> dict:
    moe_ov = [*C.MOE, "ddp.bucket_size=20000"]
    equiv = C.equivalence(rank, world, {
        "reference": ["optimizer.name=muon"],
        "compact": C.LAYER_WISE,
        "padded": C.PADDED,
        "compact_small_buckets": [*C.LAYER_WISE, *C.SMALL_BUCKETS],
        "reference_grouped": ["optimizer.name=muon", *C.SINGLE_GROUPED],
        "compact_grouped": [*C.LAYER_WISE, *C.SINGLE_GROUPED],
        "padded_grouped": [*C.PADDED, *C.SINGLE_GROUPED, *C.SMALL_BUCKETS],
    })
    fp8 = C.fp8_on_off(rank, world, {
        f"{rname}_{oname}_{mname}": [*C.LAYER_WISE, *recipe, *ov, *m]
        for rname, recipe in (("blockwise", C.BLOCKWISE), ("mxfp8", C.MXFP8))
        for oname, ov in (("overlap", [*C.OVERLAP, "ddp.bucket_size=20000"]), ("sync", []))
        for mname, m in (("dense", []), ("moe", moe_ov))
    }, steps=2)
    return {
        "equiv": equiv,
        "fp8": fp8,
        "ownership": C.ownership_orders(rank, world),
        "regressions": C.layer_wise_regressions(rank, world),
        "forced_sync": (C.forced_sync(rank, world, False), C.forced_sync(rank, world, True)),
        "memory": C.memory(rank, world, {
            "adamw_fp8": ["ddp.use_distributed_optimizer=true", *C.MXFP8, *C.FP8_PG],
            "muon_compact_fp8": [*C.LAYER_WISE, *C.MXFP8, *C.FP8_PG],
            "muon_padded": [*C.PADDED, *C.SMALL_BUCKETS],
        }),
    }


def _dp4(rank: int, world: int) -> dict:
    mbs = ["train.micro_batch_size=2"]  # global batch 8 over 4 ranks
    return {
        "equiv": C.equivalence(rank, world, {
            "reference": ["optimizer.name=muon", *mbs],
            "compact": [*C.LAYER_WISE, *mbs],
            "padded": [*C.PADDED, *C.SMALL_BUCKETS, *mbs],
        }, steps=2),
        "ownership": C.ownership_orders(rank, world),
    }


@pytest.fixture(scope="module")
def dp2() -> list[dict]:
    return run_distributed(_dp2, 2, timeout_s=300)


@pytest.fixture(scope="module")
def dp4() -> list[dict]:
    return run_distributed(_dp4, 4, timeout_s=300)


def _check_equivalence(results: list[dict], pairs: dict[str, str]) -> None:
    equiv = results[0]["equiv"]
    for name, res in equiv.items():
        assert not res["rank_mismatch"], f"{name}: ranks disagree: {res['rank_mismatch']}"
    for name, ref in pairs.items():
        got, want = equiv[name], equiv[ref]
        err = max_rel_diff(got["masters"], want["masters"])
        assert err <= EQUIV_RTOL, f"{name} vs {ref}: masters differ by {err:.2e} relative"
        for a, b in zip(got["losses"], want["losses"], strict=True):
            assert abs(a - b) <= EQUIV_RTOL * abs(b), f"{name}: losses {got['losses']} vs {want['losses']}"


def test_dp2_layer_wise_equals_non_distributed_muon(dp2: list[dict]) -> None:
    _check_equivalence(dp2, {
        "compact": "reference",
        "padded": "reference",
        "compact_small_buckets": "reference",
        "compact_grouped": "reference_grouped",
        "padded_grouped": "reference_grouped",
    })


def test_dp4_layer_wise_equals_non_distributed_muon(dp4: list[dict]) -> None:
    _check_equivalence(dp4, {"compact": "reference", "padded": "reference"})


@pytest.mark.parametrize("world", [2, 4])
def test_ownership_is_rank_independent(world: int, dp2: list[dict], dp4: list[dict]) -> None:
    results = dp2 if world == 2 else dp4
    own = results[0]["ownership"]
    assert own["fixed"] is None, own["fixed"]
    # the fix matters: upstream's numel-only key follows each rank's registration order
    assert own["broken"] is not None
    owned = [r["ownership"]["owned"] for r in results]
    assert sum(owned) == 7 and max(owned) - min(owned) <= 2, owned  # balanced


def test_fp8_param_gather_on_equals_off_bitwise(dp2: list[dict]) -> None:
    fp8 = dp2[0]["fp8"]
    assert len(fp8) == 8
    bad = {k: v for k, v in fp8.items() if v is not None}
    assert not bad, bad


def test_layer_wise_fixes_removed_reproduce_their_bugs(dp2: list[dict]) -> None:
    s = dp2[0]["regressions"]
    # empty rank-0 slot in the gather helper
    assert s["empty_slot_fixed"] is None, s["empty_slot_fixed"]
    assert isinstance(s["empty_slot_broken"], str) and "IndexError" in s["empty_slot_broken"]
    # fp32 params downcast to bf16 by the gather
    assert s["fp32_fixed"] is None, s["fp32_fixed"]
    assert s["fp32_broken"], "bf16 transport should have rounded the fp32 params"
    # FP8 and bf16 Muon grads in one all-reduce buffer, as with fp8 param gather off
    assert s["split_fixed"] is None, s["split_fixed"]
    assert s["split_broken"] is not None


def test_forced_sync_finalizes_pending_layer_wise_gather(dp2: list[dict]) -> None:
    fixed, broken = dp2[0]["forced_sync"]
    assert fixed is None, f"stale params inside params_synced: {fixed}"
    assert broken is not None, "without the fix the forced sync should leave stale params"


def test_memory_measured_equals_analytic(dp2: list[dict]) -> None:
    for rank, res in enumerate(dp2):
        for name, m in res["memory"].items():
            assert m["measured"] == m["analytic"], f"rank {rank} {name}: {m}"
    mem = dp2[0]["memory"]
    # target: compact Muon + fp8 param gather <= distributed AdamW + fp8 param gather
    assert mem["muon_compact_fp8"]["measured"]["total"] <= mem["adamw_fp8"]["measured"]["total"]
    assert mem["muon_padded"]["measured"]["padding"] > 0  # small buckets: padding reported
