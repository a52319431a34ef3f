"""``ddp.data_parallel_sharding_strategy`` on real gloo ranks: ``optim_grads`` (ZeRO-2) and
``optim_grads_params`` (ZeRO-3) train bitwise like ``optim`` (ZeRO-1).

Why bitwise: the strategies change where bytes live between uses, never the values, the
collectives or their order -- the same full-bucket grads go into the same reduce-scatter,
the same masters are staged and gathered -- so losses, grad norms, fp32 masters, final
params and a probe forward's logits must agree with ``torch.equal``.

Selection (the issue's matrix is recipe x dense/MoE x overlap x DP size; each axis is
covered, not every product, to stay within seconds): at DP=2 bf16 (dense, overlap, two
micro-batches per rank so accumulation across ``no_sync`` runs), FP8 tensorwise (MoE,
no overlap), blockwise (dense, overlap), MXFP8 (MoE, overlap), the FP8 ones with FP8
primary weights gathered; at DP=4 MXFP8 (dense, no overlap, FP8 primary weights) and bf16
(dense, the memory runs: one step).
Every recipe appears with and without param gather interplay, dense and MoE, overlap on
and off, and each DP size has a quantized and an unquantized case.

Layer-wise Muon (padded layout: each whole matrix inside its owner's equal shard, so the
owner's reduced grad shard and param shard hold the whole gradient and value) runs the same
matrix: bf16 dense with overlap and MXFP8 MoE without it at DP=2 (the padded layout refuses
FP8 primary weights, rule MUON-PADDED-NO-PG, so MXFP8 quantizes in the forward); at DP=4 the
memory runs are bf16 Muon on an MoE model (experts shard over the expert-data-parallel
group), bitwise alike under the three strategies; plus train-eval-train under ZeRO-2 and ZeRO-3
(ZeRO-1: tests/dist/test_ddp_engine.py), a ZeRO-2
checkpoint resumed under the other strategies and the Muon buffers' measured bytes (and
estimate-memory's) at DP=2 and DP=4.
"""

from __future__ import annotations

import _engine_cases as C
import _sharding_cases as S
import pytest

from lptrain.testing.dist import run_distributed
from lptrain.testing.parity import first_difference

pytestmark = pytest.mark.dist

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
MB2 = ["train.micro_batch_size=2"]

DP2 = {
    "bf16-dense-overlap-mb2": [*C.OVERLAP, *MB2],
    "tensorwise-moe-sync": [*C.TENSORWISE, *C.FP8_PG, *C.MOE, *C.NO_OVERLAP],
    "blockwise-dense-overlap": [*C.BLOCKWISE, *C.FP8_PG, *C.OVERLAP],
    "mxfp8-moe-overlap": [*C.MXFP8, *C.FP8_PG, *C.MOE, *C.OVERLAP],
}
MUON = ["optimizer.name=muon", "optimizer.layer_wise_param_layout=padded"]
DP2_MUON = {
    "muon-dense-overlap": [*MUON, *C.OVERLAP],
    "muon-mxfp8-moe-sync": [*MUON, *C.MXFP8, *C.MOE, *C.NO_OVERLAP],
}
DP2 = {**DP2, **DP2_MUON}
DP4 = {"mxfp8-dense-sync": [*C.MXFP8, *C.FP8_PG, *C.NO_OVERLAP, *MB2]}


# Recompute at DP=2 (DP=1: tests/unit/model/test_recompute.py): a matrix case (the "off"
# run) again with recompute on, in the same world; under ZeRO-2 and ZeRO-3 too, where the
# recompute's forwards gather params the backward then reads.
RECOMPUTE_DP2 = {
    "tensorwise-moe-sync|optim": ["model.recompute_granularity=full"],
    "blockwise-dense-overlap|optim_grads_params": ["model.recompute_granularity=selective",
                                                   "model.recompute_modules=[mlp,core_attn]"],
    "mxfp8-moe-overlap|optim_grads": ["model.recompute_granularity=full", "model.recompute_method=block"],
}


def _recompute_cases(matrix: dict[str, list[str]]) -> dict[str, list[str]]:
    return {f"{case}|recompute": [*matrix[case], *mode] for case, mode in RECOMPUTE_DP2.items()}


def _cases(base: dict[str, list[str]]) -> dict[str, list[str]]:
    return {f"{name}|{s}": [*ov, f"ddp.data_parallel_sharding_strategy={s}"]
            for name, ov in base.items() for s in STRATEGIES}


def _assert_matrix(per_rank: list[dict], base: dict[str, list[str]]) -> None:
    m = per_rank[0]["matrix"]
    for name in base:
        ref = m[f"{name}|optim"]
        for s in STRATEGIES[1:]:
            d = first_difference(ref, m[f"{name}|{s}"])
            assert d is None, f"{name}: {s} differs from optim: {d}"
    for r in per_rank[1:]:  # every rank holds the same final params
        for case in (c for c in m if "|" in c and c.split("|")[0] in base):
            d = first_difference(m[case]["raw"], r["matrix"][case]["raw"])
            assert d is None, f"{case}: ranks differ: {d}"


def _assert_memory(mem: dict, dp: int) -> None:
    """Measured bytes (``memory_breakdown()``, padding included): ``optim`` holds the whole
    padded grad buffer and every param, ``optim_grads`` this rank's shard of every bucket's
    grads -- exactly 1/dp of the buffer (the layout pads every bucket to a multiple of dp) --
    and ``optim_grads_params`` the same shard of the params too. The param elements in a
    shard are what the planner's accounting (``kept_grad_elements``) says: 1/dp of all
    param elements up to the padding the layout reports."""
    full, z2, z3 = mem["optim"], mem["optim_grads"], mem["optim_grads_params"]
    grad_bytes, param_bytes = 4, 2  # fp32 grads, bf16 params
    used = sum(u for u, _ in z2["kept"])
    pad = sum(p for _, p in z2["kept"])
    assert full["measured"]["grads"] == full["padded"] * grad_bytes
    for z in (z2, z3):
        assert z["measured"]["grads"] == (used + pad) * grad_bytes
        assert z["measured"]["grads"] * dp == full["measured"]["grads"]
    # a shard holds 1/dp of the param elements, off by at most the buffer's whole padding
    assert abs(used * dp - full["unpadded"]) <= dp * (full["padded"] - full["unpadded"])
    assert full["measured"]["params"] == full["unpadded"] * param_bytes
    assert z2["measured"]["params"] == full["measured"]["params"]
    assert z3["measured"]["params"] == used * param_bytes
    assert z3["measured"]["param_buffer"] == pad * param_bytes  # (the shard's padding)


def _assert_muon_memory(mem: dict, dp: int) -> None:
    """The padded Muon buffers' measured bytes (``ParamAndGradBuffer.nbytes()``, after the
    step: no full bucket is alive): ``optim`` holds the whole grad buffer and param buffer,
    ``optim_grads`` exactly 1/dp of the grads (padded Muon buckets are ``dp`` equal shards),
    ``optim_grads_params`` 1/dp of the params too; and ``estimate-memory`` plans every
    persistent category of the run exactly (the same layout and accounting code)."""
    for s in STRATEGIES:  # estimate-memory models the same placement, byte for byte
        assert mem[s]["planned"] == mem[s]["categories"], s
    full, z2, z3 = (mem[s]["muon_buffers"] for s in STRATEGIES)
    assert full, "no Muon buffer"
    for (numel, b1), (_, b2), (_, b3) in zip(full, z2, z3, strict=True):
        assert b1 == {"grad": numel * 4, "param": numel * 2}
        assert b2 == {"grad": numel * 4 // dp, "param": numel * 2}
        assert b3 == {"grad": numel * 4 // dp, "param": numel * 2 // dp}


def test_strategies_bitwise_dp2_with_eval_resume_and_memory() -> None:
    muon_moe = DP2_MUON["muon-mxfp8-moe-sync"]
    spec = {
        "matrix": {**_cases(DP2), **_recompute_cases(_cases(DP2))},
        "eval": {k: v for k, v in _cases(DP2).items()
                 if k in ("bf16-dense-overlap-mb2|optim_grads", "mxfp8-moe-overlap|optim_grads_params",
                           "muon-mxfp8-moe-sync|optim_grads_params")},
        "resume": {
            # (base, [saved under, resumed under...])
            "blockwise": ([*C.BLOCKWISE, *C.FP8_PG, *C.OVERLAP],
                          ["optim_grads_params", "optim_grads_params", "optim", "optim_grads"]),
            "muon": (muon_moe, ["optim_grads", "optim", "optim_grads_params"]),
        },
        "memory": ([*MUON, *C.NO_OVERLAP], list(STRATEGIES)),
    }
    res = run_distributed(S.run_suite, 2, args=(spec,), timeout_s=400)
    _assert_matrix(res, DP2)
    m = res[0]["matrix"]
    for case in RECOMPUTE_DP2:
        d = first_difference(m[case], m[f"{case}|recompute"])
        assert d is None, f"{case}: recompute changed training at DP=2: {d}"
    # train-eval-train with forced syncs == train only (the matrix's optim_grads run)
    for case, ev in res[0]["eval"].items():
        ref = {k: res[0]["matrix"][case][k] for k in ev}
        d = first_difference(ref, ev)
        assert d is None, f"{case}: eval and forced syncs changed training: {d}"
    for name, (_, strategies) in spec["resume"].items():
        resume = res[0]["resume"][name]
        for s in strategies[1:]:
            d = first_difference(resume["continued"], resume[s])
            assert d is None, f"{name}: saved under {strategies[0]}, resumed under {s}: {d}"
    for r in res:
        _assert_memory(r["memory"], 2)
        _assert_muon_memory(r["memory"], 2)


def test_strategies_bitwise_dp4_and_memory() -> None:
    # the memory runs: bf16 layer-wise Muon (padded) on an MoE model, experts sharded over
    # the 4-rank expert-data-parallel group, AdamW for the rest
    spec = {"matrix": _cases(DP4), "memory": ([*MUON, *C.MOE, *C.NO_OVERLAP, *MB2], list(STRATEGIES))}
    res = run_distributed(S.run_suite, 4, args=(spec,), timeout_s=400)
    _assert_matrix(res, DP4)
    for r in res:
        _assert_memory(r["memory"], 4)
        _assert_muon_memory(r["memory"], 4)
        # the memory runs (one step) train alike too
        for s in STRATEGIES[1:]:
            d = first_difference(r["memory"]["optim"]["trained"], r["memory"][s]["trained"])
            assert d is None, f"Muon MoE DP=4: {s} differs from optim: {d}"
