"""Rank-side functions for the layer-wise Muon tests (module-level: they are pickled).

Each runs several configurations inside ONE spawned world and returns plain results that the
parent test compares (see tests/dist/_engine_cases.py for the pattern).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lptrain.testing.parity import first_difference, patched, train_steps

from _engine_cases import BASE, TINY  # lr 0.01: large for spectral Muon, amplifies mismatches
LAYER_WISE = ["optimizer.name=muon", "ddp.use_distributed_optimizer=true"]
PADDED = [*LAYER_WISE, "optimizer.layer_wise_param_layout=padded"]
SMALL_BUCKETS = ["ddp.bucket_size=6000"]
OVERLAP = ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"]
MOE = [
    "model.moe.num_experts=4",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=64",
    "model.moe.grouped_gemm=true",
]
SINGLE_GROUPED = [*MOE, "model.moe.single_grouped_weight=true"]
EMU = ["precision.backend=emulated", "precision.fp8_format=e4m3"]
BLOCKWISE = [*EMU, "precision.fp8_recipe=blockwise"]
MXFP8 = [*EMU, "precision.fp8_recipe=mxfp8"]
FP8_PG = ["precision.fp8_param_gather=true"]


def _all_ranks_equal(x: dict[str, Any]) -> str | None:
    """None when every rank holds bitwise the same ``x`` (compared on rank 0)."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, x)
    for r, other in enumerate(found[1:], start=1):
        d = first_difference(found[0], other)
        if d:
            return f"rank {r}: {d}"
    return None


def _raw(engine: Any) -> dict[str, Any]:
    from lptrain.testing.parity import _param_snapshot

    return {n: _param_snapshot(p) for n, p in engine.model.named_parameters()}


def equivalence(rank: int, world: int, cases: dict[str, Sequence[str]], steps: int = 3) -> dict[str, Any]:
    """Train each case; record, after every step, whether all ranks hold bitwise-identical
    params (non-overlapped cases: params are synced at the end of each step)."""
    out: dict[str, Any] = {}
    for name, ov in cases.items():
        mismatches: list[str] = []

        def check(engine: Any, step: int, mismatches: list[str] = mismatches) -> None:
            if step > 1:  # params after step-1's sync
                d = _all_ranks_equal(_raw(engine))
                if d:
                    mismatches.append(f"before step {step}: {d}")

        res = train_steps(TINY, [*BASE, *ov], steps=steps, before_step=check)
        d = _all_ranks_equal(res["raw"])
        if d:
            mismatches.append(f"final: {d}")
        res["rank_mismatch"] = mismatches
        out[name] = {k: res[k] for k in ("losses", "grad_norms", "masters", "rank_mismatch")}
    return out


def _templates(store: dict[str, torch.Tensor]) -> Any:
    from lptrain.precision.param_storage import is_quantized

    def grab(engine: Any, step: int) -> None:
        if step == 1:
            for n, p in engine.model.named_parameters():
                if is_quantized(p):
                    store[n] = p.detach().clone()

    return grab


def fp8_on_off(rank: int, world: int, cases: dict[str, Sequence[str]], steps: int = 3) -> dict[str, str | None]:
    """``{case: first difference between fp8 param gather ON and OFF}`` (None = bitwise
    equal): per-step losses and grad norms, final logits, per-param main_grads, fp32
    masters, and model params (ON's FP8 bytes vs OFF's bf16 param quantized by ON's own
    quantizer)."""
    out: dict[str, str | None] = {}
    for name, ov in cases.items():
        templates: dict[str, torch.Tensor] = {}
        on = train_steps(TINY, [*BASE, *ov, *FP8_PG], steps=steps, before_step=_templates(templates))
        off = train_steps(TINY, [*BASE, *ov], steps=steps)
        if not templates:
            out[name] = "ON run has no quantized params"
            continue
        diff = None
        for key in ("losses", "grad_norms", "logits", "main_grads", "masters"):
            diff = diff or first_difference(on[key], off[key], key)
        for n, t in templates.items():
            if diff:
                break
            t.requantize_from(off["raw"][n]["value"])
            want = {k: v.clone() for k, v in t.storage_views().items()}
            diff = first_difference(on["raw"][n], want, f"param {n}")
        out[name] = diff
    return out


def ownership_orders(rank: int, world: int) -> dict[str, Any]:
    """Ownership of equal-shape matrices registered in a rank-dependent order, with the fix
    and with the canonical key replaced by upstream's numel-only key."""
    from lptrain.optim import layerwise
    from lptrain.optim.layerwise import MuonUnit, assign_owners

    units = [MuonUnit(f"layers.{i}.w", -1, (64, 64), 0, 0, i * 4096, (i + 1) * 4096, False)
             for i in range(6)]
    units += [MuonUnit("qkv", -1, (192, 64), 0, 0, 30000, 42288, False)]
    mine = units[rank:] + units[:rank]  # every rank registers them in another order

    def owners() -> list[tuple[tuple[str, int], int]]:
        return sorted(assign_owners(mine, world).items())

    fixed = owners()
    with patched(layerwise, "ownership_key", lambda u: -u.numel):
        broken = owners()
    return {"fixed": _all_ranks_equal({"o": fixed}), "broken": _all_ranks_equal({"o": broken}),
            "owned": sum(1 for _, r in fixed if r == rank)}


def layer_wise_regressions(rank: int, world: int) -> dict[str, Any]:
    """Each layer-wise fix removed in turn (and kept, as the control)."""
    from lptrain.distributed import layerwise_layout as layout
    from lptrain.optim import compact_gather

    out: dict[str, Any] = {}

    def run(ov: Sequence[str], **kw: Any) -> Any:
        try:
            return train_steps(TINY, [*BASE, *LAYER_WISE, *ov], **kw)
        except Exception as e:  # the failure this fix prevents, reported to the parent
            return f"{type(e).__name__}: {e}"

    # 1. empty rank-0 slot: small buckets leave rank 0 owning nothing in some bucket.
    def naive_first(per_rank: Sequence[Sequence[Any]]) -> Any:
        return per_rank[0][0]

    with patched(compact_gather, "first_nonempty", naive_first):
        out["empty_slot_broken"] = run(SMALL_BUCKETS, steps=1)
    ok = run(SMALL_BUCKETS, steps=1)
    out["empty_slot_fixed"] = ok if isinstance(ok, str) else None

    # 2. fp32 params gathered in bf16: params must equal their fp32 masters bitwise.
    def fp32_match(res: Any) -> Any:
        if isinstance(res, str):
            return res
        bad = [n for n, m in res["masters"].items() if not torch.equal(res["raw"][n]["value"], m)]
        return bad[:3] or None

    fp32 = ["precision.params_dtype=fp32"]
    out["fp32_fixed"] = fp32_match(run(fp32, steps=2))
    with patched(compact_gather, "transport_dtype", lambda p: torch.bfloat16):
        out["fp32_broken"] = fp32_match(run(fp32, steps=2))

    # 3. split all-reduce buffers: FP8 Muon params keyed apart from bf16 ones (the router).
    def muon_keys(ov: Sequence[str]) -> Any:
        from lptrain.config import World, derive
        from lptrain.config.compose import load
        from lptrain.train.engine import TrainEngine

        cfg = derive(load(TINY, [*BASE, *LAYER_WISE, *MOE, *MXFP8, *ov]).cfg, World.detect())
        engine = TrainEngine(cfg)
        return [(b.key.describe(), [s.name for s in b.params], b.numel) for b in engine.layout.buffers]

    def split_key(key: Any, logical_dtype: torch.dtype) -> Any:
        return layout.BufferKey(key.param_dtype, key.grad_dtype, key.quantized, key.is_expert, True)

    out["split_fixed"] = first_difference(muon_keys([]), muon_keys(FP8_PG))
    with patched(layout, "muon_buffer_key", split_key):
        out["split_broken"] = first_difference(muon_keys([]), muon_keys(FP8_PG))
    return out


def forced_sync(rank: int, world: int, remove_fix: bool) -> str | None:
    """Overlapped layer-wise gather, then a forced sync: every param must hold its master
    (bf16-rounded) inside ``params_synced``. ``remove_fix``: the forced sync ignores
    layer-wise buckets (a forced sync that only finalizes sharded buckets leaves a pending
    layer-wise gather unfinished, and params stale)."""
    from lptrain.distributed.ddp import DataParallel

    problems: list[str] = []

    def check(engine: Any, step: int) -> None:
        if step != 3:
            return
        with engine.params_synced():
            state = engine.checkpoint_state()["global"]["model"]
            for n, p in engine.model.named_parameters():
                if not torch.equal(p.detach(), state[n].to(p.dtype)):
                    problems.append(n)

    def sharded_only(self: DataParallel) -> list[Any]:
        return [b for b in self.forward_order if b.buffer.sharded]

    ov = [*BASE, *LAYER_WISE, *OVERLAP]
    if remove_fix:
        with patched(DataParallel, "gathered_buckets", sharded_only):
            train_steps(TINY, ov, steps=3, before_step=check)
    else:
        train_steps(TINY, ov, steps=3, before_step=check)
    return ", ".join(problems[:3]) or None


def memory(rank: int, world: int, cases: dict[str, Sequence[str]]) -> dict[str, Any]:
    """``{case: (measured breakdown, analytic breakdown of this rank)}`` after one step."""
    from lptrain.memory.analytic import (
        analytic_memory,
        describe_params,
        quantized_bytes_per_element,
    )
    from lptrain.memory.measure import measured_memory
    from lptrain.precision.param_storage import is_quantized, staging_dtype

    out: dict[str, Any] = {}
    for name, ov in cases.items():
        seen: dict[str, Any] = {}

        def grab(engine: Any, step: int, seen: dict[str, Any] = seen) -> None:
            if step == 2:  # after step 1: optimizer state exists
                seen["measured"] = measured_memory(engine.model, engine.ddp.buffers,
                                                   engine.optimizer.children).as_dict()
                params = [(n, p) for n, p in engine.model.named_parameters()]
                q = [p for _, p in params if is_quantized(p)]
                o, d = engine.cfg.optimizer, engine.cfg.ddp
                model = analytic_memory(
                    describe_params(params), dp=world, optimizer=o.name,
                    distributed=d.use_distributed_optimizer, param_layout=o.layer_wise_param_layout,
                    bucket_size=d.bucket_size,
                    quantized_bpe=quantized_bytes_per_element(q[0]) if q else 0.0,
                    quantized_staging_dtype=staging_dtype(q[0]) if q else torch.bfloat16,
                    reuse_grad_buffer=bool(d.reuse_grad_buf_for_mxfp8_param_ag),
                )
                seen["analytic"] = model[rank].as_dict()

        train_steps(TINY, [*BASE, *ov], steps=2, before_step=grab)
        out[name] = seen
    return out
